"""Unit tests of value conversion: every type and special case, text and binary, hand-made bytes.

Binary layouts follow the types' send functions in PostgreSQL (``numeric_send`` and kin);
``tests/test_values_server.py`` checks the same conversions against real servers.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from datetime import UTC, date, datetime
from decimal import Decimal
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput import types
from cdc_assets.pgoutput.types import PgTypeInfo, TypeCatalog
from cdc_assets.pgoutput.values import ConvertedColumn, column_converter
from cdc_assets.pgoutput.values.arrays import ArrayShape, format_array, parse_text_array
from cdc_assets.pgoutput.values.calendar import (
    civil_from_days,
    days_from_civil,
    format_offset,
    format_timestamp,
)
from cdc_assets.pgoutput.values.interval import format_interval, parse_interval
from cdc_assets.pgoutput.values.numeric import numeric_typmod
from cdc_assets.pgoutput.values.scalars import format_float
from tests.support.records import numeric_modifier

INT32_MAX, INT32_MIN = 2**31 - 1, -(2**31)
INT64_MAX, INT64_MIN = 2**63 - 1, -(2**63)
PG_EPOCH_US = 946_684_800_000_000  # 2000-01-01 in Unix microseconds
MOOD, MOOD_ARRAY, PRICE, PRICE_ARRAY, AMOUNT, POINT3D = 16_400, 16_399, 16_410, 16_409, 16_420, 16_430
CATALOG = TypeCatalog.of(
    [
        PgTypeInfo(MOOD, "public", "mood", "e"),
        PgTypeInfo(MOOD_ARRAY, "public", "_mood", "b", element_oid=MOOD),
        PgTypeInfo(PRICE, "public", "price", "d", base_oid=types.NUMERIC, base_modifier=numeric_modifier(10, 2)),
        PgTypeInfo(PRICE_ARRAY, "public", "_price", "b", element_oid=PRICE),
        PgTypeInfo(AMOUNT, "public", "amount", "d", base_oid=PRICE),
        PgTypeInfo(POINT3D, "public", "point3d", "c"),
    ]
)


def convert(
    oid: int,
    values: Sequence[bytes | None],
    binary: bool,
    modifier: int = -1,
    ndims: int = 1,
    raw_type: pa.DataType = pa.binary(),
) -> ConvertedColumn:
    return column_converter(oid, modifier, CATALOG, ndims).convert(pa.array(values, raw_type), binary)


def values_of(oid: int, values: Sequence[bytes | None], binary: bool, **kwargs: Any) -> list[Any]:
    result = convert(oid, values, binary, **kwargs)
    assert result.special == {}
    return result.array.to_pylist()


def storage(result: ConvertedColumn) -> list[Any]:
    """Dates and timestamps as their integers (sentinels and BC do not fit Python's datetime)."""
    target = pa.int32() if pa.types.is_date32(result.array.type) else pa.int64()
    return result.array.cast(target).to_pylist()


def be(layout: str, *fields: Any) -> bytes:
    return struct.pack(">" + layout, *fields)


def numeric_send(text: str) -> bytes:
    """numeric_send of a numeric_out text: ndigits, weight, sign, dscale, base-10000 digits."""
    if text in ("NaN", "Infinity", "-Infinity"):
        return be("hhHh", 0, 0, {"NaN": 0xC000, "Infinity": 0xD000, "-Infinity": 0xF000}[text], 0)
    negative = text.startswith("-")
    whole, _, fraction = text.lstrip("-").partition(".")
    whole = whole.lstrip("0")
    whole = "0" * (-len(whole) % 4) + whole
    groups = [int(whole[i : i + 4]) for i in range(0, len(whole), 4)]
    padded = fraction + "0" * (-len(fraction) % 4)
    groups += [int(padded[i : i + 4]) for i in range(0, len(padded), 4)]
    weight = len(whole) // 4 - 1
    while groups and groups[0] == 0:
        groups.pop(0)
        weight -= 1
    while groups and groups[-1] == 0:
        groups.pop()
    weight = weight if groups else 0
    header = be("hhHh", len(groups), weight, 0x4000 if negative and groups else 0, len(fraction))
    return header + b"".join(be("H", g) for g in groups)


def array_send(
    element_oid: int, dims: list[int], elements: list[bytes | None], lower_bounds: list[int] | None = None
) -> bytes:
    header = be("iiI", len(dims), int(None in elements), element_oid)
    header += b"".join(be("ii", d, b) for d, b in zip(dims, lower_bounds or [1] * len(dims), strict=True))
    return header + b"".join(be("i", -1) if e is None else be("i", len(e)) + e for e in elements)


def assert_decode_error(
    oid: int, values: Sequence[bytes | None], binary: bool, row: int, *words: str, **kwargs: Any
) -> None:
    with pytest.raises(DecodeError) as caught:
        convert(oid, values, binary, **kwargs)
    error = caught.value
    assert error.message_type is None and error.offset is None
    assert f"at row {row}" in error.reason
    for word in words:
        assert word in error.reason, error.reason


# --- type mapping ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("oid", "modifier", "arrow_type"),
    [
        (types.BOOL, -1, pa.bool_()),
        (types.INT2, -1, pa.int16()),
        (types.INT4, -1, pa.int32()),
        (types.INT8, -1, pa.int64()),
        (types.OID, -1, pa.int64()),
        (types.XID, -1, pa.int64()),
        (types.FLOAT4, -1, pa.float32()),
        (types.FLOAT8, -1, pa.float64()),
        (types.NUMERIC, numeric_modifier(10, 2), pa.decimal128(10, 2)),
        (types.NUMERIC, numeric_modifier(38, 38), pa.decimal128(38, 38)),
        (types.NUMERIC, numeric_modifier(5, 0), pa.decimal128(5, 0)),
        (types.NUMERIC, -1, pa.string()),
        (types.NUMERIC, numeric_modifier(39, 2), pa.string()),
        (types.NUMERIC, numeric_modifier(5, -2), pa.string()),
        (types.NUMERIC, numeric_modifier(3, 5), pa.string()),
        (types.TEXT, -1, pa.string()),
        (types.VARCHAR, 24, pa.string()),
        (types.BPCHAR, 9, pa.string()),
        (types.NAME, -1, pa.string()),
        (types.CHAR, -1, pa.string()),
        (types.BYTEA, -1, pa.binary()),
        (types.UUID, -1, pa.string()),
        (types.JSON, -1, pa.string()),
        (types.JSONB, -1, pa.string()),
        (types.DATE, -1, pa.date32()),
        (types.TIME, -1, pa.time64("us")),
        (types.TIMETZ, -1, pa.struct([("time", pa.time64("us")), ("utc_offset_seconds", pa.int32())])),
        (types.TIMESTAMP, -1, pa.timestamp("us")),
        (types.TIMESTAMPTZ, -1, pa.timestamp("us", tz="UTC")),
        (types.INTERVAL, -1, pa.month_day_nano_interval()),
        (1007, -1, pa.list_(pa.int32())),
        (1231, numeric_modifier(10, 2), pa.list_(pa.decimal128(10, 2))),
        (1009, -1, pa.list_(pa.string())),
        (1041, -1, pa.list_(pa.string())),  # inet[]: elements kept as text
        (types.BOX_ARRAY, -1, pa.string()),  # box[] separates elements with ';': kept whole
        (790, -1, pa.string()),  # money
        (MOOD, -1, pa.string()),
        (MOOD_ARRAY, -1, pa.list_(pa.string())),
        (PRICE, -1, pa.decimal128(10, 2)),
        (AMOUNT, -1, pa.decimal128(10, 2)),  # a domain over a domain
        (PRICE_ARRAY, -1, pa.list_(pa.decimal128(10, 2))),
        (POINT3D, -1, pa.string()),
        (99_999, -1, pa.string()),  # not in the catalog
    ],
)
def test_arrow_types(oid: int, modifier: int, arrow_type: pa.DataType) -> None:
    assert column_converter(oid, modifier, CATALOG).arrow_type == arrow_type


