"""Vectorized extraction of TupleData from many change messages at once.

The drain's hot path never builds a Python object per row: the Insert/Update/Delete messages of
one relation are concatenated into one byte buffer and walked column by column with numpy — each
step advances every message's cursor at once. The result is, per tuple part (new / old), a matrix
of column kinds and one raw :class:`pyarrow.BinaryArray` per column, ready for bulk conversion by
:mod:`cdc_assets.pgoutput.values`.

Layout violations are reported exactly as :class:`~cdc_assets.pgoutput.decoder.PgoutputDecoder`
reports them: the first offending message is re-decoded one by one to name the byte offset.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.decoder import PgoutputDecoder, message_name
from cdc_assets.pgoutput.protocol import (
    COLUMN_BINARY,
    COLUMN_NULL,
    COLUMN_TEXT,
    COLUMN_UNCHANGED,
    MSG_DELETE,
    MSG_INSERT,
    MSG_UPDATE,
    TUPLE_KEY,
    TUPLE_NEW,
    TUPLE_OLD,
)

_PADDING = bytes(16)  # lets fixed-size reads run past a truncated last message safely
_MAX_CHUNK_BYTES = 1 << 30  # binary-view offsets are Int32: split larger inputs


@dataclass(slots=True)
class TupleColumns:
    """One tuple part (new or old) of a set of messages, column-wise.

    ``present[i]`` says whether message i has this part at all (a Delete has no new tuple; an
    Update has an old one only with ``'K'``/``'O'``). ``kinds[i, j]`` is the kind byte of column j
    (0 where the part is absent); ``raw[j]`` holds the bytes of 't'/'b' values and null elsewhere.
    """

    present: np.ndarray
    kinds: np.ndarray
    raw: list[pa.BinaryArray]


@dataclass(slots=True)
class ChangeColumns:
    """The Insert/Update/Delete messages of one relation, column-wise.

    ``ops`` holds the message type bytes (``I``/``U``/``D``), ``old_markers`` the old tuple's
    marker (``K``/``O``, or 0 when none was sent).
    """

    ops: np.ndarray
    old_markers: np.ndarray
    new: TupleColumns
    old: TupleColumns


class _Bad(Exception):
    """Internal: message ``index`` breaks the layout; ``reason`` is used if re-decoding passes."""

    def __init__(self, index: int, reason: str) -> None:
        self.index = index
        self.reason = reason


def extract_changes(messages: Sequence[bytes], ncols: int, *, xid_prefixed: bool = False) -> ChangeColumns:
    """Extract every tuple of Insert/Update/Delete ``messages`` of one relation with ``ncols`` columns.

    ``xid_prefixed`` is True for messages from inside a Stream Start…Stop block. The caller has
    routed the messages here by relation OID, which is not checked again.
    """
    lengths = np.fromiter(map(len, messages), dtype=np.int64, count=len(messages))
    ends = np.cumsum(lengths)
    return extract_from_buffer(b"".join(messages), ends - lengths, ends, ncols, xid_prefixed=xid_prefixed)


def extract_from_buffer(
    data: bytes, starts: np.ndarray, ends: np.ndarray, ncols: int, *, xid_prefixed: bool = False
) -> ChangeColumns:
    """Like :func:`extract_changes`, for messages at ``data[starts[i]:ends[i]]`` (in order)."""
    if len(starts) > 1 and int(ends[-1] - starts[0]) > _MAX_CHUNK_BYTES:
        half = len(starts) // 2
        parts = [(starts[:half], ends[:half]), (starts[half:], ends[half:])]
        first, second = (_compact(data, s, e) for s, e in parts)
        return _concat(
            extract_from_buffer(*first, ncols, xid_prefixed=xid_prefixed),
            extract_from_buffer(*second, ncols, xid_prefixed=xid_prefixed),
        )
    if len(data) < int(ends[-1] if len(ends) else 0) + len(_PADDING):
        data = data + _PADDING
    buf = _Buffer(data)
    try:
        return _extract(buf, starts, ends, ncols, 5 + 4 * xid_prefixed)
    except _Bad as bad:
        message = data[int(starts[bad.index]) : int(ends[bad.index])]
        raise _precise_error(message, bad.reason, xid_prefixed) from None


def _compact(data: bytes, starts: np.ndarray, ends: np.ndarray) -> tuple[bytes, np.ndarray, np.ndarray]:
    """The messages at ``starts``/``ends`` copied next to each other into a buffer of their own."""
    compacted = b"".join(data[int(s) : int(e)] for s, e in zip(starts, ends))
    lengths = ends - starts
    new_ends = np.cumsum(lengths)
    return compacted, new_ends - lengths, new_ends


class _Buffer:
    """Concatenated messages with big-endian Int16/Int32 readable at any byte offset.

    The integer views have a stride of one byte, so ``int32[p]`` is the Int32 starting at byte
    ``p`` — a single gather instead of four byte gathers. ``le_u32`` reads raw little-endian
    words, the layout of Arrow's binary views.
    """

    __slots__ = ("data", "int16", "int32", "le_u32", "u8")

    def __init__(self, data: bytes) -> None:
        self.data = pa.py_buffer(data)
        self.u8 = np.frombuffer(data, dtype=np.uint8)
        self.int16 = np.ndarray(shape=(len(data) - 1,), dtype=">i2", buffer=data, strides=(1,))
        self.int32 = np.ndarray(shape=(len(data) - 3,), dtype=">i4", buffer=data, strides=(1,))
        self.le_u32 = np.ndarray(shape=(len(data) - 3,), dtype="<u4", buffer=data, strides=(1,))


def _extract(buf: _Buffer, starts: np.ndarray, ends: np.ndarray, ncols: int, marker_offset: int) -> ChangeColumns:
    u8 = buf.u8
    ops = u8[starts]
    marker_pos = starts + marker_offset
    _check(marker_pos < ends, "message ends before its tuple marker")
    markers = u8[marker_pos]
    is_update = ops == MSG_UPDATE
    is_delete = ops == MSG_DELETE
    _check(is_update | is_delete | (ops == MSG_INSERT), "not an Insert, Update or Delete message")
    has_old = (is_delete | is_update) & ((markers == TUPLE_KEY) | (markers == TUPLE_OLD))
    _check(~is_delete | has_old, "Delete without a 'K' or 'O' tuple")
    old = _walk(buf, marker_pos + 1, ends, ncols, has_old)
    new_marker_pos = np.where(has_old, old.end, marker_pos)
    has_new = ~is_delete
    _check(~has_new | (new_marker_pos < ends), "message ends before its new tuple")
    _check(~has_new | (u8[new_marker_pos] == TUPLE_NEW), "expected 'N' before the new tuple")
    new = _walk(buf, new_marker_pos + 1, ends, ncols, has_new)
    final = np.where(has_new, new.end, old.end)
    _check(final == ends, "unexpected trailing bytes")
    return ChangeColumns(
        ops=ops,
        old_markers=np.where(has_old, markers, 0).astype(np.uint8),
        new=new.columns(buf),
        old=old.columns(buf),
    )


@dataclass(slots=True)
class _Walk:
    """Where each present tuple's columns are inside the buffer."""

    present: np.ndarray
    kinds: np.ndarray
    value_starts: np.ndarray
    value_lengths: np.ndarray
    end: np.ndarray

    def columns(self, buf: _Buffer) -> TupleColumns:
        raw = [
            _binary_array(buf, self.value_starts[:, j], self.value_lengths[:, j], _has_value(self.kinds[:, j]))
            for j in range(self.kinds.shape[1])
        ]
        return TupleColumns(self.present, self.kinds, raw)


