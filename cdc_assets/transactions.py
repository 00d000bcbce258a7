"""The transaction assembler: rows of peek calls → committed transactions, written to a sink.

:class:`TransactionAssembler` is fed the ``(lsn, data)`` rows of a
``pg_logical_slot_peek_binary_changes`` call in order, a block at a time. It keeps only what the protocol needs
between rows — the Relation and Type messages of the current call (the server sends them again in
every call), the open transaction, and the streamed transactions of the call — and hands a
:class:`ChangeSink` the change records of committed transactions, per table in commit order.

Plain transactions (Begin … Commit) are contiguous in the output and always complete within a
call, so their changes go to buffers shared by the whole batch, one per table, and are converted
to Arrow in large chunks spanning many transactions — a transaction of four rows costs no numpy
pipeline of its own. Streamed transactions (Stream Start … Stream Commit, interleaved with others)
and prepared ones (two-phase slots) are buffered on their own; a streamed subtransaction abort
drops the aborted subtransaction's changes and every later one, as PostgreSQL's apply worker
truncates its spool file. Converted chunks beyond a memory budget spill to temporary Arrow files,
so a transaction of millions of rows drains in bounded memory.

Transactions whose end LSN is at or below ``checkpoint_lsn`` are dropped: the slot re-sends them
after a rewind (invariant 3).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from struct import Struct
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.decoder import PgoutputDecoder, Streaming, message_name
from cdc_assets.pgoutput.messages import (
    POSTGRES_EPOCH_US,
    BeginMessage,
    BeginPrepareMessage,
    CommitMessage,
    CommitPreparedMessage,
    LogicalDecodingMessage,
    OriginMessage,
    PrepareMessage,
    RelationMessage,
    RollbackPreparedMessage,
    StreamAbortMessage,
    StreamCommitMessage,
    StreamPrepareMessage,
    StreamStartMessage,
    StreamStopMessage,
    TruncateMessage,
    TypeMessage,
)
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.source.reader import PeekBlock

CHUNK_ROWS = 65_536
SPILL_BYTES = 64 << 20

_BEGIN = ord("B")
_COMMIT = ord("C")
_PLAIN_TYPES = np.array([ord(c) for c in "BCIUD"], dtype=np.uint8)
_PADDING = bytes(32)
# Commit times the message classes accept (years 1 to 9999), as sent (µs since 2000-01-01).
_MIN_TIME_US = -62_135_596_800_000_000 - POSTGRES_EPOCH_US
_MAX_TIME_US = 253_402_300_799_999_999 - POSTGRES_EPOCH_US

_OID = Struct(">I").unpack_from
_XID_AND_OID = Struct(">II").unpack_from
_CHANGE_TYPES = frozenset(b"IUD")

DescribeRelation = Callable[[RelationMessage], RelationSchema]


@dataclass(slots=True)
class CommitInfo:
    """Where and when a transaction committed. ``origin`` is set when it was replayed from
    another node (an Origin message); ``gid`` for a transaction committed with COMMIT PREPARED."""

    xid: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int
    origin: str | None = None
    origin_lsn: int | None = None
    gid: str | None = None


@dataclass(slots=True, frozen=True)
class TransactionalMessage:
    position: int
    message: LogicalDecodingMessage


@dataclass(slots=True)
class PreparedTransaction:
    """A two-phase transaction at PREPARE: to be kept until COMMIT or ROLLBACK PREPARED."""

    gid: str
    xid: int
    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    origin: str | None
    origin_lsn: int | None
    chunks: list[tuple[RelationSchema, pa.RecordBatch]]
    messages: list[TransactionalMessage]


class ChangeSink(Protocol):
    """Where the assembler puts what it assembles (the change log's batch writer)."""

    def records(self, relation: RelationSchema, records: pa.RecordBatch) -> None:
        """Change records of committed transactions, with commit columns, in commit order."""

    def transaction(self, info: CommitInfo, changes: int, messages: list[TransactionalMessage]) -> None:
        """A committed transaction, after all its records were given to :meth:`records`."""

    def transactions(
        self, commit_lsns: np.ndarray, end_lsns: np.ndarray, xids: np.ndarray, times_us: np.ndarray, changes: np.ndarray
    ) -> None:
        """Committed plain transactions (no origin, no messages), in commit order, as columns."""

    def standalone_message(self, lsn: int, message: LogicalDecodingMessage) -> None:
        """A non-transactional logical decoding message."""

    def prepared(self, transaction: PreparedTransaction) -> None:
        """A prepared transaction (two-phase slots only)."""

    def commit_prepared(self, gid: str, info: CommitInfo) -> None:
        """COMMIT PREPARED: write the prepared transaction ``gid`` as committed with ``info``."""

    def rollback_prepared(self, gid: str, end_lsn: int) -> None:
        """ROLLBACK PREPARED: forget the prepared transaction ``gid``."""


class _SpillQueue:
    """Converted record batches in order, kept in memory up to a budget, then in temp files."""

    def __init__(self, spill_dir: str | None) -> None:
        self._items: list[tuple[RelationSchema, pa.RecordBatch | str, np.ndarray | None]] = []
        self._memory = 0
        self._spill_dir = spill_dir

    def __bool__(self) -> bool:
        return bool(self._items)

    def append(self, schema: RelationSchema, records: pa.RecordBatch, tags: np.ndarray | None = None) -> None:
        if self._memory + records.nbytes > SPILL_BYTES:
            handle, path = tempfile.mkstemp(prefix="cdc-spill-", suffix=".arrow", dir=self._spill_dir)
            with os.fdopen(handle, "wb") as sink, ipc.new_file(sink, records.schema) as writer:
                writer.write_batch(records)
            self._items.append((schema, path, tags))
        else:
            self._memory += records.nbytes
            self._items.append((schema, records, tags))

    def pop_all(self) -> Iterator[tuple[RelationSchema, pa.RecordBatch, np.ndarray | None]]:
        """Every item in order, removing it (spilled ones are read back and deleted)."""
        items, self._items, self._memory = self._items, [], 0
        for schema, records, tags in items:
            if isinstance(records, str):
                with pa.memory_map(records) as source:
                    batch = ipc.open_file(source).get_batch(0)
                os.unlink(records)
                yield schema, batch, tags
            else:
                yield schema, records, tags

    def discard(self) -> None:
        for _ in self.pop_all():
            pass


@dataclass(slots=True)
class _Segment:
    """Change messages at ``data[starts[i]:ends[i]]`` with sequence numbers ``seqs``."""

    data: bytes
    starts: np.ndarray
    ends: np.ndarray
    seqs: np.ndarray

    @classmethod
    def of(cls, messages: list[bytes], seqs: list[int]) -> _Segment:
        lengths = np.fromiter(map(len, messages), dtype=np.int64, count=len(messages))
        ends = np.cumsum(lengths)
        return cls(b"".join(messages), ends - lengths, ends, np.array(seqs, dtype=np.int64))

    def select(self, mask: np.ndarray) -> _Segment:
        return _Segment(self.data, self.starts[mask], self.ends[mask], self.seqs[mask])


def _combine(segments: list[_Segment]) -> _Segment:
    """One segment over one buffer (the segments' buffers joined, offsets shifted)."""
    if len(segments) == 1:
        return segments[0]
    shifts = np.cumsum([0] + [len(s.data) for s in segments[:-1]])
    return _Segment(
        b"".join(s.data for s in segments),
        np.concatenate([s.starts + shift for s, shift in zip(segments, shifts)]),
        np.concatenate([s.ends + shift for s, shift in zip(segments, shifts)]),
        np.concatenate([s.seqs for s in segments]),
    )


@dataclass(slots=True)
class _RawBuffer:
    """Raw change messages of one table under one schema, waiting to be converted, each with its
    sequence number (see :class:`_Buffers`): whole segments from the block path, plus single
    messages from the message-at-a-time path."""

    schema: RelationSchema
    segments: list[_Segment] = field(default_factory=list)
    messages: list[bytes] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    rows: int = 0

    def freeze(self) -> None:
        """Turn the single messages into a segment, keeping the order."""
        if self.messages:
            self.segments.append(_Segment.of(self.messages, self.seqs))
            self.messages, self.seqs = [], []


class _BlockView:
    """A block's joined messages, with big-endian integers readable at any byte offset."""

    __slots__ = ("data", "u8", "u32", "u64", "i64")

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.u8 = np.frombuffer(data, dtype=np.uint8)
        self.u32 = np.ndarray(shape=(len(data) - 3,), dtype=">u4", buffer=data, strides=(1,))
        self.u64 = np.ndarray(shape=(len(data) - 7,), dtype=">i8", buffer=data, strides=(1,))
        self.i64 = self.u64


Locate = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


def _own_positions(seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """In a transaction's own buffers a sequence number is the position (one transaction, tag 0)."""
    return seqs, np.zeros(len(seqs), dtype=np.int64)


class _Buffers:
    """Raw and converted changes per table, in order. ``xid_prefixed`` says how raw messages
    were sent (inside stream blocks they carry an xid); ``locate`` maps sequence numbers to
    positions in their transactions and to transaction tags."""

    def __init__(
        self,
        builder: Callable[[RelationSchema], ChangeRecordBuilder],
        xid_prefixed: bool,
        spill_dir: str | None,
        locate: Locate = _own_positions,
    ) -> None:
        self.raw: dict[str, _RawBuffer] = {}
        self.converted: dict[str, _SpillQueue] = {}
        self._builder = builder
        self._xid_prefixed = xid_prefixed
        self._spill_dir = spill_dir
        self._locate = locate

    @property
    def raw_rows(self) -> int:
        return sum(raw.rows for raw in self.raw.values())

    def buffer(self, schema: RelationSchema) -> _RawBuffer:
        """The raw buffer for new changes under ``schema``; what an older schema of the same table
        buffered is converted first, so records stay in order."""
        name = schema.qualified_name
        raw = self.raw.get(name)
        if raw is None or raw.schema != schema:
            if raw is not None:
                self.convert(name)
            raw = self.raw[name] = _RawBuffer(schema)
        return raw

    def add(self, raw: _RawBuffer, data: bytes, seq: int) -> None:
        raw.messages.append(data)
        raw.seqs.append(seq)
        raw.rows += 1
        if raw.rows >= CHUNK_ROWS:
            self.convert(raw.schema.qualified_name)

    def add_segment(self, raw: _RawBuffer, segment: _Segment) -> None:
        raw.freeze()
        raw.segments.append(segment)
        raw.rows += len(segment.seqs)
        if raw.rows >= CHUNK_ROWS:
            self.convert(raw.schema.qualified_name)

    def add_records(self, schema: RelationSchema, records: pa.RecordBatch, tag: int = 0) -> None:
        """Already converted records (a truncate) after everything buffered for the table."""
        name = schema.qualified_name
        self.convert(name)
        self._queue(name).append(schema, records, np.full(records.num_rows, tag, dtype=np.int64))

    def convert(self, name: str) -> None:
        """Convert what is buffered raw for table ``name``; the buffer object stays usable."""
        raw = self.raw.get(name)
        if raw is None or not raw.rows:
            return
        raw.freeze()
        segment = _combine(raw.segments)
        positions, tags = self._locate(segment.seqs)
        records = self._builder(raw.schema).changes_in(
            segment.data, segment.starts, segment.ends, positions, xid_prefixed=self._xid_prefixed
        )
        self._queue(name).append(raw.schema, records, tags)
        raw.segments, raw.rows = [], 0

    def convert_all(self) -> None:
        for name in list(self.raw):
            self.convert(name)

    def drop_positions(self, start: int, end: int) -> None:
        """Forget changes at positions in [start, end) (an aborted subtransaction and later ones)."""
        for raw in self.raw.values():
            raw.freeze()
            raw.segments = [s.select((s.seqs < start) | (s.seqs >= end)) for s in raw.segments]
            raw.rows = sum(len(s.seqs) for s in raw.segments)
        for name, queue in self.converted.items():
            kept = _SpillQueue(self._spill_dir)
            for schema, records, tags in queue.pop_all():
                positions = records.column("_cdc_position").to_numpy()
                mask = (positions < start) | (positions >= end)
                if mask.any():
                    kept.append(schema, records.filter(pa.array(mask)), tags[mask] if tags is not None else None)
            self.converted[name] = kept

    def discard(self) -> None:
        self.raw.clear()
        for queue in self.converted.values():
            queue.discard()
        self.converted.clear()

    def _queue(self, name: str) -> _SpillQueue:
        queue = self.converted.get(name)
        if queue is None:
            queue = self.converted[name] = _SpillQueue(self._spill_dir)
        return queue


class _OwnTransaction:
    """A streamed or prepared transaction, buffered apart from the plain ones."""

    def __init__(self, xid: int, buffers: _Buffers) -> None:
        self.xid = xid
        self.buffers = buffers
        self.origin: str | None = None
        self.origin_lsn: int | None = None
        self.next_position = 0
        self.subtransactions: dict[int, int] = {}  # subxid -> position of its first change
        self.messages: list[TransactionalMessage] = []


class _PlainTransaction:
    """The open plain (or non-streamed two-phase) transaction.

    Its changes take the assembler's sequence numbers from ``start`` on (a change's position is
    its number minus ``start``); ``adjust`` corrects their count to the number of change records
    (a message takes a number but is no change; a Truncate is one record per relation). ``own``
    is set for Begin Prepare: such a transaction is buffered on its own.
    """

    __slots__ = ("xid", "tag", "prepared", "start", "adjust", "origin", "origin_lsn", "messages", "own")

    def __init__(self, xid: int, tag: int, prepared: bool, start: int) -> None:
        self.xid = xid
        self.tag = tag
        self.prepared = prepared
        self.start = start
        self.adjust = 0
        self.origin: str | None = None
        self.origin_lsn: int | None = None
        self.messages: list[TransactionalMessage] | None = None
        self.own: _OwnTransaction | None = None


class TransactionAssembler:
    """Turns the rows of peek calls into committed transactions; see the module docstring."""

    def __init__(
        self,
        *,
        streaming: Streaming = "off",
        catalog: TypeCatalog | None = None,
        describe: DescribeRelation | None = None,
        slot: str | None = None,
        spill_dir: str | None = None,
    ) -> None:
        self.sink: ChangeSink | None = None
        self.streaming: Streaming = streaming
        self.checkpoint_lsn = 0
        self.catalog = catalog if catalog is not None else TypeCatalog()
        self.slot = slot
        self._describe = describe or RelationSchema.from_message
        self._spill_dir = spill_dir
        self._builders: dict[RelationSchema, ChangeRecordBuilder] = {}
        self._commits = _CommitTable()
        self._shared = _Buffers(self._builder, False, spill_dir, self._commits.locate)
        self._seq = 0  # sequence numbers of the positioned items (changes, truncates, messages) of plain transactions
        self._decoder = PgoutputDecoder(streaming)
        self._relations: dict[int, RelationSchema] = {}
        self._shared_raw: dict[int, _RawBuffer] = {}  # this call's relations → their shared buffer
        self._current: _PlainTransaction | None = None
        self._streams: dict[int, _OwnTransaction] = {}
        self._stream: _OwnTransaction | None = None
        self._lsn = 0
        self.last_end_lsn = 0
        self.completed = 0

    # -- per call ----------------------------------------------------------------------------

    def start_call(self, sink: ChangeSink, checkpoint_lsn: int) -> None:
        """Begin a peek call whose transactions go to ``sink``; those ending at or before
        ``checkpoint_lsn`` are dropped. Forgets what the previous call sent: Relation and Type
        messages and partial streams."""
        self.sink = sink
        self.checkpoint_lsn = checkpoint_lsn
        self.last_end_lsn = max(self.last_end_lsn, checkpoint_lsn)
        self._decoder = PgoutputDecoder(self.streaming)
        self._relations.clear()
        self._shared_raw.clear()
        for stream in self._streams.values():
            stream.buffers.discard()
        self._streams.clear()
        self._stream = None
        self._current = None
        self.completed = 0

    def finish_call(self) -> None:
        """Write every committed change buffered so far (call at the end of each peek call).

        Streamed transactions still open are forgotten: the next call sends them again whole.
        """
        if self._current is not None:
            raise DecodeError(
                f"the call ended inside transaction {self._current.xid} (no Commit)", message_type=None, offset=0
            ).at(lsn=self._lsn, slot=self.slot)
        self._write_shared()
        for stream in self._streams.values():
            stream.buffers.discard()
        self._streams.clear()
        self._stream = None

    @property
    def open_streams(self) -> int:
        """Streamed transactions begun in the current call and not yet committed or aborted."""
        return len(self._streams)

    # -- rows ----------------------------------------------------------------------------------

    def feed_blocks(self, blocks: Iterable[PeekBlock]) -> int:
        """Consume the blocks of a peek call; return how many rows there were.

        In each block, runs of plain transactions (Begin, Insert, Update, Delete, Commit) are
        handled with numpy for the whole run — boundaries, commit fields, relations, positions —
        and every other message goes through :meth:`feed`.
        """
        count = 0
        for block in blocks:
            self._feed_block(block)
            count += len(block)
        return count

    def _feed_block(self, block: PeekBlock) -> None:
        ends = block.ends
        starts = block.starts()
        view = _BlockView(block.data + _PADDING)
        types = np.where(ends > starts, view.u8[starts], 0)
        plain = np.isin(types, _PLAIN_TYPES)
        first = 0
        for stop in [*np.flatnonzero(~plain).tolist(), len(block)]:
            if stop > first:
                self._plain_run(view, starts[first:stop], ends[first:stop], types[first:stop], block, first)
            if stop < len(block):
                self._one_by_one(block, stop, stop + 1)
            first = stop + 1

    def _plain_run(
        self, view: _BlockView, starts: np.ndarray, ends: np.ndarray, types: np.ndarray, block: PeekBlock, offset: int
    ) -> None:
        """Rows ``offset…`` of a block, all Begin/Commit/Insert/Update/Delete, vectorized when they
        are plain transactions of relations this call described; else message by message."""
        count = len(starts)
        done = 0
        if self._stream is not None or self._decoder.in_stream or (self._current and self._current.own):
            return self._one_by_one(block, offset, offset + count)
        if self._current is not None:  # finish the transaction the run starts inside, one by one
            commits = np.flatnonzero(types == _COMMIT)
            done = int(commits[0]) + 1 if len(commits) else count
            self._one_by_one(block, offset, offset + done)
        if done < count and not self._vectorized(
            view, starts[done:], ends[done:], types[done:], int(block.lsns[offset + done])
        ):
            self._one_by_one(block, offset + done, offset + count)  # something is off: exact errors come from here

    def _one_by_one(self, block: PeekBlock, start: int, stop: int) -> None:
        for lsn, data in block.rows(start, stop):
            self.feed(lsn, data)

    def _vectorized(self, view: _BlockView, starts: np.ndarray, ends: np.ndarray, types: np.ndarray, lsn: int) -> bool:
        """Plain transactions starting outside any transaction; False (nothing done) unless every
        row is well-formed, every relation known and every Begin/Commit where it belongs."""
        is_begin = types == _BEGIN
        is_commit = types == _COMMIT
        is_change = ~(is_begin | is_commit)
        depth_after = np.cumsum(is_begin.astype(np.int64) - is_commit)
        depth_before = depth_after - is_begin + is_commit
        sizes = ends - starts
        ok = np.where(is_begin, (depth_before == 0) & (sizes == 21), depth_before == 1)
        ok &= np.where(is_commit, sizes == 26, is_begin | (sizes >= 5))
        begins, commits, changes = np.flatnonzero(is_begin), np.flatnonzero(is_commit), np.flatnonzero(is_change)
        relations = view.u32[starts[changes] + 1].astype(np.int64)
        known = np.fromiter(self._shared_raw, dtype=np.int64, count=len(self._shared_raw))
        commit_at = starts[commits]
        times = view.i64[commit_at + 18]
        if not (
            ok.all()
            and np.isin(relations, known).all()
            and not view.u8[commit_at + 1].any()  # Commit flags are 0
            and ((times >= _MIN_TIME_US) & (times <= _MAX_TIME_US)).all()
        ):
            return False
        self._lsn = lsn
        base = self._seq
        seqs = base + np.cumsum(is_change) - is_change  # a change's number; a Begin's: its first change's
        begin_seqs = seqs[begins]
        tags = self._commits.open_many(begin_seqs)
        xids = view.u32[starts[begins] + 17].astype(np.int64)
        txn = np.cumsum(is_begin)[commits] - 1  # the transaction each Commit ends
        commit_lsns, end_lsns = view.u64[commit_at + 2], view.u64[commit_at + 10]
        live = end_lsns > self.checkpoint_lsn
        counts = seqs[commits] - begin_seqs[txn]
        self._commits.commit_many(
            tags[txn][live], commit_lsns[live], end_lsns[live], xids[txn][live], times[live] + POSTGRES_EPOCH_US
        )
        self.sink.transactions(
            commit_lsns[live], end_lsns[live], xids[txn][live], times[live] + POSTGRES_EPOCH_US, counts[live]
        )
        self.completed += len(commits)
        if len(commits):
            self.last_end_lsn = max(self.last_end_lsn, int(end_lsns.max()))
        if depth_after[-1] == 1:  # the run ends inside a transaction: later rows continue it
            self._current = _PlainTransaction(int(xids[-1]), int(tags[-1]), False, int(begin_seqs[-1]))
        for relation in np.unique(relations).tolist():
            rows = changes[relations == relation]
            segment = _Segment(view.data, starts[rows], ends[rows], seqs[rows])
            self._shared.add_segment(self._shared_raw[relation], segment)
        self._seq = base + len(changes)
        if self._commits.pending >= CHUNK_ROWS // 4 and self._shared.raw_rows >= CHUNK_ROWS:
            self._write_shared()
        return True

    def feed(self, lsn: int, data: bytes) -> None:
        """Consume one row of a peek call."""
        self._lsn = lsn
        try:
            if data and data[0] in _CHANGE_TYPES:
                self._change(data)
            else:
                self._control(data)
        except DecodeError as error:
            raise error.at(lsn=lsn, slot=self.slot) from None

    def _change(self, data: bytes) -> None:
        if len(data) < (9 if self._decoder.in_stream else 5):
            self._decoder.decode(data)  # raises the precise DecodeError
        if self._decoder.in_stream:
            subxid, relation_oid = _XID_AND_OID(data, 1)
            own = self._stream
            assert own is not None  # the decoder is inside a block only after Stream Start
            own.subtransactions.setdefault(subxid, own.next_position)
            own.buffers.add(own.buffers.buffer(self._schema(relation_oid, data)), data, own.next_position)
            own.next_position += 1
            return
        (relation_oid,) = _OID(data, 1)
        plain = self._open(data[0])
        schema = self._schema(relation_oid, data)
        buffers = plain.own.buffers if plain.own is not None else self._shared
        buffers.add(buffers.buffer(schema), data, self._take_position(plain)[1])

    def _control(self, data: bytes) -> None:
        message = self._decoder.decode(data)
        match message:
            case BeginMessage() | BeginPrepareMessage():
                if self._current is not None:
                    raise DecodeError(
                        f"transaction {message.xid} begins while {self._current.xid} is still open",
                        message_type=message_name(data[0]),
                        offset=0,
                    )
                prepared = isinstance(message, BeginPrepareMessage)
                self._current = _PlainTransaction(message.xid, self._commits.open(self._seq), prepared, self._seq)
                if prepared:
                    self._current.own = _OwnTransaction(message.xid, self._new_buffers(xid_prefixed=False))
            case CommitMessage():
                txn = self._close_plain(data[0], prepared=False)
                info = CommitInfo(
                    txn.xid, message.commit_lsn, message.end_lsn, message.commit_time_us, txn.origin, txn.origin_lsn
                )
                self._finish(info)
                if info.end_lsn > self.checkpoint_lsn:
                    self._commits.commit(txn.tag, info)
                    self.sink.transaction(info, self._seq - txn.start + txn.adjust, txn.messages or [])
                    if self._commits.pending >= CHUNK_ROWS // 4 and self._shared.raw_rows >= CHUNK_ROWS:
                        self._write_shared()
            case OriginMessage():
                target = self._stream or self._open(data[0])
                target.origin, target.origin_lsn = message.name, message.commit_lsn
            case RelationMessage():
                schema = self._relations[message.relation_oid] = self._describe(message)
                self._shared_raw[message.relation_oid] = self._shared.buffer(schema)
            case TypeMessage():
                self.catalog.note_type_message(message.type_oid, message.namespace, message.name)
            case TruncateMessage():
                self._truncate(message)
            case LogicalDecodingMessage():
                if not message.transactional:
                    self.sink.standalone_message(self._lsn, message)
                    return
                target = self._stream or self._open(data[0])
                position = self._take_position(target)[0]
                if isinstance(target, _PlainTransaction) and target.own is None:
                    target.adjust -= 1  # a message is not a change record
                if target.messages is None:
                    target.messages = []
                target.messages.append(TransactionalMessage(position, message))
            case StreamStartMessage():
                own = self._streams.get(message.xid)
                if own is None:
                    if not message.first_segment:
                        raise DecodeError(
                            f"Stream Start continues transaction {message.xid}, whose first segment was not sent in"
                            " this call",
                            message_type="Stream Start",
                            offset=5,
                        )
                    own = self._streams[message.xid] = _OwnTransaction(
                        message.xid, self._new_buffers(xid_prefixed=True)
                    )
                self._stream = own
            case StreamStopMessage():
                self._stream = None
            case StreamAbortMessage():
                self._stream_abort(message)
            case StreamCommitMessage():
                own = self._pop_stream(message.xid, "Stream Commit")
                info = CommitInfo(
                    own.xid, message.commit_lsn, message.end_lsn, message.commit_time_us, own.origin, own.origin_lsn
                )
                self._finish(info)
                if info.end_lsn > self.checkpoint_lsn:
                    self._write_own(own, info)
                else:
                    own.buffers.discard()
            case PrepareMessage():
                txn = self._close_plain(data[0], prepared=True)
                assert txn.own is not None
                txn.own.origin, txn.own.origin_lsn, txn.own.messages = txn.origin, txn.origin_lsn, txn.messages or []
                self._prepared(txn.own, message)
            case StreamPrepareMessage():
                self._prepared(self._pop_stream(message.xid, "Stream Prepare"), message)
            case CommitPreparedMessage():
                info = CommitInfo(
                    message.xid, message.commit_lsn, message.end_lsn, message.commit_time_us, gid=message.gid
                )
                self._finish(info)
                if info.end_lsn > self.checkpoint_lsn:
                    self._write_shared()
                    self.sink.commit_prepared(message.gid, info)
            case RollbackPreparedMessage():
                self.last_end_lsn = max(self.last_end_lsn, message.rollback_end_lsn)
                self.completed += 1
                if message.rollback_end_lsn > self.checkpoint_lsn:
                    self.sink.rollback_prepared(message.gid, message.rollback_end_lsn)

    # -- pieces --------------------------------------------------------------------------------

    def _schema(self, relation_oid: int, data: bytes) -> RelationSchema:
        schema = self._relations.get(relation_oid)
        if schema is None:
            raise DecodeError(
                f"change for unknown relation OID {relation_oid}: no Relation message preceded it in this call",
                message_type=message_name(data[0]),
                offset=1 + 4 * self._decoder.in_stream,
            )
        return schema

    def _truncate(self, message: TruncateMessage) -> None:
        schemas = []
        for oid in message.relation_oids:
            schema = self._relations.get(oid)
            if schema is None:
                raise DecodeError(
                    f"Truncate lists unknown relation OID {oid}: no Relation message preceded it in this call",
                    message_type="Truncate",
                    offset=0,
                )
            schemas.append(schema)
        target = self._stream or self._open(ord("T"))
        if isinstance(target, _OwnTransaction):
            buffers, tag = target.buffers, 0
            if message.xid is not None:
                target.subtransactions.setdefault(message.xid, target.next_position)
        else:
            buffers = target.own.buffers if target.own else self._shared
            tag = 0 if target.own else target.tag
            target.adjust += len(schemas) - 1  # one change record per truncated relation
        position = self._take_position(target)[0]
        names = [s.qualified_name for s in schemas]
        for schema in schemas:
            records = self._builder(schema).truncate(position, names, message.cascade, message.restart_identity)
            buffers.add_records(schema, records, tag)

    def _take_position(self, target: _OwnTransaction | _PlainTransaction) -> tuple[int, int]:
        """The next position in ``target`` and the number its buffers know it by (the same in a
        transaction's own buffers; the shared sequence number for a plain transaction)."""
        own = target if isinstance(target, _OwnTransaction) else target.own
        if own is not None:
            position = own.next_position
            own.next_position += 1
            return position, position
        assert isinstance(target, _PlainTransaction)
        seq = self._seq
        self._seq += 1
        return seq - target.start, seq

    def _stream_abort(self, message: StreamAbortMessage) -> None:
        own = self._streams.get(message.xid)
        if own is None:
            return  # not streamed in this call: nothing of it is buffered
        if message.subtransaction_xid == message.xid:
            self._streams.pop(message.xid)
            own.buffers.discard()
            return
        cut = own.subtransactions.get(message.subtransaction_xid)
        if cut is None:
            return  # the aborted subtransaction made no change seen here
        own.buffers.drop_positions(cut, own.next_position)
        own.messages = [m for m in own.messages if m.position < cut]
        own.subtransactions = {x: p for x, p in own.subtransactions.items() if p < cut}

    def _prepared(self, own: _OwnTransaction, message: PrepareMessage | StreamPrepareMessage) -> None:
        self.last_end_lsn = max(self.last_end_lsn, message.end_lsn)
        self.completed += 1
        if message.end_lsn <= self.checkpoint_lsn:
            own.buffers.discard()
            return
        own.buffers.convert_all()
        chunks = [
            (schema, records) for queue in own.buffers.converted.values() for schema, records, _ in queue.pop_all()
        ]
        self.sink.prepared(
            PreparedTransaction(
                message.gid,
                message.xid,
                message.prepare_lsn,
                message.end_lsn,
                message.prepare_time_us,
                own.origin,
                own.origin_lsn,
                chunks,
                own.messages,
            )
        )

    def _finish(self, info: CommitInfo) -> None:
        self.last_end_lsn = max(self.last_end_lsn, info.end_lsn)
        self.completed += 1

    def _write_shared(self) -> None:
        """Write every buffered change of committed plain transactions, with commit columns."""
        self._shared.convert_all()
        current = self._current.tag if self._current is not None else -1
        columns = self._commits.columns()
        for name, queue in list(self._shared.converted.items()):
            kept = _SpillQueue(self._spill_dir)
            for schema, records, tags in queue.pop_all():
                assert tags is not None
                waiting = tags == current
                if waiting.any():  # rows of the open transaction stay until it commits
                    kept.append(schema, records.filter(pa.array(waiting)), tags[waiting])
                    done = ~waiting
                    records, tags = records.filter(pa.array(done)), tags[done]
                live = columns.live[tags]
                if not live.all():  # transactions already in the log (a rewound slot)
                    records, tags = records.filter(pa.array(live)), tags[live]
                if records.num_rows:
                    self.sink.records(schema, columns.attach(records, tags))
            if kept:
                self._shared.converted[name] = kept
            else:
                del self._shared.converted[name]
        if self._current is None:
            self._commits.clear()
            self._seq = 0

    def _write_own(self, own: _OwnTransaction, info: CommitInfo) -> None:
        self._write_shared()  # earlier commits first: order within each table
        own.buffers.convert_all()
        changes = 0
        for queue in own.buffers.converted.values():
            for schema, records, _ in queue.pop_all():
                changes += records.num_rows
                self.sink.records(schema, with_commit_columns(records, info))
        self.sink.transaction(info, changes, own.messages)

    def _builder(self, schema: RelationSchema) -> ChangeRecordBuilder:
        builder = self._builders.get(schema)
        if builder is None:
            builder = self._builders[schema] = ChangeRecordBuilder(schema, self.catalog)
        return builder

    def _new_buffers(self, *, xid_prefixed: bool) -> _Buffers:
        return _Buffers(self._builder, xid_prefixed, self._spill_dir)

    def _open(self, type_byte: int) -> _PlainTransaction:
        if self._current is None:
            raise DecodeError(
                "message outside a transaction (no Begin before it)", message_type=message_name(type_byte), offset=0
            )
        return self._current

    def _close_plain(self, type_byte: int, *, prepared: bool) -> _PlainTransaction:
        txn = self._open(type_byte)
        if txn.prepared != prepared:
            raise DecodeError(
                f"{message_name(type_byte)} ends transaction {txn.xid}, which began with"
                f" {'Begin Prepare' if txn.prepared else 'Begin'}",
                message_type=message_name(type_byte),
                offset=0,
            )
        self._current = None
        return txn

    def _pop_stream(self, xid: int, what: str) -> _OwnTransaction:
        own = self._streams.pop(xid, None)
        if own is None:
            raise DecodeError(
                f"{what} for transaction {xid}, which was not streamed in this call", message_type=what, offset=1
            )
        return own


COMMIT_FIELDS = [
    pa.field("_cdc_commit_lsn", pa.int64(), nullable=False),
    pa.field("_cdc_end_lsn", pa.int64(), nullable=False),
    pa.field("_cdc_xid", pa.int64(), nullable=False),
    pa.field("_cdc_commit_time", pa.timestamp("us", tz="UTC"), nullable=False),
]


def with_commit_columns(records: pa.RecordBatch, info: CommitInfo) -> pa.RecordBatch:
    """``records`` of one transaction with its commit LSN, end LSN, xid and commit time."""
    values = (info.commit_lsn, info.end_lsn, info.xid, info.commit_time_us)
    return _prepend(records, [np.full(records.num_rows, v, dtype=np.int64) for v in values])


def _prepend(records: pa.RecordBatch, commit_columns: list[np.ndarray]) -> pa.RecordBatch:
    arrays = [pa.array(c, f.type) for c, f in zip(commit_columns, COMMIT_FIELDS)]
    return pa.RecordBatch.from_arrays([*arrays, *records.columns], schema=pa.schema([*COMMIT_FIELDS, *records.schema]))


@dataclass(slots=True)
class _CommitColumns:
    """Commit values by transaction tag, as arrays; ``live`` is False for dropped transactions."""

    values: list[np.ndarray]
    live: np.ndarray

    def attach(self, records: pa.RecordBatch, tags: np.ndarray) -> pa.RecordBatch:
        return _prepend(records, [column[tags] for column in self.values])


class _CommitTable:
    """Commit values of the plain transactions of a batch, by tag (their order of Begin), in
    arrays that grow by doubling: commit LSN, end LSN, xid, commit time (µs since 1970)."""

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._size = 0
        self._starts = np.zeros(1024, dtype=np.int64)
        self._values = [np.zeros(1024, dtype=np.int64) for _ in range(4)]
        self._live = np.zeros(1024, dtype=bool)
        self.pending = 0

    def _reserve(self, count: int) -> int:
        """Room for ``count`` more tags; returns the first."""
        first = self._size
        if first + count > len(self._starts):
            capacity = max(first + count, 2 * len(self._starts))
            self._starts = _grown(self._starts, capacity)
            self._values = [_grown(column, capacity) for column in self._values]
            self._live = _grown(self._live, capacity)
        self._size = first + count
        return first

    def open(self, start: int) -> int:
        """A tag for a transaction that just began with sequence number ``start``; it is dropped
        unless :meth:`commit` is called."""
        tag = self._reserve(1)
        self._starts[tag] = start
        return tag

    def open_many(self, starts: np.ndarray) -> np.ndarray:
        """Tags for transactions that began with sequence numbers ``starts`` (in order)."""
        first = self._reserve(len(starts))
        self._starts[first : self._size] = starts
        return np.arange(first, self._size, dtype=np.int64)

    def commit_many(
        self, tags: np.ndarray, commit_lsns: np.ndarray, end_lsns: np.ndarray, xids: np.ndarray, times: np.ndarray
    ) -> None:
        for column, values in zip(self._values, (commit_lsns, end_lsns, xids, times)):
            column[tags] = values
        self._live[tags] = True
        self.pending += len(tags)

    def locate(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions within their transactions and tags of the changes numbered ``seqs``."""
        starts = self._starts[: self._size]
        tags = np.searchsorted(starts, seqs, side="right") - 1
        return seqs - starts[tags], tags

    def commit(self, tag: int, info: CommitInfo) -> None:
        for column, value in zip(self._values, (info.commit_lsn, info.end_lsn, info.xid, info.commit_time_us)):
            column[tag] = value
        self._live[tag] = True
        self.pending += 1

    def columns(self) -> _CommitColumns:
        return _CommitColumns([column[: self._size] for column in self._values], self._live[: self._size])


def _grown(array: np.ndarray, capacity: int) -> np.ndarray:
    grown = np.zeros(capacity, dtype=array.dtype)
    grown[: len(array)] = array
    return grown
