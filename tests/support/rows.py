"""Rows as Python values: the source read the way the change log reads it, and the one way the
tests compare rows.

**The source** (:func:`read_source_text`): ``SELECT <typoutput>(col), … FROM t [WHERE …]`` inside a
transaction with the drain's pinned settings (``PINNED_SETTINGS``) — exactly the text pgoutput
sends and the snapshot copies. Each column then goes through the change log's own converter
(``cdc_assets.pgoutput.values.column_converter``), so a difference is a difference in data, never
in how two libraries render a value. Two views of it:

* :func:`source_values` — the change log's Python values (what the replay in
  ``tests/support/oracle.py`` compares with); a value the Arrow type cannot hold is a
  :class:`Special` with its exact text;
* :func:`source_table` / :func:`source_rows` — then the apply's Delta representation
  (``cdc_assets.apply.spark_types.to_delta_arrow``), what a Delta mirror should hold
  (``tests/support/mirror_diff.py``); a special value is null there, and counted.

``SELECT *`` shows every column; the log holds published columns only, so compare tables without
column lists and, before PostgreSQL 18, without generated columns.

**Comparing** (:func:`difference`): rows are multisets (:func:`multiset`: order-independent,
duplicates counted), each row its ``(column, frozen value)`` pairs (:func:`freeze`: lists →
tuples, dicts → item tuples, floats by their exact bits — NaN equals NaN, ``-0.0`` is not
``0.0``). Decimals compare by value, aware timestamps as instants. A difference is one line per
row only on one side (``N x only in …``), or, with a ``key``, one line per key whose row differs,
naming the columns.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
import pyarrow as pa
from psycopg.types.string import ByteaBinaryLoader

from cdc_assets.apply.spark_types import to_delta_arrow
from cdc_assets.names import TableName
from cdc_assets.pgoutput.records import DeltaColumn
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.pgoutput.values import ConvertedColumn, column_converter
from cdc_assets.source import PINNED_SETTINGS, load_type_catalog

CSTRING_OID = 2275
METADATA = (DeltaColumn.LSN, DeltaColumn.COMMIT_TIME)
MAX_LINES = 12

Row = dict[str, Any]


# -- values ----------------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Special:
    """A value the Arrow type cannot hold, as PostgreSQL's exact text (``NaN`` in numeric(10,2))."""

    text: str


@dataclass(slots=True, frozen=True)
class OutOfRange:
    """A date or timestamp Python cannot represent (``infinity`` is int64 max, BC dates, …), as its
    Arrow type and integer value."""

    type: str
    value: int


def to_python(array: pa.Array | pa.ChunkedArray) -> list[Any]:
    """``array.to_pylist()``, except that dates and timestamps outside Python's range become
    :class:`OutOfRange` instead of failing."""
    if isinstance(array, pa.ChunkedArray):
        return [v for chunk in array.chunks for v in to_python(chunk)]
    try:
        return array.to_pylist()
    except (OverflowError, ValueError):
        pass
    t = array.type
    valid = array.is_valid().to_pylist()
    if pa.types.is_struct(t):
        fields = [to_python(array.field(i)) for i in range(t.num_fields)]
        names = [t.field(i).name for i in range(t.num_fields)]
        return [dict(zip(names, values)) if ok else None for ok, *values in zip(valid, *fields)]
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        offsets = array.offsets.to_pylist()
        values = to_python(array.values)
        return [values[a:b] if ok else None for ok, a, b in zip(valid, offsets, offsets[1:])]
    if pa.types.is_timestamp(t) or pa.types.is_date(t):
        raw = array.cast(pa.int64() if pa.types.is_timestamp(t) else pa.int32()).to_pylist()
        out = []
        for ok, value in zip(valid, raw):
            try:
                out.append(pa.scalar(value, t).as_py() if ok else None)
            except (OverflowError, ValueError):
                out.append(OutOfRange(str(t), value))
        return out
    return array.to_pylist()


def table_rows(table: pa.Table) -> list[Row]:
    """``table``'s rows as dicts of :func:`to_python` values."""
    columns = [to_python(table.column(i)) for i in range(table.num_columns)]
    return [dict(zip(table.column_names, values)) for values in zip(*columns)]