def _walk(buf: _Buffer, tuple_starts: np.ndarray, ends: np.ndarray, ncols: int, present: np.ndarray) -> _Walk:
    """Advance through one TupleData per present message, all messages at once.

    Only the present rows are walked (an Update without an old tuple has nothing to walk); each
    column costs a handful of vector operations and one combined check.
    """
    count = len(tuple_starts)
    kinds = np.zeros((count, ncols), dtype=np.uint8)
    value_starts = np.zeros((count, ncols), dtype=np.int64)
    value_lengths = np.zeros((count, ncols), dtype=np.int64)
    end = np.zeros(count, dtype=np.int64)
    everyone = bool(present.all())
    picked = None if everyone else np.flatnonzero(present)
    if picked is not None and not len(picked):
        return _Walk(present, kinds, value_starts, value_lengths, end)
    rows = slice(None) if picked is None else picked
    pos, limit = tuple_starts[rows], ends[rows]

    def check(ok: np.ndarray, reason: str) -> None:
        if not ok.all():
            index = int(np.argmin(ok))
            raise _Bad(index if picked is None else int(picked[index]), reason)

    check((pos + 2 <= limit) & (buf.int16[pos] == ncols), f"tuple does not have the relation's {ncols} columns")
    pos = pos + 2
    last = len(buf.int32) - 1
    for j in range(ncols):
        kind = buf.u8[np.minimum(pos, len(buf.u8) - 1)]
        valued = _has_value(kind)
        length = np.where(valued, buf.int32[np.minimum(pos + 1, last)], 0).astype(np.int64)
        following = np.where(valued, pos + 5 + length, pos + 1)
        check(
            (pos < limit)
            & (valued | (kind == COLUMN_NULL) | (kind == COLUMN_UNCHANGED))
            & (length >= 0)
            & (following <= limit),
            f"column {j} has an unknown kind or runs past the end",
        )
        kinds[rows, j] = kind
        value_starts[rows, j] = pos + 5
        value_lengths[rows, j] = length
        pos = following
    end[rows] = pos
    return _Walk(present, kinds, value_starts, value_lengths, end)


