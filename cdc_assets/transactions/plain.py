"""Plain transactions (Begin … Commit): contiguous in the output and always complete within a session.

Their changes go to buffers shared by the whole batch, one per table, and are converted to Arrow
in large chunks spanning many transactions — a transaction of four rows costs no numpy pipeline
of its own. Everything positioned in a plain transaction (a change, a Truncate, a message) takes
the next number of one sequence; the :class:`~cdc_assets.transactions.commit_table.CommitTable`
maps a number to its transaction (a tag, by order of Begin) and its position there, and gives the
records their commit columns when they are written.

A run of rows that are all Begin, Insert, Update, Delete or Commit is taken whole with numpy
(:meth:`PlainTransactions.add_run`); other rows come one at a time from the assembler.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from cdc_assets.pgoutput.messages import (
    POSTGRES_EPOCH_US,
    SENT_TIME_RANGE_US,
    CommitMessage,
    LogicalDecodingMessage,
    TruncateMessage,
)
from cdc_assets.pgoutput.protocol import MSG_BEGIN, MSG_COMMIT, MSG_DELETE, MSG_INSERT, MSG_UPDATE
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.transactions import spill
from cdc_assets.transactions.buffers import Buffers, RawBuffer, RecordBuilders, Segment
from cdc_assets.transactions.commit_table import CommitTable
from cdc_assets.transactions.sink import CommitInfo, Output, TransactionalMessage

PLAIN_TYPES = np.array([MSG_BEGIN, MSG_COMMIT, MSG_INSERT, MSG_UPDATE, MSG_DELETE], dtype=np.uint8)
_PADDING = bytes(32)


class BlockView:
    """A block's joined messages, with big-endian integers readable at any byte offset (the data
    is padded, so a read past the last message stays in bounds)."""

    __slots__ = ("data", "i64", "u8", "u32")

    def __init__(self, data: bytes) -> None:
        self.data = data = data + _PADDING
        self.u8 = np.frombuffer(data, dtype=np.uint8)
        self.u32 = np.ndarray(shape=(len(data) - 3,), dtype=">u4", buffer=data, strides=(1,))
        self.i64 = np.ndarray(shape=(len(data) - 7,), dtype=">i8", buffer=data, strides=(1,))


class PlainTransaction:
    """The open plain transaction. Its changes are numbered from ``start`` on (a change's position
    is its number minus ``start``); ``adjust`` corrects their count to the number of change records
    (a message takes a number but is no change; a Truncate is one record per relation)."""

    __slots__ = ("adjust", "messages", "origin", "origin_lsn", "start", "tag", "xid")

    def __init__(self, xid: int, tag: int, start: int) -> None:
        self.xid = xid
        self.tag = tag
        self.start = start
        self.adjust = 0
        self.origin: str | None = None
        self.origin_lsn: int | None = None
        self.messages: list[TransactionalMessage] | None = None


class PlainTransactions:
    """The plain transactions of a batch: the open one (``current``), the shared buffers, and the
    commit table. While ``current`` is set, the ``add_*`` methods add to it."""

    __slots__ = ("_buffers", "_by_relation", "_commits", "_output", "_seq", "_spill_dir", "current")

    def __init__(self, output: Output, builders: RecordBuilders, spill_dir: str | None) -> None:
        self._output = output
        self._spill_dir = spill_dir
        self._commits = CommitTable()
        self._buffers = Buffers(builders, False, spill_dir, self._commits.locate)
        self._by_relation: dict[int, RawBuffer] = {}  # the session's relations → their shared buffers
        self._seq = 0  # the next sequence number
        self.current: PlainTransaction | None = None

    def start_session(self) -> None:
        """Forget the previous session's relations (each session describes them again)."""
        self._by_relation.clear()
        self.current = None

    def discard(self) -> None:
        """Forget every buffered change and commit, and the open transaction."""
        self._buffers.discard()
        self._commits.clear()
        self._seq = 0
        self.current = None

    def add_relation(self, relation_oid: int, schema: RelationSchema) -> None:
        """A Relation message: changes of ``relation_oid`` are under ``schema`` from now on."""
        self._by_relation[relation_oid] = self._buffers.buffer(schema)

    def begin(self, xid: int) -> None:
        self.current = PlainTransaction(xid, self._commits.open(self._seq), self._seq)

    def add_change(self, schema: RelationSchema, data: bytes) -> None:
        buffers = self._buffers
        buffers.add(buffers.buffer(schema), data, self._seq)
        self._seq += 1

    def add_truncate(self, schemas: list[RelationSchema], message: TruncateMessage) -> None:
        txn = self._open()
        txn.adjust += len(schemas) - 1  # one change record per truncated relation
        self._buffers.add_truncate(schemas, message, self._seq - txn.start, txn.tag)
        self._seq += 1

    def add_message(self, message: LogicalDecodingMessage) -> None:
        txn = self._open()
        txn.adjust -= 1  # a message is not a change record
        if txn.messages is None:
            txn.messages = []
        txn.messages.append(TransactionalMessage(self._seq - txn.start, message))
        self._seq += 1

    def set_origin(self, name: str, commit_lsn: int) -> None:
        txn = self._open()
        txn.origin, txn.origin_lsn = name, commit_lsn

    def commit(self, message: CommitMessage) -> None:
        txn = self._open()
        self.current = None
        info = CommitInfo(
            txn.xid, message.commit_lsn, message.end_lsn, message.commit_time_us, txn.origin, txn.origin_lsn
        )
        if self._output.ended(info.end_lsn):
            self._commits.commit(txn.tag, info)
            self._output.sink.transaction(info, self._seq - txn.start + txn.adjust, txn.messages or [])
            self._write_if_large()

    def add_run(self, view: BlockView, starts: np.ndarray, ends: np.ndarray, types: np.ndarray) -> bool:
        """Rows at ``starts``/``ends`` of ``view`` of types ``types`` (all in :data:`PLAIN_TYPES`),
        starting outside any transaction, taken whole. False, and nothing done, unless every row is
        well-formed, every relation described in this session and every Begin/Commit where it belongs."""
        is_begin = types == MSG_BEGIN
        is_commit = types == MSG_COMMIT
        is_change = ~(is_begin | is_commit)
        depth_after = np.cumsum(is_begin.astype(np.int64) - is_commit)
        depth_before = depth_after - is_begin + is_commit
        sizes = ends - starts
        ok = np.where(is_begin, (depth_before == 0) & (sizes == 21), depth_before == 1)
        ok &= np.where(is_commit, sizes == 26, is_begin | (sizes >= 5))
        begins, commits, changes = np.flatnonzero(is_begin), np.flatnonzero(is_commit), np.flatnonzero(is_change)
        relations = view.u32[starts[changes] + 1].astype(np.int64)
        known = np.fromiter(self._by_relation, dtype=np.int64, count=len(self._by_relation))
        commit_at = starts[commits]
        times = view.i64[commit_at + 18]
        if not (
            ok.all()
            and np.isin(relations, known).all()
            and not view.u8[commit_at + 1].any()  # Commit flags are 0
            and ((times >= SENT_TIME_RANGE_US[0]) & (times <= SENT_TIME_RANGE_US[1])).all()
        ):
            return False
        base = self._seq
        seqs = base + np.cumsum(is_change) - is_change  # a change's number; a Begin's: its first change's
        begin_seqs = seqs[begins]
        tags = self._commits.open_many(begin_seqs)
        xids = view.u32[starts[begins] + 17].astype(np.int64)
        txn = np.cumsum(is_begin)[commits] - 1  # the transaction each Commit ends
        commit_lsns, end_lsns = view.i64[commit_at + 2], view.i64[commit_at + 10]
        live = self._output.ended_many(end_lsns)
        counts = seqs[commits] - begin_seqs[txn]
        times_us = times[live] + POSTGRES_EPOCH_US
        self._commits.commit_many(tags[txn][live], commit_lsns[live], end_lsns[live], xids[txn][live], times_us)
        self._output.sink.transactions(commit_lsns[live], end_lsns[live], xids[txn][live], times_us, counts[live])
        if depth_after[-1] == 1:  # the run ends inside a transaction: later rows continue it
            self.current = PlainTransaction(int(xids[-1]), int(tags[-1]), int(begin_seqs[-1]))
        for relation in np.unique(relations).tolist():
            rows = changes[relations == relation]
            segment = Segment(view.data, starts[rows], ends[rows], seqs[rows])
            self._buffers.add_segment(self._by_relation[relation], segment)
        self._seq = base + len(changes)
        self._write_if_large()
        return True

    def write(self) -> None:
        """Write every buffered change of committed transactions, with commit columns (those of the
        open transaction stay), then, if no transaction is open, start numbering afresh."""
        self._buffers.convert_all()
        current = self.current.tag if self.current is not None else -1
        columns = self._commits.columns()
        converted = self._buffers.converted
        for name, queue in list(converted.items()):
            kept = spill.SpillQueue(self._spill_dir)
            for schema, records, tags in queue.pop_all():
                waiting = tags == current
                if waiting.any():  # rows of the open transaction stay until it commits
                    kept.append(schema, records.filter(pa.array(waiting)), tags[waiting])
                    done = ~waiting
                    records, tags = records.filter(pa.array(done)), tags[done]
                live = columns.live[tags]
                if not live.all():  # transactions already in the log (a rewound slot)
                    records, tags = records.filter(pa.array(live)), tags[live]
                if records.num_rows:
                    self._output.sink.records(schema, columns.attach(records, tags))
            if kept:
                converted[name] = kept
            else:
                del converted[name]
        if self.current is None:
            self._commits.clear()
            self._seq = 0

    def _write_if_large(self) -> None:
        """Write once enough transactions committed and enough changes wait (memory stays bounded)."""
        if self._commits.pending >= spill.CHUNK_ROWS // 4 and self._buffers.raw_rows >= spill.CHUNK_ROWS:
            self.write()

    def _open(self) -> PlainTransaction:
        txn = self.current
        assert txn is not None, "the assembler adds to plain transactions only while one is open"
        return txn