def test_nested_list_types_follow_ndims() -> None:
    assert column_converter(1007, -1, ndims=2).arrow_type == pa.list_(pa.list_(pa.int32()))
    assert column_converter(1007, -1, ndims=3).arrow_type == pa.list_(pa.list_(pa.list_(pa.int32())))
    for ndims in (0, 7):
        with pytest.raises(ValueError):
            column_converter(1007, -1, ndims=ndims)


@pytest.mark.parametrize(
    ("modifier", "expected"),
    [
        (-1, None),
        (numeric_modifier(10, 2), (10, 2)),
        (numeric_modifier(5, -2), (5, -2)),
        (numeric_modifier(1000, -1000), (1000, -1000)),
        (numeric_modifier(3, 5), (3, 5)),
    ],
)
def test_numeric_typmod(modifier: int, expected: tuple[int, int] | None) -> None:
    assert numeric_typmod(modifier) == expected


def test_binary_support_is_known_up_front() -> None:
    assert column_converter(types.INT4, -1).binary_supported
    assert column_converter(MOOD_ARRAY, -1, CATALOG).binary_supported
    assert not column_converter(790, -1).binary_supported
    assert not column_converter(1041, -1).binary_supported


# --- input shapes ---------------------------------------------------------------------------


def test_sliced_large_and_empty_inputs() -> None:
    raw = pa.array([b"1", None, b"2", b"3", None, b"4"], pa.large_binary()).slice(2, 3)
    assert column_converter(types.INT4, -1).convert(raw, binary=False).array.to_pylist() == [2, 3, None]
    raw = pa.array([be("i", 1), None, be("i", 2), be("i", 3)], pa.binary()).slice(1)
    assert column_converter(types.INT4, -1).convert(raw, binary=True).array.to_pylist() == [None, 2, 3]
    assert values_of(types.INT4, [], False) == []
    assert values_of(types.TEXT, [b"a", None], False, raw_type=pa.large_binary()) == ["a", None]
    assert convert(types.TIMESTAMPTZ, [None, None], True).array.type == pa.timestamp("us", tz="UTC")
    with pytest.raises(TypeError):
        column_converter(types.INT4, -1).convert(pa.array(["1"]), binary=False)


# --- booleans and numbers ---------------------------------------------------------------------


