"""date, time, timetz, timestamp and timestamptz.

Text values in the common ISO layout go through Arrow's casts (date, timestamps) or a numpy parser
of the fixed ``HH:MM:SS.ffffff`` layout (time, timetz); only rows flagged by byte-level checks as
rare — infinities, BC, years past 9999, seconds-precision zone offsets — are parsed one by one.
Binary values are big-endian integers counted from 2000-01-01, shifted to the Unix epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_assets.pgoutput.values import calendar
from cdc_assets.pgoutput.values.base import ConvertedColumn, ScalarCodec
from cdc_assets.pgoutput.values.calendar import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    US_PER_DAY,
)
from cdc_assets.pgoutput.values.raw import RawColumn, null_where

_DIGIT_WEIGHTS = 10 ** np.arange(5, -1, -1)  # the six fraction digits, as µs


def _with_rare_rows(
    col: RawColumn, common: pa.Array, rare: np.ndarray, parse: Callable[[str], int | None], storage: pa.DataType
) -> ConvertedColumn:
    """Merge ``common`` (the cast of every other row) with the rare rows parsed one by one;
    ``parse`` returns the storage integer, or None for a value the Arrow type cannot hold."""
    rows = np.flatnonzero(rare)
    if rows.size == 0:
        return ConvertedColumn(common)
    values = common.cast(storage).fill_null(0).to_numpy().copy()
    special: dict[int, str] = {}
    for row in rows:
        text = col.text(int(row))
        try:
            value = parse(text)
        except ValueError as exc:
            raise col.bad_value(int(row), f"not a valid {col.type_name} ({exc})") from None
        if value is None:
            special[int(row)] = text
        else:
            values[row] = value
    nulls = np.zeros(len(col), bool)
    nulls[list(special)] = True
    return ConvertedColumn(col.to_arrow(values, common.type, nulls), special)


def _unix_days(pg_days: np.ndarray) -> np.ndarray:
    finite = (pg_days != INT32_MAX) & (pg_days != INT32_MIN)
    return np.where(finite, pg_days + calendar.UNIX_DAYS_AT_PG_EPOCH, pg_days).astype(np.int32)


@dataclass(slots=True)
class DateCodec(ScalarCodec):
    """date -> date32; ±infinity -> int32 max/min."""

    name: str = "date"
    arrow_type: pa.DataType = pa.date32()

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        rare = col.valid & (col.lengths != 10)  # infinity, BC, years past 9999
        strings = col.strings()
        common = col.cast(null_where(strings, rare), self.arrow_type)
        return _with_rare_rows(col, common, rare, calendar.parse_date, pa.int32())

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        days = col.fixed(4).view(">i4")[:, 0].astype(np.int32)
        return ConvertedColumn(col.to_arrow(_unix_days(days), self.arrow_type))

    def render(self, values: pa.Array) -> list[str | None]:
        return [None if v is None else calendar.format_date(v) for v in values.cast(pa.int32()).to_pylist()]


@dataclass(slots=True)
class TimestampCodec(ScalarCodec):
    """timestamp -> timestamp('us'); timestamptz -> timestamp('us', 'UTC'). ±infinity -> int64
    max/min; instants beyond int64 Unix microseconds (after 294247 AD) are special."""

    name: str
    arrow_type: pa.DataType

    @property
    def with_zone(self) -> bool:
        return self.arrow_type.tz is not None

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        first = col.byte_at(0)
        rare = (first == ord("i")) | (first == ord("-")) | (col.byte_at(4) != ord("-"))
        rare |= col.byte_at(1, from_end=True) == ord("C")  # " BC"
        if self.with_zone:  # +HH:MM:SS offsets, which Arrow's cast rejects
            sign = col.byte_at(9, from_end=True)
            rare |= (
                (col.byte_at(3, from_end=True) == ord(":"))
                & (col.byte_at(6, from_end=True) == ord(":"))
                & ((sign == ord("+")) | (sign == ord("-")))
            )
        rare &= col.valid
        strings = col.strings()
        common = col.cast(null_where(strings, rare), self.arrow_type)
        return _with_rare_rows(col, common, rare, self._parse, pa.int64())

    def _parse(self, text: str) -> int | None:
        return calendar.parse_timestamp(text, self.with_zone)

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        pg_micros = col.fixed(8).view(">i8")[:, 0].astype(np.int64)
        infinite = (pg_micros == INT64_MAX) | (pg_micros == INT64_MIN)
        beyond = col.valid & ~infinite & (pg_micros >= INT64_MAX - calendar.UNIX_US_AT_PG_EPOCH)
        unix = pg_micros + np.where(infinite | beyond, 0, calendar.UNIX_US_AT_PG_EPOCH)
        special = {
            int(row): calendar.format_timestamp(int(pg_micros[row]) + calendar.UNIX_US_AT_PG_EPOCH, self.with_zone)
            for row in np.flatnonzero(beyond)
        }
        return ConvertedColumn(col.to_arrow(unix, self.arrow_type, beyond), special)

    def render(self, values: pa.Array) -> list[str | None]:
        micros = values.cast(pa.int64()).to_pylist()
        return [None if v is None else calendar.format_timestamp(v, self.with_zone) for v in micros]


def _parse_clock(col: RawColumn, chars: np.ndarray, length: np.ndarray) -> np.ndarray:
    """µs of the day of ``HH:MM:SS[.f…]`` at the start of each row of ``chars``, ``length`` long."""
    digits = chars.astype(np.int64) - ord("0")
    fraction_used = np.arange(9, 15) < length[:, None]
    is_digit = (digits >= 0) & (digits <= 9)
    bad = (length != 8) & ((length < 10) | (length > 15) | (chars[:, 8] != ord(".")))
    bad |= (chars[:, 2] != ord(":")) | (chars[:, 5] != ord(":")) | ~is_digit[:, [0, 1, 3, 4, 6, 7]].all(axis=1)
    bad |= (fraction_used & ~is_digit[:, 9:15]).any(axis=1)
    hours, minutes, seconds = (digits[:, [i, i + 1]] @ [10, 1] for i in (0, 3, 6))
    micros = (hours * 3600 + minutes * 60 + seconds) * 1_000_000
    micros += np.where(fraction_used, digits[:, 9:15], 0) @ _DIGIT_WEIGHTS
    bad |= (minutes > 59) | (seconds > 59) | (micros > US_PER_DAY)
    col.check(bad, f"not a valid {col.type_name}")
    return micros


@dataclass(slots=True)
class TimeCodec(ScalarCodec):
    """time -> time64('us'); 24:00:00, outside Arrow's range, is special."""

    name: str = "time"
    arrow_type: pa.DataType = pa.time64("us")

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        micros = _parse_clock(col, col.padded(15, ord("0")), col.lengths)
        return self._build(col, micros)

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        micros = col.fixed(8).view(">i8")[:, 0].astype(np.int64)
        col.check((micros < 0) | (micros > US_PER_DAY), "time out of range")
        return self._build(col, micros)

    def _build(self, col: RawColumn, micros: np.ndarray) -> ConvertedColumn:
        midnight = col.valid & (micros == US_PER_DAY)
        special = {int(row): calendar.format_clock(US_PER_DAY) for row in np.flatnonzero(midnight)}
        return ConvertedColumn(col.to_arrow(micros, self.arrow_type, midnight), special)

    def render(self, values: pa.Array) -> list[str | None]:
        return [None if v is None else calendar.format_clock(v) for v in values.cast(pa.int64()).to_pylist()]


