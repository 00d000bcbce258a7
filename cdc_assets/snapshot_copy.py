"""Copying tables as of an exported snapshot into a change log: the initial snapshot (the log's
first batch) and each online snapshot run (a run's own little log).

Every value arrives as pgoutput sends it, through its type's send or output function
(:mod:`cdc_assets.source.binary_copy`); the copy reads each table as PostgreSQL publishes it
(``docs/architecture.md``, "The initial snapshot") with ``source.snapshot_workers`` connections
(:mod:`cdc_assets.source.parallel_copy`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from cdc_assets.changelog.checkpoint import Checkpoint
from cdc_assets.changelog.layout import COPY_BATCH
from cdc_assets.changelog.store import LogStore
from cdc_assets.changelog.writer import BatchWriter
from cdc_assets.config import Config, TableConfig
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.source import load_type_catalog
from cdc_assets.source.parallel_copy import ParallelCopy
from cdc_assets.transactions import CommitInfo, with_commit_columns


@dataclass(slots=True, frozen=True)
class CopiedSnapshot:
    """The checkpoint that makes the copy valid (write it last), and the rows copied per table."""

    checkpoint: Checkpoint
    rows: dict[str, int]


def copy_snapshot(
    config: Config,
    store: LogStore,
    snapshot_name: str,
    lsn: int,
    tables: Sequence[TableConfig],
    progress: Callable[[str, int], None] | None = None,
) -> CopiedSnapshot:
    """Copy ``tables`` as of the snapshot into a batch of ``snapshot`` records at ``lsn``, the batch
    starting at 0; ``progress(table, rows_so_far)`` after each block."""
    writer = BatchWriter(store, Checkpoint(config.source.slot, COPY_BATCH))
    info = CommitInfo(xid=0, commit_lsn=lsn, end_lsn=lsn, commit_time_us=time.time_ns() // 1000)
    try:
        with ParallelCopy(config.source, snapshot_name, config.source.snapshot_workers) as copy:
            relations = [copy.reader.describe(table.name) for table in tables]
            oids = [c.type_oid for relation in relations for c in relation.columns]
            catalog = TypeCatalog.of(load_type_catalog(copy.reader.connection, oids))
            builders = {r.qualified_name: ChangeRecordBuilder(r, catalog) for r in relations}
            plans = [copy.plan(b.relation, b.binary_supported) for b in builders.values()]
            copied = dict.fromkeys(builders, 0)
            for plan in plans:  # each table's schema first: an empty table has nothing else
                empty = [pa.array([], pa.binary()) for _ in plan.relation.columns]
                builder = builders[plan.relation.qualified_name]
                writer.records(
                    plan.relation, with_commit_columns(builder.snapshot(empty, np.arange(0), plan.select.binary), info)
                )
            for plan, columns in copy.run(plans):
                name = plan.relation.qualified_name
                count = len(columns[0]) if columns else 0
                records = builders[name].snapshot(
                    columns, np.arange(copied[name], copied[name] + count, dtype=np.int64), plan.select.binary
                )
                writer.records(plan.relation, with_commit_columns(records, info))
                copied[name] += count
                if progress is not None:
                    progress(name, copied[name])
    except BaseException:
        writer.abandon()
        raise
    checkpoint = writer.close(lsn).advanced(lsn, snapshot_lsn=lsn, snapshot_time_us=info.commit_time_us)
    return CopiedSnapshot(checkpoint, copied)
