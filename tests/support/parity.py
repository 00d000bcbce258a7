"""Delta table ↔ source table parity, value by value, read back with Spark and with delta-rs.

**Normalisation** (the same for every side, and not loosened):

* The **source** is read with ``SELECT <typoutput>(col), … FROM t [WHERE <row filter>]`` inside a
  transaction with the drain's pinned settings (``PINNED_SETTINGS``): exactly the text pgoutput
  sends and the snapshot copies. Each column then goes through the change log's own converter
  (``cdc_assets.pgoutput.values.column_converter``, ``ndims`` from ``pg_attribute``) and the
  apply's Delta representation (``cdc_assets.apply.spark_types.to_delta_arrow``). A value the
  Arrow type cannot hold (a *special*, stored as null in Delta) is reported as a mismatch —
  the workloads never produce one.
* **Delta** is read by Spark (``spark.read.format("delta").load(path)`` → ``toArrow()``) and by
  delta-rs (``QueryBuilder().register("t", DeltaTable(path)).execute("select * from t")``, which
  reads deletion vectors and column mapping), without the ``_cdc_*`` metadata columns. Each
  reader's column types must be the expected Delta type up to Arrow's *layout* variants (string /
  large_string / string_view, binary variants, list / large_list, a UTC zone spelled ``UTC`` or
  ``+00:00``); then the columns are cast to exactly the expected type, which only changes layout.
* Rows become Python values (``to_pylist`` via :func:`tests.support.oracle.to_python`), frozen
  (lists → tuples, dicts → item tuples: :func:`tests.support.oracle.freeze_exact`), and are compared as
  multisets (order-independent, duplicates counted). Decimals compare by value at the column's
  fixed scale, timestamps as UTC instants at µs, floats (none in these tables) bit for bit.

Column sets must be equal too (the table's columns in the source's order).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa

from cdc_assets.apply.spark_types import to_delta_arrow
from cdc_assets.config import Config, TableConfig
from cdc_assets.pgoutput.values import column_converter
from tests.support.oracle import freeze_exact, read_source_text, to_python

CSTRING_OID = 2275
# Session settings that make Delta's per-commit work cheaper on a small machine without changing
# any result: the log replay of a table's snapshot in 1 partition instead of 50.
FAST_SPARK = {"spark.databricks.delta.snapshotPartitions": "1"}
METADATA_PREFIX = "_cdc_"
MAX_LINES = 12


@dataclass(slots=True)
class TableParity:
    """One table's comparison: source rows, what each reader returned, and every difference."""

    table: str
    source_rows: int = 0
    spark_rows: int | None = None
    rust_rows: int | None = None
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def rows_compared(self) -> int:
        readers = (self.spark_rows is not None) + (self.rust_rows is not None)
        return self.source_rows * readers


def source_table(conn: psycopg.Connection[Any], table: TableConfig) -> tuple[pa.Table, dict[str, int]]:
    """The source rows (after the row filter) in Delta's Arrow types, and the count of special
    values per column. ``conn`` must be in autocommit mode."""
    name = table.name
    source = read_source_text(conn, name, table.row_filter)
    described, catalog, fetched = source.described, source.catalog, source.rows
    arrays, special = [], {}
    for j, (column, oid, typmod, ndims, _) in enumerate(described):
        raw = pa.array([row[j] for row in fetched], pa.binary())
        converted = column_converter(oid, typmod, catalog, max(ndims, 1)).convert(raw, binary=False)
        arrays.append(converted.array)
        if converted.special:
            special[column] = len(converted.special)
    names = [column for column, *_ in described]
    return to_delta_arrow(pa.table(arrays, names=names)), special


def read_spark(spark: Any, path: str) -> pa.Table:
    frame = spark.read.format("delta").load(path)
    return frame.select(*[c for c in frame.columns if not c.startswith(METADATA_PREFIX)]).toArrow()


def read_delta_rs(path: str, storage_options: dict[str, str] | None = None) -> pa.Table:
    from deltalake import DeltaTable, QueryBuilder

    reader = QueryBuilder().register("t", DeltaTable(path, storage_options=storage_options)).execute("select * from t")
    table = pa.RecordBatchReader.from_stream(reader).read_all()
    return table.select([c for c in table.column_names if not c.startswith(METADATA_PREFIX)])


def _layout(kind: pa.DataType) -> pa.DataType:
    """``kind`` with Arrow layout variants folded (the value domain is the same)."""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind):
        return pa.string()
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind):
        return pa.binary()
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_list_view(kind):
        return pa.list_(_layout(kind.value_type))
    if pa.types.is_struct(kind):
        return pa.struct([pa.field(f.name, _layout(f.type)) for f in kind])
    if pa.types.is_timestamp(kind) and kind.tz in ("UTC", "+00:00", "Etc/UTC"):
        return pa.timestamp(kind.unit, "UTC")
    return kind


def conform(read: pa.Table, expected: pa.Schema, reader: str) -> tuple[pa.Table | None, list[str]]:
    """``read`` with exactly ``expected``'s columns and types, or the reasons it cannot be."""
    problems = []
    if read.column_names != expected.names:
        if sorted(read.column_names) != sorted(expected.names):
            return None, [f"{reader}: columns {read.column_names}, source {expected.names}"]
        read = read.select(expected.names)
    columns = []
    for f in expected:
        column = read.column(f.name)
        if _layout(column.type) != _layout(f.type):
            problems.append(f"{reader}: column {f.name} is {column.type}, expected {f.type}")
            continue
        columns.append(column.cast(f.type) if not column.type.equals(f.type) else column)
    if problems:
        return None, problems
    return pa.table(columns, schema=expected), []


