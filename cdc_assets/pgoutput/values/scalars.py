"""Booleans, integers, floats, strings, bytea and uuid.

Text values go through Arrow casts; binary values are read as big-endian fixed-width numpy
matrices. Nothing here creates a Python object per row except :meth:`Codec.render`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_assets.pgoutput.values.base import ConvertedColumn, ScalarCodec
from cdc_assets.pgoutput.values.raw import RawColumn, binary_array

# ASCII hex digit -> value, -1 for anything else.
HEX_VALUES = np.full(256, -1, np.int16)
HEX_VALUES[np.frombuffer(b"0123456789", np.uint8)] = np.arange(10)
HEX_VALUES[np.frombuffer(b"abcdef", np.uint8)] = np.arange(10, 16)
HEX_VALUES[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
HEX_DIGITS = np.frombuffer(b"0123456789abcdef", np.uint8)


@dataclass(slots=True)
class BoolCodec(ScalarCodec):
    """bool: text ``t``/``f``, binary one byte 1/0."""

    name: str = "bool"
    arrow_type: pa.DataType = pa.bool_()

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        return self._convert(col, ord("t"), ord("f"))

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        return self._convert(col, 1, 0)

    def _convert(self, col: RawColumn, true: int, false: int) -> ConvertedColumn:
        byte = col.fixed(1)[:, 0]
        col.check((byte != true) & (byte != false), "not a boolean")
        return ConvertedColumn(col.to_arrow(byte == true, self.arrow_type))

    def render(self, values: pa.Array) -> list[str | None]:
        return [None if v is None else ("t" if v else "f") for v in values.to_pylist()]


@dataclass(slots=True)
class NumberCodec(ScalarCodec):
    """Integers (int2/int4/int8, and the unsigned 32-bit oid and xid widened to int64) and floats:
    text through Arrow's cast, binary as big-endian numbers of the ``wire`` numpy type."""

    name: str
    arrow_type: pa.DataType
    wire: str

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        return ConvertedColumn(col.cast(col.strings(), self.arrow_type))

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        wire = np.dtype(self.wire)
        values = col.fixed(wire.itemsize).view(wire)[:, 0]
        kind = "f" if pa.types.is_floating(self.arrow_type) else "i"
        return ConvertedColumn(col.to_arrow(values.astype(f"{kind}{self.arrow_type.bit_width // 8}"), self.arrow_type))

    def render(self, values: pa.Array) -> list[str | None]:
        return [None if v is None else str(v) for v in values.to_pylist()]


@dataclass(slots=True)
class FloatCodec(NumberCodec):
    """float4/float8, including NaN and ±Infinity."""

    fixed_exponent_limit: int = 15  # PostgreSQL prints decimal exponents in [-4, limit) without 'e'

    def render(self, values: pa.Array) -> list[str | None]:
        scalar = np.float32 if self.arrow_type == pa.float32() else np.float64
        return [None if v is None else format_float(scalar(v), self.fixed_exponent_limit) for v in values.to_pylist()]


def format_float(value: np.floating, fixed_exponent_limit: int) -> str:
    """float4out/float8out with extra_float_digits > 0: the shortest exact digits, printed like
    ``%g`` (plain for decimal exponents in [-4, limit), else ``1.5e-07``)."""
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "Infinity" if value > 0 else "-Infinity"
    if value == 0:
        return "-0" if math.copysign(1.0, float(value)) < 0 else "0"
    mantissa, exponent_text = np.format_float_scientific(value, unique=True, trim="-").split("e")
    sign = "-" if mantissa.startswith("-") else ""
    digits = mantissa.lstrip("-").replace(".", "")
    exponent = int(exponent_text)
    if -4 <= exponent < fixed_exponent_limit:
        if exponent < 0:
            return f"{sign}0.{'0' * (-exponent - 1)}{digits}"
        whole, fraction = digits[: exponent + 1].ljust(exponent + 1, "0"), digits[exponent + 1 :]
        return f"{sign}{whole}.{fraction}" if fraction else f"{sign}{whole}"
    head = f"{digits[0]}.{digits[1:]}" if len(digits) > 1 else digits
    return f"{sign}{head}e{'-' if exponent < 0 else '+'}{abs(exponent):02d}"


