"""Reading the change log: only what the checkpoint has made valid, in log order.

A table's segments are read in name order (batch start, then part), which is commit order;
``read_changes`` yields them with the schema version each was written with, restricted to
transactions with end LSN in ``(after, upto]``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from cdc_assets.changelog.checkpoint import Checkpoint, TableState, read_checkpoint, require_checkpoint
from cdc_assets.changelog.encoding import from_storage
from cdc_assets.changelog.layout import (
    COPY_BATCH,
    MESSAGES,
    PREPARED,
    TABLES,
    TRANSACTIONS,
    SegmentName,
    table_folder,
    table_of_folder,
)
from cdc_assets.changelog.schema_changes import SchemaChangeMessage, TableDdl
from cdc_assets.changelog.segment_file import RELATION_KEY
from cdc_assets.changelog.segment_stats import column_max
from cdc_assets.changelog.snapshot_runs import SnapshotRunRef, run_store
from cdc_assets.changelog.store import TEMPORARY_MARK, LogStore
from cdc_assets.errors import CdcError
from cdc_assets.pgoutput.records import ChangeChunk, RecordColumn
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.source.ddl_capture import DDL_PREFIX


@dataclass(slots=True, frozen=True)
class Segment:
    path: str
    name: SegmentName


class ChangeLogReader:
    """Reads a change log at ``root`` (a local path or a pyarrow filesystem URI)."""

    def __init__(self, root: str | LogStore) -> None:
        self.store = root if isinstance(root, LogStore) else LogStore(root)

    def checkpoint(self) -> Checkpoint | None:
        return read_checkpoint(self.store)

    def require_checkpoint(self) -> Checkpoint:
        """The checkpoint; :class:`~cdc_assets.errors.NotSetUpError` before setup."""
        return require_checkpoint(self.store)

    def tables(self) -> list[str]:
        """Every table the log has records of."""
        return [table_of_folder(folder) for folder in self.store.folders(TABLES)]

    def segments(self, folder: str, upto: int) -> list[Segment]:
        """Valid segments of ``folder``: those whose batch started before the checkpoint ``upto``."""
        found = []
        for path in self.store.list(folder):
            name = SegmentName.parse(path)
            if name is not None and name.batch_start < upto:
                found.append(Segment(path, name))
        return sorted(found, key=lambda s: s.name)

    def read_changes(
        self, table: str, after: int = -1, upto: int | None = None, *, committed_since_us: int | None = None
    ) -> Iterator[ChangeChunk]:
        """The table's change records of transactions with end LSN in ``(after, upto]``, in order
        (``upto`` defaults to the checkpoint; the segments are listed at the call). ``committed_since_us``:
        skip segments whose footer says every change in them committed before then (µs since 1970)."""
        limit = self._limit(upto)
        wanted = _batches_after(self.segments(table_folder(table), limit), after)
        return self._read_segments(table, wanted, after, limit, committed_since_us)

    def _read_segments(
        self, table: str, segments: list[Segment], after: int, limit: int, committed_since_us: int | None
    ) -> Iterator[ChangeChunk]:
        for segment in segments:
            try:
                parquet = pq.ParquetFile(self.store.path(segment.path), filesystem=self.store.fs)
                if committed_since_us is not None:
                    newest = column_max(parquet.metadata, RecordColumn.COMMIT_TIME)
                    if newest is not None and newest < committed_since_us:
                        continue
                metadata = json.loads(parquet.schema_arrow.metadata[RELATION_KEY])
                records = from_storage(parquet.read())
            except FileNotFoundError:  # only retention deletes valid segments
                raise CdcError(
                    f"segment {segment.path} of {table} was removed by change-log retention while it was being"
                    " read: run again"
                ) from None
            end = records.column(RecordColumn.END_LSN)
            keep = pc.and_(pc.greater(end, after), pc.less_equal(end, limit))
            records = records.filter(keep).replace_schema_metadata(None)
            copy = segment.name.batch_start == COPY_BATCH and (records.num_rows > 0 or self._copy_due(after, limit))
            if records.num_rows or parquet.metadata.num_rows == 0:  # an empty segment still gives the schema
                yield ChangeChunk(RelationSchema.from_json(metadata), records, copy, int(metadata["schema_version"]))

    def due_snapshot_run(self, state: TableState, after: int, upto: int | None = None) -> SnapshotRunRef | None:
        """The table's latest snapshot run if it was announced in ``(after, upto]``."""
        run = state.snapshot_run
        return run if run is not None and after < run.position <= self._limit(upto) else None

    def read_table(
        self, table: str, state: TableState, after: int = -1, upto: int | None = None
    ) -> Iterator[ChangeChunk]:
        """What brings ``table`` from ``after`` to ``upto``: :meth:`read_changes`, unless a snapshot
        run was announced in between — then the run's records (the table as of its consistent point
        ``C``), followed by the log's changes in ``(C, upto]``."""
        run = self.due_snapshot_run(state, after, upto)
        if run is None:
            yield from self.read_changes(table, after, upto)
            return
        copy = ChangeLogReader(run_store(self.store, table, run.run))
        if copy.checkpoint() is None:
            raise CdcError(
                f"snapshot run {run.run} of {table} is missing at {copy.store.root}: the log announced it at"
                f" LSN {run.position:X}; copy the table again with `cdc-assets snapshot {table}`"
            )
        yield from copy.read_changes(table, upto=run.consistent_point)
        yield from self.read_changes(table, after=run.consistent_point, upto=upto)

    def transactions(self, after: int = -1, upto: int | None = None) -> pa.Table:
        """One row per committed transaction with end LSN in ``(after, upto]``."""
        return self._read_log(TRANSACTIONS, "end_lsn", after, upto)

    def messages(self, after: int = -1, upto: int | None = None) -> pa.Table:
        """Logical decoding messages (``pg_logical_emit_message``) logged in ``(after, upto]``."""
        return self._read_log(MESSAGES, "lsn", after, upto)

    def schema_changes(self, table: str, after: int = -1, upto: int | None = None) -> list[TableDdl]:
        """The table's captured schema changes in transactions with end LSN in ``(after, upto]``,
        in the order of its change records (commit LSN, position); ``messages/`` is read only when
        the checkpoint notes one after ``after``."""
        checkpoint = self.require_checkpoint()
        state = checkpoint.tables.get(table)
        if state is None or state.last_ddl_lsn is None or state.last_ddl_lsn <= after:
            return []
        rows = self._read_log(MESSAGES, "end_lsn", after, upto)
        if not rows.num_rows:
            return []
        rows = rows.filter(pc.equal(rows.column("prefix"), DDL_PREFIX))
        times = rows.column("commit_time").cast(pa.int64()).to_pylist()
        found = []
        for row, commit_time_us in zip(rows.to_pylist(), times):
            message = SchemaChangeMessage.decode(row["content"], row["lsn"], checkpoint.slot)
            if message.slot == checkpoint.slot and message.qualified_name == table:
                found.append(
                    TableDdl(row["commit_lsn"], row["end_lsn"], row["position"], row["lsn"], commit_time_us, message)
                )
        return sorted(found, key=lambda d: (d.commit_lsn, d.position))

    def schema_changes_read(
        self, table: str, state: TableState, after: int = -1, upto: int | None = None
    ) -> list[TableDdl]:
        """The schema changes that :meth:`read_table` with the same bounds reads its records
        through: those after the copy it starts from, if it starts from one."""
        run = self.due_snapshot_run(state, after, upto)
        return self.schema_changes(table, after if run is None else max(after, run.consistent_point), upto)

    def remove_stale(self) -> None:
        """Delete what no checkpoint covers: files of a batch that died before its checkpoint,
        prepared transactions already resolved, and temporary files of an interrupted replace.
        Call only while holding the drain lock."""
        checkpoint = self.checkpoint()
        position = checkpoint.lsn if checkpoint else 0
        for folder in [table_folder(t) for t in self.tables()] + [TRANSACTIONS, MESSAGES]:
            for path in self.store.list(folder):
                name = SegmentName.parse(path)
                if checkpoint is None or name is None or name.batch_start >= position:
                    self.store.delete(path)
        live = {p.folder for p in checkpoint.prepared.values()} if checkpoint else set()
        for folder in self.store.folders(PREPARED):
            if folder not in live:
                self.store.delete_folder(folder)
        for path in self.store.list(""):
            if TEMPORARY_MARK in path:  # a replace (checkpoint, setup marker) killed before its rename
                self.store.delete(path)

    def _copy_due(self, after: int, upto: int) -> bool:
        """Whether the log's copy (its batch 0, at the checkpoint's ``snapshot_lsn``) is in ``(after, upto]``."""
        checkpoint = self.checkpoint()
        copied = checkpoint.snapshot_lsn if checkpoint is not None else None
        return copied is not None and after < copied <= upto

    def _limit(self, upto: int | None) -> int:
        if upto is not None:
            return upto
        checkpoint = self.checkpoint()
        return checkpoint.lsn if checkpoint is not None else 0

    def _read_log(self, folder: str, column: str, after: int, upto: int | None) -> pa.Table:
        limit = self._limit(upto)
        tables = [
            pq.read_table(self.store.path(s.path), filesystem=self.store.fs)
            for s in _batches_after(self.segments(folder, limit), after)
        ]
        if not tables:
            return pa.table({})
        combined = pa.concat_tables(tables, promote_options="default")
        values = combined.column(column)
        return combined.filter(pc.and_(pc.greater(values, after), pc.less_equal(values, limit)))


def _batches_after(segments: list[Segment], after: int) -> list[Segment]:
    """Those of ``segments`` that may hold end LSNs after ``after``: a batch holds end LSNs in (its
    start, the next batch's start], so the batches wholly at or before ``after`` are skipped."""
    starts = sorted({s.name.batch_start for s in segments})
    first = max([b for b in starts if b <= after] or [starts[0] if starts else 0])
    return [s for s in segments if s.name.batch_start >= first]
