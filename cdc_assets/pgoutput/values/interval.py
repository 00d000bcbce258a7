"""interval -> month_day_nano_interval.

Binary values (Int64 µs, Int32 days, Int32 months) are converted vectorized. Text values in
``IntervalStyle=postgres`` (``1 year 2 mons 3 days 04:05:06.5``, ``-1 days +02:03:04``) are parsed
once per distinct text. PostgreSQL 17's ±infinity and time parts whose nanoseconds overflow int64
are special.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_assets.pgoutput.values.base import ConvertedColumn, ScalarCodec
from cdc_assets.pgoutput.values.calendar import (
    INT32_MAX,
    INT32_MIN,
    INT64_MAX,
    INT64_MIN,
    US_PER_SECOND,
)
from cdc_assets.pgoutput.values.raw import RawColumn, validity_buffer

MAX_MICROS = INT64_MAX // 1000  # beyond this, µs * 1000 does not fit int64 nanoseconds
_MONTH_DAY_NANO = np.dtype([("months", "<i4"), ("days", "<i4"), ("nanos", "<i8")])
_NUMBER = re.compile(r"[+-]?[0-9]+")
_TIME = re.compile(r"([+-]?)([0-9]+):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,6}))?")
_UNITS = (("year", "years", 12), ("mon", "mons", 1), ("day", "days", 0))  # order and months each


def parse_interval(text: str) -> tuple[int, int, int] | None:
    """Postgres-style interval text -> (months, days, µs); None for ±infinity."""
    if text in ("infinity", "-infinity"):
        return None
    months = days = micros = 0
    tokens = text.split(" ")
    unit_index = 0
    position = 0
    while position < len(tokens):
        token = tokens[position]
        time = _TIME.fullmatch(token)
        if time is not None and position == len(tokens) - 1:
            sign, hours, minutes, seconds, fraction = time.groups()
            if int(minutes) > 59 or int(seconds) > 59:
                raise ValueError("time part out of range")
            micros = (int(hours) * 3600 + int(minutes) * 60 + int(seconds)) * US_PER_SECOND
            micros += int((fraction or "").ljust(6, "0"))
            micros = -micros if sign == "-" else micros
            position += 1
            continue
        if _NUMBER.fullmatch(token) is None or position + 1 >= len(tokens):
            raise ValueError("not a postgres-style interval")
        unit = tokens[position + 1]
        while unit_index < len(_UNITS) and unit not in _UNITS[unit_index][:2]:
            unit_index += 1
        if unit_index == len(_UNITS):
            raise ValueError(f"unexpected interval unit {unit!r}")
        if _UNITS[unit_index][2]:
            months += int(token) * _UNITS[unit_index][2]
        else:
            days = int(token)
        unit_index += 1
        position += 2
    if not (INT32_MIN <= months <= INT32_MAX and INT32_MIN <= days <= INT32_MAX):
        raise ValueError("not a postgres-style interval")
    return months, days, micros


def format_interval(months: int, days: int, micros: int) -> str:
    """interval_out with IntervalStyle=postgres (EncodeInterval, INTSTYLE_POSTGRES)."""
    years = abs(months) // 12 * (-1 if months < 0 else 1)
    parts: list[str] = []
    is_before = False
    for value, unit in ((years, "year"), (months - years * 12, "mon"), (days, "day")):
        if value:
            parts.append(f"{'+' if is_before and value > 0 else ''}{value} {unit}{'' if value == 1 else 's'}")
            is_before = value < 0
    if not parts or micros:
        seconds, fraction = divmod(abs(micros), US_PER_SECOND)
        sign = "-" if micros < 0 else ("+" if is_before else "")
        clock = f"{sign}{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
        parts.append(f"{clock}.{fraction:06d}".rstrip("0") if fraction else clock)
    return " ".join(parts)


@dataclass(slots=True)
class IntervalCodec(ScalarCodec):
    name: str = "interval"
    arrow_type: pa.DataType = pa.month_day_nano_interval()

    def from_text(self, col: RawColumn) -> ConvertedColumn:
        encoded = pc.dictionary_encode(col.strings())
        texts = encoded.dictionary.to_pylist()
        indices = encoded.indices.fill_null(0).to_numpy()
        parsed = np.zeros(len(texts), _MONTH_DAY_NANO)
        special_texts = np.zeros(len(texts), bool)
        for index, text in enumerate(texts):
            try:
                value = parse_interval(text)
            except ValueError as exc:
                raise col.bad_value(
                    int(np.argmax(col.valid & (indices == index))), f"not a valid interval ({exc})"
                ) from None
            if value is None or abs(value[2]) > MAX_MICROS:
                special_texts[index] = True
            else:
                parsed[index] = (value[0], value[1], value[2] * 1000)
        special_rows = col.valid & special_texts[indices]
        special = {int(row): texts[indices[row]] for row in np.flatnonzero(special_rows)}
        return self._build(col, parsed[indices], special_rows, special)

    def from_binary(self, col: RawColumn) -> ConvertedColumn:
        raw = col.fixed(16)
        micros = np.ascontiguousarray(raw[:, :8]).view(">i8")[:, 0].astype(np.int64)
        days, months = np.ascontiguousarray(raw[:, 8:]).view(">i4").astype(np.int32).T
        infinite = ((micros == INT64_MAX) & (days == INT32_MAX) & (months == INT32_MAX)) | (
            (micros == INT64_MIN) & (days == INT32_MIN) & (months == INT32_MIN)
        )
        special_rows = col.valid & (infinite | (np.abs(np.where(infinite, 0, micros)) > MAX_MICROS))
        special = {
            int(row): (
                ("infinity" if micros[row] > 0 else "-infinity")
                if infinite[row]
                else format_interval(int(months[row]), int(days[row]), int(micros[row]))
            )
            for row in np.flatnonzero(special_rows)
        }
        values = np.zeros(len(col), _MONTH_DAY_NANO)
        values["months"], values["days"] = months, days
        values["nanos"] = np.where(special_rows, 0, micros) * 1000
        return self._build(col, values, special_rows, special)

    def _build(
        self, col: RawColumn, values: np.ndarray, special_rows: np.ndarray, special: dict[int, str]
    ) -> ConvertedColumn:
        valid = col.valid & ~special_rows
        array = pa.Array.from_buffers(self.arrow_type, len(col), [validity_buffer(valid), pa.py_buffer(values)])
        return ConvertedColumn(array, special)

    def render(self, values: pa.Array) -> list[str | None]:
        return [
            None if v is None else format_interval(v.months, v.days, v.nanoseconds // 1000) for v in values.to_pylist()
        ]
