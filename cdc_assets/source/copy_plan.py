"""What a parallel copy does: a table split into ``ctid`` block ranges, and the tasks — one range of
one table each — that the workers (:mod:`cdc_assets.source.copy_workers`) hand to a
:class:`RangeCopier` (see :mod:`cdc_assets.source.parallel_copy`)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol, TypeVar

import pyarrow as pa

from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.source.binary_copy import CopySelect

RANGE_BLOCKS_MIN = 256
"""Blocks (2 MiB of 8 kB pages) below which a range is not worth its own query."""
RANGE_BLOCKS_MAX = 8_192
"""Blocks (64 MiB) a range holds at most, so that workers finish close together."""
RANGES_PER_WORKER = 4


@dataclass(slots=True, frozen=True)
class BlockRange:
    """Blocks ``[start, end)`` of a table's heap; ``None`` leaves that side open."""

    start: int | None
    end: int | None

    @property
    def condition(self) -> str:
        """The ``WHERE`` condition selecting the range's rows (empty: the whole table)."""
        bounds = []
        if self.start is not None:
            bounds.append(f"ctid >= '({self.start},0)'::tid")
        if self.end is not None:
            bounds.append(f"ctid < '({self.end},0)'::tid")
        return " AND ".join(bounds)


def block_ranges(blocks: int, workers: int) -> list[BlockRange]:
    """Split ``blocks`` into about ``RANGES_PER_WORKER`` ranges per worker, each between
    :data:`RANGE_BLOCKS_MIN` and :data:`RANGE_BLOCKS_MAX` blocks (a small table is one range)."""
    count = max(math.ceil(blocks / RANGE_BLOCKS_MAX), min(workers * RANGES_PER_WORKER, blocks // RANGE_BLOCKS_MIN))
    if count <= 1:
        return [BlockRange(None, None)]
    cuts = [blocks * i // count for i in range(1, count)]
    return [BlockRange(start, end) for start, end in zip([None, *cuts], [*cuts, None])]


@dataclass(slots=True, frozen=True)
class TablePlan:
    """How one table is copied: its published columns and how each is sent, what the copy reads,
    and the ranges."""

    relation: RelationSchema
    select: CopySelect
    source: str
    blocks: int
    ranges: tuple[BlockRange, ...]

    def query(self, block_range: BlockRange) -> str:
        return self.select.query(self.source, block_range.condition)

    def blocks_of(self, block_range: BlockRange) -> int:
        """The range's size in blocks (the open last range: up to the planned count)."""
        return (self.blocks if block_range.end is None else block_range.end) - (block_range.start or 0)


@dataclass(slots=True, frozen=True)
class CopyTask:
    """One range of one table; ``number`` is the range's place among the table's ranges."""

    plan: TablePlan
    block_range: BlockRange
    number: int


_R_co = TypeVar("_R_co", covariant=True)
Progress = Callable[[CopyTask, int], None]
"""Called with a range and the rows of each block of it as they are copied."""


class RangeCopier(Protocol[_R_co]):
    """What a worker does with a range's rows: ``blocks`` yields them a block at a time, one
    binary array per column (:func:`~cdc_assets.source.binary_copy.read_columns`). Workers run in
    processes of their own: a copier is picklable, and so is what it returns."""

    def __call__(self, task: CopyTask, blocks: Iterator[list[pa.Array]]) -> _R_co: ...