def test_bool() -> None:
    assert values_of(types.BOOL, [b"t", b"f", None], False) == [True, False, None]
    assert values_of(types.BOOL, [b"\x01", b"\x00", None], True) == [True, False, None]
    assert_decode_error(types.BOOL, [b"t", b"true"], False, 1, "bool")
    assert_decode_error(types.BOOL, [b"x"], False, 0, "not a boolean")
    assert_decode_error(types.BOOL, [None, b"\x02"], True, 1)
    assert_decode_error(types.BOOL, [b""], True, 0)


@pytest.mark.parametrize(
    ("oid", "layout", "values"),
    [
        (types.INT2, "h", [-32768, 32767, 0]),
        (types.INT4, "i", [INT32_MIN, INT32_MAX, 7]),
        (types.INT8, "q", [INT64_MIN, INT64_MAX, -1]),
        (types.OID, "I", [0, 4_294_967_295, 16384]),
        (types.XID, "I", [0, 4_294_967_295, 735]),
    ],
)
def test_integers(oid: int, layout: str, values: list[int]) -> None:
    assert values_of(oid, [str(v).encode() for v in values] + [None], False) == [*values, None]
    assert values_of(oid, [be(layout, v) for v in values] + [None], True) == [*values, None]


def test_malformed_integers() -> None:
    assert_decode_error(types.INT4, [b"1", b"abc"], False, 1, "int4", "abc")
    assert_decode_error(types.INT4, [b"2147483648"], False, 0, "int4")
    assert_decode_error(types.INT2, [b"1.5"], False, 0)
    assert_decode_error(types.INT4, [be("i", 1), b"\x00\x01"], True, 1, "expected 4 bytes, got 2")
    assert_decode_error(types.INT8, [be("i", 1)], True, 0, "expected 8 bytes")


def test_floats() -> None:
    texts = [b"0.1", b"-0", b"NaN", b"Infinity", b"-Infinity", b"1e+100", b"1.5e-07", None]
    from_text = values_of(types.FLOAT8, texts, False)
    from_binary = values_of(types.FLOAT8, [None if t is None else be("d", float(t)) for t in texts], True)
    for values in (from_text, from_binary):
        assert values[0] == 0.1 and str(values[1]) == "-0.0" and values[2] != values[2]
        assert values[3:7] == [float("inf"), float("-inf"), 1e100, 1.5e-07] and values[7] is None
    single = values_of(types.FLOAT4, [b"0.1", b"3.4028235e+38", b"1e-45"], False)
    assert single == values_of(types.FLOAT4, [be("f", 0.1), be("f", 3.4028235e38), be("f", 1e-45)], True)
    assert_decode_error(types.FLOAT8, [b"one"], False, 0, "float8")
    assert_decode_error(types.FLOAT4, [be("d", 1.0)], True, 0, "expected 4 bytes")


@pytest.mark.parametrize(
    ("value", "limit", "text"),
    [
        (1e15, 15, "1e+15"),
        (1e14, 15, "100000000000000"),
        (123456789012345.0, 15, "123456789012345"),
        (1234567890123456.0, 15, "1.234567890123456e+15"),
        (0.0001, 15, "0.0001"),
        (0.00001, 15, "1e-05"),
        (1.5e-7, 15, "1.5e-07"),
        (0.30000000000000004, 15, "0.30000000000000004"),
        (-0.0, 15, "-0"),
        (float("nan"), 15, "NaN"),
        (float("-inf"), 15, "-Infinity"),
        (1e6, 6, "1e+06"),
        (100000.0, 6, "100000"),
        (1.2345679e14, 6, "1.2345679e+14"),
    ],
)
def test_format_float(value: float, limit: int, text: str) -> None:
    assert format_float((np.float32 if limit == 6 else np.float64)(value), limit) == text


# --- numeric ----------------------------------------------------------------------------------


def test_numeric_send_worked_examples() -> None:
    """``numeric_send``'s layout: -12.500 and NaN."""
    assert numeric_send("-12.500") == bytes.fromhex("0002 0000 4000 0003 000c 1388")
    assert numeric_send("NaN") == bytes.fromhex("0000 0000 c000 0000")
    result = convert(
        types.NUMERIC, [bytes.fromhex("0002 0000 4000 0003 000c 1388"), bytes.fromhex("0000 0000 c000 0000")], True
    )
    assert result.array.to_pylist() == ["-12.500", "NaN"]


def test_decimal_numeric_with_nan_special() -> None:
    texts = [b"12.50", b"-0.01", b"0.00", b"NaN", None, b"99999999.99"]
    expected = [Decimal("12.50"), Decimal("-0.01"), Decimal("0.00"), None, None, Decimal("99999999.99")]
    for binary, values in ((False, texts), (True, [None if t is None else numeric_send(t.decode()) for t in texts])):
        result = convert(types.NUMERIC, values, binary, modifier=numeric_modifier(10, 2))
        assert result.array.to_pylist() == expected
        assert result.special == {3: "NaN"}


def test_wide_decimal_numeric() -> None:
    texts = ["12345678901234567890.0123456789", "-0.0000000001", "0.0000000000"]
    expected = [Decimal(t) for t in texts]
    assert values_of(types.NUMERIC, [t.encode() for t in texts], False, modifier=numeric_modifier(30, 10)) == expected
    assert (
        values_of(types.NUMERIC, [numeric_send(t) for t in texts], True, modifier=numeric_modifier(30, 10)) == expected
    )


