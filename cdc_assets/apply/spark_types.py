"""Change-log Arrow types → what Spark and Delta hold.

Most types map directly (``docs/types.md`` has the full table). Three have no Delta equivalent and
are converted before the data reaches Spark:

* ``time`` (time64) → string ``HH:MM:SS.ffffff``;
* ``timetz`` (struct of time and UTC offset) → string ``HH:MM:SS.ffffff+HH:MM[:SS]``;
* ``interval`` (month_day_nano) → struct<months: int, days: int, microseconds: bigint>.

Timestamps without time zone become Spark ``TIMESTAMP_NTZ`` (Spark would otherwise read them as
local-time ``TIMESTAMP``), so the schema passed to Spark is built here too.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import types as T

from cdc_assets.pgoutput.records import DeltaColumn

INTERVAL_TYPE = pa.struct(
    [pa.field("months", pa.int32()), pa.field("days", pa.int32()), pa.field("microseconds", pa.int64())]
)


def delta_arrow_type(arrow_type: pa.DataType) -> pa.DataType:
    """The Arrow type a change-log type is stored as in Delta."""
    if pa.types.is_time(arrow_type) or _is_timetz(arrow_type):
        return pa.string()
    if pa.types.is_interval(arrow_type):
        return INTERVAL_TYPE
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return pa.list_(delta_arrow_type(arrow_type.value_type))
    if pa.types.is_struct(arrow_type):
        return pa.struct([pa.field(f.name, delta_arrow_type(f.type)) for f in arrow_type])
    if pa.types.is_large_string(arrow_type):
        return pa.string()
    if pa.types.is_large_binary(arrow_type):
        return pa.binary()
    return arrow_type


def to_delta_arrow(table: pa.Table) -> pa.Table:
    """``table`` with every column converted to its Delta representation."""
    return pa.table([to_delta_array(c.combine_chunks()) for c in table.columns], names=table.column_names)


def to_delta_array(array: pa.Array) -> pa.Array:
    kind = array.type
    if pa.types.is_time(kind):
        return array.cast(pa.string())
    if _is_timetz(kind):
        return _timetz_text(array)
    if pa.types.is_interval(kind):
        return _interval_struct(array)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        target = delta_arrow_type(kind)
        if target.equals(kind):
            return array
        values = to_delta_array(array.values)
        offsets = array.offsets.cast(pa.int32())
        return pa.ListArray.from_arrays(offsets, values, mask=array.is_null() if array.null_count else None)
    if pa.types.is_struct(kind):
        target = delta_arrow_type(kind)
        if target.equals(kind):
            return array
        children = [to_delta_array(array.field(i)) for i in range(kind.num_fields)]
        return pa.StructArray.from_arrays(
            children, fields=list(target), mask=array.is_null() if array.null_count else None
        )
    target = delta_arrow_type(kind)
    return array if target.equals(kind) else array.cast(target)


def spark_schema(schema: pa.Schema) -> T.StructType:
    """The Spark schema of a table already converted with :func:`to_delta_arrow`."""
    return T.StructType([T.StructField(f.name, spark_type(f.type), True) for f in schema])


def spark_type(arrow_type: pa.DataType) -> T.DataType:
    if pa.types.is_boolean(arrow_type):
        return T.BooleanType()
    if pa.types.is_int8(arrow_type):
        return T.ByteType()
    if pa.types.is_int16(arrow_type):
        return T.ShortType()
    if pa.types.is_int32(arrow_type):
        return T.IntegerType()
    if pa.types.is_int64(arrow_type):
        return T.LongType()
    if pa.types.is_float32(arrow_type):
        return T.FloatType()
    if pa.types.is_float64(arrow_type):
        return T.DoubleType()
    if pa.types.is_decimal(arrow_type):
        return T.DecimalType(arrow_type.precision, arrow_type.scale)
    if pa.types.is_string(arrow_type) or pa.types.is_large_string(arrow_type):
        return T.StringType()
    if pa.types.is_binary(arrow_type) or pa.types.is_large_binary(arrow_type):
        return T.BinaryType()
    if pa.types.is_date(arrow_type):
        return T.DateType()
    if pa.types.is_timestamp(arrow_type):
        return T.TimestampType() if arrow_type.tz else T.TimestampNTZType()
    if pa.types.is_list(arrow_type) or pa.types.is_large_list(arrow_type):
        return T.ArrayType(spark_type(arrow_type.value_type), True)
    if pa.types.is_struct(arrow_type):
        return T.StructType([T.StructField(f.name, spark_type(f.type), True) for f in arrow_type])
    if pa.types.is_null(arrow_type):
        return T.StringType()
    raise TypeError(f"no Spark type for Arrow {arrow_type}")


def _is_timetz(kind: pa.DataType) -> bool:
    return pa.types.is_struct(kind) and [f.name for f in kind] == ["time", "utc_offset_seconds"]


def _timetz_text(array: pa.StructArray) -> pa.Array:
    """``HH:MM:SS.ffffff+HH:MM`` (``+HH:MM:SS`` when the offset has seconds)."""
    time_text = array.field("time").cast(pa.string())
    offsets = array.field("utc_offset_seconds").to_numpy(zero_copy_only=False)
    offsets = np.nan_to_num(offsets.astype(np.float64)).astype(np.int64)
    sign = np.where(offsets < 0, "-", "+")
    magnitude = np.abs(offsets)
    hours, rest = np.divmod(magnitude, 3600)
    minutes, seconds = np.divmod(rest, 60)
    zone = [
        f"{s}{h:02d}:{m:02d}" + (f":{sec:02d}" if sec else "") for s, h, m, sec in zip(sign, hours, minutes, seconds)
    ]
    text = pc.binary_join_element_wise(time_text, pa.array(zone, pa.string()), "")
    return pc.if_else(array.is_valid(), text, pa.nulls(len(array), pa.string()))


def _interval_struct(array: pa.Array) -> pa.StructArray:
    values = array.to_pylist()
    months = [v.months if v is not None else None for v in values]
    days = [v.days if v is not None else None for v in values]
    micros = [v.nanoseconds // 1000 if v is not None else None for v in values]
    return pa.StructArray.from_arrays(
        [pa.array(months, pa.int32()), pa.array(days, pa.int32()), pa.array(micros, pa.int64())],
        fields=list(INTERVAL_TYPE),
        mask=array.is_null() if array.null_count else None,
    )


def delta_schema(columns: pa.Schema) -> T.StructType:
    """The Spark schema of a mirrored table: its columns, then the metadata columns."""
    metadata = [
        T.StructField(DeltaColumn.LSN, T.LongType(), True),
        T.StructField(DeltaColumn.COMMIT_TIME, T.TimestampType(), True),
    ]
    return T.StructType([*spark_schema(columns).fields, *metadata])


def without_metadata(schema: Any) -> Any:
    """A Delta schema's JSON without its fields' metadata, at every depth."""
    if isinstance(schema, dict):
        return {key: without_metadata(value) for key, value in schema.items() if key != "metadata"}
    return [without_metadata(item) for item in schema] if isinstance(schema, list) else schema
