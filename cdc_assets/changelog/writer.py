"""Writing one batch of the change log: per-table Parquet segments, transactions and messages.

:class:`BatchWriter` is the :class:`~cdc_assets.transactions.ChangeSink` of a drain batch. It
buffers each table's records into row groups of a useful size, opens a new part when a table's
schema version changes, and on :meth:`BatchWriter.close` makes every file durable and returns the
checkpoint to write next. It writes nothing outside its batch's names, so a batch that dies before
its checkpoint leaves only files the next drain deletes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, replace
from typing import Required, TypedDict

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from cdc_assets.changelog.checkpoint import Checkpoint, PreparedEntry, TableState
from cdc_assets.changelog.encoding import from_storage, to_storage
from cdc_assets.changelog.layout import MESSAGES, TRANSACTIONS, SegmentName, prepared_folder, table_folder
from cdc_assets.changelog.schema_changes import SchemaChangeMessage, uncertain_column_change
from cdc_assets.changelog.segment_file import (
    PARQUET_OPTIONS,
    RELATION_KEY,
    RowGroupEncoder,
    SegmentFile,
    relation_metadata,
)
from cdc_assets.changelog.snapshot_runs import SNAPSHOT_RUN_PREFIX, SnapshotRunAnnouncement, SnapshotRunRef
from cdc_assets.changelog.store import LogStore
from cdc_assets.errors import CdcError
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.messages import LogicalDecodingMessage
from cdc_assets.pgoutput.records import RecordColumn
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.source.ddl_capture import DDL_PREFIX
from cdc_assets.transactions import CommitInfo, PreparedTransaction, TransactionalMessage, with_commit_columns

log = logging.getLogger(__name__)

TRANSACTION_SCHEMA = pa.schema(
    [
        pa.field("commit_lsn", pa.int64(), nullable=False),
        pa.field("end_lsn", pa.int64(), nullable=False),
        pa.field("xid", pa.int64(), nullable=False),
        pa.field("commit_time", pa.timestamp("us", tz="UTC"), nullable=False),
        pa.field("changes", pa.int64(), nullable=False),
        pa.field("origin", pa.string()),
        pa.field("origin_lsn", pa.int64()),
        pa.field("gid", pa.string()),
    ]
)
MESSAGE_SCHEMA = pa.schema(
    [
        pa.field("lsn", pa.int64(), nullable=False),
        pa.field("transactional", pa.bool_(), nullable=False),
        pa.field("prefix", pa.string(), nullable=False),
        pa.field("content", pa.binary(), nullable=False),
        pa.field("commit_lsn", pa.int64()),
        pa.field("end_lsn", pa.int64()),
        pa.field("xid", pa.int64()),
        pa.field("position", pa.int64()),
        pa.field("commit_time", pa.timestamp("us", tz="UTC")),
    ]
)


@dataclass(slots=True)
class _TableSegment:
    """The open segment file of one table in this batch."""

    version: int
    relation: RelationSchema
    file: SegmentFile


@dataclass(slots=True, frozen=True)
class _ColumnChange:
    """A new schema version of a table's records: from ``old`` to ``new`` columns, between its
    change ending at ``after`` and the first one ending at ``first``."""

    table: str
    old: RelationSchema
    new: RelationSchema
    after: int
    first: int


@dataclass(slots=True)
class BatchSummary:
    """What one batch added: changes per table and the transactions it completed."""

    transactions: int = 0
    changes: dict[str, int] = field(default_factory=dict)
    messages: int = 0
    files: list[str] = field(default_factory=list)


class _MessageRow(TypedDict, total=False):
    """A logical decoding message as a row of the messages file (commit fields: transactional only)."""

    lsn: Required[int]
    transactional: Required[bool]
    prefix: Required[str]
    content: Required[bytes]
    commit_lsn: int
    end_lsn: int
    xid: int
    position: int
    commit_time: int


class BatchWriter:
    """Writes the batch that starts at ``checkpoint.lsn``; see the module docstring."""

    def __init__(self, store: LogStore, checkpoint: Checkpoint, carried: list[_MessageRow] | None = None) -> None:
        self.store = store
        self.start = checkpoint
        self.summary = BatchSummary()
        self._tables = dict(checkpoint.tables)
        self._prepared = dict(checkpoint.prepared)
        self._resolved_prepared: list[str] = []  # folders to delete once the checkpoint is written
        self._segments: dict[str, _TableSegment] = {}
        self._copied: set[str] = set()  # tables with segments written by a copy's workers
        self._parts: dict[str, int] = {}
        self._transactions = _TransactionLog()
        self._encoder = RowGroupEncoder()
        self._messages: list[_MessageRow] = list(carried or [])
        self._column_changes: list[_ColumnChange] = []  # new schema versions of the stream's records
        self._schema_changes: dict[str, list[int]] = {}  # end LSNs of the batch's captured schema changes, per table
        self.carried: list[_MessageRow] = []
        """Non-transactional messages past the checkpoint :meth:`close` wrote: the next batch of the
        same replication session holds them (a new session receives them again)."""

    # -- ChangeSink -----------------------------------------------------------------------------

    def records(self, relation: RelationSchema, records: pa.RecordBatch) -> None:
        table = relation.qualified_name
        before = self._tables.get(table)
        segment = self._segment(table, relation, records.schema)
        if not records.num_rows:
            return  # the segment exists now, with the table's schema (an empty table's snapshot)
        if before is not None and segment.version != before.schema_version:
            first = int(np.min(records.column(RecordColumn.END_LSN).to_numpy()))
            self._column_changes.append(_ColumnChange(table, before.relation, relation, before.last_change_lsn, first))
        segment.file.add(records)
        last = int(np.max(records.column(RecordColumn.END_LSN).to_numpy()))
        state = self._tables[table]
        if last > state.last_change_lsn:
            self._tables[table] = replace(state, last_change_lsn=last)
        self.summary.changes[table] = self.summary.changes.get(table, 0) + records.num_rows

    def transaction(self, info: CommitInfo, changes: int, messages: list[TransactionalMessage]) -> None:
        self._transactions.add(info, changes)
        self.summary.transactions += 1
        for item in messages:
            self._message(item.message, info, item.position)

    def transactions(
        self, commit_lsns: np.ndarray, end_lsns: np.ndarray, xids: np.ndarray, times_us: np.ndarray, changes: np.ndarray
    ) -> None:
        self._transactions.extend(commit_lsns, end_lsns, xids, times_us, changes)
        self.summary.transactions += len(commit_lsns)

    def standalone_message(self, lsn: int, message: LogicalDecodingMessage) -> None:
        self._messages.append(
            {"lsn": lsn, "transactional": False, "prefix": message.prefix, "content": message.content}
        )

    def prepared(self, transaction: PreparedTransaction) -> None:
        folder = prepared_folder(transaction.end_lsn, transaction.gid)
        for number, (relation, records) in enumerate(transaction.chunks):
            self._write_file(f"{folder}/{number:06d}.parquet", pa.Table.from_batches([records]), relation, None)
        if transaction.messages:
            rows = [
                {"position": m.position, "lsn": m.message.lsn, "prefix": m.message.prefix, "content": m.message.content}
                for m in transaction.messages
            ]
            self._write_file(f"{folder}/messages.parquet", pa.Table.from_pylist(rows), None, None)
        self._prepared[transaction.gid] = PreparedEntry(
            transaction.gid,
            transaction.xid,
            transaction.prepare_lsn,
            transaction.end_lsn,
            transaction.prepare_time_us,
            folder,
            transaction.origin,
            transaction.origin_lsn,
        )

    def commit_prepared(self, gid: str, info: CommitInfo) -> None:
        entry = self._take_prepared(gid, info.end_lsn)
        info.origin, info.origin_lsn = entry.origin, entry.origin_lsn
        changes = 0
        for name in self.store.list(entry.folder):
            table = from_storage(pq.read_table(self.store.path(name), filesystem=self.store.fs))
            if name.endswith("/messages.parquet"):
                for row in table.to_pylist():
                    message = LogicalDecodingMessage(None, 1, row["lsn"], row["prefix"], row["content"])
                    self._message(message, info, row["position"])
                continue
            relation = RelationSchema.from_json(json.loads(table.schema.metadata[RELATION_KEY]))
            for batch in table.to_batches():
                changes += batch.num_rows
                self.records(relation, with_commit_columns(batch, info))
        self._transactions.add(info, changes)
        self.summary.transactions += 1

    def rollback_prepared(self, gid: str, end_lsn: int) -> None:
        self._take_prepared(gid, end_lsn)

    # -- closing --------------------------------------------------------------------------------

    def close(self, lsn: int) -> Checkpoint:
        """Finish every file durably; return the checkpoint that makes this batch valid."""
        self._hold_uncertain_column_changes()
        for segment in self._segments.values():
            segment.file.flush()
        self._encoder.wait()
        self._encoder.shutdown()
        for segment in self._segments.values():
            segment.file.finish()
        for folder in {table_folder(t) for t in (*self._segments, *self._copied)}:
            self.store.sync_folder(folder)
        name = SegmentName(self.start.lsn, 0).file
        if self._transactions:
            self._write_file(f"{TRANSACTIONS}/{name}", self._transactions.table(), None, None)
        # A non-transactional message past the new checkpoint belongs to the next batch.
        messages = [m for m in self._messages if m["transactional"] or self.start.lsn < m["lsn"] <= lsn]
        self.carried = [m for m in self._messages if not m["transactional"] and m["lsn"] > lsn]
        if messages:
            self._write_file(f"{MESSAGES}/{name}", pa.Table.from_pylist(messages, MESSAGE_SCHEMA), None, None)
            self.summary.messages = len(messages)
        for folder in (TRANSACTIONS, MESSAGES):
            self.store.sync_folder(folder)
        return self.start.advanced(lsn, tables=self._tables, prepared=self._prepared)

    @property
    def last_commit_time_us(self) -> int | None:
        """The commit time of the batch's latest transaction (None for a batch without any)."""
        times = self._transactions.columns["commit_time"]
        return max(int(t) for t in times) if times else None  # type: ignore[call-overload]

    def after_checkpoint(self) -> None:
        """Delete prepared transactions resolved in this batch (only once the checkpoint says so)."""
        for folder in self._resolved_prepared:
            self.store.delete_folder(folder)

    def abandon(self) -> None:
        """Close open files after a failure; they stay invalid and the next drain deletes them."""
        self._encoder.shutdown(cancel=True)
        for segment in self._segments.values():
            segment.file.abandon()

    # -- a copy's segments ------------------------------------------------------------------------

    def copy_version(self, relation: RelationSchema) -> int:
        """The schema version of ``relation``'s segments that a copy's workers write into this
        batch (:meth:`copied_segment`), the table now known to the batch with these columns."""
        return self._version(relation.qualified_name, relation)

    def copied_segment(self, table: str, name: str, rows: int, last_lsn: int) -> None:
        """Take ``name``, a whole and durable segment of ``table`` with ``rows`` records up to
        ``last_lsn`` that a copy's worker wrote into this batch (after :meth:`copy_version`)."""
        self._copied.add(table)
        self.summary.files.append(name)
        self.summary.changes[table] = self.summary.changes.get(table, 0) + rows
        state = self._tables[table]
        if rows and last_lsn > state.last_change_lsn:
            self._tables[table] = replace(state, last_change_lsn=last_lsn)

    # -- pieces --------------------------------------------------------------------------------

    def _version(self, table: str, relation: RelationSchema) -> int:
        """Record ``relation`` as the table's columns; return their schema version."""
        state = self._tables.get(table)
        if state is None:
            version = 1
        elif state.relation.same_version(relation):
            version = state.schema_version
        else:
            version = state.schema_version + 1
        self._tables[table] = (
            replace(state, schema_version=version, relation=relation) if state else TableState(0, version, relation)
        )
        return version

    def _segment(self, table: str, relation: RelationSchema, schema: pa.Schema) -> _TableSegment:
        segment = self._segments.get(table)
        if segment is not None and segment.relation == relation:
            return segment
        version = self._version(table, relation)
        if segment is not None:
            if segment.version == version:  # same columns, e.g. the table got a new OID
                segment.relation = relation
                return segment
            segment.file.close()
        part = self._parts.get(table, -1) + 1
        self._parts[table] = part
        name = f"{table_folder(table)}/{SegmentName(self.start.lsn, part).file}"
        file = SegmentFile(
            self.store, name, schema.with_metadata(relation_metadata(relation, version)), self._encoder, table
        )
        segment = self._segments[table] = _TableSegment(version, relation, file)
        self.summary.files.append(name)
        return segment

    def _write_file(self, name: str, table: pa.Table, relation: RelationSchema | None, version: int | None) -> None:
        if relation is not None:
            table = table.replace_schema_metadata(relation_metadata(relation, version))
        table = to_storage(table)
        with self.store.create(name) as sink:
            pq.write_table(table, sink, **PARQUET_OPTIONS)
        self.summary.files.append(name)

    def _message(self, message: LogicalDecodingMessage, info: CommitInfo, position: int) -> None:
        if message.prefix == SNAPSHOT_RUN_PREFIX:
            self._snapshot_run(SnapshotRunAnnouncement.decode(message.content, message.lsn), info.end_lsn)
        elif message.prefix == DDL_PREFIX:
            self._schema_change(SchemaChangeMessage.decode(message.content, message.lsn, self.start.slot), info.end_lsn)
        self._messages.append(
            {
                "lsn": message.lsn,
                "transactional": True,
                "prefix": message.prefix,
                "content": message.content,
                "commit_lsn": info.commit_lsn,
                "end_lsn": info.end_lsn,
                "xid": info.xid,
                "position": position,
                "commit_time": info.commit_time_us,
            }
        )

    def _snapshot_run(self, run: SnapshotRunAnnouncement, end_lsn: int) -> None:
        """Record a complete online snapshot run of ``run.table`` at ``end_lsn``: the table is due
        again, and its columns are the run's unless the log holds a change after the run's
        consistent point (whose columns are newer). A run older than the table's latest copy (a
        compacted base retention wrote meanwhile, past the run's consistent point) is not used: the
        base is, from the announcement on — the log's changes the run would need are gone. A run at or
        after the point a table awaits a re-copy from (``cdc-assets recover``) releases it."""
        ref = SnapshotRunRef(run.run, run.consistent_point, end_lsn)
        state = self._tables.get(run.table)
        if state is None:
            self._tables[run.table] = TableState(end_lsn, 1, run.relation, ref)
            return
        awaiting = state.awaiting_copy
        if awaiting is not None and run.consistent_point >= awaiting:
            ref = replace(ref, reason=state.copy_reason)  # the hold it releases, for the mirror's history
        latest = state.snapshot_run
        if latest is not None and latest.consistent_point > run.consistent_point:
            ref = SnapshotRunRef(latest.run, latest.consistent_point, end_lsn, latest.reason)
        newer_columns = state.last_change_lsn <= run.consistent_point and not state.relation.same_version(run.relation)
        self._tables[run.table] = replace(
            state,
            last_change_lsn=max(state.last_change_lsn, end_lsn),
            schema_version=state.schema_version + 1 if newer_columns else state.schema_version,
            relation=run.relation if newer_columns else state.relation,
            snapshot_run=ref,
            awaiting_copy=awaiting if awaiting is not None and run.consistent_point < awaiting else None,
            copy_reason=state.copy_reason if awaiting is not None and run.consistent_point < awaiting else None,
        )

    def _schema_change(self, change: SchemaChangeMessage, end_lsn: int) -> None:
        """Note a captured schema change of a table the log knows, by this log's slot's capture (another
        installation's messages, and those of tables without a copy yet, stay in ``messages/`` only).
        A rewrite holds the table until a copy from the end of its transaction on is announced: the
        stream never carries the rows a rewrite wrote ("Schema migrations")."""
        state = self._tables.get(change.qualified_name)
        if change.slot != self.start.slot or state is None:
            return
        state = replace(state, last_ddl_lsn=end_lsn)
        self._schema_changes.setdefault(change.qualified_name, []).append(end_lsn)
        if change.rewritten:
            state = replace(
                state,
                awaiting_copy=max(end_lsn, state.awaiting_copy or -1),
                copy_reason=f"{change.command_tag} rewrote it ({', '.join(change.rewrite_reasons())})"
                f" in the transaction ending at LSN {format_lsn(end_lsn)}",
            )
        self._tables[change.qualified_name] = state

    def _hold_uncertain_column_changes(self) -> None:
        """Hold for a copy each table whose columns changed in a way the Relation messages cannot
        tell for sure, with no captured schema change between its last change under the old columns
        and its first under the new ones (no DDL capture, or DDL from before it): the copy starts
        after the change instead of a guess ("Schema migrations")."""
        for change in self._column_changes:
            state = self.start.tables.get(change.table)
            captured = [state.last_ddl_lsn if state and state.last_ddl_lsn else -1]
            captured += self._schema_changes.get(change.table, [])
            if any(change.after <= end <= change.first for end in captured):  # its transaction's, or between
                continue
            uncertain = uncertain_column_change(change.old, change.new)
            if uncertain is None:
                continue
            reason = (
                f"its columns changed ({uncertain}) with no captured schema change to tell how before the change"
                f" ending at LSN {format_lsn(change.first)}; DDL capture (`source.ddl_capture`) applies such"
                " changes in place"
            )
            log.warning("%s: held for a copy: %s", change.table, reason)
            held = self._tables[change.table]
            self._tables[change.table] = replace(
                held, awaiting_copy=max(change.first, held.awaiting_copy or -1), copy_reason=reason
            )

    def _take_prepared(self, gid: str, end_lsn: int) -> PreparedEntry:
        entry = self._prepared.pop(gid, None)
        if entry is None:
            raise CdcError(
                f"COMMIT/ROLLBACK PREPARED of {gid!r} (ending at LSN {end_lsn:X}) but the change log holds no"
                " prepared transaction with that gid"
            )
        self._resolved_prepared.append(entry.folder)
        return entry


