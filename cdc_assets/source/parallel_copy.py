"""Copying tables as of an exported snapshot with several connections at once.

Every worker is a :class:`SnapshotReader`: its own connection that imports the same exported
snapshot (REPEATABLE READ, READ ONLY, the pinned settings), so the copy is one consistent moment
however it is split. A table is split into ``ctid`` block ranges (PostgreSQL 14+ runs
``ctid >= '(b,0)' AND ctid < '(e,0)'`` as a TID range scan); the first range has no lower bound
and the last none above, so every row is in exactly one range whatever the table's size. The
block count is that of the largest heap the copy reads: the table, or for a partitioned table
(read through its root, see :func:`~cdc_assets.source.snapshot.copy_source`) its largest leaf —
the ranges then apply to every leaf, one TID range scan each, with the root's privileges. A worker
locks a table before its first range of it, until the worker ends
(:meth:`~cdc_assets.source.snapshot.SnapshotReader.lock`: a table rewritten since the snapshot
fails the copy). Not the planning connection: holding a lock until every worker is done would
deadlock with a TRUNCATE queued between it and a worker's own lock request.

Workers (:mod:`cdc_assets.source.copy_workers`) take tasks — one range of one table, largest
first — in turn and hand each range's rows, a block at a time, to a :class:`RangeCopier` that does
all the rest (convert, write). The caller gets each range's result, and the rows as they come
(``progress``); a worker's error stops the others and is raised in the caller, naming the table.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from types import TracebackType
from typing import TypeVar

from cdc_assets.config import SourceConfig
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.source.binary_copy import CopySelect
from cdc_assets.source.connection import one_row
from cdc_assets.source.copy_plan import CopyTask, Progress, RangeCopier, TablePlan, block_ranges
from cdc_assets.source.copy_workers import WorkerPool
from cdc_assets.source.snapshot import SnapshotReader, copy_source

_R = TypeVar("_R")
_HEAP_BLOCKS = """
SELECT greatest(pg_relation_size(%(oid)s::oid),
                (SELECT max(pg_relation_size(relid)) FROM pg_partition_tree(%(oid)s::oid) WHERE isleaf))
       / current_setting('block_size')::int8"""


class ParallelCopy:
    """``with ParallelCopy(source, snapshot_name, workers) as copy:`` plan tables with
    :meth:`plan`, then iterate :meth:`run` — while the slot-creating connection is open.

    ``copy.reader`` is the planning connection (also a :class:`SnapshotReader`), for catalog
    look-ups in the same snapshot.
    """

    def __init__(self, source: SourceConfig, snapshot_name: str, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.source = source
        self.snapshot_name = snapshot_name
        self.workers = workers
        self._reader: SnapshotReader | None = None

    def __enter__(self) -> ParallelCopy:
        self._reader = SnapshotReader(self.source, self.snapshot_name).__enter__()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._reader is not None:
            self._reader.__exit__(exc_type, exc, tb)
            self._reader = None

    @property
    def reader(self) -> SnapshotReader:
        if self._reader is None:
            raise RuntimeError("ParallelCopy is not open (use it as a context manager)")
        return self._reader

    def plan(self, relation: RelationSchema, binary: Sequence[bool]) -> TablePlan:
        """How to copy ``relation`` (described by :attr:`reader`), its columns sent in binary where
        ``binary`` says so (:class:`CopySelect`), and its block ranges."""
        conn = self.reader.connection
        (blocks,) = one_row(conn.execute(_HEAP_BLOCKS, {"oid": relation.relation_oid}))
        return TablePlan(
            relation,
            CopySelect.of(conn, relation, binary),
            copy_source(conn, relation.table),
            int(blocks),
            tuple(block_ranges(int(blocks), self.workers)),
        )

    def run(
        self, plans: Sequence[TablePlan], copier: RangeCopier[_R], progress: Progress | None = None
    ) -> Iterator[tuple[CopyTask, _R]]:
        """Copy every range of the planned tables with ``copier``; yield each range with what
        ``copier`` returned for it, in the order they finish. Closing the iterator early stops
        the workers."""
        tasks = sorted(
            (CopyTask(plan, r, number) for plan in plans for number, r in enumerate(plan.ranges)),
            key=lambda t: -t.plan.blocks_of(t.block_range),
        )
        pool = WorkerPool(self.source, self.snapshot_name, tasks, copier, progress or _ignore)
        yield from pool.run(min(self.workers, len(tasks)))


def _ignore(task: CopyTask, rows: int) -> None:
    """No progress wanted."""
