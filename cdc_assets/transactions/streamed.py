"""Streamed transactions (protocol 2+ with ``streaming``): a large transaction is sent while it
runs, in blocks (Stream Start … Stream Stop) interleaved with other transactions, and ended by
Stream Commit, Stream Abort or, on two-phase slots, Stream Prepare. Each is buffered on its own.

Inside a block every change carries the xid of its (sub)transaction. A Stream Abort of a
subtransaction drops that subtransaction's changes and every later one, as PostgreSQL's apply
worker truncates its spool file; a Stream Abort of the transaction itself drops it whole.
A streamed transaction not ended in a session is forgotten: the next session sends it again whole.
"""

from __future__ import annotations

from collections.abc import Callable

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.messages import (
    StreamAbortMessage,
    StreamCommitMessage,
    StreamStartMessage,
    TruncateMessage,
)
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.transactions.buffers import Buffers, OwnTransaction, RecordBuilders
from cdc_assets.transactions.commit_table import with_commit_columns
from cdc_assets.transactions.sink import CommitInfo, Output


class StreamedTransaction(OwnTransaction):
    """A streamed transaction, with the position of the first change of each of its subtransactions."""

    __slots__ = ("subtransactions",)

    def __init__(self, xid: int, buffers: Buffers) -> None:
        super().__init__(xid, buffers)
        self.subtransactions: dict[int, int] = {}  # subxid → position of its first change

    def add_streamed_change(self, subxid: int, schema: RelationSchema, data: bytes) -> None:
        """A change (``data``, xid prefixed) of subtransaction ``subxid`` (the top xid for its own)."""
        position = self.next_position
        self.subtransactions.setdefault(subxid, position)
        buffers = self.buffers
        buffers.add(buffers.buffer(schema), data, position)
        self.next_position = position + 1

    def add_truncate(self, schemas: list[RelationSchema], message: TruncateMessage) -> None:
        if message.xid is not None:
            self.subtransactions.setdefault(message.xid, self.next_position)
        super().add_truncate(schemas, message)

    def abort_subtransaction(self, subxid: int) -> None:
        """Drop what subtransaction ``subxid`` and every later one added."""
        cut = self.subtransactions.get(subxid)
        if cut is None:
            return  # the aborted subtransaction made no change seen here
        self.buffers.drop_positions(cut, self.next_position)
        self.messages = [m for m in self.messages if m.position < cut]
        self.subtransactions = {x: p for x, p in self.subtransactions.items() if p < cut}


class StreamedTransactions:
    """The streamed transactions of the current session, by xid, and the one whose block is open
    (``active``). ``write_earlier`` writes the changes of plain transactions committed before, so
    that a streamed transaction's records follow theirs."""

    __slots__ = ("_builders", "_by_xid", "_output", "_spill_dir", "_write_earlier", "active")

    def __init__(
        self, output: Output, builders: RecordBuilders, spill_dir: str | None, write_earlier: Callable[[], None]
    ) -> None:
        self._output = output
        self._builders = builders
        self._spill_dir = spill_dir
        self._write_earlier = write_earlier
        self._by_xid: dict[int, StreamedTransaction] = {}
        self.active: StreamedTransaction | None = None

    def __len__(self) -> int:
        return len(self._by_xid)

    def start(self, message: StreamStartMessage) -> None:
        """Stream Start: the block's changes belong to transaction ``message.xid``."""
        txn = self._by_xid.get(message.xid)
        if txn is None:
            if not message.first_segment:
                raise DecodeError(
                    f"Stream Start continues transaction {message.xid}, whose first segment was not sent in this session",
                    message_type="Stream Start",
                    offset=5,
                )
            buffers = Buffers(self._builders, True, self._spill_dir)
            txn = self._by_xid[message.xid] = StreamedTransaction(message.xid, buffers)
        self.active = txn

    def stop(self) -> None:
        self.active = None

    def abort(self, message: StreamAbortMessage) -> None:
        txn = self._by_xid.get(message.xid)
        if txn is None:
            return  # not streamed in this session: nothing of it is buffered
        if message.subtransaction_xid == message.xid:
            del self._by_xid[message.xid]
            txn.buffers.discard()
        else:
            txn.abort_subtransaction(message.subtransaction_xid)

    def commit(self, message: StreamCommitMessage) -> None:
        txn = self.pop(message.xid, "Stream Commit")
        info = CommitInfo(
            txn.xid, message.commit_lsn, message.end_lsn, message.commit_time_us, txn.origin, txn.origin_lsn
        )
        if not self._output.ended(info.end_lsn):
            txn.buffers.discard()
            return
        self._write_earlier()
        sink = self._output.sink
        changes = 0
        for schema, records in txn.chunks():
            changes += records.num_rows
            sink.records(schema, with_commit_columns(records, info))
        sink.transaction(info, changes, txn.messages)

    def pop(self, xid: int, what: str) -> StreamedTransaction:
        """The streamed transaction ``xid``, which the message ``what`` ends."""
        txn = self._by_xid.pop(xid, None)
        if txn is None:
            raise DecodeError(
                f"{what} for transaction {xid}, which was not streamed in this session", message_type=what, offset=1
            )
        return txn

    def discard(self) -> None:
        """Forget every streamed transaction of the session."""
        for txn in self._by_xid.values():
            txn.buffers.discard()
        self._by_xid.clear()
        self.active = None