@pytest.mark.parametrize(
    "text",
    [
        "0",
        "12.500",
        "-12.5",
        "0.5",
        "0.00000012",
        "12345.678",
        "100000000",
        "10000",
        "-99990000",
        "0.0001",
        "0.00000000000000000001",
        "123456789012345678901234567890.123456789",
        "1" + "0" * 100,
        "0.00",
        "NaN",
        "Infinity",
        "-Infinity",
    ],
)
def test_unconstrained_numeric_is_exact_text(text: str) -> None:
    assert values_of(types.NUMERIC, [text.encode()], False) == [text]
    assert values_of(types.NUMERIC, [numeric_send(text)], True) == [text]


def test_malformed_numeric() -> None:
    assert_decode_error(types.NUMERIC, [b"1.5", b"abc"], False, 1, "numeric")
    assert_decode_error(types.NUMERIC, [b"Nope"], False, 0, "numeric")
    assert_decode_error(types.NUMERIC, [b"Nope"], False, 0, modifier=numeric_modifier(10, 2))
    assert_decode_error(types.NUMERIC, [b"123456789.00"], False, 0, "numeric(10,2)", modifier=numeric_modifier(10, 2))
    assert_decode_error(
        types.NUMERIC, [numeric_send("123456789.00")], True, 0, "numeric(10,2)", modifier=numeric_modifier(10, 2)
    )
    assert_decode_error(
        types.NUMERIC, [numeric_send("1.234")], True, 0, "numeric(10,2)", modifier=numeric_modifier(10, 2)
    )
    assert_decode_error(types.NUMERIC, [numeric_send("1"), b"\x00\x01\x00"], True, 1, "header")
    assert_decode_error(types.NUMERIC, [numeric_send("1")[:-1]], True, 0, "digit count")
    assert_decode_error(types.NUMERIC, [be("hhHhH", 1, 0, 0x1234, 0, 1)], True, 0, "sign")
    assert_decode_error(types.NUMERIC, [be("hhHhH", 1, 0, 0, 0, 10000)], True, 0, "digit out of range")


# --- strings ------------------------------------------------------------------------------------


def test_strings_are_kept_as_sent() -> None:
    texts = [b"plain", b"", b"ab   ", "ünïcödé ✓ 😀".encode(), b"NULL", None]
    for oid in (types.TEXT, types.VARCHAR, types.BPCHAR, types.NAME, types.JSON, MOOD):
        for binary in (False, True):
            assert values_of(oid, texts, binary) == [None if t is None else t.decode() for t in texts]
    assert_decode_error(types.TEXT, [b"ok", b"\xff\xfe"], False, 1, "invalid UTF-8")
    assert_decode_error(MOOD, [b"\xc3"], True, 0, "invalid UTF-8")


def test_char() -> None:
    assert values_of(types.CHAR, [b"a", b"", b"\\351", None], False) == ["a", "", "\\351", None]
    assert values_of(types.CHAR, [b"a", b"\x00", b"\xe9", None], True) == ["a", "", "\\351", None]
    assert_decode_error(types.CHAR, [b"ab"], True, 0, "expected 1 bytes")


def test_jsonb() -> None:
    assert values_of(types.JSONB, [b'{"a": 1}', None], False) == ['{"a": 1}', None]
    assert values_of(types.JSONB, [b'\x01{"a": 1}', None, b"\x01null"], True) == ['{"a": 1}', None, "null"]
    assert_decode_error(types.JSONB, [b"\x01{}", b'\x02{"a": 1}'], True, 1, "jsonb binary version")
    assert_decode_error(types.JSONB, [b""], True, 0, "jsonb binary version")


def test_bytea() -> None:
    assert values_of(types.BYTEA, [b"\\x00ff10", b"\\x", None, b"\\xC3A9"], False) == [
        b"\x00\xff\x10",
        b"",
        None,
        b"\xc3\xa9",
    ]
    assert values_of(types.BYTEA, [b"\x00\xff", b"", None], True) == [b"\x00\xff", b"", None]
    assert_decode_error(types.BYTEA, [b"\\x00", b"abc"], False, 1, "hex-format")
    assert_decode_error(types.BYTEA, [b"\\x0"], False, 0, "odd number")
    assert_decode_error(types.BYTEA, [b"\\x00", b"\\xzz"], False, 1, "bad hex digit")


def test_uuid() -> None:
    text = b"a0eebc99-9c0b-4ef8-bb6d-6bb9bd380a11"
    octets = bytes.fromhex("a0eebc999c0b4ef8bb6d6bb9bd380a11")
    assert values_of(types.UUID, [text, None, text.upper()], False) == [text.decode(), None, text.decode()]
    assert values_of(types.UUID, [octets, None], True) == [text.decode(), None]
    assert_decode_error(types.UUID, [text, text[:-1] + b"g"], False, 1, "not a uuid")
    assert_decode_error(types.UUID, [text.replace(b"-", b"")], False, 0)
    assert_decode_error(types.UUID, [octets[:15]], True, 0, "expected 16 bytes")


