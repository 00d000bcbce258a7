"""Splitting binary COPY rows into columns (``cdc_assets/source/binary_copy.py``), on rows built by
hand: values and NULLs in place, and malformed rows refused with the row named. The real server's
rows are checked in ``tests/test_parallel_copy.py`` and ``tests/test_source.py``."""

from __future__ import annotations

import struct

import pytest

from cdc_assets.errors import DecodeError
from cdc_assets.source.binary_copy import SIGNATURE, _header_size, split_rows


def row(*fields: bytes | None, count: int | None = None) -> bytes:
    """One binary COPY row: the field count, then each field's length (-1: NULL) and bytes."""
    parts = [struct.pack("!h", len(fields) if count is None else count)]
    for value in fields:
        parts.append(struct.pack("!i", -1) if value is None else struct.pack("!i", len(value)) + value)
    return b"".join(parts)


def split(rows: list[bytes], columns: int) -> list[list[bytes | None]]:
    return [column.to_pylist() for column in split_rows(bytearray(b"".join(rows)), [len(r) for r in rows], columns)]


def test_rows_split_into_columns_with_nulls() -> None:
    rows = [row(b"\x00\x00\x00\x01", b"abc"), row(None, b""), row(b"\xff" * 4, None), row(b"\x80" * 4, b"x" * 300)]
    assert split(rows, 2) == [
        [b"\x00\x00\x00\x01", None, b"\xff" * 4, b"\x80" * 4],
        [b"abc", b"", None, b"x" * 300],
    ]
    assert split([row(), row()], 0) == []


@pytest.mark.parametrize(
    ("rows", "reason"),
    [
        ([row(b"a", b"b"), row(b"a", b"b", b"c")], "a row with 3 fields, expected 2 (row 2 of the block)"),
        ([row(b"a", b"b"), row(b"a", b"b")[:-1]], "column 2's value does not fit the row (row 2"),
        ([row(b"a", b"b") + b"\x00"], "the row's end does not fit the row (row 1"),
        ([row(b"a", b"b")[:5]], "column 1's length does not fit the row (row 1"),
        ([row(b"a", b"b")[:6]], "column 1's value does not fit the row (row 1"),
        ([b"\x00"], "a row shorter than its field count (row 1"),
        ([struct.pack("!hi", 2, -2)], "column 1 has a negative length (row 1"),
    ],
)
def test_malformed_rows_are_refused(rows: list[bytes], reason: str) -> None:
    with pytest.raises(DecodeError, match="malformed binary COPY data") as failure:
        split(rows, 2)
    assert reason in str(failure.value)


def test_header() -> None:
    header = SIGNATURE + struct.pack("!ii", 0, 4) + b"extn"
    assert _header_size(bytearray(header + row(b"a"))) == len(header)
    for bad in (b"PGCOPY\n\xff\r\n\x01" + bytes(8), SIGNATURE + struct.pack("!ii", 1 << 16, 0), SIGNATURE[:5]):
        with pytest.raises(DecodeError, match="header"):
            _header_size(bytearray(bad))
