"""The drain lock: a session advisory lock on the source, keyed by the slot name; and, keyed by
slot and table, the locks of one table's online copy and of its Delta table's writers.

It lives on the source because the change log may be on object storage, where no lock exists.
The lock is held by a dedicated connection for the whole drain and released before it closes (so
the next holder in this process, change-log retention after a drain, finds it free) — or when the
server restarts, after which a drain that goes on takes it again (:meth:`DrainLock.retake`).
"""

from __future__ import annotations

import hashlib
import logging
from contextlib import suppress
from types import TracebackType
from typing import Any, ClassVar

import psycopg
from psycopg import errors

from cdc_assets.config import SourceConfig
from cdc_assets.errors import DrainLockedError
from cdc_assets.source.connection import connect, one_row

log = logging.getLogger(__name__)

_HOLDER = (
    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted AND objsubid = 1"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND classid = %s::int8::oid AND objid = %s::int8::oid AND pid <> pg_backend_pid()"
)


def drain_lock_key(slot: str) -> int:
    """A stable signed 64-bit key for ``pg_advisory_lock``: BLAKE2b of ``cdc_assets:<slot>``."""
    digest = hashlib.blake2b(f"cdc_assets:{slot}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big", signed=True)


class DrainLock:
    """``with DrainLock(source, wait=False):`` — exclusive right to drain ``source.slot``.

    Busy and not waiting: :class:`DrainLockedError` naming the holder's pid. Waiting: blocks in
    ``pg_advisory_lock`` ``poll_seconds`` at a time (``lock_timeout``), logging the holder between
    attempts, so it is granted as soon as the holder lets go.
    """

    def __init__(self, source: SourceConfig, wait: bool, *, poll_seconds: float = 5.0) -> None:
        self.source = source
        self.wait = wait
        self.poll_seconds = poll_seconds
        self.key = drain_lock_key(self._lock_name())
        self._conn: psycopg.Connection[Any] | None = None

    def __enter__(self) -> DrainLock:
        self._take(self.wait)
        return self

    def retake(self) -> None:
        """Hold the lock again after the source went away: kept if its session lives, else taken
        anew without waiting — if another process took it meanwhile, :class:`DrainLockedError`."""
        if self._conn is not None:
            try:
                self._conn.execute("SELECT 1")
                return
            except psycopg.Error:
                self._conn.close()
                self._conn = None
        self._take(wait=False, lost=True)

    def _take(self, wait: bool, *, lost: bool = False) -> None:
        conn = connect(self.source, purpose="drain-lock")
        try:
            self._acquire(conn, wait, lost)
        except BaseException:
            conn.close()
            raise
        self._conn = conn

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._conn is not None:
            with suppress(psycopg.Error):  # released now: the session itself ends after the close returns
                self._conn.execute("SELECT pg_advisory_unlock(%s::int8)", (self.key,))
            self._conn.close()  # ends the session, which releases its advisory locks in any case
            self._conn = None

    @property
    def pid(self) -> int:
        """The backend pid of the session holding the lock (what a second drain reports)."""
        if self._conn is None:
            raise RuntimeError("the drain lock is not held")
        return self._conn.info.backend_pid

    def holder_pid(self, conn: psycopg.Connection[Any]) -> int | None:
        """The pid of the session holding the lock, seen from ``conn`` (None if free)."""
        unsigned = self.key & 0xFFFF_FFFF_FFFF_FFFF
        row = conn.execute(_HOLDER, (unsigned >> 32, unsigned & 0xFFFF_FFFF)).fetchone()
        return None if row is None else row[0]

    def _lock_name(self) -> str:
        return self.source.slot

    def _busy(self) -> str:
        """What the lock's holder is doing, for the error a second process gets."""
        return f"slot {self.source.slot} is being drained by another process"

    def _acquire(self, conn: psycopg.Connection[Any], wait: bool, lost: bool) -> None:
        if one_row(conn.execute("SELECT pg_try_advisory_lock(%s::int8)", (self.key,)))[0]:
            return
        if not wait:
            pid = self.holder_pid(conn)
            holder = f"pid {pid}" if pid is not None else "a process that has just let go"
            if lost:
                raise DrainLockedError(
                    f"{self._busy()} ({holder}), which took the lock while this process had lost its connection"
                    " to the source: this one stops"
                )
            raise DrainLockedError(f"{self._busy()} ({holder}): wait for it to finish, or run with --wait")
        conn.execute("SELECT set_config('lock_timeout', %s, false)", (f"{max(1, round(self.poll_seconds * 1000))}ms",))
        while True:
            log.info("waiting: %s (pid %s)", self._busy(), self.holder_pid(conn))
            try:
                conn.execute("SELECT pg_advisory_lock(%s::int8)", (self.key,))
                return
            except errors.LockNotAvailable:
                continue


class TableLock(DrainLock):
    """Exclusive right to one kind of work (``purpose``) on one table, keyed by slot, purpose and
    table; ``busy`` says what the holder is doing, ``waits``: whether a second one waits by default."""

    purpose: ClassVar[str]
    busy: ClassVar[str]  # with {table}
    waits: ClassVar[bool]

    def __init__(self, source: SourceConfig, table: str, *, wait: bool | None = None) -> None:
        self.table = table
        super().__init__(source, self.waits if wait is None else wait)

    def _lock_name(self) -> str:
        return f"{self.source.slot}:{self.purpose}:{self.table}"

    def _busy(self) -> str:
        return self.busy.format(table=self.table)


class TableCopyLock(TableLock):
    """``with TableCopyLock(source, table):`` — exclusive right to copy ``table`` online (one
    snapshot run of a table at a time; the drain goes on meanwhile)."""

    purpose = "snapshot"
    busy = "table {table} is being copied by another `cdc-assets snapshot`"
    waits = False


class TableWriteLock(TableLock):
    """``with TableWriteLock(source, table):`` — exclusive right to write the Delta table of
    ``table`` where no Dagster pool orders the writers: the merges of a following drain and the
    table's maintenance, so that neither loses a Delta conflict to the other (waits by default)."""

    purpose = "write"
    busy = "the Delta table of {table} is being written by another process (a merge or its maintenance)"
    waits = True
