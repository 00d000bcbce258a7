"""Which codec converts a column: built-in OIDs, arrays, and catalog types (enums, domains)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa

from cdc_assets.pgoutput import types
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.pgoutput.values.arrays import MAX_DIMENSIONS, ArrayCodec
from cdc_assets.pgoutput.values.base import (
    Codec,
    ConvertedColumn,
    ScalarCodec,
    convert_column,
)
from cdc_assets.pgoutput.values.interval import IntervalCodec
from cdc_assets.pgoutput.values.numeric import (
    NumericCodec,
    numeric_arrow_type,
    numeric_typmod,
)
from cdc_assets.pgoutput.values.raw import RawArray, RawColumn
from cdc_assets.pgoutput.values.scalars import (
    BoolCodec,
    ByteaCodec,
    CharCodec,
    FloatCodec,
    JsonbCodec,
    NumberCodec,
    StringCodec,
    TextOnlyCodec,
    UuidCodec,
)
from cdc_assets.pgoutput.values.temporal import (
    DateCodec,
    TimeCodec,
    TimestampCodec,
    TimeTzCodec,
)

_MAX_DOMAIN_DEPTH = 32

_BUILTIN: dict[int, ScalarCodec] = {
    types.BOOL: BoolCodec(),
    types.INT2: NumberCodec("int2", pa.int16(), ">i2"),
    types.INT4: NumberCodec("int4", pa.int32(), ">i4"),
    types.INT8: NumberCodec("int8", pa.int64(), ">i8"),
    types.OID: NumberCodec("oid", pa.int64(), ">u4"),
    types.XID: NumberCodec("xid", pa.int64(), ">u4"),
    types.FLOAT4: FloatCodec("float4", pa.float32(), ">f4", fixed_exponent_limit=6),
    types.FLOAT8: FloatCodec("float8", pa.float64(), ">f8", fixed_exponent_limit=15),
    types.TEXT: StringCodec("text"),
    types.VARCHAR: StringCodec("varchar"),
    types.BPCHAR: StringCodec("bpchar"),
    types.NAME: StringCodec("name"),
    types.CHAR: CharCodec('"char"'),
    types.JSON: StringCodec("json"),
    types.JSONB: JsonbCodec("jsonb"),
    types.BYTEA: ByteaCodec(),
    types.UUID: UuidCodec(),
    types.DATE: DateCodec(),
    types.TIME: TimeCodec(),
    types.TIMETZ: TimeTzCodec(),
    types.TIMESTAMP: TimestampCodec("timestamp", pa.timestamp("us")),
    types.TIMESTAMPTZ: TimestampCodec("timestamptz", pa.timestamp("us", tz="UTC")),
    types.INTERVAL: IntervalCodec(),
}


@dataclass(slots=True, frozen=True)
class ColumnConverter:
    """Converts raw values of one column type (OID, typmod, array dimensions) to Arrow.

    Cheap to build and reusable; :meth:`convert` takes the column's values as one binary array,
    null where the column was NULL or not sent.
    """

    codec: Codec

    @property
    def arrow_type(self) -> pa.DataType:
        return self.codec.arrow_type

    @property
    def type_name(self) -> str:
        return self.codec.name

    @property
    def binary_supported(self) -> bool:
        """Whether binary-format values of this type can be converted (else use text mode)."""
        return self.codec.binary_supported

    def convert(self, raw: RawArray, binary: bool) -> ConvertedColumn:
        """Convert text-format (``binary=False``) or binary-format values; raises DecodeError."""
        return convert_column(self.codec, RawColumn.of(raw, self.codec.name), binary)


def column_converter(
    type_oid: int, type_modifier: int, catalog: TypeCatalog | None = None, ndims: int = 1
) -> ColumnConverter:
    """The converter for a column of type ``type_oid`` with ``atttypmod`` ``type_modifier``.

    ``ndims`` is the number of list levels for an array column (pass ``max(attndims, 1)``; it is
    ignored for other types); array values of another dimensionality become special.
    """
    if not 1 <= ndims <= MAX_DIMENSIONS:
        raise ValueError(f"ndims must be between 1 and {MAX_DIMENSIONS}, not {ndims}")
    return ColumnConverter(_codec(type_oid, type_modifier, catalog or TypeCatalog(), ndims))


def _codec(oid: int, type_modifier: int, catalog: TypeCatalog, ndims: int, depth: int = 0) -> Codec:
    if oid == types.NUMERIC:
        typmod = numeric_typmod(type_modifier)
        name = "numeric" if typmod is None else f"numeric({typmod[0]},{typmod[1]})"
        return NumericCodec(name, numeric_arrow_type(type_modifier))
    if oid in _BUILTIN:
        return _BUILTIN[oid]
    if oid == types.BOX_ARRAY:
        return TextOnlyCodec("box[]", type_oid=oid)
    info = catalog.get(oid)
    element_oid = types.BUILTIN_ARRAY_ELEMENTS.get(oid) or (info.element_oid if info else 0)
    if element_oid:
        element = _codec(element_oid, type_modifier, catalog, 1, depth + 1)
        if isinstance(element, ScalarCodec):
            return ArrayCodec(f"{element.name}[]", element, element_oid, ndims)
    elif info is not None and info.category == types.CATEGORY_DOMAIN and depth < _MAX_DOMAIN_DEPTH:
        # Like getBaseTypeAndTypmod: each domain level's typtypmod replaces the one above.
        return _codec(info.base_oid, info.base_modifier, catalog, ndims, depth + 1)
    elif info is not None and info.category == types.CATEGORY_ENUM:
        return StringCodec(info.qualified_name)
    return TextOnlyCodec(info.qualified_name if info else f"oid {oid}", type_oid=oid)
