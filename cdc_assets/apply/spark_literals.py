"""Spark SQL literals of values in their Delta types, so a statement compares or sets a column
itself (Delta's file statistics apply to a comparison on the column, not on a cast of it)."""

from __future__ import annotations

import math
from datetime import datetime

import pyarrow as pa

_INTEGER_SUFFIX = {8: "Y", 16: "S", 32: "", 64: "L"}
_FLOAT_TEXT = {"nan": "NaN", "inf": "Infinity", "-inf": "-Infinity"}


def backquote(name: str) -> str:
    """A name (column, path) quoted for Spark SQL."""
    return "`" + name.replace("`", "``") + "`"


def sql_string(text: str) -> str:
    """A Spark SQL string literal of ``text`` (backslash escapes, as Spark's parser reads them)."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


def spark_literal(value: object, kind: pa.DataType) -> str | None:
    """A Spark SQL literal of ``value`` (not None), a value of the Delta Arrow type ``kind`` (None:
    a type this has no literal for — nested ones)."""
    if pa.types.is_boolean(kind):
        return "TRUE" if value else "FALSE"
    if pa.types.is_integer(kind):
        return f"{value}{_INTEGER_SUFFIX[kind.bit_width]}"
    if pa.types.is_floating(kind):
        assert isinstance(value, float)
        text = _FLOAT_TEXT.get(repr(value), repr(value)) if not math.isfinite(value) else repr(value)
        return f"CAST('{text}' AS {'FLOAT' if kind.bit_width == 32 else 'DOUBLE'})"
    if pa.types.is_decimal(kind):
        return f"CAST('{value}' AS DECIMAL({kind.precision}, {kind.scale}))"
    if pa.types.is_date32(kind):
        return f"DATE'{value}'"
    if pa.types.is_timestamp(kind) and isinstance(value, datetime):
        if kind.tz is None:
            return f"TIMESTAMP_NTZ'{value.isoformat(sep=' ')}'"
        micros = pa.scalar(value, kind).cast(pa.int64()).as_py()
        return f"timestamp_micros({micros}L)"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return sql_string(str(value))
    if (pa.types.is_binary(kind) or pa.types.is_large_binary(kind)) and isinstance(value, bytes):
        return f"X'{value.hex()}'"
    return None
