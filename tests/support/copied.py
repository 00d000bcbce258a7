"""Rows as their change records hold them — the typed ``new`` values and the exact text of values
Arrow cannot hold — so that a copy (binary or text columns) and what pgoutput sends for the same
rows can be compared value for value; the raw values a copy must carry (:func:`raw_rows`), and two
copies' arrays compared buffer for buffer (:func:`assert_same_layout`)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
from psycopg.types.string import ByteaBinaryLoader

from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.source.copy_plan import CopyTask


@dataclass(slots=True, frozen=True)
class KeptBlocks:
    """A range copier that returns the range's raw blocks as they came (from a worker process too)."""

    def __call__(self, task: CopyTask, blocks: Iterator[list[pa.Array]]) -> list[list[pa.Array]]:
        return list(blocks)


def typed_rows(builder: ChangeRecordBuilder, blocks: Iterable[Sequence[pa.Array]], binary: Sequence[bool]) -> list[str]:
    """Every row of ``blocks`` (one raw array per column, in ``binary`` or text format) converted
    by ``builder``, as the sorted ``repr`` of ``(values, special)`` (``repr`` lets NaN equal NaN)."""
    rows = []
    for columns in blocks:
        records = builder.snapshot(columns, np.arange(len(columns[0])), binary)
        new = records.column("new")
        for values, special in zip(new.view(_plain(new.type)).to_pylist(), records.column("_cdc_special").to_pylist()):
            rows.append(repr((tuple(values.values()), sorted(special or []))))
    return sorted(rows)


def sent_rows(builder: ChangeRecordBuilder, tuples: Sequence[Sequence[bytes | None]]) -> list[str]:
    """:func:`typed_rows` of rows as pgoutput sends them in text mode (one value list per row)."""
    columns = [pa.array(list(column), pa.binary()) for column in zip(*tuples)]
    return typed_rows(builder, [columns], [False] * len(builder.converters))


def _plain(t: pa.DataType) -> pa.DataType:
    """``t`` with dates, times and timestamps as the integers they are stored as (Python's
    ``datetime`` cannot hold every value they can)."""
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(_plain(t.field(i).type)) for i in range(t.num_fields)])
    if pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(_plain(t.value_type)))
    if pa.types.is_temporal(t) and not pa.types.is_interval(t):
        return pa.int32() if t.bit_width == 32 else pa.int64()
    return t


def raw_rows(conn: psycopg.Connection[Any], query: str) -> list[tuple[bytes | None, ...]]:
    """The rows of ``query`` as the server sends them in binary results (each value its type's send
    function's bytes, what a binary COPY carries), read with no conversion."""
    cursor = conn.cursor(binary=True)
    for (oid,) in conn.execute("SELECT oid::int8 FROM pg_type").fetchall():
        cursor.adapters.register_loader(oid, ByteaBinaryLoader)
    return cursor.execute(query).fetchall()


def block_rows(blocks: Iterable[Sequence[pa.Array]]) -> list[tuple[bytes | None, ...]]:
    """The rows of copied blocks (one binary array per column), in order."""
    return [row for columns in blocks for row in zip(*(column.to_pylist() for column in columns))]


def assert_same_layout(a: pa.Array, b: pa.Array) -> None:
    """``a`` and ``b``, two binary arrays, hold the same bytes in every buffer they use: the same
    type, null count, validity bitmap, offsets and values."""
    assert (a.type, len(a), a.null_count, a.offset, b.offset) == (b.type, len(b), b.null_count, 0, 0)
    width = 8 if pa.types.is_large_binary(a.type) else 4
    (a_valid, a_offsets, a_values), (b_valid, b_offsets, b_values) = a.buffers(), b.buffers()
    assert (a_valid is None) == (b_valid is None)
    if a_valid is not None:
        assert a_valid.to_pybytes()[: (len(a) + 7) // 8] == b_valid.to_pybytes()[: (len(b) + 7) // 8]
    used = (len(a) + 1) * width
    assert a_offsets.to_pybytes()[:used] == b_offsets.to_pybytes()[:used]
    end = int(np.frombuffer(a_offsets.to_pybytes()[:used], np.int64 if width == 8 else np.int32)[-1])
    assert a_values.to_pybytes()[:end] == b_values.to_pybytes()[:end]
