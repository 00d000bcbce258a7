"""Rows as their change records hold them — the typed ``new`` values and the exact text of values
Arrow cannot hold — so that a copy (binary or text columns) and what pgoutput sends for the same
rows can be compared value for value."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

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