class _TransactionLog:
    """The batch's committed transactions, as columns of the transactions log."""

    def __init__(self) -> None:
        self.columns: dict[str, list[object]] = {f.name: [] for f in TRANSACTION_SCHEMA}

    def __bool__(self) -> bool:
        return bool(self.columns["end_lsn"])

    def add(self, info: CommitInfo, changes: int) -> None:
        values = (
            info.commit_lsn,
            info.end_lsn,
            info.xid,
            info.commit_time_us,
            changes,
            info.origin,
            info.origin_lsn,
            info.gid,
        )
        for column, value in zip(self.columns.values(), values):
            column.append(value)

    def extend(
        self, commit_lsns: np.ndarray, end_lsns: np.ndarray, xids: np.ndarray, times_us: np.ndarray, changes: np.ndarray
    ) -> None:
        """Plain transactions: no origin, no gid."""
        count = len(commit_lsns)
        for name, values in zip(
            ("commit_lsn", "end_lsn", "xid", "commit_time", "changes"), (commit_lsns, end_lsns, xids, times_us, changes)
        ):
            self.columns[name].extend(values.tolist())
        for name in ("origin", "origin_lsn", "gid"):
            self.columns[name].extend([None] * count)

    def table(self) -> pa.Table:
        arrays = {
            name: pa.array(values, pa.int64() if name == "commit_time" else TRANSACTION_SCHEMA.field(name).type)
            for name, values in self.columns.items()
        }
        arrays["commit_time"] = arrays["commit_time"].cast(TRANSACTION_SCHEMA.field("commit_time").type)
        return pa.table(arrays, schema=TRANSACTION_SCHEMA)
