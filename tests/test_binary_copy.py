"""Splitting binary COPY messages into columns (``cdc_assets/source/binary_copy.py``), on each
path — C (``_copy_rows.c``) and pure Python (``rows_in_python.py``) — on messages built by hand:
values and NULLs in place, and malformed rows and headers refused with the row named. The real
server's rows are checked in ``tests/test_copy_paths.py``, ``tests/test_parallel_copy.py`` and
``tests/test_source.py``."""

from __future__ import annotations

import struct

import pyarrow as pa
import pytest

from cdc_assets.errors import DecodeError
from cdc_assets.source.binary_copy import CopyRows
from cdc_assets.source.copy_rows import PATHS

SIGNATURE = b"PGCOPY\n\xff\r\n\x00"
HEADER = SIGNATURE + struct.pack("!ii", 0, 0)
TRAILER = b"\xff\xff"


@pytest.fixture(params=list(PATHS))
def path(request: pytest.FixtureRequest) -> str:
    """Each binary copy path this install has (both where the C module is built)."""
    return str(request.param)


def row(*fields: bytes | None, count: int | None = None) -> bytes:
    """One binary COPY row: the field count, then each field's length (-1: NULL) and bytes."""
    parts = [struct.pack("!h", len(fields) if count is None else count)]
    for value in fields:
        parts.append(struct.pack("!i", -1) if value is None else struct.pack("!i", len(value)) + value)
    return b"".join(parts)


def split(rows: list[bytes], columns: int, path: str, header: bytes = HEADER) -> list[pa.Array]:
    """The rows sent as PostgreSQL sends them: the header with the first, the trailer alone."""
    copy = CopyRows(columns, path)
    for message in [header + rows[0], *rows[1:]] if rows else [header + TRAILER]:
        copy.add_message(message)
    if rows:
        copy.add_message(TRAILER)
    assert copy.rows == len(rows)
    return copy.take()


def test_rows_split_into_columns_with_nulls(path: str) -> None:
    rows = [row(b"\x00\x00\x00\x01", b"abc"), row(None, b""), row(b"\xff" * 4, None), row(b"\x80" * 4, b"x" * 300)]
    columns = split(rows, 2, path)
    assert [column.to_pylist() for column in columns] == [
        [b"\x00\x00\x00\x01", None, b"\xff" * 4, b"\x80" * 4],
        [b"abc", b"", None, b"x" * 300],
    ]
    assert [column.null_count for column in columns] == [1, 1]
    assert [column.type for column in columns] == [pa.binary(), pa.binary()]
    assert split([row(), row()], 0, path) == []
    assert [column.to_pylist() for column in split([], 2, path)] == [[], []]


def test_a_block_taken_starts_the_next(path: str) -> None:
    copy = CopyRows(1, path)
    copy.add_message(HEADER + row(b"a"))
    copy.add_message(row(None))
    assert [column.to_pylist() for column in copy.take()] == [[b"a", None]]
    copy.add_message(row(b"bc"))
    assert copy.rows == 1
    assert [column.to_pylist() for column in copy.take()] == [[b"bc"]]


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
        ([row(b"a", b"b"), TRAILER, row(b"a", b"b")], "a message after the trailer (row 2"),
    ],
)
def test_malformed_rows_are_refused(rows: list[bytes], reason: str, path: str) -> None:
    with pytest.raises(DecodeError, match="malformed binary COPY data") as failure:
        split(rows, 2, path)
    assert reason in str(failure.value)


def test_header(path: str) -> None:
    extension = SIGNATURE + struct.pack("!ii", 0, 4) + b"extn"
    assert [column.to_pylist() for column in split([row(b"a")], 1, path, header=extension)] == [[b"a"]]
    for bad in (b"PGCOPY\n\xff\r\n\x01" + bytes(8), SIGNATURE + struct.pack("!ii", 1 << 16, 0), SIGNATURE[:5]):
        with pytest.raises(DecodeError, match="header"):
            split([row(b"a")], 1, path, header=bad)