def _has_value(kind: np.ndarray) -> np.ndarray:
    has_value: np.ndarray = (kind == COLUMN_TEXT) | (kind == COLUMN_BINARY)
    return has_value


# _WORD_MASKS[k] keeps the first k bytes of a little-endian 32-bit word.
_WORD_MASKS = np.array([0, 0xFF, 0xFFFF, 0xFFFFFF, 0xFFFFFFFF], dtype=np.uint32)


def _binary_array(buf: _Buffer, starts: np.ndarray, lengths: np.ndarray, valid: np.ndarray) -> pa.BinaryArray:
    """A BinaryArray of the byte ranges ``buf[starts[i]:starts[i]+lengths[i]]``, null where not valid.

    Built as an Arrow binary-view array pointing into the message buffer, then cast to a plain
    binary array by Arrow's C++ kernels — several times faster than gathering every byte with
    numpy. A view is four 32-bit words: the length, then either the value itself zero-padded
    (up to 12 bytes) or its first four bytes, the buffer index (0) and the offset.
    """
    count = len(starts)
    if not valid.any():
        return pa.nulls(count, pa.binary())
    lengths = np.where(valid, lengths, 0)
    at = np.minimum(starts, len(buf.le_u32) - 9)
    inline = lengths <= 12
    views = np.empty((count, 4), dtype=np.uint32)
    views[:, 0] = lengths
    views[:, 1] = buf.le_u32[at] & _WORD_MASKS[np.clip(lengths, 0, 4)]
    views[:, 2] = np.where(inline, buf.le_u32[at + 4] & _WORD_MASKS[np.clip(lengths - 4, 0, 4)], 0)
    views[:, 3] = np.where(inline, buf.le_u32[at + 8] & _WORD_MASKS[np.clip(lengths - 8, 0, 4)], starts)
    all_valid = bool(valid.all())
    validity = None if all_valid else pa.py_buffer(np.packbits(valid, bitorder="little"))
    null_count = 0 if all_valid else int(count - np.count_nonzero(valid))
    array = pa.Array.from_buffers(pa.binary_view(), count, [validity, pa.py_buffer(views), buf.data], null_count)
    return array.cast(pa.binary())


def _concat(first: ChangeColumns, second: ChangeColumns) -> ChangeColumns:
    def tuples(a: TupleColumns, b: TupleColumns) -> TupleColumns:
        return TupleColumns(
            np.concatenate([a.present, b.present]),
            np.concatenate([a.kinds, b.kinds]),
            [pa.concat_arrays([x, y]) for x, y in zip(a.raw, b.raw)],
        )

    return ChangeColumns(
        np.concatenate([first.ops, second.ops]),
        np.concatenate([first.old_markers, second.old_markers]),
        tuples(first.new, second.new),
        tuples(first.old, second.old),
    )


def _check(ok: np.ndarray, reason: str) -> None:
    if not ok.all():
        raise _Bad(int(np.argmin(ok)), reason)


def _precise_error(message: bytes, reason: str, xid_prefixed: bool) -> DecodeError:
    """The DecodeError the message-at-a-time decoder gives, or one built from ``reason``."""
    decoder = PgoutputDecoder()
    decoder.in_stream = xid_prefixed
    try:
        decoder.decode(message)
    except DecodeError as error:
        return error
    name = message_name(message[0]) if message else None
    return DecodeError(reason, message_type=name, offset=0)