def test_other_types_are_text_only() -> None:
    assert values_of(790, [b"$1.50", None], False) == ["$1.50", None]
    assert values_of(types.BOX_ARRAY, [b"{(1,1),(0,0);(2,2),(1,1)}"], False) == ["{(1,1),(0,0);(2,2),(1,1)}"]
    assert values_of(POINT3D, [b"(1,2,3)"], False) == ["(1,2,3)"]
    assert values_of(790, [None, None], True) == [None, None]
    assert_decode_error(
        790, [None, b"\x00\x00\x00\x00\x00\x00\x00\x96"], True, 1, "type oid 790", "use text mode (binary off)"
    )
    assert_decode_error(
        1041, [array_send(869, [1], [b"\x02\x20\x00\x04\x7f\x00\x00\x01"])], True, 0, "oid 869", "use text mode"
    )
    assert values_of(1041, [b'{127.0.0.1,"::1",NULL}'], False) == [["127.0.0.1", "::1", None]]


# --- dates and times ------------------------------------------------------------------------------


def test_date() -> None:
    texts = [
        b"2024-02-29",
        b"1970-01-01",
        b"infinity",
        b"-infinity",
        b"0044-03-15 BC",
        b"0001-12-31 BC",
        b"10000-01-01",
        b"5874897-12-31",
        None,
    ]
    days = [19782, 0, INT32_MAX, INT32_MIN, -735160, -719163, 2932897, 2145042905, None]
    assert storage(convert(types.DATE, texts, False)) == days
    sent = [None if d is None else be("i", d if d in (INT32_MAX, INT32_MIN) else d - 10957) for d in days]
    assert storage(convert(types.DATE, sent, True)) == days
    assert convert(types.DATE, [b"2024-02-29"], False).array.to_pylist() == [date(2024, 2, 29)]
    for bad in (b"2024-02-30", b"soon", b"0000-01-01 BC", b"2023-02-29 BC"):
        assert_decode_error(types.DATE, [b"2024-01-01", bad], False, 1, "date")
    assert_decode_error(types.DATE, [b"\x00\x00"], True, 0, "expected 4 bytes")


def test_time() -> None:
    texts = [b"00:00:00", b"12:34:56.789", b"23:59:59.999999", b"24:00:00", None]
    micros = [0, 45_296_789_000, 86_399_999_999, None, None]
    for binary, values in (
        (False, texts),
        (True, [be("q", 0), be("q", 45_296_789_000), be("q", 86_399_999_999), be("q", 86_400_000_000), None]),
    ):
        result = convert(types.TIME, values, binary)
        assert result.array.cast(pa.int64()).to_pylist() == micros and result.special == {3: "24:00:00"}
    for bad in (b"25:00:00", b"12:3:00", b"12:34:56.1234567", b"12:34:56.", b"12:60:00", b"1:00:00", b"12-34-56"):
        assert_decode_error(types.TIME, [b"00:00:00", bad], False, 1, "time")
    assert_decode_error(types.TIME, [be("q", -1)], True, 0, "out of range")


def test_timetz() -> None:
    texts = [b"12:34:56.789+05:30", b"00:00:00-08", b"01:02:03.5+05:53:28", b"23:59:59.999999+00", b"24:00:00+01", None]
    zones_west = [-19800, 28800, -21208, 0, -3600]
    clock = [45_296_789_000, 0, 3_723_500_000, 86_399_999_999, 86_400_000_000]
    sent = [be("qi", c, z) for c, z in zip(clock, zones_west, strict=True)] + [None]
    expected = [{"time": c, "utc_offset_seconds": -z} for c, z in zip(clock[:4], zones_west[:4], strict=True)] + [
        None,
        None,
    ]
    for binary, values in ((False, texts), (True, sent)):
        result = convert(types.TIMETZ, values, binary)
        array = result.array
        times = array.field("time").cast(pa.int64()).to_pylist()
        offsets = array.field("utc_offset_seconds").to_pylist()
        actual = [
            {"time": t, "utc_offset_seconds": o} if array[i].is_valid else None
            for i, (t, o) in enumerate(zip(times, offsets, strict=True))
        ]
        assert actual == expected and result.special == {4: "24:00:00+01"}
    for bad in (b"12:00:00", b"12:00:00+5", b"12:00:00+05:3", b"12:00:00+05:30:1", b"12:00:00*05"):
        assert_decode_error(types.TIMETZ, [b"00:00:00+00", bad], False, 1, "timetz")
    assert_decode_error(types.TIMETZ, [be("q", 0)], True, 0, "expected 12 bytes")


def test_timestamptz() -> None:
    texts = [
        b"2024-01-02 01:04:05.123456+00",
        b"2024-01-02 03:04:05+05:30",
        b"2024-01-01 16:04:05-08",
        b"1900-01-01 05:21:10+05:21:10",
        b"infinity",
        b"-infinity",
        b"0044-03-15 12:00:00+00 BC",
        b"10000-01-01 00:00:00+00",
        b"294276-12-31 23:59:59.999999+00",
        None,
    ]
    micros = [
        1_704_157_445_123_456,
        1_704_144_845_000_000,
        1_704_153_845_000_000,
        -2_208_988_800_000_000,
        INT64_MAX,
        INT64_MIN,
        -63_517_780_800_000_000,
        253_402_300_800_000_000,
        None,
        None,
    ]
    result = convert(types.TIMESTAMPTZ, texts, False)
    assert storage(result) == micros and result.special == {8: "294276-12-31 23:59:59.999999+00"}
    pg_micros = [m if m in (INT64_MAX, INT64_MIN) else m - PG_EPOCH_US for m in micros[:8] if m is not None] + [
        9_223_371_331_199_999_999
    ]
    result = convert(types.TIMESTAMPTZ, [be("q", m) for m in pg_micros] + [None], True)
    assert storage(result) == micros and result.special == {8: "294276-12-31 23:59:59.999999+00"}
    assert result.array[0].as_py() == datetime(2024, 1, 2, 1, 4, 5, 123456, tzinfo=UTC)


