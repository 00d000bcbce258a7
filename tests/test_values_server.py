"""Value conversion against real servers (PostgreSQL 15, 16, 18).

For every type, a table of tricky values is read back twice — as text (the type's ``typoutput``
function under the drain's pinned settings, as pgoutput sends it) and in binary (its ``typsend``
function) — and both are converted.
The two Arrow arrays must be identical, equal the values PostgreSQL computes for the same rows, and
special values must carry exactly the server's text. Every scalar type is also checked as an array:
its values in a 1-D array, with a special element, and in a 2-D array stored in a 1-D column (whose
text the binary path must rebuild exactly as ``array_out`` writes it).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from cdc_assets.pgoutput.types import PgTypeInfo, TypeCatalog
from cdc_assets.pgoutput.values import ConvertedColumn, column_converter

PINNED_SETTINGS = (
    "SET TimeZone = 'UTC'",
    "SET DateStyle = 'ISO'",
    "SET IntervalStyle = 'postgres'",
    "SET extra_float_digits = 3",
    "SET bytea_output = 'hex'",
    "SET client_encoding = 'UTF8'",
)

USER_TYPES_QUERY = """
    SELECT t.oid, n.nspname, t.typname, t.typtype, t.typbasetype, t.typtypmod,
           CASE WHEN t.typcategory = 'A' THEN t.typelem ELSE 0 END
    FROM pg_type t JOIN pg_namespace n ON n.oid = t.typnamespace
    WHERE t.oid >= 16384