def multiset(table: pa.Table) -> Counter[tuple[Any, ...]]:
    columns = [to_python(table.column(i)) for i in range(table.num_columns)]
    return Counter(tuple(freeze_exact(v) for v in row) for row in zip(*columns))


def diff_multisets(
    left: Counter[Any],
    right: Counter[Any],
    left_name: str,
    right_name: str,
    names: list[str],
    key: list[str] | None = None,
) -> list[str]:
    """Every row in one multiset and not the other; with ``key``, a row on each side under the
    same key is shown as the columns that differ."""
    only_left, only_right = left - right, right - left
    lines = []
    if key:
        index = [names.index(k) for k in key]
        by_key: dict[Any, list[Any]] = {}
        for row in only_right:
            by_key.setdefault(tuple(row[i] for i in index), []).append(row)
        for row in sorted(only_left, key=repr):
            same = by_key.get(tuple(row[i] for i in index))
            if same and only_left[row] == 1 and only_right[same[0]] == 1:
                other = same.pop(0)
                del only_right[other]
                del only_left[row]
                changed = [
                    f"{n}: {left_name} {_short(a, 80)}, {right_name} {_short(b, 80)}"
                    for n, a, b in zip(names, row, other)
                    if a != b
                ]
                lines.append(f"key {dict(zip(key, (row[i] for i in index)))}: " + "; ".join(changed))
    for row, count in sorted(only_left.items(), key=repr):
        lines.append(f"{count} x only in {left_name}: {_short(dict(zip(names, row)))}")
    for row, count in sorted(only_right.items(), key=repr):
        lines.append(f"{count} x only in {right_name}: {_short(dict(zip(names, row)))}")
    return lines


_KEY = """
SELECT a.attname::text
FROM pg_class c
JOIN pg_index i ON i.indrelid = c.oid
  AND ((c.relreplident = 'd' AND i.indisprimary) OR (c.relreplident = 'i' AND i.indisreplident))
JOIN LATERAL unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, n) ON true
JOIN pg_attribute a ON a.attrelid = c.oid AND a.attnum = k.attnum
WHERE c.oid = to_regclass(%s)
ORDER BY k.n
"""


def identity_key(conn: psycopg.Connection[Any], table: TableConfig) -> list[str]:
    """The replica identity key columns (none for FULL, NOTHING, or DEFAULT without a primary key)."""
    return [name for (name,) in conn.execute(_KEY, (table.name.sql,)).fetchall()]


def compare_table(
    config: Config, table: TableConfig, conn: psycopg.Connection[Any], spark: Any | None, *, rust: bool = True
) -> TableParity:
    """Compare one Delta table with its source; ``spark`` None skips the Spark reader."""
    result = TableParity(str(table.name))
    expected, special = source_table(conn, table)
    result.source_rows = expected.num_rows
    if special:
        result.problems.append(f"source holds values Delta cannot (special): {special}")
    want = multiset(expected)
    path = config.target_path(table)
    names = expected.column_names
    key = identity_key(conn, table)
    readers: dict[str, Counter[Any]] = {}
    if spark is not None:
        got, problems = conform(read_spark(spark, path), expected.schema, "spark")
        result.problems += problems
        if got is not None:
            result.spark_rows = got.num_rows
            readers["spark"] = multiset(got)
    if rust:
        got, problems = conform(read_delta_rs(path, config.delta_storage_options or None), expected.schema, "delta-rs")
        result.problems += problems
        if got is not None:
            result.rust_rows = got.num_rows
            readers["delta-rs"] = multiset(got)
    for reader, rows in readers.items():
        result.problems += diff_multisets(want, rows, "the source", f"Delta ({reader})", names, key)
    if len(readers) == 2 and readers["spark"] != readers["delta-rs"]:
        result.problems.append("the readers disagree:")
        result.problems += diff_multisets(readers["spark"], readers["delta-rs"], "spark", "delta-rs", names, key)
    return result


def compare_all(config: Config, dsn: str, spark: Any | None, *, rust: bool = True) -> list[TableParity]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [compare_table(config, table, conn, spark, rust=rust) for table in config.tables]


def report(results: list[TableParity], limit: int = MAX_LINES) -> str:
    out = []
    for result in results:
        if result.problems:
            out.append(
                f"{result.table}: {len(result.problems)} problem(s); source {result.source_rows} rows,"
                f" spark {result.spark_rows}, delta-rs {result.rust_rows}"
            )
            out += [f"  {line}" for line in result.problems[:limit]]
            if len(result.problems) > limit:
                out.append(f"  … and {len(result.problems) - limit} more")
    return "\n".join(out)


def _short(value: Any, limit: int = 400) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"


@contextmanager
def fast_spark(spark: Any) -> Iterator[None]:
    """:data:`FAST_SPARK` on the shared session for the duration; the previous values restored."""
    saved = {key: spark.conf.get(key, None) for key in FAST_SPARK}
    for key, value in FAST_SPARK.items():
        spark.conf.set(key, value)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                spark.conf.unset(key)
            else:
                spark.conf.set(key, value)
