"""Reading mirrored Delta tables two ways, and the source the way the Delta table should hold it.

* :func:`spark_rows` — Spark (the session the tests share) ``spark.read.format("delta")``;
* :func:`rust_rows` — delta-rs through its DataFusion ``QueryBuilder`` (its pyarrow dataset path
  supports neither deletion vectors nor column mapping, which the mirrored tables use);
* :func:`source_rows` — ``SELECT *`` of the source table (optionally ``WHERE …``) read with every
  column passed through its type's output function under the drain's pinned settings and
  converted with the change log's own ``column_converter`` (as the oracle does), then with
  :func:`cdc_assets.apply.spark_types.to_delta_arrow`, the conversion the apply uses on the way
  to Delta. So every side ends as Python values of the same Delta types, and a difference is a
  difference in data — never in how two libraries print a value.

Comparisons are of multisets of rows (:func:`canonical`): each row becomes a tuple of
``(column, frozen value)`` pairs, where lists become tuples, structs item tuples, NaN a tag and
aware datetimes are compared as instants. The metadata columns ``_cdc_lsn`` and
``_cdc_commit_time`` are split off (:func:`split_metadata`) and checked on their own.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder

from cdc_assets.apply.spark_types import to_delta_arrow
from cdc_assets.apply.target import delta_table_exists
from cdc_assets.names import TableName
from cdc_assets.pgoutput.records import DeltaColumn
from cdc_assets.pgoutput.values import column_converter
from tests.support.oracle import read_source_text

CSTRING_OID = 2275
METADATA = (DeltaColumn.LSN, DeltaColumn.COMMIT_TIME)
Row = dict[str, Any]


# -- Delta, two readers -----------------------------------------------------------------------------


def spark_table(spark: Any, path: str) -> pa.Table:
    """The table as Spark reads it (its schema's column order kept, even with no rows)."""
    frame = spark.read.format("delta").load(path)
    table = frame.toArrow()
    assert table.column_names == frame.columns
    return table


def rust_table(path: str) -> pa.Table:
    reader = QueryBuilder().register("t", DeltaTable(path)).execute("select * from t")
    return pa.table(reader.read_all())


def holds_key(path: str, key: object, column: str = "id") -> bool:
    """Whether the Delta table at ``path`` exists and has a row whose ``column`` is ``key``."""
    return delta_table_exists(path) and key in rust_table(path).column(column).to_pylist()


def spark_rows(spark: Any, path: str) -> list[Row]:
    return spark_table(spark, path).to_pylist()


def rust_rows(path: str) -> list[Row]:
    return rust_table(path).to_pylist()


def delta_columns(spark: Any, path: str) -> list[str]:
    """The table's column names as Spark sees them (metadata columns included)."""
    return list(spark.read.format("delta").load(path).columns)


def delta_version(path: str) -> int:
    return DeltaTable(path).version()


# -- the source, as Delta should hold it ------------------------------------------------------------


def source_table(conn: psycopg.Connection[Any], table: str, where: str | None = None) -> pa.Table:
    """``SELECT * FROM table [WHERE where]`` as Delta-typed Arrow (see the module docstring).

    ``conn`` must be in autocommit mode; the read runs in its own transaction. A value the Arrow
    type cannot hold (``_cdc_special``) is null, as in the change record's typed column."""
    name = TableName.parse(table)
    source = read_source_text(conn, name, where)
    described, catalog, fetched = source.described, source.catalog, source.rows
    arrays = []
    for j, (_, oid, typmod, ndims, _) in enumerate(described):
        raw = pa.array([row[j] for row in fetched], pa.binary())
        arrays.append(column_converter(oid, typmod, catalog, max(ndims, 1)).convert(raw, binary=False).array)
    return to_delta_arrow(pa.table(arrays, names=[c for c, *_ in described]))


def source_rows(conn: psycopg.Connection[Any], table: str, where: str | None = None) -> list[Row]:
    return source_table(conn, table, where).to_pylist()


# -- comparing -------------------------------------------------------------------------------------


def freeze_comparable(value: Any) -> Any:
    """A hashable, self-equal form of a value."""
    if isinstance(value, float) and math.isnan(value):
        return ("NaN",)
    if isinstance(value, list):
        return tuple(freeze_comparable(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, freeze_comparable(v)) for k, v in value.items())
    if isinstance(value, datetime) and value.tzinfo is not None:
        return ("instant", value.astimezone(UTC).replace(tzinfo=None))
    if isinstance(value, (bytearray, memoryview)):
        return bytes(value)
    return value


def split_metadata(rows: Iterable[Row]) -> tuple[list[Row], list[Row]]:
    """(rows without the ``_cdc_`` metadata columns, the metadata of each row)."""
    data, meta = [], []
    for row in rows:
        data.append({k: v for k, v in row.items() if k not in METADATA})
        meta.append({k: row.get(k) for k in METADATA})
    return data, meta


def canonical(rows: Iterable[Row]) -> Counter[tuple[tuple[str, Any], ...]]:
    """The multiset of rows, each a tuple of (column, frozen value) in column-name order."""
    return Counter(tuple(sorted((k, freeze_comparable(v)) for k, v in row.items())) for row in rows)


def difference(
    left: Sequence[Row], right: Sequence[Row], names: tuple[str, str] = ("left", "right"), limit: int = 12
) -> str:
    """A readable multiset difference; empty when equal."""
    a, b = canonical(left), canonical(right)
    lines = []
    for row, count in (a - b).items():
        lines.append(f"{count} x only in {names[0]}: {_short(dict(row))}")
    for row, count in (b - a).items():
        lines.append(f"{count} x only in {names[1]}: {_short(dict(row))}")
    if len(lines) > limit:
        lines = [*lines[:limit], f"… and {len(lines) - limit} more"]
    return "\n".join(lines)


def _short(value: Any, limit: int = 240) -> str:
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} chars)"