"""

SCHEMA = (
    "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy', 'very \"happy\", really')",
    "CREATE DOMAIN price AS numeric(10,2)",
)


def load_catalog(conn: psycopg.Connection[Any]) -> TypeCatalog:
    """The user-defined types of the database, as the source module reads them from pg_type."""
    return TypeCatalog.of(PgTypeInfo(*row) for row in conn.execute(USER_TYPES_QUERY).fetchall())


# Views of converted Arrow arrays as Python lists, for comparison with what the server computes.
def plain(array: pa.Array) -> list[Any]:
    return array.to_pylist()


def integers(array: pa.Array) -> list[Any]:
    return array.cast(pa.int32() if pa.types.is_date32(array.type) else pa.int64()).to_pylist()


def timetz_view(array: pa.Array) -> list[Any]:
    times = pc.struct_field(array, 0).cast(pa.int64()).to_pylist()
    zones = pc.struct_field(array, 1).to_pylist()
    return [
        {"time": t, "utc_offset_seconds": z} if ok else None
        for ok, t, z in zip(array.is_valid().to_pylist(), times, zones, strict=True)
    ]


def interval_view(array: pa.Array) -> list[Any]:
    return [
        None if v is None else {"months": v.months, "days": v.days, "micros": v.nanoseconds // 1000}
        for v in array.to_pylist()
    ]


def lists_of(view: Callable[[pa.Array], list[Any]]) -> Callable[[pa.Array], list[Any]]:
    def nested(array: pa.Array) -> list[Any]:
        return [view(array[i].values) if array[i].is_valid else None for i in range(len(array))]

    return nested


@dataclass(slots=True)
class Case:
    """A column type and SQL values for it. ``expected`` and ``special`` are SQL over ``{x}``:
    the Python value the Arrow entry must equal, and which rows must be special."""

    column_type: str
    values: list[str]
    expected: str = "{x}"
    special: str = "false"
    view: Callable[[pa.Array], list[Any]] = plain
    to_arrow_value: Callable[[Any], Any] = lambda value: value
    ndims: int = 1
    newer_values: dict[int, list[str]] = field(default_factory=dict)  # server version -> extra values

    def values_for(self, version: int) -> list[str]:
        return self.values + [v for since, extra in self.newer_values.items() if version >= since for v in extra]

    def as_array(self, version: int) -> Case:
        """The same values inside arrays: all of them in one 1-D array, an empty array, one with a
        special element (when the type has special values) and a 2-D array in this 1-D column."""
        values = self.values_for(version)
        ordinary = [v for v in values if v != "NULL" and v not in self.special_values]
        array_type = f"{self.column_type}[]"
        rows = [
            f"ARRAY[{', '.join(values)}]::{array_type}",
            f"'{{}}'::{array_type}",
            "NULL",
            f"ARRAY[[{', '.join(ordinary)}], [NULL, {', '.join(ordinary[1:])}]]::{array_type}",
        ]
        rows += [f"ARRAY[{ordinary[0]}, {special}]::{array_type}" for special in self.special_values]
        element_expected = f"CASE WHEN coalesce({self.special}, false) THEN NULL ELSE {self.expected} END"
        return replace(
            self,
            column_type=array_type,
            values=rows,
            expected=(
                f"CASE WHEN {{x}} IS NULL THEN NULL ELSE ARRAY(SELECT {element_expected.format(x='u.e')}"
                " FROM unnest({x}) WITH ORDINALITY AS u(e, i) ORDER BY i) END"
            ),
            special=(
                "(coalesce(array_ndims({x}), 1) <> 1"
                f" OR EXISTS (SELECT FROM unnest({{x}}) AS u(e) WHERE {self.special.format(x='u.e')}))"
            ),
            view=lists_of(self.view),
            to_arrow_value=lambda items: None if items is None else [self.to_arrow_value(v) for v in items],
            newer_values={},
        )

    @property
    def special_values(self) -> list[str]:
        return [v for v in self.values if v in _SPECIAL_LITERALS and self.special != "false"]


# Values that are special wherever they appear in the cases below.
_SPECIAL_LITERALS = {"'NaN'", "'24:00:00'", "'24:00:00+01'", "'294276-12-31 23:59:59.999999'", "'2562048 hours'"}

EPOCH_MICROS = (
    "CASE WHEN {x} = 'infinity' THEN 9223372036854775807 WHEN {x} = '-infinity' THEN -9223372036854775808"
    " ELSE (extract(epoch FROM {x}) * 1000000)::int8 END"
)
BEYOND_INT64_MICROS = "(isfinite({x}) AND extract(epoch FROM {x}) * 1000000 >= 9223372036854775807)"
INTERVAL_MICROS = (
    "(extract(hour FROM {x}) * 3600000000 + extract(minute FROM {x}) * 60000000 + extract(microseconds FROM {x}))"
)


def float32(value: float | None) -> float | None:
    return None if value is None else float(np.float32(value))


CASES: dict[str, Case] = {
    "int2": Case("int2", ["0", "-32768", "32767", "NULL"]),
    "int4": Case("int4", ["-2147483648", "2147483647", "0", "NULL"]),
    "int8": Case("int8", ["-9223372036854775808", "9223372036854775807", "42", "NULL"]),
    "oid": Case("oid", ["0", "4294967295", "NULL", "16384"]),
    "xid": Case("xid", ["'0'", "'4294967295'", "NULL", "'735'"], expected="{x}::text::int8"),
    "bool": Case("bool", ["true", "false", "NULL"]),
    "float4": Case(
        "float4",
        [
            "'0.1'",
            "'-0'",
            "'3.4028235e38'",
            "'1e-45'",
            "'1.1754944e-38'",
            "'123456.7'",
            "'1e+06'",
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "NULL",
        ],
        to_arrow_value=float32,
    ),
    "float8": Case(
        "float8",
        [
            "'0.1'",
            "'0.30000000000000004'",
            "'1e100'",
            "'-1.5e-07'",
            "'5e-324'",
            "'1.7976931348623157e308'",
            "'123456789012345'",
            "'1e15'",
            "'0.0001'",
            "'-0'",
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "NULL",
        ],
    ),
    "numeric(10,2)": Case(
        "numeric(10,2)",
        ["'0'", "'-12.50'", "'99999999.99'", "'-99999999.99'", "'0.01'", "'NaN'", "NULL"],
        special="{x} = 'NaN'",
    ),
    "price": Case("price", ["'0'", "'-12.5'", "'99999999.99'", "'0.01'", "'NaN'", "NULL"], special="{x} = 'NaN'"),
    "numeric(30,10)": Case(
        "numeric(30,10)",
        [
            "'12345678901234567890.0123456789'",
            "'-0.0000000001'",
            "'0'",
            "'-99999999999999999999.9999999999'",
            "'NaN'",
            "NULL",
        ],
        special="{x} = 'NaN'",
    ),
    "numeric(38,0)": Case("numeric(38,0)", ["'99999999999999999999999999999999999999'", "'-1'", "'0'", "NULL"]),
    "numeric": Case(
        "numeric",
        [
            "'0'",
            "'-0.000000000000000000001'",
            "'123456789012345678901234567890.123456789'",
            "'1e100'",
            "'12.500'",
            "'10000'",
            "'0.0001'",
            "'-99990000'",
            "'NaN'",
            "'Infinity'",
            "'-Infinity'",
            "NULL",
        ],
        expected="{x}::text",
    ),
    "numeric(40,5)": Case("numeric(40,5)", ["'123.45'", "'-0.00001'", "NULL"], expected="{x}::text"),
    "numeric(5,-2)": Case("numeric(5,-2)", ["'12345'", "'-50'", "NULL"], expected="{x}::text"),
    "numeric(3,5)": Case("numeric(3,5)", ["'0.00123'", "'-0.001'", "NULL"], expected="{x}::text"),
    "text": Case(
        "text",
        [
            "'plain'",
            "''",
            "' lead and trail '",
            "'ünïcödé ✓ 😀'",
            "E'tab\\there\\nnewline'",
            "'NULL'",
            "'null'",
            "'\"quoted\", with comma'",
            "E'back\\\\slash'",
            "'{braces}'",
            "NULL",
        ],
    ),
    "varchar(20)": Case("varchar(20)", ["'abc'", "''", "'ü'", "NULL"]),
    "bpchar(5)": Case("bpchar(5)", ["'ab'", "''", "'abcde'", "'ü'", "NULL"]),
    "name": Case("name", ["'pg_catalog'", "'Ünïcode name'", "NULL"]),
    '"char"': Case('"char"', ["'a'", 'chr(233)::"char"', "'\"'", "''", "NULL"], expected="{x}::text"),
    "bytea": Case("bytea", ["'\\x'", "'\\x00ff10'", "decode('c3a9', 'hex')", "sha256('x')", "NULL"]),
    "uuid": Case(
        "uuid",
        ["'a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11'", "'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A12'", "NULL"],
        expected="{x}::text",
    ),
    "json": Case("json", ['\'{"b":1,"a":2}\'', "'[1, \"ü\", null]'", "'null'", "NULL"], expected="{x}::text"),
    "jsonb": Case("jsonb", ['\'{"b":1,"a":2}\'', "'[1, \"ü\", null]'", "'null'", "NULL"], expected="{x}::text"),
    "mood": Case("mood", ["'sad'", "'happy'", "'very \"happy\", really'", "NULL"], expected="{x}::text"),
    "date": Case(
        "date",
        [
            "'2024-02-29'",
            "'1970-01-01'",
            "'0044-03-15 BC'",
            "'4714-11-24 BC'",
            "'0001-01-01'",
            "'0001-12-31 BC'",
            "'10000-01-01'",
            "'5874897-12-31'",
            "'infinity'",
            "'-infinity'",
            "NULL",
        ],
        expected=(
            "CASE WHEN {x} = 'infinity' THEN 2147483647 WHEN {x} = '-infinity' THEN -2147483648"
            " ELSE {x} - DATE '1970-01-01' END"
        ),
        view=integers,
    ),
    "time": Case(
        "time",
        ["'00:00:00'", "'12:34:56.789'", "'23:59:59.999999'", "'00:00:00.000001'", "'24:00:00'", "NULL"],
        expected="(extract(epoch FROM {x}) * 1000000)::int8",
        special="{x} = '24:00:00'",
        view=integers,
    ),
    "timetz": Case(
        "timetz",
        [
            "'12:34:56.789+05:30'",
            "'00:00:00-08'",
            "'12:00:00+05:53:28'",
            "'23:59:59.999999-15:59'",
            "'01:02:03.5+00'",
            "'24:00:00+01'",
            "NULL",
        ],
        expected=(
            "json_build_object('time', (extract(epoch FROM {x}::time) * 1000000)::int8,"
            " 'utc_offset_seconds', extract(timezone FROM {x})::int)"
        ),
        special="{x}::time = '24:00:00'",
        view=timetz_view,
    ),
    "timestamp": Case(
        "timestamp",
        [
            "'2024-01-02 03:04:05.123456'",
            "'1970-01-01 00:00:00'",
            "'2000-01-01 00:00:00.000001'",
            "'0044-03-15 12:00:00 BC'",
            "'4714-11-24 00:00:00 BC'",
            "'10000-01-01 00:00:00'",
            "'294276-12-31 23:59:59.999999'",
            "'infinity'",
            "'-infinity'",
            "NULL",
        ],
        expected=EPOCH_MICROS,
        special=BEYOND_INT64_MICROS,
        view=integers,
    ),
    "timestamptz": Case(
        "timestamptz",
        [
            "'2024-01-02 03:04:05.123456+00'",
            "'2024-06-01 12:00:00+05:30'",
            "'1900-01-01 00:00:00+05:21:10'",
            "'1969-12-31 23:59:59.999999-08'",
            "'0044-03-15 12:00:00+00 BC'",
            "'10000-01-01 00:00:00+00'",
            "'294276-12-31 23:59:59.999999'",
            "'infinity'",
            "'-infinity'",
            "NULL",
        ],
        expected=EPOCH_MICROS,
        special=BEYOND_INT64_MICROS,
        view=integers,
    ),
    "interval": Case(
        "interval",
        [
            "'1 year 2 mons 3 days 04:05:06.5'",
            "'-1 days +02:03:04'",
            "'00:00:00'",
            "'-00:00:00.000001'",
            "'178000000 years'",
            "'-178000000 years'",
            "'1 mon -1 days'",
            "'-1 years -2 mons +3 days -04:05:06'",
            "'2562047 hours 47 minutes 16.854775 seconds'",
            "'2562048 hours'",
            "'-2562048 hours'",
            "NULL",
        ],
        expected=(
            f"json_build_object('months', (extract(year FROM {{x}}) * 12 + extract(month FROM {{x}}))::int,"
            f" 'days', extract(day FROM {{x}})::int, 'micros', {INTERVAL_MICROS}::int8)"
        ),
        special=f"(NOT isfinite({{x}}) OR abs({INTERVAL_MICROS}) > 9223372036854775)",
        view=interval_view,
        newer_values={17: ["'infinity'", "'-infinity'"]},
    ),
}


def fetch_and_convert(conn: psycopg.Connection[Any], case: Case, table: str) -> None:
    """Store the case's values, read them back as text and binary, convert both, compare."""
    version = conn.info.server_version // 10000
    values = case.values_for(version)
    conn.execute(f"CREATE TEMP TABLE {table} (id int PRIMARY KEY, x {case.column_type})")
    conn.execute(f"INSERT INTO {table} VALUES " + ", ".join(f"({i}, {v})" for i, v in enumerate(values)))
    column = conn.execute(
        "SELECT a.atttypid::int8, a.atttypmod, a.attndims, t.typoutput::regproc::text, t.typsend::regproc::text"
        " FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid"
        " WHERE a.attrelid = %s::regclass AND a.attname = 'x'",
        (table,),
    ).fetchone()
    assert column is not None
    type_oid, typmod, ndims, output, send = column
    special_sql = f"coalesce({case.special.format(x='x')}, false)"
    expected_sql = f"CASE WHEN {special_sql} THEN NULL ELSE {case.expected.format(x='x')} END"
    rows = conn.execute(
        f"SELECT {output}(x)::text, {send}(x), {special_sql}, {expected_sql} FROM {table} ORDER BY id"
    ).fetchall()
    texts = [None if r[0] is None else r[0].encode() for r in rows]
    binaries = [r[1] for r in rows]

    converter = column_converter(type_oid, typmod, load_catalog(conn), max(ndims, case.ndims))
    from_text = converter.convert(pa.array(texts, pa.binary()), binary=False)
    from_binary = converter.convert(pa.array(binaries, pa.large_binary()), binary=True)
    context = f"{case.column_type} on PostgreSQL {version}"
    assert from_text.array.type == converter.arrow_type, context
    assert identical(from_text.array, from_binary.array), (
        f"{context}: text {from_text.array} != binary {from_binary.array}"
    )
    assert from_text.special == from_binary.special, context
    assert_matches(from_text, rows, case, context)