def test_timestamp() -> None:
    texts = [b"2024-01-02 03:04:05.5", b"infinity", b"0001-01-01 00:00:00 BC", b"12345-06-07 08:09:10", None]
    year_12345 = (date(1945, 6, 7) - date(1970, 1, 1)).days + 26 * 146_097  # 26 Gregorian 400-year cycles later
    micros = [
        1_704_164_645_500_000,
        INT64_MAX,
        -62_167_219_200_000_000,
        year_12345 * 86_400_000_000 + 29_350_000_000,
        None,
    ]
    assert storage(convert(types.TIMESTAMP, texts, False)) == micros
    sent = [be("q", m if m == INT64_MAX else m - PG_EPOCH_US) for m in micros[:4] if m is not None] + [None]
    assert storage(convert(types.TIMESTAMP, sent, True)) == micros


def test_malformed_timestamps() -> None:
    for bad in (
        b"yesterday",
        b"2024-13-01 00:00:00+00",
        b"2024-01-01 00:00:00",
        b"0000-01-01 00:00:00+00 BC",
        b"2024-01-01 00:00:00+00:00:00:00",
    ):
        assert_decode_error(types.TIMESTAMPTZ, [None, bad], False, 1, "timestamptz")
    assert_decode_error(types.TIMESTAMP, [b"2024-01-01 00:00:00+00"], False, 0, "timestamp")
    assert_decode_error(types.TIMESTAMP, [b"2024-01-01 00:00:00+00 BC"], False, 0, "timestamp")
    assert_decode_error(types.TIMESTAMPTZ, [be("i", 0)], True, 0, "expected 8 bytes")


def test_calendar_round_trip() -> None:
    for days in range(-2_500_000, 3_000_000, 997):
        assert days_from_civil(*civil_from_days(days)) == days
    assert civil_from_days(0) == (1970, 1, 1)
    assert days_from_civil(0, 12, 31) == -719163  # 1 BC
    with pytest.raises(ValueError):
        days_from_civil(2023, 2, 29)
    assert format_timestamp(-63_517_780_800_000_000, True) == "0044-03-15 12:00:00+00 BC"
    assert format_timestamp(1, False) == "1970-01-01 00:00:00.000001"
    assert [format_offset(s) for s in (0, 19800, -28800, 21208, -59)] == [
        "+00",
        "+05:30",
        "-08",
        "+05:53:28",
        "-00:00:59",
    ]


# --- intervals ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "months", "days", "micros"),
    [
        ("1 year 2 mons 3 days 04:05:06.5", 14, 3, 14_706_500_000),
        ("-1 days +02:03:04", 0, -1, 7_384_000_000),
        ("00:00:00", 0, 0, 0),
        ("-00:00:00.000001", 0, 0, -1),
        ("1 mon -1 days", 1, -1, 0),
        ("-1 years -2 mons +3 days -04:05:06", -14, 3, -14_706_000_000),
        ("178000000 years", 2_136_000_000, 0, 0),
        ("1 day", 0, 1, 0),
        ("100:00:00", 0, 0, 360_000_000_000),
        ("2562047:47:16.854775", 0, 0, 9_223_372_036_854_775),
    ],
)
def test_interval_text_round_trip(text: str, months: int, days: int, micros: int) -> None:
    assert parse_interval(text) == (months, days, micros)
    assert format_interval(months, days, micros) == text


def test_interval() -> None:
    texts = [
        b"1 year 2 mons 3 days 04:05:06.5",
        b"-1 days +02:03:04",
        b"1 year 2 mons 3 days 04:05:06.5",
        b"2562048:00:00",
        b"infinity",
        None,
    ]
    sent: list[bytes | None] = [be("qii", 14_706_500_000, 3, 14), be("qii", 7_384_000_000, -1, 0)]
    sent += [
        be("qii", 14_706_500_000, 3, 14),
        be("qii", 9_223_372_800_000_000, 0, 0),
        be("qii", INT64_MAX, INT32_MAX, INT32_MAX),
        None,
    ]
    for binary, values in ((False, texts), (True, sent)):
        result = convert(types.INTERVAL, values, binary)
        assert [None if v is None else (v.months, v.days, v.nanoseconds) for v in result.array.to_pylist()] == [
            (14, 3, 14_706_500_000_000),
            (0, -1, 7_384_000_000_000),
            (14, 3, 14_706_500_000_000),
            None,
            None,
            None,
        ]
        assert result.special == {3: "2562048:00:00", 4: "infinity"}
    assert convert(types.INTERVAL, [be("qii", INT64_MIN, INT32_MIN, INT32_MIN)], True).special == {0: "-infinity"}
    for bad in (b"1 fortnight", b"", b"1 day 1 year", b"P1D", b"1 days 2 days", b"1:2:3", b"1 year 00:00:00 1 day"):
        assert_decode_error(types.INTERVAL, [b"00:00:00", bad], False, 1, "interval")
    assert_decode_error(types.INTERVAL, [be("qi", 0, 0)], True, 0, "expected 16 bytes")


