"""Binary COPY rows split into one binary Arrow column each, in pure Python: the path a copy runs
where the C module (``_copy_rows.c``) was not built, e.g. an install without a C compiler. It
mirrors the C module's interface, checks, error messages and output buffers exactly
(``tests/test_copy_paths.py`` compares the two on a real server's rows).

A row costs one Python step, receiving it (psycopg's ``PGconn.get_copy_data``) and appending it
to the block's bytes; a block's rows are then split at once, a column at a time over every row
with numpy, and each column's values gathered by pyarrow's ``take`` from the block's bytes cut at
every field boundary. A malformed row
is therefore reported when its block is taken (not when it arrives), naming the same row of the
block as the C module would.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass

import numpy as np
import psycopg
import pyarrow as pa
from psycopg import pq

RECEIVE_LIMIT, RECEIVE_WAIT, RECEIVE_ENDED, RECEIVE_FAILED = 1, 0, -1, -2
"""What :meth:`RowSplitter.receive` returns: as the C module's constants."""

MAX_COLUMNS = 1664
SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
HEADER_SIZE = 19
TRAILER = b"\xff\xff"
INT32_MAX = 2**31 - 1

ColumnBuffers = tuple[bytes | memoryview | None, bytes | memoryview, bytes | memoryview, int, bool]
"""One column of a taken block: ``(validity, offsets, values, nulls, wide)``."""

# Why a row is malformed, in the order the rows' checks run (codes of :class:`_Split`).
_SHORT, _FIELDS, _LENGTH, _NEGATIVE, _VALUE, _END = range(1, 7)
_PADDING = 8
"""Bytes after a block's rows, so that a malformed row's reads stay inside the block."""


class RowSplitter:
    """Binary COPY rows split into one binary column each (``_copy_rows.RowSplitter`` in Python)."""

    __slots__ = ("_block", "_bytes", "_columns", "_ended", "_header_done", "_lengths")

    def __init__(self, columns: int) -> None:
        if not 0 <= columns <= MAX_COLUMNS:
            raise ValueError(f"a table has 0 to {MAX_COLUMNS} columns, not {columns}")
        self._columns = columns
        self._block = bytearray()  # the block's rows, one after the other
        self._lengths = array("q")  # each row's length
        self._bytes = 0
        self._header_done = False
        self._ended = False

    @property
    def rows(self) -> int:
        """Rows in the block."""
        return len(self._lengths)

    def add_message(self, message: bytes | bytearray | memoryview, /) -> None:
        """Add one CopyData message's contents (the header, a row, or the trailer)."""
        self._add(memoryview(message))

    def receive(self, pgconn: pq.abc.PGconn, max_rows: int, max_bytes: int, /) -> int:
        """Take rows from libpq until the block holds ``max_rows`` rows or reaches ``max_bytes``
        (``RECEIVE_LIMIT``), libpq holds no complete message (``RECEIVE_WAIT``), or the COPY has
        ended (``RECEIVE_ENDED``; ``RECEIVE_FAILED``: libpq's result tells why)."""
        get_copy_data, block, lengths = pgconn.get_copy_data, self._block, self._lengths
        append, rows, size = lengths.append, len(lengths), self._bytes
        plain = self._header_done and not self._ended  # a message that can only be a row
        status = RECEIVE_LIMIT
        while rows < max_rows and size < max_bytes:
            try:
                length, message = get_copy_data(1)
            except psycopg.OperationalError:  # libpq's -2, as the C module sees it
                status = RECEIVE_FAILED
                break
            if length <= 0:
                status = RECEIVE_ENDED if length == -1 else RECEIVE_WAIT
                break
            if plain and length != 2:
                block += message
                append(length)
                rows += 1
                size += length
            else:
                self._bytes = size
                self._add(message)
                rows, size, plain = len(lengths), self._bytes, self._header_done and not self._ended
        self._bytes = size
        return status

    def take(self) -> list[ColumnBuffers]:
        """The block's columns as ``(validity, offsets, values, nulls, wide)``, and a new block;
        ``ValueError`` naming the block's first malformed row."""
        block, lengths = self._block, self._lengths
        self._block, self._lengths, self._bytes = bytearray(), array("q"), 0
        return _Split(block, lengths, self._columns).columns()

    def _add(self, message: memoryview) -> None:
        """One CopyData message: the header first (with a row, the trailer or nothing), then a
        row or the trailer."""
        if self._ended:
            raise self._malformed("a message after the trailer")
        if not self._header_done:
            message = self._after_header(message)
            if not message:
                return
        if message == TRAILER:
            self._ended = True
            return
        self._block += message
        self._lengths.append(len(message))
        self._bytes += len(message)

    def _after_header(self, message: memoryview) -> memoryview:
        if len(message) < HEADER_SIZE:
            raise self._malformed("the header is cut short")
        flags, extension = struct.unpack_from("!ii", message, 11)
        if message[:11] != SIGNATURE or flags & 0x1FFFF or extension < 0 or extension > len(message) - HEADER_SIZE:
            raise self._malformed(f"unexpected header (flags {flags}, extension of {extension} bytes)")
        self._header_done = True
        return message[HEADER_SIZE + extension :]

    def _malformed(self, reason: str) -> ValueError:
        return ValueError(f"{reason} (row {len(self._lengths) + 1} of the block)")