def freeze(value: Any) -> Any:
    """A hashable, self-equal, exact form of a value: lists → tuples, dicts → item tuples, floats
    → their hex form (NaN equals NaN, -0.0 differs from 0.0), bytes-likes → bytes."""
    if isinstance(value, float):
        return ("float", value.hex() if not math.isnan(value) else "nan")
    if isinstance(value, list):
        return tuple(freeze(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, freeze(v)) for k, v in value.items())
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return value


def short(value: Any, limit: int = 240) -> str:
    """``repr(value)``, cut at ``limit`` characters."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


# -- comparing rows --------------------------------------------------------------------------------

FrozenRow = tuple[tuple[str, Any], ...]


def frozen_row(row: Row) -> FrozenRow:
    """The row's ``(column, frozen value)`` pairs, in column-name order."""
    return tuple(sorted((k, freeze(v)) for k, v in row.items()))


def multiset(rows: Iterable[Row]) -> Counter[FrozenRow]:
    """The multiset of rows (:func:`frozen_row`)."""
    return Counter(frozen_row(row) for row in rows)


def row_differences(
    left: Iterable[Row] | Counter[FrozenRow],
    right: Iterable[Row] | Counter[FrozenRow],
    names: tuple[str, str] = ("left", "right"),
    key: Sequence[str] = (),
) -> list[str]:
    """Every row in one multiset and not the other, one line each; with ``key``, a row on each
    side under the same key is one line naming the columns that differ."""
    a = left if isinstance(left, Counter) else multiset(left)
    b = right if isinstance(right, Counter) else multiset(right)
    only_left, only_right = a - b, b - a
    lines = []
    if key:
        by_key: dict[Any, list[FrozenRow]] = {}
        for row in only_right:
            by_key.setdefault(_key_of(row, key), []).append(row)
        for row in sorted(only_left, key=repr):
            same = by_key.get(_key_of(row, key))
            if same and only_left[row] == 1 and only_right[same[0]] == 1:
                other = same.pop(0)
                del only_right[other]
                del only_left[row]
                mine, theirs = dict(row), dict(other)
                changed = [
                    f"{column}: {names[0]} {short(mine.get(column), 80)}, {names[1]} {short(theirs.get(column), 80)}"
                    for column in sorted(mine.keys() | theirs.keys())
                    if mine.get(column) != theirs.get(column)
                ]
                lines.append(f"key {dict(zip(key, _key_of(row, key)))}: " + "; ".join(changed))
    for row, count in sorted(only_left.items(), key=repr):
        lines.append(f"{count} x only in {names[0]}: {short(dict(row))}")
    for row, count in sorted(only_right.items(), key=repr):
        lines.append(f"{count} x only in {names[1]}: {short(dict(row))}")
    return lines


def difference(
    left: Iterable[Row],
    right: Iterable[Row],
    names: tuple[str, str] = ("left", "right"),
    key: Sequence[str] = (),
    limit: int = MAX_LINES,
) -> str:
    """:func:`row_differences` as text, at most ``limit`` lines; empty when the multisets are equal."""
    return cut(row_differences(left, right, names, key), limit)


def cut(lines: list[str], limit: int = MAX_LINES, indent: str = "") -> str:
    """``lines`` joined, at most ``limit`` of them and a line that says how many more."""
    shown = [f"{indent}{line}" for line in lines[:limit]]
    if len(lines) > limit:
        shown.append(f"{indent}… and {len(lines) - limit} more")
    return "\n".join(shown)


def _key_of(row: FrozenRow, key: Sequence[str]) -> tuple[Any, ...]:
    values = dict(row)
    return tuple(values.get(column) for column in key)


def split_metadata(rows: Iterable[Row]) -> tuple[list[Row], list[Row]]:
    """(rows without the ``_cdc_`` metadata columns, the metadata of each row)."""
    data, meta = [], []
    for row in rows:
        data.append({k: v for k, v in row.items() if k not in METADATA})
        meta.append({k: row.get(k) for k in METADATA})
    return data, meta


# -- the source ------------------------------------------------------------------------------------

