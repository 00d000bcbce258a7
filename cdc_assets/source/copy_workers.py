"""The processes that copy ranges of tables for :class:`~cdc_assets.source.parallel_copy.ParallelCopy`.

A copy costs the client more CPU than the server, so each worker is a process of its own, which
receives, converts and writes on a core of its own without sharing an interpreter lock. The
caller's process is the first worker: it copies from the start while the others start (a second or
so, most of it imports). Every worker — its own :class:`SnapshotReader` connection into the
snapshot — claims the next task by its index from a shared counter. The processes report on a
queue; a worker's error is raised in the caller with its type. On Linux a worker dies with the
process that started it, so a killed copy leaves no worker writing on. Workers are started with
``spawn``: a script that copies needs the usual ``if __name__ == "__main__":`` guard.
"""

from __future__ import annotations

import ctypes
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
from typing import Any, Generic, TypeVar

import psycopg
import pyarrow as pa
from psycopg import errors

from cdc_assets.config import SourceConfig
from cdc_assets.errors import CdcError, DecodeError, SourceError, SourcePermissionError
from cdc_assets.source.binary_copy import read_columns
from cdc_assets.source.copy_plan import CopyTask, Progress, RangeCopier
from cdc_assets.source.snapshot import SnapshotReader

_R = TypeVar("_R")

WORKER_POLL_S = 1.0
"""How often the caller looks for a worker that died without a word (killed, out of memory)."""
_PR_SET_PDEATHSIG = 1


@dataclass(slots=True)
class WorkerPool(Generic[_R]):
    """The calling process is worker 0; ``count - 1`` worker processes join it once started. Each
    claims the next task by its index from a shared counter; the processes report on a queue:
    ``("rows", index, rows)``, ``("copied", index, result)``, ``("failed", error)``, ``("exit",)``."""

    source: SourceConfig
    snapshot_name: str
    tasks: list[CopyTask]
    copier: RangeCopier[_R]
    progress: Progress

    def run(self, count: int) -> Iterator[tuple[CopyTask, _R]]:
        context = multiprocessing.get_context("spawn")
        claimed = context.Value("q", 0)
        events: Any = context.Queue()
        workers = [
            context.Process(
                target=_work,
                args=(self.source, self.snapshot_name, self.copier, self.tasks, claimed, events, os.getpid()),
                name=f"cdc-copy-{number}",
                daemon=True,
            )
            for number in range(1, count)
        ]
        try:
            for worker in workers:
                worker.start()
            running = len(workers)
            mine = _copy_claimed(self.source, self.snapshot_name, self.copier, self.tasks, claimed, self._rows)
            for index, result in mine:
                yield self.tasks[index], result
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

    def _rows(self, index: int, count: int) -> None:
        self.progress(self.tasks[index], count)

    def _handle(self, event: tuple[Any, ...]) -> Generator[tuple[CopyTask, _R], None, int]:
        """Act on a worker's report; return 1 when it says the worker has ended."""
        if event[0] == "rows":
            self._rows(event[1], event[2])
        elif event[0] == "copied":
            yield self.tasks[event[1]], event[2]
        elif event[0] == "failed":
            raise event[1]
        return int(event[0] == "exit")

    def _check_alive(self, workers: Sequence[BaseProcess]) -> None:
        for worker in workers:
            if worker.exitcode is not None and worker.exitcode != 0:
                raise SourceError(
                    f"copy worker {worker.name} (pid {worker.pid}) of replication slot {self.source.slot}'s"
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
    """A worker process: its share of the tasks (:func:`_copy_claimed`), reported on ``events``."""
    _die_with(parent)

    def rows(index: int, count: int) -> None:
        events.put(("rows", index, count))

    try:
        for index, result in _copy_claimed(source, snapshot_name, copier, tasks, claimed, rows):
            events.put(("copied", index, result))
    except BaseException as error:  # noqa: BLE001 - raised in the caller
        events.put(("failed", _portable(error)))
    finally:
        events.put(("exit",))


def _copy_claimed(
    source: SourceConfig,
    snapshot_name: str,
    copier: RangeCopier[_R],
    tasks: list[CopyTask],
    claimed: Any,
    rows: Callable[[int, int], None],
) -> Iterator[tuple[int, _R]]:
    """This process's share of the work: its own connection into the snapshot, the next task
    nobody has claimed until none is left; yields each task's index and what ``copier`` returned,
    ``rows(index, count)`` on each block."""
    with SnapshotReader(source, snapshot_name) as reader:
        while (index := _claim(claimed, len(tasks))) is not None:

            def progress(task: CopyTask, count: int, index: int = index) -> None:
                rows(index, count)

            yield index, _copy_range(reader, tasks[index], copier, progress)


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


def _copy_range(reader: SnapshotReader, task: CopyTask, copier: RangeCopier[_R], progress: Progress) -> _R:
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
    except psycopg.Error as error:
        kind = SourcePermissionError if isinstance(error, errors.InsufficientPrivilege) else SourceError
        raise kind(f"cannot copy table {relation.qualified_name}: {error.diag.message_primary or error}") from None
    except DecodeError as error:
        raise SourceError(f"cannot copy table {relation.qualified_name}: {error}") from None