# --- arrays ---------------------------------------------------------------------------------------


def test_text_arrays() -> None:
    literal = rb'{"a b","c,d",NULL,"NULL","",plain,"back\\slash","quo\"te","{x}",null}'
    assert values_of(1009, [literal, b"{}", None], False) == [
        ["a b", "c,d", None, "NULL", "", "plain", "back\\slash", 'quo"te', "{x}", None],
        [],
        None,
    ]
    assert values_of(1007, [b"{1,2,NULL}", b"{-2147483648}"], False) == [[1, 2, None], [INT32_MIN]]
    assert values_of(1007, [b"{{1,2},{3,4}}", b"{{NULL,5}}", b"{}"], False, ndims=2) == [
        [[1, 2], [3, 4]],
        [[None, 5]],
        [],
    ]
    assert values_of(1001, [rb'{"\\x00ff",NULL}'], False) == [[b"\x00\xff", None]]
    assert values_of(MOOD_ARRAY, [b'{sad,"very \\"happy\\""}'], False) == [["sad", 'very "happy"']]


def test_simple_and_quoted_text_arrays_keep_row_order() -> None:
    texts = [b"{1,2}", b'{"3"}', None, b"{4}", b"{{5}}", b"{6,NULL}", b"{}", b'{"7",8}']
    result = convert(1007, texts, False)
    assert result.array.to_pylist() == [[1, 2], [3], None, [4], None, [6, None], [], [7, 8]]
    assert result.special == {4: "{{5}}"}


def test_binary_arrays_of_mixed_lengths() -> None:
    sent = [
        array_send(23, [3], [be("i", 1), None, be("i", 3)]),
        None,
        be("iiI", 0, 0, 23),
        array_send(23, [1], [be("i", 4)]),
        be("iiIii", 1, 0, 23, 0, 1),  # a zero-length dimension: empty, as array_recv makes it
        array_send(23, [5], [be("i", v) for v in range(5)]),
    ]
    assert values_of(1007, sent, True) == [[1, None, 3], None, [], [4], [], [0, 1, 2, 3, 4]]


def test_array_values_of_another_shape_are_special() -> None:
    texts = [b"{1,2}", b"[0:1]={7,8}", b"{{1,2},{3,4}}", b"{{{1}}}", None]
    result = convert(1007, texts, False)
    assert result.array.to_pylist() == [[1, 2], None, None, None, None]
    assert result.special == {1: "[0:1]={7,8}", 2: "{{1,2},{3,4}}", 3: "{{{1}}}"}
    result = convert(1007, texts, False, ndims=2)
    assert result.array.to_pylist() == [None, None, [[1, 2], [3, 4]], None, None]
    assert set(result.special) == {0, 1, 3}


def test_array_with_a_special_element_is_special() -> None:
    result = convert(1231, [b"{1.00,NaN}", b"{2.50,NULL}"], False, modifier=numeric_modifier(10, 2))
    assert result.array.to_pylist() == [None, [Decimal("2.50"), None]]
    assert result.special == {0: "{1.00,NaN}"}
    sent = [
        array_send(1700, [2], [numeric_send("1.00"), numeric_send("NaN")]),
        array_send(1700, [2], [numeric_send("2.50"), None]),
    ]
    binary = convert(1231, sent, True, modifier=numeric_modifier(10, 2))
    assert binary.array.equals(result.array) and binary.special == result.special


def test_malformed_text_arrays() -> None:
    for bad in (
        b"{1,2",
        b"{1,,2}",
        b"1,2",
        b"{{1},2}",
        b"{{1,2},{3}}",
        b'{"a}',
        b"{a}b",
        b"{}}",
        b"{{}}",
        b"{1}{2}",
        b"{,}",
    ):
        assert_decode_error(1007, [b"{1}", bad], False, 1, "array literal")
    assert_decode_error(1007, [b"{1}", b"{1,x}"], False, 1, "int4 element of int4[]")


def test_binary_arrays() -> None:
    worked_example = bytes.fromhex("00000001 00000001 00000017 00000002 00000001 00000004 00000001 ffffffff")
    assert worked_example == array_send(23, [2], [be("i", 1), None])
    assert values_of(1007, [worked_example, be("iiI", 0, 0, 23), None], True) == [[1, None], [], None]
    square = array_send(23, [2, 2], [be("i", v) for v in (1, 2, 3, 4)])
    assert values_of(1007, [square], True, ndims=2) == [[[1, 2], [3, 4]]]
    assert values_of(1009, [array_send(25, [3], [b"a b", b"", None])], True) == [["a b", "", None]]
    assert values_of(MOOD_ARRAY, [array_send(MOOD, [2], [b"sad", b"ok"])], True) == [["sad", "ok"]]
    price = array_send(PRICE, [2], [numeric_send("1.50"), None])
    assert values_of(PRICE_ARRAY, [price], True) == [[Decimal("1.50"), None]]


