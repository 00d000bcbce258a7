"""A table's values as pgoutput's text, read with ``COPY (SELECT c1, … FROM t) TO STDOUT (FORMAT csv)``.

COPY's text formats write each value through its type's output function (``typoutput``; a
domain's is its base type's), exactly as pgoutput's text mode sends it — a ``::text`` cast would
differ (``true::text`` is ``true``, pgoutput sends ``t``; bpchar casts drop padding; inet casts add
``/32``). The pinned settings make that text deterministic, and their ``client_encoding`` (UTF8,
the only server encoding cdc-assets accepts) means no conversion.

CSV keeps every byte: PostgreSQL quotes a value holding a comma, a quote, CR or LF (doubling the
quotes), writes the empty string as ``""`` and NULL as an empty unquoted field; pyarrow reads it
back by exactly those rules into ``binary`` columns (no UTF-8 check, no trimming). COPY sends one
message per row, so the rows of a block are counted as they arrive, and a block whose bytes hold
exactly one LF per row and no CR has no line break inside a value: pyarrow then parses it with
its faster splitter.
"""

from __future__ import annotations

import selectors
import sys
from collections.abc import Generator
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.csv as pacsv
from psycopg import pq

from cdc_assets.config import quote_identifier
from cdc_assets.pgoutput.schema import RelationSchema

BLOCK_BYTES = 4 << 20
"""CSV bytes parsed at a time when no row count is asked for (plus the row that crosses it)."""


def copy_text_query(relation: RelationSchema, source: str, where: str = "") -> str:
    """The ``COPY`` reading ``relation``'s published columns from ``source`` (a FROM item), with an
    optional filter."""
    columns = ", ".join(quote_identifier(c.name) for c in relation.columns)
    condition = f" WHERE {where}" if where else ""
    return f"COPY (SELECT {columns} FROM {source}{condition}) TO STDOUT (FORMAT csv)"


def read_text_columns(
    conn: psycopg.Connection[Any],
    query: str,
    columns: int,
    *,
    block_rows: int = sys.maxsize,
    block_bytes: int = BLOCK_BYTES,
) -> Generator[list[pa.BinaryArray], None, None]:
    """Run a :func:`copy_text_query` and yield its rows a block at a time (``block_rows`` rows, or
    the rows that reach ``block_bytes``), one ``BinaryArray`` per column (null for NULL).

    Closing the generator early cancels the COPY.
    """
    with conn.cursor().copy(query), _Receiver(conn) as receiver:  # leaving on an exception cancels the COPY
        while not receiver.done:
            block, rows = receiver.block(block_rows, block_bytes)
            if rows:
                yield parse_csv(block, rows, columns)


class _Receiver:
    """The rows of a running ``COPY … TO STDOUT``, taken from libpq one call each.

    psycopg's ``Copy.read()`` costs a generator and a wait per row, more than twice the CPU of
    this loop, which waits on the socket only when libpq holds no complete row.
    """

    def __init__(self, conn: psycopg.Connection[Any]) -> None:
        self._conn = conn
        self._pgconn = conn.pgconn
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._pgconn.socket, selectors.EVENT_READ)
        self.done = False

    def __enter__(self) -> _Receiver:
        return self

    def __exit__(self, *exc: object) -> None:
        self._selector.close()

    def block(self, max_rows: int, max_bytes: int) -> tuple[bytearray, int]:
        """The next rows, up to either limit (none once the COPY has ended)."""
        get = self._pgconn.get_copy_data
        block = bytearray()
        rows = 0
        while rows < max_rows and len(block) < max_bytes:
            size, row = get(1)
            if size > 0:
                block += row
                rows += 1
            elif size == 0:
                self._wait()
            else:
                self._finish()
                break
        return block, rows

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


def parse_csv(block: bytes | bytearray, rows: int, columns: int) -> list[pa.BinaryArray]:
    """``rows`` rows of PostgreSQL CSV as one ``BinaryArray`` per column."""
    if not columns:
        return []
    names = [str(i) for i in range(columns)]
    multiline = block.count(b"\n") != rows or b"\r" in block
    table = pacsv.read_csv(
        pa.BufferReader(block),
        read_options=pacsv.ReadOptions(column_names=names, use_threads=False, block_size=len(block) + 1),
        parse_options=pacsv.ParseOptions(newlines_in_values=multiline, ignore_empty_lines=False),
        convert_options=pacsv.ConvertOptions(
            column_types=dict.fromkeys(names, pa.binary()),
            null_values=[""],
            strings_can_be_null=True,
            quoted_strings_can_be_null=False,
        ),
    )
    if table.num_rows != rows:
        raise RuntimeError(f"COPY sent {rows} rows, the CSV parser read {table.num_rows}")
    return [table.column(i).combine_chunks() for i in range(columns)]
