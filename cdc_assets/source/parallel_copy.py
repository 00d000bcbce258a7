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

Workers take tasks — one range of one table, largest first — in turn and hand each range's rows, a
block at a time, to a :class:`RangeCopier` that does all the rest (convert, write): a copy costs
the client more CPU than the server, so each worker is a process of its own, which receives,
converts and writes on a core of its own without sharing an interpreter lock. The caller's process
is the first worker: it copies from the start, while the others start (a second or so, most of it
imports). The caller gets each range's result and the rows as they
come (``progress``); a worker's error stops the others and is raised in the caller, naming the
table. On Linux a worker dies with the process that started it, so a killed copy leaves no worker
writing on. Workers are started with ``spawn``: a script that copies needs the usual
``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import pickle
import queue
import signal
import sys
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Any, Generic, Protocol, TypeVar

import psycopg
import pyarrow as pa
from psycopg import errors

from cdc_assets.config import SourceConfig
from cdc_assets.errors import CdcError, DecodeError, SourceError, SourcePermissionError
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.source.binary_copy import CopySelect, read_columns
from cdc_assets.source.connection import one_row
from cdc_assets.source.snapshot import SnapshotReader, copy_source

RANGE_BLOCKS_MIN = 256
"""Blocks (2 MiB of 8 kB pages) below which a range is not worth its own query."""
RANGE_BLOCKS_MAX = 8_192
"""Blocks (64 MiB) a range holds at most, so that workers finish close together."""
RANGES_PER_WORKER = 4

_HEAP_BLOCKS = """
SELECT greatest(pg_relation_size(%(oid)s::oid),
                (SELECT max(pg_relation_size(relid)) FROM pg_partition_tree(%(oid)s::oid) WHERE isleaf))
       / current_setting('block_size')::int8"""


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


_R = TypeVar("_R")
_R_co = TypeVar("_R_co", covariant=True)
Progress = Callable[[CopyTask, int], None]
"""Called with a range and the rows of each block of it as they are copied."""


class RangeCopier(Protocol[_R_co]):
    """What a worker does with a range's rows: ``blocks`` yields them a block at a time, one
    binary array per column (:func:`~cdc_assets.source.binary_copy.read_columns`). Workers run in
    processes of their own: a copier is picklable, and so is what it returns."""

    def __call__(self, task: CopyTask, blocks: Iterator[list[pa.Array]]) -> _R_co: ...


WORKER_POLL_S = 1.0
"""How often the caller looks for a worker that died without a word (killed, out of memory)."""
_PR_SET_PDEATHSIG = 1


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
        pool = _WorkerPool(self, tasks, copier, progress or _ignore)
        yield from pool.run(min(self.workers, len(tasks)))


def copy_range(reader: SnapshotReader, task: CopyTask, copier: RangeCopier[_R], progress: Progress) -> _R:
    """One range, read by ``reader`` (which locks the table first) and given to ``copier``."""
    reader.lock(task.plan.relation)
    return copier(task, _range_blocks(reader.connection, task, progress))


def _range_blocks(conn: psycopg.Connection[Any], task: CopyTask, progress: Progress) -> Iterator[list[pa.Array]]:
    relation = task.plan.relation
    blocks = read_columns(conn, task.plan.query(task.block_range), len(relation.columns))
    try:
        with closing(blocks):  # leaving early cancels the COPY
            for columns in blocks:
                progress(task, len(columns[0]) if columns else 0)
                yield columns
    except errors.InsufficientPrivilege as error:
        raise SourcePermissionError(
            f"cannot copy table {relation.qualified_name}: {error.diag.message_primary or error}"
        ) from None
    except psycopg.Error as error:
        raise SourceError(
            f"cannot copy table {relation.qualified_name}: {error.diag.message_primary or error}"
        ) from None
    except DecodeError as error:
        raise SourceError(f"cannot copy table {relation.qualified_name}: {error}") from None


def _ignore(task: CopyTask, rows: int) -> None:
    """No progress wanted."""


