"""numeric: decimal128 when the typmod fits, else the exact text.

Binary values (``numeric_send``: Int16 ndigits, weight, sign, dscale, then base-10000 digits) go
straight to int64 unscaled values for decimal128 columns of precision ≤ 18; otherwise they are
rendered, vectorized, to the text ``numeric_out`` prints (dscale digits kept) and take the text path.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_assets.pgoutput.values.base import ConvertedColumn, ScalarCodec
from cdc_assets.pgoutput.values.raw import (
    RawColumn,
    big_endian,
    binary_array,
    null_where,
    validity_buffer,
)

MAX_DECIMAL128_PRECISION = 38
MAX_INT64_PRECISION = 18

_POSITIVE, _NEGATIVE = 0x0000, 0x4000
_SPECIAL_SIGNS = {0xC000: "NaN", 0xD000: "Infinity", 0xF000: "-Infinity"}
_SPECIAL_TEXTS = frozenset(_SPECIAL_SIGNS.values())
_MAX_DSCALE = 0x3FFF
_TEXT_PATTERN = r"^(-?[0-9]+(\.[0-9]+)?|NaN|-?Infinity)$"

# Base-10000 digit -> its four ASCII decimal digits; two more rows for the sign and dot slots.
_SLOT_CHARS = np.vstack(
    [np.arange(10000)[:, None] // np.array([1000, 100, 10, 1]) % 10 + ord("0"), [[ord("-")] * 4], [[ord(".")] * 4]]
).astype(np.uint8)
_SIGN_SLOT, _DOT_SLOT = 10000, 10001
_POWERS_OF_TEN = 10 ** np.arange(MAX_INT64_PRECISION + 1, dtype=np.int64)
_KEEP = (np.arange(4) >= np.arange(25)[:, None] // 5) & (np.arange(4) < np.arange(25)[:, None] % 5)


def numeric_typmod(type_modifier: int) -> tuple[int, int] | None:
    """(precision, scale) of a numeric typmod, None when unconstrained.

    The scale is an 11-bit signed field since PostgreSQL 15 (numeric.c ``NUMERIC_TYPMOD_SCALE``).
    """
    if type_modifier < 4:
        return None
    packed = type_modifier - 4
    return (packed >> 16) & 0xFFFF, ((packed & 0x7FF) ^ 1024) - 1024


def numeric_arrow_type(type_modifier: int) -> pa.DataType:
    """decimal128(p, s) for 0 ≤ s ≤ p ≤ 38, else string."""
    typmod = numeric_typmod(type_modifier)
    if typmod is not None and 0 <= typmod[1] <= typmod[0] <= MAX_DECIMAL128_PRECISION:
        return pa.decimal128(*typmod)
    return pa.string()


@dataclass(slots=True)
class NumericCodec(ScalarCodec):
    """numeric -> decimal128(p, s) (NaN is special) or, when the typmod does not fit, its text."""

    name: str
    arrow_type: pa.DataType

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        strings = col.strings()
        first, second = col.byte_at(0), col.byte_at(1)
        special = col.valid & ((first == ord("N")) | (first == ord("I")) | ((first == ord("-")) & (second == ord("I"))))
        for index in np.flatnonzero(special):
            if col.text(int(index)) not in _SPECIAL_TEXTS:
                raise col.bad_value(int(index), "not a valid numeric")
        if not pa.types.is_decimal(self.arrow_type):
            valid = pc.match_substring_regex(strings, _TEXT_PATTERN).fill_null(True)
            col.check(~valid.to_numpy(zero_copy_only=False), "not a valid numeric")
        return self._from_strings(col, strings, special)

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        sent = NumericSend.parse(col)
        if pa.types.is_decimal(self.arrow_type) and self.arrow_type.precision <= MAX_INT64_PRECISION:
            return sent.small_decimals(col, self.arrow_type)
        return self._from_strings(col, *sent.text(col))

    def _from_strings(self, col: RawColumn, strings: pa.StringArray, special: np.ndarray) -> ConvertedColumn:
        if not pa.types.is_decimal(self.arrow_type):
            return ConvertedColumn(strings)
        decimals = col.cast(null_where(strings, special), self.arrow_type)
        return ConvertedColumn(decimals, {int(r): strings[int(r)].as_py() for r in np.flatnonzero(special)})

    def render(self, values: pa.Array) -> list[str | None]:
        if pa.types.is_decimal(self.arrow_type):
            return [None if v is None else format(v, "f") for v in values.to_pylist()]
        rendered: list[str | None] = values.to_pylist()
        return rendered


@dataclass(slots=True)
class NumericSend:
    """The validated numeric_send headers of a column's values; arrays run over ``rows``, the
    rows with a value."""

    rows: np.ndarray
    ndigits: np.ndarray
    weight: np.ndarray
    sign: np.ndarray
    dscale: np.ndarray
    digits: np.ndarray  # every row's base-10000 digits, one after another

    @classmethod
    def parse(cls, col: RawColumn) -> NumericSend:
        col.check(col.lengths < 8, "numeric shorter than its 8-byte header")
        rows = np.flatnonzero(col.valid)
        starts = col.starts[rows]
        ndigits, weight, dscale = (big_endian(col.data, starts + at, 2) for at in (0, 2, 6))
        sign = big_endian(col.data, starts + 4, 2, signed=False)
        bad = np.zeros(len(col), bool)
        bad[rows] = (ndigits < 0) | (col.lengths[rows] != 8 + 2 * ndigits)
        col.check(bad, "numeric length does not match its digit count")
        bad[rows] = (dscale < 0) | (dscale > _MAX_DSCALE) | ~np.isin(sign, [_POSITIVE, _NEGATIVE, *_SPECIAL_SIGNS])
        col.check(bad, "bad numeric sign or scale")
        first = np.cumsum(ndigits) - ndigits
        at = np.repeat(starts + 8 - 2 * first, ndigits) + 2 * np.arange(int(ndigits.sum()))
        digits = big_endian(col.data, at, 2, signed=False)
        if (digits >= 10000).any():
            raise col.bad_value(int(np.repeat(rows, ndigits)[np.argmax(digits >= 10000)]), "numeric digit out of range")
        return cls(rows, ndigits, weight, sign, dscale, digits)

    @property
    def special(self) -> np.ndarray:
        return np.isin(self.sign, list(_SPECIAL_SIGNS))

    def special_texts(self) -> list[str]:
        return [_SPECIAL_SIGNS[s] for s in self.sign[self.special]]

    def small_decimals(self, col: RawColumn, arrow_type: pa.Decimal128Type) -> ConvertedColumn:
        """decimal128 of precision ≤ 18 from int64 unscaled values: the sum over digits of
        digit × 10^(4·(weight − i) + scale). A digit that does not fit the precision, or fraction
        digits beyond the scale, raise."""
        special = self.special
        finite = ~special
        precision, scale = arrow_type.precision, arrow_type.scale
        # One row per digit position, one column per value (NaN and ±Infinity have no digits).
        matrix = np.zeros((int(self.ndigits.max(initial=0)), self.rows.size), np.int64)
        first = np.cumsum(self.ndigits) - self.ndigits
        position = np.arange(self.digits.size) - np.repeat(first, self.ndigits)
        matrix[position, np.repeat(np.arange(self.rows.size), self.ndigits)] = self.digits
        exponent = 4 * (self.weight - np.arange(matrix.shape[0])[:, None]) + scale
        power = _POWERS_OF_TEN.take(np.minimum(np.abs(exponent), MAX_INT64_PRECISION))
        whole = exponent >= 0
        size = 1 + (matrix >= 10).view(np.int8) + (matrix >= 100).view(np.int8) + (matrix >= 1000).view(np.int8)
        bad = ((matrix != 0) & (exponent + size > precision)) | (~whole & (matrix % power != 0))
        terms = np.where(whole, matrix * power, matrix // power)
        terms[bad] = 0
        unscaled = terms.sum(axis=0)[finite]
        bad = bad.any(axis=0)
        rows = self.rows[finite]
        if bad.any():
            raise col.bad_value(
                int(self.rows[np.argmax(bad)]), f"numeric value does not fit numeric({precision},{scale})"
            )
        unscaled = np.where(self.sign[finite] == _NEGATIVE, -unscaled, unscaled)
        words = np.zeros((len(col), 2), np.int64)  # little-endian 128-bit two's complement
        words[rows, 0], words[rows, 1] = unscaled, unscaled >> 63
        valid = col.valid.copy()
        valid[self.rows[special]] = False
        array = pa.Array.from_buffers(arrow_type, len(col), [validity_buffer(valid), pa.py_buffer(words)])
        return ConvertedColumn(array, dict(zip(self.rows[special].tolist(), self.special_texts(), strict=True)))

    def text(self, col: RawColumn) -> tuple[pa.StringArray, np.ndarray]:
        """The values as numeric_out text, and the mask of NaN/±Infinity rows.

        Each finite value is printed as a run of four-character slots — a sign slot, its integer
        base-10000 groups, a dot slot, its fraction groups — and each slot keeps a range of its
        characters: the sign only when negative, the first group without leading zeros, the
        fraction up to dscale digits.
        """
        n = len(col)
        special = self.special
        finite = ~special
        f_rows = self.rows[finite]
        f_weight, f_dscale, f_ndigits = (a[finite].astype(np.int32) for a in (self.weight, self.dscale, self.ndigits))
        top = np.maximum(f_weight, 0)  # the most significant group printed; weight < 0 prints "0"
        int_groups = top + 1
        slots = int_groups + (f_dscale + 3) // 4 + 2
        first_slot = np.cumsum(slots) - slots
        slot = np.arange(int(slots.sum()), dtype=np.int32) - np.repeat(first_slot, slots)
        group = slot - 1 - (slot > np.repeat(int_groups + 1, slots))  # int groups from 0, then fraction groups
        digit = group + np.repeat(f_weight - top, slots)
        stored = (digit >= 0) & (digit < np.repeat(f_ndigits, slots)) & (slot != 0)
        stored[first_slot + int_groups + 1] = False  # the dot slot
        position = np.repeat(col.starts[f_rows] + 8, slots)[stored] + 2 * digit[stored]
        value = np.zeros(slot.size, np.int16)
        value[stored] = col.data[position].astype(np.int16) << 8 | col.data[position + 1]
        lead = 3 - (value[first_slot + 1] >= 10) - (value[first_slot + 1] >= 100) - (value[first_slot + 1] >= 1000)
        value[first_slot], value[first_slot + int_groups + 1] = _SIGN_SLOT, _DOT_SLOT

        # Each slot keeps its characters low..high-1; the 25 (low, high) pairs index _KEEP.
        fraction_digits = np.repeat(f_dscale, slots) - 4 * (group - np.repeat(int_groups, slots))
        high = np.where(group < np.repeat(int_groups, slots), 4, np.clip(fraction_digits, 0, 4)).astype(np.int8)
        low = np.zeros(slot.size, np.int8)
        low[first_slot + 1] = lead
        low[first_slot], high[first_slot] = 3, 3 + (self.sign[finite] == _NEGATIVE)
        low[first_slot + int_groups + 1], high[first_slot + int_groups + 1] = 3, 3 + (f_dscale > 0)
        lengths = np.zeros(n, np.int64)
        lengths[f_rows] = np.add.reduceat((high - low).astype(np.int64), first_slot) if f_rows.size else 0
        offsets = np.zeros(n + 1, np.int64)
        np.cumsum(lengths, out=offsets[1:])
        strings = binary_array(offsets, _SLOT_CHARS[value][_KEEP[low * 5 + high]], col.valid, pa.string())

        special_rows = np.zeros(n, bool)
        special_rows[self.rows[special]] = True
        if special.any():
            strings = pc.replace_with_mask(strings, pa.array(special_rows), pa.array(self.special_texts(), pa.string()))
        return strings, special_rows