def test_binary_arrays_of_another_shape_keep_their_exact_text() -> None:
    sent = [
        array_send(23, [2, 2], [be("i", v) for v in (1, 2, 3, 4)]),
        array_send(23, [2], [be("i", 7), be("i", 8)], lower_bounds=[0]),
        array_send(25, [1, 2], [b'quo"te', None]),
        array_send(25, [2, 1], [b"back\\slash", b"NULL"], lower_bounds=[-1, 5]),
        array_send(1184, [1, 2], [be("q", 0), be("q", INT64_MAX)]),
        array_send(1186, [1, 1], [be("qii", -1, 0, 13)]),
        array_send(701, [1, 3], [be("d", 1e15), be("d", 0.1), be("d", float("nan"))]),
        array_send(16, [1, 2], [b"\x01", b"\x00"]),
        array_send(1082, [1, 1], [be("i", -730_120 - 10957)]),
        array_send(17, [1, 1], [b"\x00\xff"]),
    ]
    oids = [1007, 1007, 1009, 1009, 1185, 1187, 1022, 1000, 1182, 1001]
    texts = [
        "{{1,2},{3,4}}",
        "[0:1]={7,8}",
        '{{"quo\\"te",NULL}}',
        '[-1:0][5:5]={{"back\\\\slash"},{"NULL"}}',
        '{{"2000-01-01 00:00:00+00",infinity}}',
        '{{"1 year 1 mon -00:00:00.000001"}}',
        "{{1e+15,0.1,NaN}}",
        "{{t,f}}",
        '{{"0030-01-01 BC"}}',
        '{{"\\\\x00ff"}}',
    ]
    for oid, value, text in zip(oids, sent, texts, strict=True):
        result = convert(oid, [None, value], True)
        assert result.array.to_pylist() == [None, None]
        assert result.special == {1: text}


def test_malformed_binary_arrays() -> None:
    good = array_send(23, [1], [be("i", 1)])
    cases = [
        (good[:10], "shorter than an array header"),
        (be("iiI", 7, 0, 23), "bad array header"),
        (be("iiI", 1, 2, 23) + be("ii", 1, 1), "bad array header"),
        (array_send(20, [1], [be("q", 1)]), "element type oid is not 23"),
        (good[:-1], "bad element length"),
        (good + b"\x00", "does not match"),
        (be("iiIii", 1, 0, 23, 1000, 1) + be("ii", 4, 1), "more elements than bytes"),
        (be("iiIii", 1, 0, 23, 1, 1) + be("i", -2), "bad element length"),
        (be("iiIii", 1, 0, 23, -1, 1), "negative dimension"),
    ]
    for value, words in cases:
        assert_decode_error(1007, [good, value], True, 1, "binary array", words)
    assert_decode_error(
        1007, [good, array_send(23, [1], [be("h", 1)])], True, 1, "int4 element of int4[]", "expected 4 bytes"
    )


@pytest.mark.parametrize(
    ("text", "elements", "dims"),
    [
        ("{}", [], ()),
        ("{a}", ["a"], (1,)),
        ('{"",NULL,"NULL"}', ["", None, "NULL"], (3,)),
        ('{{"a\\\\b",c},{NULL,d}}', ["a\\b", "c", None, "d"], (2, 2)),
        ("{{{1},{2}}}", ["1", "2"], (1, 2, 1)),
    ],
)
def test_parse_and_format_text_arrays(text: str, elements: list[str | None], dims: tuple[int, ...]) -> None:
    assert parse_text_array(text) == (elements, dims)
    assert format_array(elements, ArrayShape(dims, (1,) * len(dims))) == text


# --- catalog --------------------------------------------------------------------------------------


def test_domains_use_their_base_type() -> None:
    assert values_of(PRICE, [b"1.50", None], False) == [Decimal("1.50"), None]
    assert values_of(AMOUNT, [numeric_send("-2.25")], True) == [Decimal("-2.25")]
    result = convert(PRICE, [b"NaN"], False)
    assert result.special == {0: "NaN"}


def test_type_messages_do_not_hide_catalog_entries() -> None:
    catalog = TypeCatalog.of([PgTypeInfo(MOOD, "public", "mood", "e")])
    catalog.note_type_message(MOOD, "public", "mood")
    assert catalog.get(MOOD) == PgTypeInfo(MOOD, "public", "mood", "e")
    catalog.note_type_message(MOOD, "public", "feeling")  # renamed: the same type, the same OID
    assert catalog.get(MOOD) == PgTypeInfo(MOOD, "public", "mood", "e")
    posint = PgTypeInfo(30_000, "public", "posint", "d", base_oid=23)
    catalog.add(posint)
    catalog.note_type_message(30_000, "", "int4")  # a domain's message names its base type
    assert catalog.get(30_000) == posint
    assert catalog.unresolved([MOOD, 30_000, 20_000]) == [20_000]
    catalog.note_type_message(20_000, "ext", "thing")
    assert 20_000 in catalog and len(catalog) == 3
    assert column_converter(20_000, -1, catalog).arrow_type == pa.string()
    assert not column_converter(20_000, -1, catalog).binary_supported