TIMETZ_TYPE = pa.struct([pa.field("time", pa.time64("us")), pa.field("utc_offset_seconds", pa.int32())])


@dataclass(slots=True)
class TimeTzCodec(ScalarCodec):
    """timetz -> struct<time, utc_offset_seconds> (seconds east of UTC); 24:00:00 is special."""

    name: str = "timetz"
    arrow_type: pa.DataType = TIMETZ_TYPE

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        chars = col.padded(24, ord("0"))
        signs = (chars[:, 8:16] == ord("+")) | (chars[:, 8:16] == ord("-"))
        col.check(~signs.any(axis=1), "timetz without a zone offset")
        sign_at = 8 + signs.argmax(axis=1)
        micros = _parse_clock(col, chars, sign_at)
        zone = np.take_along_axis(chars, np.minimum(sign_at[:, None] + np.arange(9), 23), axis=1).astype(np.int64)
        zone_length = col.lengths - sign_at
        digits = zone - ord("0")
        is_digit = (digits >= 0) & (digits <= 9)
        bad = ~np.isin(zone_length, [3, 6, 9]) | ~is_digit[:, 1:3].all(axis=1)
        bad |= (zone_length >= 6) & ((zone[:, 3] != ord(":")) | ~is_digit[:, 4:6].all(axis=1))
        bad |= (zone_length == 9) & ((zone[:, 6] != ord(":")) | ~is_digit[:, 7:9].all(axis=1))
        col.check(bad, "bad timetz zone offset")
        hours, minutes, seconds = (digits[:, [i, i + 1]] @ [10, 1] for i in (1, 4, 7))
        offset = hours * 3600 + np.where(zone_length >= 6, minutes * 60, 0) + np.where(zone_length == 9, seconds, 0)
        return self._build(col, micros, np.where(zone[:, 0] == ord("-"), -offset, offset))

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        raw = col.fixed(12)
        micros = np.ascontiguousarray(raw[:, :8]).view(">i8")[:, 0].astype(np.int64)
        west = np.ascontiguousarray(raw[:, 8:]).view(">i4")[:, 0].astype(np.int64)
        col.check((micros < 0) | (micros > US_PER_DAY), "time out of range")
        return self._build(col, micros, -west)

    def _build(self, col: RawColumn, micros: np.ndarray, offset: np.ndarray) -> ConvertedColumn:
        midnight = col.valid & (micros == US_PER_DAY)
        special = {
            int(row): calendar.format_clock(US_PER_DAY) + calendar.format_offset(int(offset[row]))
            for row in np.flatnonzero(midnight)
        }
        nulls = ~col.valid | midnight
        array = pa.StructArray.from_arrays(
            [pa.array(micros, pa.time64("us")), pa.array(offset.astype(np.int32), pa.int32())],
            fields=list(TIMETZ_TYPE),
            mask=pa.array(nulls) if nulls.any() else None,
        )
        return ConvertedColumn(array, special)

    def render(self, values: pa.Array) -> list[str | None]:
        micros = pc.struct_field(values, 0).cast(pa.int64()).to_pylist()
        offsets = pc.struct_field(values, 1).to_pylist()
        valid = values.is_valid().to_pylist()
        return [
            calendar.format_clock(t) + calendar.format_offset(z) if ok else None
            for ok, t, z in zip(valid, micros, offsets, strict=True)
        ]
