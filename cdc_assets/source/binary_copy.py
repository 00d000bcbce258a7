"""A table's values read with ``COPY (SELECT …) TO STDOUT (FORMAT binary)``, one array per column.

A column whose type cdc-assets converts from binary (:attr:`ColumnConverter.binary_supported`) is
selected as it is: binary COPY sends each value through its type's send function, the same bytes
pgoutput's binary mode sends. Any other column is selected through its type's output function
(``typoutput(c)``, a ``cstring``), whose binary form is the text pgoutput's text mode sends — a
``::text`` cast would differ (``inet`` casts add ``/32``). The pinned settings make that text
deterministic. Both formats convert to the same Arrow values (``docs/architecture.md``, "The
initial snapshot").

The binary COPY format: an 11-byte signature, an int32 of flags and an int32 extension length
(and the extension) once; then per row an int16 field count and per field an int32 length (-1 for
NULL) and that many bytes; finally the int16 -1. PostgreSQL sends one CopyData message per row,
the header with the first (or with the trailer, when there is none) and the trailer alone. Rows
are taken from libpq one call each and kept as they came; a block of them is split into columns
with numpy, every row at once, one field after the other.
"""

from __future__ import annotations

import selectors
import struct
import sys
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
from psycopg import pq

from cdc_assets.config import quote_identifier
from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pgoutput.values.raw import big_endian, validity_buffer

BLOCK_BYTES = 4 << 20
"""Bytes split at a time when no row count is asked for (plus the row that crosses it)."""

SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
_HEADER = struct.Struct("!11sii")
_TRAILER = b"\xff\xff"
_INT32_OFFSETS_MAX = 2**31 - 1


@dataclass(slots=True, frozen=True)
class CopySelect:
    """The select list of a copy: each published column, ``binary[i]`` telling whether it arrives
    in its send function's format (else as its output function's text)."""

    columns: str
    binary: tuple[bool, ...]

    @classmethod
    def of(cls, conn: psycopg.Connection[Any], relation: RelationSchema, binary: Sequence[bool]) -> CopySelect:
        """``relation``'s columns, sent in binary where ``binary`` says its values convert from it."""
        text_types = sorted({c.type_oid for c, as_binary in zip(relation.columns, binary) if not as_binary})
        outputs: dict[int, str] = {}
        if text_types:
            outputs = dict(
                conn.execute(
                    "SELECT oid::int8, typoutput::regproc::text FROM pg_type WHERE oid = ANY(%s::int8[]::oid[])",
                    (text_types,),
                ).fetchall()
            )
        selected = [
            quote_identifier(c.name) if as_binary else f"{outputs[c.type_oid]}({quote_identifier(c.name)})"
            for c, as_binary in zip(relation.columns, binary)
        ]
        return cls(", ".join(selected), tuple(binary))

    def query(self, source: str, where: str = "") -> str:
        """The ``COPY`` reading the columns from ``source`` (a FROM item), with an optional filter."""
        condition = f" WHERE {where}" if where else ""
        return f"COPY (SELECT {self.columns} FROM {source}{condition}) TO STDOUT (FORMAT binary)"


def read_columns(
    conn: psycopg.Connection[Any],
    query: str,
    columns: int,
    *,
    block_rows: int = sys.maxsize,
    block_bytes: int = BLOCK_BYTES,
) -> Generator[list[pa.Array], None, None]:
    """Run a :meth:`CopySelect.query` and yield its rows a block at a time (``block_rows`` rows, or
    the rows that reach ``block_bytes``), one binary array per column (null for NULL).

    Closing the generator early cancels the COPY.
    """
    with conn.cursor().copy(query), _Receiver(conn) as receiver:  # leaving on an exception cancels the COPY
        while not receiver.done:
            block, sizes = receiver.block(block_rows, block_bytes)
            if sizes:
                yield split_rows(block, sizes, columns)


