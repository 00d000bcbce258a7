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
the header with the first (or with the trailer, when there is none) and the trailer alone. A
small C module (``_copy_rows.c``) takes the messages from libpq and splits each row into the
columns as it arrives: a loop over rows in Python cost more CPU than the server's send functions
(docs/architecture.md, "The initial snapshot"). Where it was not built, a pure Python splitter
does the same a block at a time (``copy_rows.py`` chooses).
"""

from __future__ import annotations

import selectors
import sys
from collections.abc import Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
from psycopg import pq

from cdc_assets.errors import DecodeError
from cdc_assets.names import quote_identifier
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.source.copy_rows import PATH, PATHS, RECEIVE_LIMIT, RECEIVE_WAIT

BLOCK_BYTES = 4 << 20
"""Bytes split at a time when no row count is asked for (plus the row that crosses it)."""


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
    path: str = PATH,
) -> Generator[list[pa.Array], None, None]:
    """Run a :meth:`CopySelect.query` and yield its rows a block at a time (``block_rows`` rows, or
    the rows that reach ``block_bytes``), one binary array per column (null for NULL), split on
    ``path`` (:data:`~cdc_assets.source.copy_rows.PATHS`).

    Closing the generator early cancels the COPY.
    """
    with (
        conn.cursor().copy(query),
        _Receiver(conn, CopyRows(columns, path)) as receiver,
    ):  # leaving on an exception cancels the COPY
        while not receiver.done:
            block = receiver.block(block_rows, block_bytes)
            if block:
                yield block


class CopyRows:
    """Binary COPY messages split into one binary array per column (on ``path``: C or Python,
    ``copy_rows.py``); a bad message raises :class:`DecodeError` naming the row of the block."""

    def __init__(self, columns: int, path: str = PATH) -> None:
        self._splitter = PATHS[path](columns)

    def add_message(self, message: bytes) -> None:
        """Add one CopyData message's contents: the header (with the first row), a row, or the trailer."""
        with _malformed():
            self._splitter.add_message(message)

    def receive(self, pgconn: pq.abc.PGconn, max_rows: int, max_bytes: int) -> int:
        """Take rows from libpq until the block holds ``max_rows`` rows or reaches ``max_bytes``
        (``RECEIVE_LIMIT``), libpq holds no complete message (``RECEIVE_WAIT``), or the COPY has
        ended (``RECEIVE_ENDED``; ``RECEIVE_FAILED``: libpq's result tells why)."""
        with _malformed():
            return self._splitter.receive(pgconn, max_rows, max_bytes)

    @property
    def rows(self) -> int:
        """Rows in the block."""
        return self._splitter.rows

    def take(self) -> list[pa.Array]:
        """The block's columns; the next rows start a new block."""
        rows = self._splitter.rows
        with _malformed():
            taken = self._splitter.take()
        return [
            pa.Array.from_buffers(
                pa.large_binary() if wide else pa.binary(),
                rows,
                [None if validity is None else pa.py_buffer(validity), pa.py_buffer(offsets), pa.py_buffer(values)],
                null_count=nulls,
            )
            for validity, offsets, values, nulls, wide in taken
        ]


class _Receiver:
    """The rows of a running binary ``COPY … TO STDOUT``, a block at a time, waiting on the socket
    only when libpq holds no complete row."""

    def __init__(self, conn: psycopg.Connection[Any], rows: CopyRows) -> None:
        self._conn = conn
        self._pgconn = conn.pgconn
        self._rows = rows
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._pgconn.socket, selectors.EVENT_READ)
        self.done = False

    def __enter__(self) -> _Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self._selector.close()

    def block(self, max_rows: int, max_bytes: int) -> list[pa.Array]:
        """The next rows, up to either limit, one array per column (none once the COPY has ended)."""
        while (status := self._rows.receive(self._pgconn, max_rows, max_bytes)) == RECEIVE_WAIT:
            self._wait()
        if status != RECEIVE_LIMIT:
            self._finish()
        return self._rows.take() if self._rows.rows else []

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


@contextmanager
def _malformed() -> Iterator[None]:
    try:
        yield
    except ValueError as error:
        raise DecodeError(f"malformed binary COPY data: {error}", message_type="CopyData", offset=None) from None
