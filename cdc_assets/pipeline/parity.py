"""Parity: does a Delta table equal its source? Checks that are sound while the source keeps changing.

Comparing a live source with a table that lags behind it proves nothing, so both sides are taken
at one point. A temporary replication slot exports a snapshot at its consistent point ``C``: the
snapshot holds exactly the transactions that committed before ``C`` (those whose commit record
ends by ``C``, as the change log's end LSNs count). The source table is read in it (through the
same conversions the change log uses) and reduced to a row count and a checksum. Then the
mirror's state at ``C`` is found in one of two ways:

* :func:`read_parity` only reads. Once the change log's checkpoint has reached ``C`` (the
  scheduled or following drain moves it), a Delta version ``v`` of the table holds the state at
  ``C`` when the log has no change of the table between ``v``'s applied LSN ``a`` and ``C``
  (in ``(a, C]`` when ``a < C``, in ``(C, a]`` when ``a > C``): ``v`` holds every change that ended
  by ``a`` and no other, and none ended in between. That version is read with Delta's time travel.
  Until such a version exists (the drain or the table's merge has not come by yet), it waits, up to
  a bound; then it reports that it could not compare, never a difference.
* :func:`verify_table` writes: it drains the log up to ``C`` and applies the table to the new
  checkpoint ``K``. Every transaction that ended by ``C`` is in the log and none ends in ``(K, C]``,
  so the source as of ``K`` is the source as of ``C``, and the table's latest version is compared.

Both sides are hashed by the same Spark expression — the sum (as an exact decimal, so order and
overflow don't matter) of ``xxhash64`` over every column of every row, duplicates included — on
the same Spark types. Equal counts and checksums mean equal contents (up to 64-bit hash
collisions); the table's row filter is applied to the source side. Metadata columns (``DeltaColumn``)
are not compared.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import dataclass, replace

import numpy as np
import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_assets.apply.runner import TableApplied, merge_table
from cdc_assets.apply.spark_types import spark_schema, to_delta_arrow
from cdc_assets.apply.target import DeltaTarget, app_id, delta_target, latest_version
from cdc_assets.apply.versions import applied_versions, version_holding
from cdc_assets.changelog.planner import latest_images
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, TableConfig
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.records import ChangeChunk
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.pipeline.drain import DrainResult, drain
from cdc_assets.source import SnapshotReader, copy_again_when_rewritten, create_slot_with_snapshot, load_type_catalog
from cdc_assets.transactions import CommitInfo, with_commit_columns


@dataclass(slots=True, frozen=True)
class Digest:
    """A table's contents reduced to a row count and an order-independent checksum."""

    rows: int
    checksum: int


@dataclass(slots=True, frozen=True)
class Parity:
    """A comparison of a table with its source at one point."""

    table: str
    snapshot_lsn: int  # the consistent point C the source was read at
    applied_lsn: int | None  # the applied LSN of the Delta version compared
    source: Digest
    delta: Digest
    columns: tuple[str, ...]
    delta_version: int | None = None  # None: there was no Delta table

    @property
    def ok(self) -> bool:
        return self.source == self.delta


@dataclass(slots=True, frozen=True)
class Uncompared:
    """Why :func:`read_parity` could not compare a table at ``snapshot_lsn`` in its time."""

    table: str
    snapshot_lsn: int
    reason: str


@dataclass(slots=True, frozen=True)
class Verification:
    """What :func:`verify_table` wrote (its drain, the table's apply) and found."""

    drained: DrainResult
    applied: TableApplied
    parity: Parity


def verify_table(config: Config, table: TableConfig, spark: SparkSession) -> Verification:
    """Drain up to a snapshot point, apply ``table``, compare (see the module docstring); writes."""
    snapshot_lsn, names, source = _source_at_snapshot(config, table, spark)
    drained = drain(config, wait=True, upto_lsn=snapshot_lsn)
    applied = merge_table(config, table, spark)
    target = delta_target(config, table, spark)
    version = latest_version(target.path, target.storage_options)
    version_applied = None if version is None else target.applied_lsn(version)
    parity = _compare(target, table, snapshot_lsn, names, source, version, version_applied)
    return Verification(drained, applied, parity)


def read_parity(
    config: Config, table: TableConfig, spark: SparkSession, *, wait_seconds: float, poll_seconds: float = 1.0
) -> Parity | Uncompared:
    """Compare ``table`` with its source at a snapshot point, reading only: the Delta version that
    holds the state at that point, waiting up to ``wait_seconds`` for the drain and the table's
    merge to bring one about (see the module docstring)."""
    snapshot_lsn, names, source = _source_at_snapshot(config, table, spark)
    target = delta_target(config, table, spark)
    reader = ChangeLogReader(changelog_store(config))
    deadline = time.monotonic() + wait_seconds
    while True:
        found = _version_at(config, table, reader, snapshot_lsn)
        if not isinstance(found, str):
            version, applied = found
            return _compare(target, table, snapshot_lsn, names, source, version, applied)
        if time.monotonic() >= deadline:
            return Uncompared(str(table.name), snapshot_lsn, f"{found} for {wait_seconds:g} s")
        time.sleep(poll_seconds)


def _version_at(
    config: Config, table: TableConfig, reader: ChangeLogReader, snapshot_lsn: int
) -> tuple[int | None, int | None] | str:
    """The Delta version (None: no table, and none due) holding ``table`` as of ``snapshot_lsn``
    and its applied LSN, or why there is none yet."""
    name = str(table.name)
    checkpoint = reader.checkpoint()
    if checkpoint is None or checkpoint.lsn < snapshot_lsn:
        behind = "none" if checkpoint is None else format_lsn(checkpoint.lsn)
        return f"the change log's checkpoint ({behind}) has not reached the snapshot point {format_lsn(snapshot_lsn)}"
    path, app = config.target_path(table), app_id(config.source.slot, name)
    versions = applied_versions(path, app, config.delta_storage_options)
    found = version_holding(reader, checkpoint, name, versions, snapshot_lsn)
    if found is None or isinstance(found, str):
        return (None, None) if found is None else found
    return found.version, found.applied_lsn


def _compare(
    target: DeltaTarget,
    table: TableConfig,
    snapshot_lsn: int,
    names: tuple[str, ...],
    source: Digest,
    version: int | None,
    applied: int | None,
) -> Parity:
    if version is None:
        delta = Digest(0, 0)
    else:
        delta = _digest(target.read(version).select(*[F.col(_q(n)) for n in names]), None)
    return Parity(str(table.name), snapshot_lsn, applied, source, delta, names, version)


def _source_at_snapshot(config: Config, table: TableConfig, spark: SparkSession) -> tuple[int, tuple[str, ...], Digest]:
    """The source's digest at a new snapshot point (read again if a rewrite of the table — a
    ``VACUUM FULL``, a ``CLUSTER`` — raced the read)."""
    return copy_again_when_rewritten(lambda: _source_digest(config, table, spark), lambda: None)


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