def assert_matches(converted: ConvertedColumn, rows: list[tuple[Any, ...]], case: Case, context: str) -> None:
    special = {i: r[0] for i, r in enumerate(rows) if r[2]}
    assert converted.special == special, context
    actual = case.view(converted.array)
    for i, (text, _, is_special, expected) in enumerate(rows):
        wanted = None if text is None or is_special else case.to_arrow_value(expected)
        assert same(actual[i], wanted), f"{context}, row {i} ({text!r}): {actual[i]!r} != {wanted!r}"


def identical(a: pa.Array, b: pa.Array) -> bool:
    """Array equality, except that NaN equals NaN (Arrow's equals says it does not)."""
    if "float" in str(a.type) or "double" in str(a.type):
        return a.type == b.type and same(a.to_pylist(), b.to_pylist())
    return a.equals(b)


def same(a: Any, b: Any) -> bool:
    """Equality that tells -0.0 from 0.0 and lets NaN equal NaN, inside lists too."""
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    return type(a) is type(b) and a == b


@pytest.fixture
def conn(pg_any: Any) -> Any:
    with pg_any.connect() as connection:
        for statement in (*PINNED_SETTINGS, *SCHEMA):
            connection.execute(statement)
        yield connection


def test_scalar_values(conn: psycopg.Connection[Any]) -> None:
    for number, case in enumerate(CASES.values()):
        fetch_and_convert(conn, case, f"scalar_{number}")