_COLUMNS = """
SELECT a.attname::text, a.atttypid::int8, a.atttypmod, a.attndims, t.typoutput::regproc::text
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""


@dataclass(slots=True)
class SourceText:
    """A source table read as text: its columns (name, type OID, typmod, ndims, output
    function), its type catalog, and its rows."""

    described: list[Any]
    catalog: TypeCatalog
    rows: list[Any]

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(column for column, *_ in self.described)

    def converted(self) -> list[ConvertedColumn]:
        """Each column through the change log's converter (text, as the snapshot copies it)."""
        out = []
        for j, (_, oid, typmod, ndims, _) in enumerate(self.described):
            raw = pa.array([row[j] for row in self.rows], pa.binary())
            out.append(column_converter(oid, typmod, self.catalog, max(ndims, 1)).convert(raw, binary=False))
        return out


def read_source_text(conn: psycopg.Connection[Any], name: TableName, where: str | None = None) -> SourceText:
    """``SELECT *`` of ``name`` (``WHERE where``) as each column's output function text, under the
    drain's pinned settings, in its own transaction (``conn`` must be in autocommit mode)."""
    with conn.transaction():
        conn.execute(
            "SELECT set_config(name, value, true) FROM unnest(%s::text[], %s::text[]) AS s(name, value)",
            (list(PINNED_SETTINGS), list(PINNED_SETTINGS.values())),
        )
        described = conn.execute(_COLUMNS, (name.sql,)).fetchall()
        if not described:
            raise AssertionError(f"table {name} does not exist in the source")
        catalog = TypeCatalog.of(load_type_catalog(conn, [oid for _, oid, _, _, _ in described]))
        select = ", ".join(
            f'{output}("{column.replace(chr(34), chr(34) * 2)}")' for column, _, _, _, output in described
        )
        cursor = conn.cursor(binary=True)
        cursor.adapters.register_loader(CSTRING_OID, ByteaBinaryLoader)
        (partitioned,) = conn.execute(
            "SELECT relkind = 'p' FROM pg_class WHERE oid = %s::regclass", (name.sql,)
        ).fetchone()
        # What PostgreSQL publishes under the name: a table's own rows (an inheritance child's
        # changes are published under the child), a partitioned table's (published under its own
        # name only via the partition root) every leaf's.
        relation = name.sql if partitioned else f"ONLY {name.sql}"
        fetched = cursor.execute(f"SELECT {select} FROM {relation}" + (f" WHERE {where}" if where else "")).fetchall()
    return SourceText(described, catalog, fetched)


@dataclass(slots=True)
class SourceValues:
    """A source table as the change log's values: its columns and rows."""

    columns: tuple[str, ...]
    rows: list[Row]


def source_values(conn: psycopg.Connection[Any], table: str | TableName, where: str | None = None) -> SourceValues:
    """``SELECT * [WHERE where]`` of ``table`` as the change log's Python values, a value the
    Arrow type cannot hold as :class:`Special` (``conn`` in autocommit mode)."""
    source = read_source_text(conn, _name(table), where)
    values: list[list[Any]] = []
    for converted in source.converted():
        column = to_python(converted.array)
        for i, text in converted.special.items():
            column[i] = Special(text)
        values.append(column)
    columns = source.columns
    return SourceValues(columns, [dict(zip(columns, row)) for row in zip(*values)] if values else [])


def source_table(
    conn: psycopg.Connection[Any], table: str | TableName, where: str | None = None
) -> tuple[pa.Table, dict[str, int]]:
    """``SELECT * [WHERE where]`` of ``table`` in Delta's Arrow types, and the count of special
    values per column (null in the table, as in the change record's typed column; ``conn`` in
    autocommit mode)."""
    source = read_source_text(conn, _name(table), where)
    converted = source.converted()
    special = {column: len(c.special) for column, c in zip(source.columns, converted) if c.special}
    return to_delta_arrow(pa.table([c.array for c in converted], names=list(source.columns))), special


def source_rows(conn: psycopg.Connection[Any], table: str | TableName, where: str | None = None) -> list[Row]:
    """The rows of :func:`source_table`: what a Delta mirror of ``table`` should hold."""
    return table_rows(source_table(conn, table, where)[0])


def _name(table: str | TableName) -> TableName:
    return table if isinstance(table, TableName) else TableName.parse(table)
