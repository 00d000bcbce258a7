"""Change buffers: per table, raw change messages waiting to be converted to Arrow, then the
converted chunks in order (:class:`Buffers`); and :class:`OwnTransaction`, a transaction whose
changes are buffered apart from the plain ones (a streamed or a prepared one).

Raw changes carry sequence numbers: in an own transaction, their positions in it; in the buffers
the plain transactions share, numbers that the commit table maps to a transaction (its tag) and a
position in it (see :mod:`cdc_assets.transactions.plain`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.messages import LogicalDecodingMessage, TruncateMessage
from cdc_assets.pgoutput.records import RecordColumn
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.transactions import spill
from cdc_assets.transactions.sink import TransactionalMessage

Locate = Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]


class RecordBuilders:
    """One :class:`ChangeRecordBuilder` per relation schema, made when first asked for."""

    __slots__ = ("_builders", "_catalog")

    def __init__(self, catalog: TypeCatalog) -> None:
        self._catalog = catalog
        self._builders: dict[RelationSchema, ChangeRecordBuilder] = {}

    def __call__(self, schema: RelationSchema) -> ChangeRecordBuilder:
        builder = self._builders.get(schema)
        if builder is None:
            builder = self._builders[schema] = ChangeRecordBuilder(schema, self._catalog)
        return builder


@dataclass(slots=True)
class Segment:
    """Change messages at ``data[starts[i]:ends[i]]`` with sequence numbers ``seqs``."""

    data: bytes
    starts: np.ndarray
    ends: np.ndarray
    seqs: np.ndarray

    @classmethod
    def of(cls, messages: list[bytes], seqs: list[int]) -> Segment:
        lengths = np.fromiter(map(len, messages), dtype=np.int64, count=len(messages))
        ends = np.cumsum(lengths)
        return cls(b"".join(messages), ends - lengths, ends, np.array(seqs, dtype=np.int64))

    def select(self, mask: np.ndarray) -> Segment:
        return Segment(self.data, self.starts[mask], self.ends[mask], self.seqs[mask])


def combine(segments: list[Segment]) -> Segment:
    """One segment over one buffer (the segments' buffers joined, offsets shifted)."""
    if len(segments) == 1:
        return segments[0]
    shifts = np.cumsum([0] + [len(s.data) for s in segments[:-1]])
    return Segment(
        b"".join(s.data for s in segments),
        np.concatenate([s.starts + shift for s, shift in zip(segments, shifts)]),
        np.concatenate([s.ends + shift for s, shift in zip(segments, shifts)]),
        np.concatenate([s.seqs for s in segments]),
    )


@dataclass(slots=True)
class RawBuffer:
    """Raw change messages of one table under one schema, waiting to be converted, each with its
    sequence number: whole segments from the block path, plus single messages from the
    message-at-a-time path."""

    schema: RelationSchema
    segments: list[Segment] = field(default_factory=list)
    messages: list[bytes] = field(default_factory=list)
    seqs: list[int] = field(default_factory=list)
    rows: int = 0

    def freeze(self) -> None:
        """Turn the single messages into a segment, keeping the order."""
        if self.messages:
            self.segments.append(Segment.of(self.messages, self.seqs))
            self.messages, self.seqs = [], []


def own_positions(seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """In a transaction's own buffers a sequence number is the position (one transaction, tag 0)."""
    return seqs, np.zeros(len(seqs), dtype=np.int64)


class Buffers:
    """Raw and converted changes per table, in order. ``xid_prefixed`` says how raw messages
    were sent (inside stream blocks they carry an xid); ``locate`` maps sequence numbers to
    positions in their transactions and to transaction tags."""

    __slots__ = ("_builders", "_last", "_locate", "_spill_dir", "_xid_prefixed", "converted", "raw")

    def __init__(
        self, builders: RecordBuilders, xid_prefixed: bool, spill_dir: str | None, locate: Locate = own_positions
    ) -> None:
        self.raw: dict[str, RawBuffer] = {}
        self.converted: dict[str, spill.SpillQueue] = {}
        self._builders = builders
        self._xid_prefixed = xid_prefixed
        self._spill_dir = spill_dir
        self._locate = locate
        self._last: tuple[RelationSchema, RawBuffer] | None = None  # the last answer of :meth:`buffer`

    @property
    def raw_rows(self) -> int:
        return sum(raw.rows for raw in self.raw.values())

    def buffer(self, schema: RelationSchema) -> RawBuffer:
        """The raw buffer for new changes under ``schema``; what an older schema of the same table
        buffered is converted first, so records stay in order."""
        last = self._last
        if last is not None and last[0] is schema:  # row after row of one table: no name, no comparison
            return last[1]
        name = schema.qualified_name
        raw = self.raw.get(name)
        if raw is None or raw.schema != schema:
            if raw is not None:
                self.convert(name)
            raw = self.raw[name] = RawBuffer(schema)
        self._last = (schema, raw)
        return raw

    def add(self, raw: RawBuffer, data: bytes, seq: int) -> None:
        raw.messages.append(data)
        raw.seqs.append(seq)
        raw.rows += 1
        if raw.rows >= spill.CHUNK_ROWS:
            self.convert(raw.schema.qualified_name)

    def add_segment(self, raw: RawBuffer, segment: Segment) -> None:
        raw.freeze()
        raw.segments.append(segment)
        raw.rows += len(segment.seqs)
        if raw.rows >= spill.CHUNK_ROWS:
            self.convert(raw.schema.qualified_name)

    def add_truncate(self, schemas: list[RelationSchema], message: TruncateMessage, position: int, tag: int) -> None:
        """A Truncate at ``position`` of transaction ``tag``: one change record per relation, each
        after everything buffered for its table."""
        names = [s.qualified_name for s in schemas]
        for schema in schemas:
            records = self._builders(schema).truncate(position, names, message.cascade, message.restart_identity)
            self.convert(schema.qualified_name)
            self._queue(schema.qualified_name).append(schema, records, np.full(records.num_rows, tag, dtype=np.int64))

    def convert(self, name: str) -> None:
        """Convert what is buffered raw for table ``name``; the buffer object stays usable."""
        raw = self.raw.get(name)
        if raw is None or not raw.rows:
            return
        raw.freeze()
        segment = combine(raw.segments)
        positions, tags = self._locate(segment.seqs)
        records = self._builders(raw.schema).changes_in(
            segment.data, segment.starts, segment.ends, positions, xid_prefixed=self._xid_prefixed
        )
        self._queue(name).append(raw.schema, records, tags)
        raw.segments, raw.rows = [], 0

    def convert_all(self) -> None:
        for name in list(self.raw):
            self.convert(name)

    def drop_positions(self, start: int, end: int) -> None:
        """Forget changes at positions in [start, end) (own buffers: a sequence number is a position)."""
        for raw in self.raw.values():
            raw.freeze()
            raw.segments = [s.select((s.seqs < start) | (s.seqs >= end)) for s in raw.segments]
            raw.rows = sum(len(s.seqs) for s in raw.segments)
        for name, queue in self.converted.items():
            kept = spill.SpillQueue(self._spill_dir)
            for schema, records, tags in queue.pop_all():
                positions = records.column(RecordColumn.POSITION).to_numpy()
                mask = (positions < start) | (positions >= end)
                if mask.any():
                    kept.append(schema, records.filter(pa.array(mask)), tags[mask])
            self.converted[name] = kept

    def discard(self) -> None:
        self.raw.clear()
        self._last = None
        for queue in self.converted.values():
            queue.discard()
        self.converted.clear()

    def _queue(self, name: str) -> spill.SpillQueue:
        queue = self.converted.get(name)
        if queue is None:
            queue = self.converted[name] = spill.SpillQueue(self._spill_dir)
        return queue


class OwnTransaction:
    """A transaction buffered apart from the plain ones, its changes numbered by their positions
    in it: a prepared one (Begin Prepare … Prepare) or, as :class:`StreamedTransaction
    <cdc_assets.transactions.streamed.StreamedTransaction>`, a streamed one."""

    __slots__ = ("buffers", "messages", "next_position", "origin", "origin_lsn", "xid")

    def __init__(self, xid: int, buffers: Buffers) -> None:
        self.xid = xid
        self.buffers = buffers
        self.origin: str | None = None
        self.origin_lsn: int | None = None
        self.next_position = 0
        self.messages: list[TransactionalMessage] = []

    def add_change(self, schema: RelationSchema, data: bytes) -> None:
        buffers = self.buffers
        buffers.add(buffers.buffer(schema), data, self.next_position)
        self.next_position += 1

    def add_truncate(self, schemas: list[RelationSchema], message: TruncateMessage) -> None:
        self.buffers.add_truncate(schemas, message, self.next_position, 0)
        self.next_position += 1

    def add_message(self, message: LogicalDecodingMessage) -> None:
        self.messages.append(TransactionalMessage(self.next_position, message))
        self.next_position += 1

    def set_origin(self, name: str, commit_lsn: int) -> None:
        self.origin, self.origin_lsn = name, commit_lsn

    def chunks(self) -> Iterator[tuple[RelationSchema, pa.RecordBatch]]:
        """Every change record, converted, per table in order, taken out of the buffers."""
        self.buffers.convert_all()
        for queue in self.buffers.converted.values():
            for schema, records, _ in queue.pop_all():
                yield schema, records