@dataclass(slots=True)
class StringCodec(ScalarCodec):
    """Types whose text and binary forms are the same UTF-8 text: text, varchar, bpchar (padding
    kept), name, json, enum labels."""

    name: str
    arrow_type: pa.DataType = pa.string()

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        return ConvertedColumn(col.strings())

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        return ConvertedColumn(col.strings())

    def render(self, values: pa.Array) -> list[str | None]:
        rendered: list[str | None] = values.to_pylist()
        return rendered


@dataclass(slots=True)
class TextOnlyCodec(StringCodec):
    """Any other type: its text kept as sent. Its binary (send) format cannot be rendered
    generically, so binary values are refused."""

    type_oid: int = 0
    binary_supported = False  # class attribute, not a field

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        if col.valid.any():
            index = int(np.flatnonzero(col.valid)[0])
            raise col.error(
                index,
                f"binary format is not supported for type oid {self.type_oid};"
                " use text mode (binary off) for this type",
            )
        return ConvertedColumn(pa.nulls(len(col), self.arrow_type))


# "char" in text: the byte itself, octal-escaped when its high bit is set, empty for \0 (charout).
_CHAR_TEXT = pa.array([""] + [chr(b) for b in range(1, 128)] + [f"\\{b:03o}" for b in range(128, 256)])


@dataclass(slots=True)
class CharCodec(StringCodec):
    """The one-byte ``"char"`` type; its binary byte is rendered as charout would."""

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        codes = pa.array(col.fixed(1)[:, 0], mask=col.mask)
        return ConvertedColumn(pc.take(_CHAR_TEXT, codes))


@dataclass(slots=True)
class JsonbCodec(StringCodec):
    """jsonb: binary is a version byte (1) followed by the text."""

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        col.check(col.byte_at(0) != 1, "unsupported jsonb binary version")
        return ConvertedColumn(col.drop_prefix(1).strings())


@dataclass(slots=True)
class ByteaCodec(ScalarCodec):
    """bytea: text is ``\\x`` + hex digits (bytea_output=hex); binary is the bytes."""

    name: str = "bytea"
    arrow_type: pa.DataType = pa.binary()

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        col.check((col.byte_at(0) != ord("\\")) | (col.byte_at(1) != ord("x")), "not hex-format bytea")
        col.check(col.lengths % 2 == 1, "odd number of hex digits")
        digits = col.drop_prefix(2)
        nibbles = HEX_VALUES[digits.data]
        if (nibbles < 0).any():
            position = int(np.flatnonzero(nibbles < 0)[0])
            raise col.bad_value(int(np.searchsorted(digits.offsets, position, "right") - 1), "bad hex digit")
        data = (nibbles[0::2] << 4 | nibbles[1::2]).astype(np.uint8)
        return ConvertedColumn(binary_array(digits.offsets // 2, data, col.valid))

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        return ConvertedColumn(col.binaries())

    def render(self, values: pa.Array) -> list[str | None]:
        return [None if v is None else "\\x" + v.hex() for v in values.to_pylist()]


_UUID_DASHES = np.array([8, 13, 18, 23])
_UUID_HEX = np.setdiff1d(np.arange(36), _UUID_DASHES)


@dataclass(slots=True)
class UuidCodec(ScalarCodec):
    """uuid: canonical lower-case text; binary is 16 bytes."""

    name: str = "uuid"
    arrow_type: pa.DataType = pa.string()

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        chars = col.fixed(36)
        nibbles = HEX_VALUES[chars[:, _UUID_HEX]]
        bad = (chars[:, _UUID_DASHES] != ord("-")).any(axis=1) | (nibbles < 0).any(axis=1)
        col.check(bad, "not a uuid")
        return self._format(col, (nibbles[:, 0::2] << 4 | nibbles[:, 1::2]).astype(np.uint8))

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        return self._format(col, col.fixed(16))

    def _format(self, col: RawColumn, octets: np.ndarray) -> ConvertedColumn:
        chars = np.full((len(col), 36), ord("-"), np.uint8)
        chars[:, _UUID_HEX[0::2]] = HEX_DIGITS[octets >> 4]
        chars[:, _UUID_HEX[1::2]] = HEX_DIGITS[octets & 15]
        offsets = np.arange(len(col) + 1, dtype=np.int64) * 36
        return ConvertedColumn(binary_array(offsets, chars.ravel(), col.valid, pa.string()))

    def render(self, values: pa.Array) -> list[str | None]:
        rendered: list[str | None] = values.to_pylist()
        return rendered
