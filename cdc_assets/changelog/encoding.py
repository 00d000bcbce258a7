"""Arrow types Parquet cannot store, and their storage form in the change log's files.

Parquet (pyarrow) has no ``month_day_nano_interval``, the type of ``interval`` columns, so an
interval is stored as ``struct<months: int32, days: int32, nanoseconds: int64>`` whose field
carries the metadata ``cdc_assets.type = month_day_nano_interval`` — readable as a plain struct by
any Parquet reader — and :func:`from_storage` turns it back into the type the value converters
produce. Both directions are vectorized and exact; every other type is stored as is.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

INTERVAL = pa.month_day_nano_interval()
INTERVAL_STORAGE = pa.struct(
    [pa.field("months", pa.int32()), pa.field("days", pa.int32()), pa.field("nanoseconds", pa.int64())]
)
TYPE_KEY = b"cdc_assets.type"
_INTERVAL_MARK = {TYPE_KEY: b"month_day_nano_interval"}
_FIELDS = ("months", "days", "nanoseconds")
_LAYOUT = np.dtype(list(zip(_FIELDS, ("<i4", "<i4", "<i8"), strict=True)))


def storage_schema(schema: pa.Schema) -> pa.Schema:
    """``schema`` with every interval (at any depth) replaced by its marked storage struct."""
    if not _needs_encoding(schema):
        return schema
    return pa.schema([_storage_field(f) for f in schema], metadata=schema.metadata)


def to_storage(table: pa.Table) -> pa.Table:
    """``table`` in its storage form (see :func:`storage_schema`)."""
    schema = storage_schema(table.schema)
    if schema is table.schema:
        return table
    columns = [
        pa.chunked_array([_encode(chunk, field.type) for chunk in column.chunks], field.type)
        for column, field in zip(table.columns, schema)
    ]
    return pa.Table.from_arrays(columns, schema=schema)


def from_storage(table: pa.Table) -> pa.Table:
    """A table read from the change log with interval columns restored."""
    fields = [_logical_field(f) for f in table.schema]
    if all(a is b for a, b in zip(fields, table.schema)):
        return table
    columns = [
        pa.chunked_array([_decode(chunk, field.type) for chunk in column.chunks], field.type)
        for column, field in zip(table.columns, fields)
    ]
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=table.schema.metadata))


# --- types ------------------------------------------------------------------------------------


def _needs_encoding(schema: pa.Schema) -> bool:
    return any(_storage_field(f) is not f for f in schema)


def _storage_field(field: pa.Field) -> pa.Field:
    if field.type == INTERVAL:
        return pa.field(field.name, INTERVAL_STORAGE, field.nullable, {**(field.metadata or {}), **_INTERVAL_MARK})
    changed = _storage_type(field.type)
    return field if changed is field.type else field.with_type(changed)


def _storage_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_struct(t):
        fields = [_storage_field(t.field(i)) for i in range(t.num_fields)]
        return t if all(a is t.field(i) for i, a in enumerate(fields)) else pa.struct(fields)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        value = _storage_field(t.value_field)
        if value is t.value_field:
            return t
        return pa.list_(value) if pa.types.is_list(t) else pa.large_list(value)
    return t


def _logical_field(field: pa.Field) -> pa.Field:
    metadata = field.metadata or {}
    if metadata.get(TYPE_KEY) == _INTERVAL_MARK[TYPE_KEY] and field.type == INTERVAL_STORAGE:
        rest = {k: v for k, v in metadata.items() if k != TYPE_KEY}
        return pa.field(field.name, INTERVAL, field.nullable, rest or None)
    changed = _logical_type(field.type)
    return field if changed is field.type else field.with_type(changed)


def _logical_type(t: pa.DataType) -> pa.DataType:
    if pa.types.is_struct(t):
        fields = [_logical_field(t.field(i)) for i in range(t.num_fields)]
        return t if all(a is t.field(i) for i, a in enumerate(fields)) else pa.struct(fields)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        value = _logical_field(t.value_field)
        if value is t.value_field:
            return t
        return pa.list_(value) if pa.types.is_list(t) else pa.large_list(value)
    return t


# --- values -----------------------------------------------------------------------------------


def _encode(array: pa.Array, target: pa.DataType) -> pa.Array:
    if array.type == target:
        return array
    if array.type == INTERVAL:
        buffer = array.buffers()[1]
        if buffer is None:
            data = np.zeros(len(array), dtype=_LAYOUT)
        else:
            data = np.frombuffer(buffer, dtype=_LAYOUT)[array.offset : array.offset + len(array)]
        children = [pa.array(data[name]) for name in _FIELDS]
        return pa.StructArray.from_arrays(children, fields=list(target), mask=_null_mask(array))
    return _rebuild(array, target, _encode)


def _decode(array: pa.Array, target: pa.DataType) -> pa.Array:
    if array.type == target:
        return array
    if target == INTERVAL:
        data = np.zeros(len(array), dtype=_LAYOUT)
        for name in _FIELDS:
            data[name] = array.field(name).fill_null(0).to_numpy(zero_copy_only=False)
        valid = ~np.asarray(array.is_null())
        validity = pa.py_buffer(np.packbits(valid, bitorder="little")) if not valid.all() else None
        return pa.Array.from_buffers(INTERVAL, len(array), [validity, pa.py_buffer(data.tobytes())])
    return _rebuild(array, target, _decode)


def _rebuild(array: pa.Array, target: pa.DataType, convert: Callable[[pa.Array, pa.DataType], pa.Array]) -> pa.Array:
    if pa.types.is_struct(target):
        children = [convert(array.field(i), target.field(i).type) for i in range(target.num_fields)]
        return pa.StructArray.from_arrays(children, fields=list(target), mask=_null_mask(array))
    if pa.types.is_list(target) or pa.types.is_large_list(target):
        offsets = array.offsets
        values = convert(array.values, target.value_type)
        start, end = offsets[0].as_py(), offsets[-1].as_py()
        values = values.slice(start, end - start)
        offsets = pc.subtract(offsets, pa.scalar(start, offsets.type))
        cls = pa.ListArray if pa.types.is_list(target) else pa.LargeListArray
        return cls.from_arrays(offsets, values, type=target, mask=_null_mask(array))
    raise TypeError(f"cannot convert {array.type} to {target}")


def _null_mask(array: pa.Array) -> pa.Array | None:
    return array.is_null() if array.null_count else None
