"""The row splitter a binary copy runs on, chosen once at import: the C module (``_copy_rows.c``)
where ``pip install`` could build it, else the pure Python one (``rows_in_python.py``), which
splits the same rows into the same arrays at a lower rate (``BENCHMARKS.md``).
``CDC_ASSETS_COPY_ROWS=c`` or ``=python`` chooses by hand (copy workers inherit it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol

from psycopg import pq

from cdc_assets.errors import CdcError
from cdc_assets.source import rows_in_python
from cdc_assets.source.libpq import copy_functions
from cdc_assets.source.rows_in_python import RECEIVE_LIMIT, RECEIVE_WAIT, ColumnBuffers

__all__ = ["PATH", "PATHS", "RECEIVE_LIMIT", "RECEIVE_WAIT", "SPLIT_IN", "RowSplitter"]

ENV = "CDC_ASSETS_COPY_ROWS"


class RowSplitter(Protocol):
    """Binary COPY messages split into one binary column each, a block at a time."""

    @property
    def rows(self) -> int: ...
    def add_message(self, message: bytes | bytearray | memoryview, /) -> None: ...
    def receive(self, pgconn: pq.abc.PGconn, max_rows: int, max_bytes: int, /) -> int: ...
    def take(self) -> list[ColumnBuffers]: ...


PATHS: dict[str, Callable[[int], RowSplitter]] = {}
"""The paths this install has, by name, the preferred first."""

try:
    from cdc_assets.source import _copy_rows
except ImportError:  # built without a C compiler
    pass
else:

    class _CRowSplitter:
        """``_copy_rows.RowSplitter``, receiving through the libpq of ``pgconn``'s own library."""

        __slots__ = ("_splitter",)

        def __init__(self, columns: int) -> None:
            self._splitter = _copy_rows.RowSplitter(columns)

        @property
        def rows(self) -> int:
            return self._splitter.rows

        def add_message(self, message: bytes | bytearray | memoryview, /) -> None:
            self._splitter.add_message(message)

        def receive(self, pgconn: pq.abc.PGconn, max_rows: int, max_bytes: int, /) -> int:
            functions = copy_functions()
            return self._splitter.receive(
                pgconn.pgconn_ptr,  # type: ignore[attr-defined]  # every implementation has it; the protocol class does not
                functions.get_copy_data,
                functions.free_mem,
                max_rows,
                max_bytes,
            )

        def take(self) -> list[ColumnBuffers]:
            return list(self._splitter.take())

    PATHS["c"] = _CRowSplitter
PATHS["python"] = rows_in_python.RowSplitter


def _chosen() -> str:
    wanted = os.environ.get(ENV)
    if wanted is None:
        return next(iter(PATHS))
    if wanted not in PATHS:
        raise CdcError(f"{ENV}={wanted!r}: this install's binary copy paths are {', '.join(PATHS)}")
    return wanted


PATH = _chosen()
"""The path copies take in this process: ``c`` or ``python``."""

SPLIT_IN = {"c": "rows split in C", "python": "rows split in pure Python"}[PATH]
"""Which path the copies take, as the copy's progress lines say it."""