@dataclass(slots=True)
class _Checks:
    """Why each row of a block is malformed: the first check it failed (``reason``, 0: none) and
    the column it failed in; kept only once a row fails."""

    rows: int
    reason: np.ndarray | None = None
    column: np.ndarray | None = None

    def check(self, failed: np.ndarray, code: int, column: int = 0) -> None:
        """Rows where ``failed`` is true fail ``code`` in ``column``, unless they failed before."""
        if not failed.any():
            return
        if self.reason is None or self.column is None:
            self.reason, self.column = np.zeros(self.rows, np.int8), np.zeros(self.rows, np.int64)
        new = failed & (self.reason == 0)
        self.reason[new] = code
        self.column[new] = column

    def safe(self, at: np.ndarray, fallback: np.ndarray) -> np.ndarray:
        """``at``, with ``fallback`` for the rows that failed (a position that can be read)."""
        return at if self.reason is None else np.where(self.reason == 0, at, fallback)

    def first(self) -> tuple[int, int, int] | None:
        """The first malformed row, with its reason and column; None when every row is sound."""
        if self.reason is None or self.column is None:
            return None
        row = int(np.argmax(self.reason != 0))
        return row, int(self.reason[row]), int(self.column[row])


@dataclass(slots=True)
class _Split:
    """A block's rows split into columns: every row's field at a time, with numpy."""

    block: bytearray
    lengths: array[int]
    count: int

    def columns(self) -> list[ColumnBuffers]:
        rows = len(self.lengths)
        lengths = np.frombuffer(self.lengths, np.int64)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        self.block += bytes(_PADDING)
        int16_at, int32_at = _ints(self.block, 2), _ints(self.block, 4)
        checks = _Checks(rows)
        checks.check(lengths < 2, _SHORT)
        fields = int16_at[starts]
        checks.check(fields != self.count, _FIELDS)
        at = checks.safe(starts + 2, starts)
        sizes, value_at = [], []
        for column in range(self.count):
            checks.check(ends - at < 4, _LENGTH, column)
            at = checks.safe(at, starts)
            size = int32_at[at].astype(np.int64)
            at = at + 4
            checks.check(size < -1, _NEGATIVE, column)
            length = np.maximum(size, 0)
            checks.check(ends - at < length, _VALUE, column)
            sizes.append(size)
            value_at.append(at)
            at = checks.safe(at + length, starts)
        checks.check(at != ends, _END)
        if (first := checks.first()) is not None:
            row, code, column = first
            raise ValueError(f"{self._reason(code, column, int(fields[row]))} (row {row + 1} of the block)")
        return self._gather(starts, sizes, value_at)

    def _reason(self, code: int, column: int, fields: int) -> str:
        return {
            _SHORT: "a row shorter than its field count",
            _FIELDS: f"a row with {fields} fields, expected {self.count}",
            _LENGTH: f"column {column + 1}'s length does not fit the row",
            _NEGATIVE: f"column {column + 1} has a negative length",
            _VALUE: f"column {column + 1}'s value does not fit the row",
            _END: "the row's end does not fit the row",
        }[code]

    def _gather(self, starts: np.ndarray, sizes: list[np.ndarray], value_at: list[np.ndarray]) -> list[ColumnBuffers]:
        """The block cut at every field boundary — per row its field count and first length,
        then each value and the next length — taken apart into one array per column."""
        rows, count = len(starts), self.count
        if not count:
            return []
        size_of_rows = len(self.block) - _PADDING
        wide_block = size_of_rows > INT32_MAX
        bounds = np.empty(rows * 2 * count + 1, np.int64 if wide_block else np.int32)
        grid = bounds[:-1].reshape(rows, 2 * count)
        grid[:, 0] = starts
        for column, (size, at) in enumerate(zip(sizes, value_at)):
            grid[:, 2 * column + 1] = at
            if column + 1 < count:
                grid[:, 2 * column + 2] = at + np.maximum(size, 0)
        bounds[-1] = size_of_rows
        pieces = pa.Array.from_buffers(
            pa.large_binary() if wide_block else pa.binary(),
            rows * 2 * count,
            [None, pa.py_buffer(bounds), pa.py_buffer(self.block)],
        )
        taken: list[ColumnBuffers] = []
        for column, size in enumerate(sizes):
            values = pieces.take(pa.array(np.arange(2 * column + 1, rows * 2 * count, 2 * count, dtype=np.int64)))
            wide = wide_block and int(np.maximum(size, 0).sum()) > INT32_MAX
            if wide_block and not wide:
                values = values.cast(pa.binary())
            nulls = int(np.count_nonzero(size == -1))
            validity = np.packbits(size != -1, bitorder="little").tobytes() if nulls else None
            _, offsets, values_buffer = values.buffers()
            taken.append((validity, memoryview(offsets), memoryview(values_buffer), nulls, wide))
        return taken


def _ints(data: bytearray, width: int) -> np.ndarray:
    """The big-endian signed ``width``-byte integer starting at each byte of ``data`` (a view)."""
    return np.ndarray((len(data) - width + 1,), f">i{width}", data, strides=(1,))