def test_arrays_of_every_type(conn: psycopg.Connection[Any]) -> None:
    version = conn.info.server_version // 10000
    for number, case in enumerate(CASES.values()):
        fetch_and_convert(conn, case.as_array(version), f"array_{number}")


def test_array_shapes(conn: psycopg.Connection[Any]) -> None:
    bounds = "(coalesce(array_ndims({x}), 1) <> 1 OR array_lower({x}, 1) <> 1)"
    fetch_and_convert(
        conn,
        Case(
            "int4[]",
            ["'{1,NULL}'", "'{}'", "'[0:1]={7,8}'", "'[0:1][1:2]={{1,2},{3,4}}'", "'{{1,2},{3,4}}'", "NULL"],
            special=bounds,
        ),
        "shape_1",
    )
    fetch_and_convert(
        conn,
        Case(
            "int4[][]",
            ["'{{1,2},{3,4}}'", "'{{NULL,5}}'", "'{}'", "'{1,2}'", "'{{{1}}}'", "'[2:2][1:1]={{9}}'", "NULL"],
            special="coalesce(array_ndims({x}), 2) <> 2 OR array_lower({x}, 1) <> 1",
            ndims=2,
        ),
        "shape_2",
    )
    fetch_and_convert(
        conn,
        Case("mood[][]", ["'{{sad,ok},{happy,NULL}}'", "'{}'", "NULL"], expected="{x}::text[]", ndims=2),
        "shape_3",
    )


def test_seconds_offsets_in_text(conn: psycopg.Connection[Any]) -> None:
    """Under a zone whose offsets have seconds (LMT), text timestamps still give the same instants."""
    conn.execute("CREATE TEMP TABLE lmt (id int, x timestamptz)")
    conn.execute(
        "INSERT INTO lmt VALUES (1, '1900-01-01 00:00:00+00'), (2, '1850-06-01 12:00:00.5+00'),"
        " (3, '2024-01-01 00:00:00+00')"
    )
    utc = [r[0] for r in conn.execute("SELECT timestamptz_send(x) FROM lmt ORDER BY id").fetchall()]
    conn.execute("SET TimeZone = 'Asia/Kolkata'")
    texts = [r[0].encode() for r in conn.execute("SELECT x::text FROM lmt ORDER BY id").fetchall()]
    assert texts[0] == b"1900-01-01 05:21:10+05:21:10"
    converter = column_converter(1184, -1)
    from_text = converter.convert(pa.array(texts, pa.binary()), binary=False)
    assert from_text.array.equals(converter.convert(pa.array(utc, pa.binary()), binary=True).array)
