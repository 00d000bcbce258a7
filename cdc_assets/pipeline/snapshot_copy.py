"""Copying tables as of an exported snapshot into a change log: the initial snapshot (the log's
first batch) and each online snapshot run (a run's own little log).

Every value arrives as pgoutput sends it, through its type's send or output function
(:mod:`cdc_assets.source.binary_copy`); the copy reads each table as PostgreSQL publishes it
(``docs/architecture.md``, "The initial snapshot") with ``source.snapshot_workers`` connections
(:mod:`cdc_assets.source.parallel_copy`). Each range of a table becomes a segment of its own in the
copy's batch, written by the worker that read it (:class:`SegmentCopier`); its records are numbered
from :data:`~cdc_assets.pgoutput.records.FIRST_COPY_POSITION` plus the range's number times
:data:`RANGE_POSITIONS`, so positions are unique within the table and below every change's.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from cdc_assets.changelog.checkpoint import Checkpoint
from cdc_assets.changelog.layout import COPY_BATCH, SegmentName, table_folder
from cdc_assets.changelog.segment_file import COPY_PARQUET_OPTIONS, RowGroupEncoder, SegmentFile, relation_metadata
from cdc_assets.changelog.store import LogStore
from cdc_assets.changelog.writer import BatchWriter
from cdc_assets.config import Config, TableConfig
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.records import FIRST_COPY_POSITION
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.source import load_type_catalog
from cdc_assets.source.copy_plan import CopyTask
from cdc_assets.source.parallel_copy import ParallelCopy
from cdc_assets.transactions import CommitInfo, with_commit_columns

RANGE_POSITIONS = 1 << 40
"""Positions each range of a table may number its records with (far more rows than a range holds)."""


@dataclass(slots=True, frozen=True)
class CopiedSnapshot:
    """The checkpoint that makes the copy valid (write it last), and the rows copied per table."""

    checkpoint: Checkpoint
    rows: dict[str, int]


@dataclass(slots=True, frozen=True)
class CopiedRange:
    """A range's segment, whole and durable."""

    table: str
    name: str
    rows: int


@dataclass(slots=True, frozen=True)
class SegmentCopier:
    """Writes each range it is given as the segment ``task.number`` of the copy's batch in
    ``store``: ``snapshot`` records at ``info``'s LSN, the table's columns at ``versions[table]``."""

    store: LogStore
    info: CommitInfo
    catalog: TypeCatalog
    versions: dict[str, int]

    def __call__(self, task: CopyTask, blocks: Iterator[list[pa.Array]]) -> CopiedRange:
        relation, binary = task.plan.relation, task.plan.select.binary
        table = relation.qualified_name
        builder = ChangeRecordBuilder(relation, self.catalog)
        empty = [pa.array([], pa.binary()) for _ in relation.columns]
        schema = with_commit_columns(builder.snapshot(empty, np.arange(0), binary), self.info).schema
        encoder = RowGroupEncoder()
        file = SegmentFile(
            self.store,
            f"{table_folder(table)}/{SegmentName(COPY_BATCH, task.number).file}",
            schema.with_metadata(relation_metadata(relation, self.versions[table])),
            encoder,
            table,
            COPY_PARQUET_OPTIONS,
        )
        try:
            position = FIRST_COPY_POSITION + task.number * RANGE_POSITIONS
            for columns in blocks:
                count = len(columns[0]) if columns else 0
                records = builder.snapshot(columns, np.arange(position, position + count, dtype=np.int64), binary)
                file.add(with_commit_columns(records, self.info))
                position += count
            file.close()
        except BaseException:
            encoder.shutdown(cancel=True)
            file.abandon()
            raise
        encoder.shutdown()
        return CopiedRange(table, file.name, file.rows)


def copy_snapshot(
    config: Config,
    store: LogStore,
    snapshot_name: str,
    lsn: int,
    tables: Sequence[TableConfig],
    progress: Callable[[str, int], None] | None = None,
) -> CopiedSnapshot:
    """Copy ``tables`` as of the snapshot into a batch of ``snapshot`` records at ``lsn``, the batch
    starting at 0; ``progress(table, rows_so_far)`` as rows arrive."""
    writer = BatchWriter(store, Checkpoint(config.source.slot, COPY_BATCH))
    info = CommitInfo(xid=0, commit_lsn=lsn, end_lsn=lsn, commit_time_us=time.time_ns() // 1000)
    try:
        with ParallelCopy(config.source, snapshot_name, config.source.snapshot_workers) as copy:
            relations = [copy.reader.describe(table.name) for table in tables]
            oids = [c.type_oid for relation in relations for c in relation.columns]
            catalog = TypeCatalog.of(load_type_catalog(copy.reader.connection, oids))
            plans = [copy.plan(r, ChangeRecordBuilder(r, catalog).binary_supported) for r in relations]
            copier = SegmentCopier(store, info, catalog, {r.qualified_name: writer.copy_version(r) for r in relations})
            seen = dict.fromkeys((r.qualified_name for r in relations), 0)

            def arrived(task: CopyTask, rows: int) -> None:
                name = task.plan.relation.qualified_name
                seen[name] += rows
                if progress is not None:
                    progress(name, seen[name])

            for _, segment in copy.run(plans, copier, arrived):
                writer.copied_segment(segment.table, segment.name, segment.rows, lsn)
    except BaseException:
        writer.abandon()
        raise
    checkpoint = writer.close(lsn).advanced(lsn, snapshot_lsn=lsn, snapshot_time_us=info.commit_time_us)
    return CopiedSnapshot(checkpoint, dict(writer.summary.changes))
