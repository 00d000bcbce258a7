"""Proleptic Gregorian calendar arithmetic and PostgreSQL's ISO date/time text, per value.

Only the rare values go through here — BC dates, years past 9999, infinities, seconds-precision
zone offsets — and the text of special values rebuilt from binary input. Years are astronomical
(1 BC = 0); PostgreSQL prints them as ``0001 … BC``.
"""

from __future__ import annotations

import re

UNIX_DAYS_AT_PG_EPOCH = 10_957  # 2000-01-01 in days since 1970-01-01
US_PER_SECOND = 1_000_000
US_PER_DAY = 86_400 * US_PER_SECOND
UNIX_US_AT_PG_EPOCH = UNIX_DAYS_AT_PG_EPOCH * US_PER_DAY

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

_DATE = r"(\d{4,})-(\d\d)-(\d\d)"
_CLOCK = r"(\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?"
_OFFSET = r"([+-])(\d\d)(?::(\d\d))?(?::(\d\d))?"
DATE_PATTERN = re.compile(rf"{_DATE}( BC)?")
TIMESTAMP_PATTERN = re.compile(rf"{_DATE} {_CLOCK}( BC)?")
TIMESTAMPTZ_PATTERN = re.compile(rf"{_DATE} {_CLOCK}{_OFFSET}( BC)?")


def days_from_civil(year: int, month: int, day: int) -> int:
    """Days since 1970-01-01 of an astronomical-year date; ValueError if it does not exist."""
    shifted = year - (month <= 2)
    era = shifted // 400
    year_of_era = shifted - era * 400
    day_of_year = (153 * (month + (-3 if month > 2 else 9)) + 2) // 5 + day - 1
    days = era * 146_097 + year_of_era * 365 + year_of_era // 4 - year_of_era // 100 + day_of_year - 719_468
    if not (1 <= month <= 12 and 1 <= day <= 31) or civil_from_days(days) != (year, month, day):
        raise ValueError(f"no such date: {year}-{month}-{day}")
    return days


def civil_from_days(days: int) -> tuple[int, int, int]:
    """(astronomical year, month, day) of days since 1970-01-01."""
    days += 719_468
    era = days // 146_097
    day_of_era = days - era * 146_097
    year_of_era = (day_of_era - day_of_era // 1460 + day_of_era // 36_524 - day_of_era // 146_096) // 365
    day_of_year = day_of_era - (365 * year_of_era + year_of_era // 4 - year_of_era // 100)
    shifted_month = (5 * day_of_year + 2) // 153
    day = day_of_year - (153 * shifted_month + 2) // 5 + 1
    month = shifted_month + (3 if shifted_month < 10 else -9)
    return year_of_era + era * 400 + (month <= 2), month, day


def parse_date(text: str) -> int | None:
    """date text -> days since 1970-01-01; ±infinity -> the int32 sentinels."""
    if text in ("infinity", "-infinity"):
        return INT32_MAX if text == "infinity" else INT32_MIN
    match = DATE_PATTERN.fullmatch(text)
    if match is None:
        raise ValueError("not a date")
    year, month, day, bc = match.groups()
    return days_from_civil(_astronomical(int(year), bc), int(month), int(day))


def parse_timestamp(text: str, with_zone: bool) -> int | None:
    """timestamp(tz) text -> µs since 1970-01-01 UTC; ±infinity -> the int64 sentinels; None when
    the instant is beyond what int64 microseconds can hold."""
    if text in ("infinity", "-infinity"):
        return INT64_MAX if text == "infinity" else INT64_MIN
    match = (TIMESTAMPTZ_PATTERN if with_zone else TIMESTAMP_PATTERN).fullmatch(text)
    if match is None:
        raise ValueError("not a timestamp with time zone" if with_zone else "not a timestamp")
    year, month, day, hour, minute, second, fraction = match.groups()[:7]
    offset = offset_seconds(*match.groups()[7:11]) if with_zone else 0
    days = days_from_civil(_astronomical(int(year), match.groups()[-1]), int(month), int(day))
    micros = (days * 86_400 + clock_seconds(hour, minute, second) - offset) * US_PER_SECOND
    micros += int((fraction or "").ljust(6, "0"))
    return micros if INT64_MIN < micros < INT64_MAX else None


def clock_seconds(hour: str, minute: str, second: str) -> int:
    if int(hour) > 24 or int(minute) > 59 or int(second) > 59:
        raise ValueError("time out of range")
    return int(hour) * 3600 + int(minute) * 60 + int(second)


def offset_seconds(sign: str, hours: str, minutes: str | None, seconds: str | None) -> int:
    """A ``+HH[:MM[:SS]]`` zone offset in seconds east of UTC."""
    value = int(hours) * 3600 + int(minutes or 0) * 60 + int(seconds or 0)
    return -value if sign == "-" else value


def _astronomical(year: int, bc: str | None) -> int:
    if year == 0:
        raise ValueError("year 0 does not exist")
    return 1 - year if bc else year


def format_date(days: int) -> str:
    """date_out: ``YYYY-MM-DD``, `` BC`` for years ≤ 0, ±infinity for the sentinels."""
    if days in (INT32_MAX, INT32_MIN):
        return "infinity" if days == INT32_MAX else "-infinity"
    year, month, day = civil_from_days(days)
    return f"{_era_year(year):04d}-{month:02d}-{day:02d}" + (" BC" if year <= 0 else "")


def format_clock(micros: int) -> str:
    """``HH:MM:SS`` plus the fraction without trailing zeros (µs of the day, 24:00:00 allowed)."""
    seconds, fraction = divmod(micros, US_PER_SECOND)
    text = f"{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"
    return f"{text}.{fraction:06d}".rstrip("0") if fraction else text


def format_offset(seconds_east: int) -> str:
    """EncodeTimezone: ``+HH``, ``+HH:MM`` or ``+HH:MM:SS``."""
    sign = "-" if seconds_east < 0 else "+"
    hours, rest = divmod(abs(seconds_east), 3600)
    minutes, seconds = divmod(rest, 60)
    text = f"{sign}{hours:02d}"
    if minutes or seconds:
        text += f":{minutes:02d}"
    return text + f":{seconds:02d}" if seconds else text


def format_timestamp(micros: int, with_zone: bool) -> str:
    """timestamp(tz)_out under DateStyle=ISO and TimeZone=UTC for µs since 1970-01-01."""
    if micros in (INT64_MAX, INT64_MIN):
        return "infinity" if micros == INT64_MAX else "-infinity"
    days, clock = divmod(micros, US_PER_DAY)
    year, month, day = civil_from_days(days)
    zone = "+00" if with_zone else ""
    era = " BC" if year <= 0 else ""
    return f"{_era_year(year):04d}-{month:02d}-{day:02d} {format_clock(clock)}{zone}{era}"


def _era_year(year: int) -> int:
    return year if year > 0 else 1 - year
