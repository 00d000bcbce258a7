"""Binary COPY rows split into one binary Arrow column each, in pure Python: the path a copy runs
where the C module (``_copy_rows.c``) was not built, e.g. an install without a C compiler. It
mirrors the C module's interface, checks, error messages and output buffers exactly
(``tests/test_copy_paths.py`` compares the two on a real server's rows).

A row costs one Python step, receiving it (psycopg's ``PGconn.get_copy_data``); a block's rows
are then split at once, a column at a time over every row with numpy, and each column's values
gathered by pyarrow's ``take`` from the block's bytes cut at every field boundary. A malformed row
is therefore reported when its block is taken (not when it arrives), naming the same row of the
block as the C module would.
"""

from __future__ import annotations

import struct
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

    __slots__ = ("_bytes", "_columns", "_ended", "_header_done", "_messages")

    def __init__(self, columns: int) -> None:
        if not 0 <= columns <= MAX_COLUMNS:
            raise ValueError(f"a table has 0 to {MAX_COLUMNS} columns, not {columns}")
        self._columns = columns
        self._messages: list[bytes | memoryview] = []
        self._bytes = 0
        self._header_done = False
        self._ended = False

    @property
    def rows(self) -> int:
        """Rows in the block."""
        return len(self._messages)

    def add_message(self, message: bytes | bytearray | memoryview, /) -> None:
        """Add one CopyData message's contents (the header, a row, or the trailer)."""
        self._add(memoryview(bytes(message)))

    def receive(self, pgconn: pq.abc.PGconn, max_rows: int, max_bytes: int, /) -> int:
        """Take rows from libpq until the block holds ``max_rows`` rows or reaches ``max_bytes``
        (``RECEIVE_LIMIT``), libpq holds no complete message (``RECEIVE_WAIT``), or the COPY has
        ended (``RECEIVE_ENDED``; ``RECEIVE_FAILED``: libpq's result tells why)."""
        get_copy_data, append = pgconn.get_copy_data, self._messages.append
        while len(self._messages) < max_rows and self._bytes < max_bytes:
            try:
                length, message = get_copy_data(1)
            except psycopg.OperationalError:  # libpq's -2, as the C module sees it
                return RECEIVE_FAILED
            if length <= 0:
                return RECEIVE_ENDED if length == -1 else RECEIVE_WAIT
            if length == 2 or not self._header_done or self._ended:
                self._add(message)
            else:
                append(message)
                self._bytes += length
        return RECEIVE_LIMIT

    def take(self) -> list[ColumnBuffers]:
        """The block's columns as ``(validity, offsets, values, nulls, wide)``, and a new block;
        ``ValueError`` naming the block's first malformed row."""
        messages, self._messages, self._bytes = self._messages, [], 0
        return _Split(messages, self._columns).columns()

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
        self._messages.append(message)
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
        return ValueError(f"{reason} (row {len(self._messages) + 1} of the block)")


@dataclass(slots=True)
class _Split:
    """A block's rows split into columns: every row's field at a time, with numpy."""

    messages: list[bytes | memoryview]
    columns_count: int

    def columns(self) -> list[ColumnBuffers]:
        rows = len(self.messages)
        lengths = np.fromiter(map(len, self.messages), np.int64, count=rows)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        data = b"".join([*self.messages, bytes(_PADDING)])
        block = np.frombuffer(data, np.uint8)
        reason = np.zeros(rows, np.int8)  # per row: the first check it failed (0: none)
        column_of = np.zeros(rows, np.int64)

        def fail(condition: np.ndarray, code: int, column: int = 0) -> None:
            new = condition & (reason == 0)
            reason[new] = code
            column_of[new] = column

        fail(lengths < 2, _SHORT)
        fields = _int_at(block, starts, 2)
        fail(fields != self.columns_count, _FIELDS)
        at = np.where(reason == 0, starts + 2, starts)
        sizes, value_at = [], []
        for column in range(self.columns_count):
            fail(ends - at < 4, _LENGTH, column)
            at = np.where(reason == 0, at, starts)
            size = _int_at(block, at, 4)
            at = at + 4
            fail(size < -1, _NEGATIVE, column)
            fail(ends - at < size, _VALUE, column)
            sizes.append(size)
            value_at.append(at)
            at = np.where(reason == 0, at + np.maximum(size, 0), starts)
        fail(at != ends, _END)
        if reason.any():
            row = int(np.argmax(reason != 0))
            raise ValueError(
                f"{self._reason(int(reason[row]), int(column_of[row]), int(fields[row]))} (row {row + 1} of the block)"
            )
        return self._gather(data, starts, sizes, value_at)

    def _reason(self, code: int, column: int, fields: int) -> str:
        return {
            _SHORT: "a row shorter than its field count",
            _FIELDS: f"a row with {fields} fields, expected {self.columns_count}",
            _LENGTH: f"column {column + 1}'s length does not fit the row",
            _NEGATIVE: f"column {column + 1} has a negative length",
            _VALUE: f"column {column + 1}'s value does not fit the row",
            _END: "the row's end does not fit the row",
        }[code]

    def _gather(
        self, data: bytes, starts: np.ndarray, sizes: list[np.ndarray], value_at: list[np.ndarray]
    ) -> list[ColumnBuffers]:
        """The block cut at every field boundary — per row its field count and first length,
        then each value and the next length — taken apart into one array per column."""
        rows, count = len(starts), self.columns_count
        if not count:
            return []
        bounds = np.empty((rows, 2 * count), np.int64)
        bounds[:, 0] = starts
        for column, (size, at) in enumerate(zip(sizes, value_at)):
            bounds[:, 2 * column + 1] = at
            if column + 1 < count:
                bounds[:, 2 * column + 2] = at + np.maximum(size, 0)
        size_of_rows = len(data) - _PADDING
        wide_block = size_of_rows > INT32_MAX
        offsets = np.append(bounds.ravel(), size_of_rows).astype(np.int64 if wide_block else np.int32)
        pieces = pa.Array.from_buffers(
            pa.large_binary() if wide_block else pa.binary(),
            rows * 2 * count,
            [None, pa.py_buffer(offsets), pa.py_buffer(data)],
        )
        taken: list[ColumnBuffers] = []
        for column, size in enumerate(sizes):
            values = pieces.take(pa.array(np.arange(rows, dtype=np.int64) * (2 * count) + (2 * column + 1)))
            wide = int(np.maximum(size, 0).sum()) > INT32_MAX
            if wide_block and not wide:
                values = values.cast(pa.binary())
            nulls = int((size == -1).sum())
            validity = np.packbits(size != -1, bitorder="little").tobytes() if nulls else None
            _, offsets_buffer, values_buffer = values.buffers()
            taken.append((validity, memoryview(offsets_buffer), memoryview(values_buffer), nulls, wide))
        return taken


def _int_at(block: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """The big-endian signed ``width``-byte integers at each of ``at``, as int64."""
    gathered = block[at[:, None] + np.arange(width)]
    return gathered.view(f">i{width}").reshape(len(at)).astype(np.int64)