class _Receiver:
    """The rows of a running binary ``COPY … TO STDOUT``, taken from libpq one call each.

    psycopg's ``Copy.read()`` costs a generator and a wait per row, more than twice the CPU of
    this loop, which waits on the socket only when libpq holds no complete row.
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self._pgconn = conn.pgconn
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._pgconn.socket, selectors.EVENT_READ)
        self._header = True
        self.done = False

    def __enter__(self) -> _Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self._selector.close()

    def block(self, max_rows: int, max_bytes: int) -> tuple[bytearray, list[int]]:
        """The next rows, up to either limit: their bytes one after the other and each one's size
        (none once the COPY has ended)."""
        get = self._pgconn.get_copy_data
        block = bytearray()
        sizes: list[int] = []
        keep = sizes.append
        rows = taken = 0
        while rows < max_rows and taken < max_bytes:
            size, row = get(1)
            if size > 2 or (size > 0 and row != _TRAILER):
                block += row
                keep(size)
                rows += 1
                taken += size
            elif size == 0:
                self._wait()
            elif size < 0:
                self._finish()
                break
        if sizes and self._header:
            header = _header_size(block)
            del block[:header]
            sizes[0] -= header
            self._header = False
            if sizes[0] == len(_TRAILER) and block.startswith(_TRAILER):  # no rows: header and trailer came as one
                del block[:2], sizes[0]
        return block, sizes

    def _wait(self) -> None:
        self._selector.select()
        self._pgconn.consume_input()

    def _finish(self) -> None:
        """Take the COPY's final result: raise the server's error if it failed."""
        while self._pgconn.is_busy():
            self._wait()
        result = self._pgconn.get_result()
        while self._pgconn.get_result() is not None:
            pass
        self.done = True
        if result is None or result.status != pq.ExecStatus.COMMAND_OK:
            if result is None:
                raise psycopg.OperationalError("the COPY ended without a result")
            raise psycopg.errors.error_from_result(result, encoding=self._conn.info.encoding)


def _header_size(block: bytearray) -> int:
    """The size of the file header in front of the first row."""
    if len(block) < _HEADER.size:
        raise _malformed("the header is cut short", 0)
    signature, flags, extension = _HEADER.unpack_from(block)
    if signature != SIGNATURE or flags & 0x1FFFF or extension < 0:  # bits 0-15 critical, 16: OIDs
        raise _malformed(f"unexpected header {bytes(block[: _HEADER.size])!r}", 0)
    return int(_HEADER.size + extension)


def split_rows(block: bytes | bytearray, sizes: Sequence[int], columns: int) -> list[pa.Array]:
    """Binary COPY rows (the header removed), one after the other with their ``sizes``, as one
    binary array per column, null for NULL.

    Every row is walked at once, field by field: each field's length says where the next begins.
    A column's values are then gathered by Arrow from the block's bytes, seen as one binary array
    whose even entries are the column's values and odd entries what lies between them.
    """
    data = np.frombuffer(block, np.uint8)
    lengths = np.array(sizes, np.int64)
    ends = np.cumsum(lengths)
    starts = ends - lengths
    too_short = np.flatnonzero(lengths < 2)
    if len(too_short):
        raise _malformed("a row shorter than its field count", int(too_short[0]))
    fields = big_endian(data, starts, 2)
    wrong = np.flatnonzero(fields != columns)
    if len(wrong):
        row = int(wrong[0])
        raise _malformed(f"a row with {fields[row]} fields, expected {columns}", row)
    position = starts + 2
    buffer = pa.py_buffer(data)
    offset_type, array_type = (
        (np.int32, pa.binary()) if len(data) <= _INT32_OFFSETS_MAX else (np.int64, pa.large_binary())
    )
    even = pa.array(np.arange(0, 2 * len(lengths), 2, dtype=np.int64))
    split: list[pa.Array] = []
    for column in range(columns):
        _check_fits(position + 4, ends, f"column {column + 1}'s length")
        size = big_endian(data, position, 4)
        if (size < -1).any():
            raise _malformed(f"column {column + 1} has a negative length", int(np.flatnonzero(size < -1)[0]))
        value_starts = position + 4
        position = value_starts + np.maximum(size, 0)
        _check_fits(position, ends, f"column {column + 1}'s value")
        bounds = np.empty(2 * len(lengths), offset_type)
        bounds[0::2] = value_starts
        bounds[1::2] = position
        between = pa.Array.from_buffers(array_type, len(bounds) - 1, [None, pa.py_buffer(bounds), buffer])
        values = between.take(even)
        valid = size >= 0
        split.append(pa.Array.from_buffers(array_type, len(lengths), [validity_buffer(valid), *values.buffers()[1:]]))
    _check_fits(position, ends, "the row's end", exact=True)
    return split


def _check_fits(reach: np.ndarray, ends: np.ndarray, what: str, *, exact: bool = False) -> None:
    """Raise for the first row where ``reach`` passes (or, ``exact``, differs from) the row's end."""
    bad = np.flatnonzero(reach != ends if exact else reach > ends)
    if len(bad):
        raise _malformed(f"{what} does not fit the row", int(bad[0]))


def _malformed(reason: str, row: int) -> DecodeError:
    return DecodeError(
        f"malformed binary COPY data: {reason} (row {row + 1} of the block)", message_type="CopyData", offset=None
    )