class _WorkerPool(Generic[_R]):
    """The calling process is worker 0; ``count - 1`` worker processes join it once started. Each
    claims the next task by its index from a shared counter; the processes report on a queue:
    ``("rows", index, rows)``, ``("copied", index, result)``, ``("failed", error)``, ``("exit",)``."""

    def __init__(self, copy: ParallelCopy, tasks: list[CopyTask], copier: RangeCopier[_R], progress: Progress) -> None:
        self.copy = copy
        self.tasks = tasks
        self.copier = copier
        self.progress = progress

    def run(self, count: int) -> Iterator[tuple[CopyTask, _R]]:
        context = multiprocessing.get_context("spawn")
        claimed = context.Value("q", 0)
        events: Any = context.Queue()
        workers = [
            context.Process(
                target=_work,
                args=(self.copy.source, self.copy.snapshot_name, self.copier, self.tasks, claimed, events, os.getpid()),
                name=f"cdc-copy-{number}",
                daemon=True,
            )
            for number in range(1, count)
        ]
        try:
            for worker in workers:
                worker.start()
            running = len(workers)
            with SnapshotReader(self.copy.source, self.copy.snapshot_name) as reader:
                while (index := _claim(claimed, len(self.tasks))) is not None:
                    task = self.tasks[index]
                    yield task, copy_range(reader, task, self.copier, self.progress)
                    for event in _waiting(events):
                        running -= yield from self._handle(event)
            while running:
                try:
                    event = events.get(timeout=WORKER_POLL_S)
                except queue.Empty:
                    self._check_alive(workers)
                    continue
                running -= yield from self._handle(event)
        finally:
            for worker in workers:
                if worker.is_alive():
                    worker.terminate()
            for worker in workers:
                if worker.pid is not None:
                    worker.join()
            events.cancel_join_thread()
            events.close()

    def _handle(self, event: tuple[Any, ...]) -> Generator[tuple[CopyTask, _R], None, int]:
        """Act on a worker's report; return 1 when it says the worker has ended."""
        if event[0] == "rows":
            self.progress(self.tasks[event[1]], event[2])
        elif event[0] == "copied":
            yield self.tasks[event[1]], event[2]
        elif event[0] == "failed":
            raise event[1]
        return int(event[0] == "exit")

    def _check_alive(self, workers: Sequence[BaseProcess]) -> None:
        for worker in workers:
            if worker.exitcode is not None and worker.exitcode != 0:
                raise SourceError(
                    f"copy worker {worker.name} (pid {worker.pid}) of replication slot {self.copy.source.slot}'s"
                    f" snapshot ended without a word (exit code {worker.exitcode}: killed, or out of memory?)"
                )


def _claim(claimed: Any, total: int) -> int | None:
    """The index of the next task nobody has taken, or None when all are taken."""
    with claimed.get_lock():
        index = int(claimed.value)
        if index >= total:
            return None
        claimed.value = index + 1
    return index


def _waiting(events: Any) -> Iterator[tuple[Any, ...]]:
    """The reports already queued, without waiting for more."""
    while True:
        try:
            yield events.get_nowait()
        except queue.Empty:
            return


def _work(
    source: SourceConfig,
    snapshot_name: str,
    copier: RangeCopier[Any],
    tasks: list[CopyTask],
    claimed: Any,
    events: Any,
    parent: int,
) -> None:
    """A worker process: its own connection into the snapshot, tasks until none is left."""
    _die_with(parent)
    try:
        with SnapshotReader(source, snapshot_name) as reader:
            while (index := _claim(claimed, len(tasks))) is not None:

                def rows(task: CopyTask, count: int, index: int = index) -> None:
                    events.put(("rows", index, count))

                events.put(("copied", index, copy_range(reader, tasks[index], copier, rows)))
    except BaseException as error:  # noqa: BLE001 - raised in the caller
        events.put(("failed", _portable(error)))
    finally:
        events.put(("exit",))


def _die_with(parent: int) -> None:
    """On Linux, have the kernel kill this process when ``parent`` dies (and leave now if it has)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:
        os._exit(1)


def _portable(error: BaseException) -> BaseException:
    """``error`` as it can cross to the caller's process (its type kept when it pickles)."""
    try:
        return pickle.loads(pickle.dumps(error))  # type: ignore[no-any-return]
    except Exception:  # noqa: BLE001 - any error that does not survive pickling
        return CdcError(f"{type(error).__name__}: {error}")
