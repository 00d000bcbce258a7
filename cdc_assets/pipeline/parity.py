"""Parity: does a Delta table equal its source? A check that is sound while the source keeps changing.

Comparing a live source with a table that lags behind it proves nothing, so the check freezes
both at one point:

1. A temporary replication slot exports a snapshot at its consistent point ``C``: the snapshot
   holds exactly the transactions that committed before ``C``. The source table is read in it
   (through the same conversions the change log uses) and reduced to a row count and a checksum.
2. The change log is drained up to ``C`` and the table applied to the new checkpoint ``K``. Every
   transaction that ended by ``C`` is in the log and none ends in ``(K, C]``, so the source as of
   ``K`` is the source as of ``C``.
3. The Delta table, now at ``K``, is reduced the same way.

Both sides are hashed by the same Spark expression — the sum (as an exact decimal, so order and
overflow don't matter) of ``xxhash64`` over every column of every row, duplicates included — on
the same Spark types. Equal counts and checksums mean equal contents (up to 64-bit hash
collisions); the table's row filter is applied to the source side. Metadata columns (``DeltaColumn``)
are not compared.
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_assets.apply.runner import apply_table, delta_target
from cdc_assets.apply.spark_types import spark_schema, to_delta_arrow
from cdc_assets.changelog.planner import latest_images
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, TableConfig
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.records import ChangeChunk
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.pipeline.drain import drain
from cdc_assets.source import SnapshotReader, copy_again_when_rewritten, create_slot_with_snapshot, load_type_catalog
from cdc_assets.transactions import CommitInfo, with_commit_columns


@dataclass(slots=True, frozen=True)
class Digest:
    """A table's contents reduced to a row count and an order-independent checksum."""

    rows: int
    checksum: int


@dataclass(slots=True, frozen=True)
class Parity:
    table: str
    snapshot_lsn: int  # the consistent point C the source was read at
    applied_lsn: int | None  # the checkpoint K the Delta table was compared at
    source: Digest
    delta: Digest
    columns: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return self.source == self.delta


def check_parity(config: Config, table: TableConfig, spark: SparkSession) -> Parity:
    """Compare ``table``'s Delta table with its source at one point (see the module docstring)."""
    snapshot_lsn, names, source = copy_again_when_rewritten(lambda: _source_digest(config, table, spark), lambda: None)
    drain(config, wait=True, upto_lsn=snapshot_lsn)
    reader = ChangeLogReader(changelog_store(config))
    checkpoint = reader.checkpoint()
    assert checkpoint is not None  # drain refuses a log that was never set up
    apply_table(config, table, spark, reader, checkpoint.lsn)
    target = delta_target(config, table, spark)
    delta = _digest(target.read().select(*[F.col(_q(n)) for n in names]), None) if target.exists() else Digest(0, 0)
    return Parity(str(table.name), snapshot_lsn, target.applied_lsn(), source, delta, names)


def _source_digest(config: Config, table: TableConfig, spark: SparkSession) -> tuple[int, tuple[str, ...], Digest]:
    """The source table's digest as of a new temporary slot's snapshot: the slot's consistent
    point, the published columns, the digest."""
    probe = replace(config.source, slot=f"cdc_check_{os.getpid()}_{secrets.token_hex(3)}", two_phase=False)
    with (
        create_slot_with_snapshot(probe, temporary=True) as exported,
        SnapshotReader(config.source, exported.snapshot_name) as snapshot,
    ):
        relation = snapshot.describe(table.name)
        catalog = TypeCatalog.of(load_type_catalog(snapshot.connection, [c.type_oid for c in relation.columns]))
        builder = ChangeRecordBuilder(relation, catalog)
        info = CommitInfo(0, exported.consistent_point, exported.consistent_point, 0)
        parts = []
        for columns in snapshot.chunks(relation, builder.binary_supported):
            positions = np.arange(len(columns[0]))
            records = with_commit_columns(builder.snapshot(columns, positions, builder.binary_supported), info)
            rows = latest_images([ChangeChunk(relation, pa.Table.from_batches([records]))], relation)
            parts.append(_digest(_frame(spark, rows), table.row_filter))
    names = tuple(c.name for c in relation.columns)
    digest = Digest(sum(p.rows for p in parts), sum(p.checksum for p in parts))
    return exported.consistent_point, names, digest


def _frame(spark: SparkSession, rows: pa.Table) -> DataFrame:
    converted = to_delta_arrow(rows)
    return spark.createDataFrame(converted, schema=spark_schema(converted.schema))


def _digest(frame: DataFrame, row_filter: str | None) -> Digest:
    if row_filter:
        frame = frame.filter(F.coalesce(F.expr(row_filter), F.lit(False)))
    row_hash = F.xxhash64(*[F.col(_q(c)) for c in frame.columns]).cast("decimal(38,0)")
    result = frame.agg(F.count(F.lit(1)).alias("rows"), F.sum(row_hash).alias("checksum")).collect()[0]
    return Digest(int(result["rows"]), int(result["checksum"] or 0))


def _q(name: str) -> str:
    return "`" + name.replace("`", "``") + "`"
