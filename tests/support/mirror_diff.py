"""The comparison oracle for a Delta mirror: the Delta table, read by Spark and by delta-rs,
against its source table, value by value.

* :func:`spark_table` — ``spark.read.format("delta").load(path)`` → ``toArrow()`` (the schema's
  column order kept, even with no rows);
* :func:`rust_table` — delta-rs through its DataFusion ``QueryBuilder`` (its pyarrow dataset path
  supports neither deletion vectors nor column mapping, which the mirrored tables use);
* the source — :func:`tests.support.rows.source_table`: the change log's own value conversion,
  then the apply's Delta representation. Both sides end as Python values of the same Delta
  types, compared as multisets by :func:`tests.support.rows.difference`.

:func:`assert_delta_equals_source` checks every table of a configuration with delta-rs (the
metadata columns ``_cdc_lsn`` / ``_cdc_commit_time`` split off). :func:`compare_table` /
:func:`compare_all` (the differential, crash and online-snapshot tests) use both readers and also
hold each reader's column types to the expected Delta type up to Arrow's *layout* variants
(string / large_string / string_view, binary variants, list / large_list, a UTC zone spelled
``UTC`` or ``+00:00``), then cast to exactly the expected type (which only changes layout); a
source value Delta cannot hold (a *special*) is a problem, the column sets must be equal, and a row
that differs under the replica identity key is shown as the columns that differ.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import psycopg
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder

from cdc_assets.apply.commit_settings import settings_around
from cdc_assets.apply.target import delta_table_exists
from cdc_assets.config import Config, TableConfig
from tests.support.rows import (
    MAX_LINES,
    METADATA,
    Row,
    cut,
    difference,
    multiset,
    row_differences,
    source_rows,
    source_table,
    split_metadata,
    table_rows,
)

# Session settings that make Delta's per-commit work cheaper on a small machine without changing
# any result: the log replay of a table's snapshot in 1 partition instead of 50.
FAST_SPARK = {"spark.databricks.delta.snapshotPartitions": "1"}


# -- Delta, two readers -----------------------------------------------------------------------------


def spark_table(spark: Any, path: str) -> pa.Table:
    """The table as Spark reads it (its schema's column order kept, even with no rows)."""
    frame = spark.read.format("delta").load(path)
    table = frame.toArrow()
    assert table.column_names == frame.columns
    return table


def rust_table(path: str, storage_options: dict[str, str] | None = None) -> pa.Table:
    """The table as delta-rs reads it (deletion vectors and column mapping included)."""
    reader = QueryBuilder().register("t", DeltaTable(path, storage_options=storage_options)).execute("select * from t")
    return pa.RecordBatchReader.from_stream(reader).read_all()


def rust_rows(path: str, storage_options: dict[str, str] | None = None) -> list[Row]:
    return table_rows(rust_table(path, storage_options))


def without_metadata(table: pa.Table) -> pa.Table:
    """``table`` without the metadata columns ``_cdc_lsn`` and ``_cdc_commit_time``."""
    return table.select([c for c in table.column_names if c not in METADATA])


def holds_key(path: str, key: object, column: str = "id") -> bool:
    """Whether the Delta table at ``path`` exists and has a row whose ``column`` is ``key``."""
    return delta_table_exists(path) and key in rust_table(path).column(column).to_pylist()


def delta_version(path: str) -> int:
    return DeltaTable(path).version()


# -- a mirror against its source --------------------------------------------------------------------


def assert_delta_equals_source(
    conn: psycopg.Connection[Any], config: Config, tables: Iterable[str] | None = None
) -> dict[str, list[Row]]:
    """Each of ``tables`` (default: the configuration's), read by delta-rs, holds exactly its
    source's rows after its row filter; returns each table's Delta rows, metadata columns included
    (``conn`` in autocommit mode)."""
    read = {}
    for table in tables if tables is not None else [str(t.name) for t in config.tables]:
        settings = config.table(table)
        rows = rust_rows(config.target_path(settings), config.delta_storage_options or None)
        data, _ = split_metadata(rows)
        problem = difference(data, source_rows(conn, table, settings.row_filter), ("Delta", "the source"))
        assert not problem, f"{table}: Delta differs from the source:\n{problem}"
        read[table] = rows
    return read


@dataclass(slots=True)
class TableDiff:
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
    """The replica identity key columns in the source's catalog (none for FULL, NOTHING, or
    DEFAULT without a primary key)."""
    return [name for (name,) in conn.execute(_KEY, (table.name.sql,)).fetchall()]


def compare_table(
    config: Config, table: TableConfig, conn: psycopg.Connection[Any], spark: Any | None, *, rust: bool = True
) -> TableDiff:
    """Compare one Delta table with its source; ``spark`` None skips the Spark reader."""
    result = TableDiff(str(table.name))
    expected, special = source_table(conn, table.name, table.row_filter)
    result.source_rows = expected.num_rows
    if special:
        result.problems.append(f"source holds values Delta cannot (special): {special}")
    want = multiset(table_rows(expected))
    path = config.target_path(table)
    key = identity_key(conn, table)
    reads = {}
    if spark is not None:
        reads["spark"] = lambda: spark_table(spark, path)
    if rust:
        reads["delta-rs"] = lambda: rust_table(path, config.delta_storage_options or None)
    readers = {}
    for reader, read in reads.items():
        got, problems = conform(without_metadata(read()), expected.schema, reader)
        result.problems += problems
        if got is not None:
            if reader == "spark":
                result.spark_rows = got.num_rows
            else:
                result.rust_rows = got.num_rows
            readers[reader] = multiset(table_rows(got))
    for reader, rows in readers.items():
        result.problems += row_differences(want, rows, ("the source", f"Delta ({reader})"), key)
    if len(readers) == 2 and readers["spark"] != readers["delta-rs"]:
        result.problems.append("the readers disagree:")
        result.problems += row_differences(readers["spark"], readers["delta-rs"], ("spark", "delta-rs"), key)
    return result


def compare_all(config: Config, dsn: str, spark: Any | None, *, rust: bool = True) -> list[TableDiff]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [compare_table(config, table, conn, spark, rust=rust) for table in config.tables]


def report(results: list[TableDiff], limit: int = MAX_LINES) -> str:
    out = []
    for result in results:
        if result.problems:
            out.append(
                f"{result.table}: {len(result.problems)} problem(s); source {result.source_rows} rows,"
                f" spark {result.spark_rows}, delta-rs {result.rust_rows}"
            )
            out.append(cut(result.problems, limit, indent="  "))
    return "\n".join(out)


@contextmanager
def fast_spark(spark: Any) -> Iterator[None]:
    """:data:`FAST_SPARK` on the shared session for the duration; the previous values restored."""
    with settings_around(spark, FAST_SPARK):
        yield
