"""Reading a slot over SQL: pgoutput options, a bounded-memory peek, and advancing the slot.

A peek never moves the slot; :meth:`SlotReader.advance` does, once the caller has made the
peeked transactions durable (invariant 2). The peek itself runs in a child process with a
connection of its own (:mod:`cdc_assets.peek_child`), so that receiving rows and assembling them
use two cores.
"""

from __future__ import annotations

import queue
import threading
import weakref
from collections.abc import Generator, Iterator
from contextlib import closing, contextmanager, suppress
from dataclasses import dataclass
from types import TracebackType
from typing import Any, Self

import numpy as np
import psycopg
from psycopg import errors

from cdc_assets.config import SourceConfig
from cdc_assets.errors import ConfigError, SlotGapError, SourceError
from cdc_assets.lsn import format_lsn
from cdc_assets.source.connection import (
    connect_failure,
    conninfo,
    one_row,
    pinned_settings_statement,
)
from cdc_assets.source.failures import diagnose, publication_missing_error
from cdc_assets.source.publication import publication_exists
from cdc_assets.source.receiver import POOL, ChildError, PeekChild, PeekFrameBlock
from cdc_assets.source.slots import read_slot, slot_invalidated, slot_missing

PeekedRow = tuple[int, bytes]
"""``(lsn, data)`` of one pgoutput message."""


@dataclass(slots=True, frozen=True)
class PeekBlock:
    """Consecutive rows of one peek call: each message's LSN (int64), where it ends in ``data``
    (int64 offsets), and the messages joined."""

    lsns: np.ndarray
    ends: np.ndarray
    data: bytes

    def __len__(self) -> int:
        return len(self.lsns)

    def starts(self) -> np.ndarray:
        return np.concatenate((np.zeros(1, dtype=np.int64), self.ends[:-1]))

    def rows(self, start: int = 0, stop: int | None = None) -> Iterator[PeekedRow]:
        """``(lsn, data)`` of rows ``start…stop``."""
        stop = len(self) if stop is None else stop
        begin = int(self.ends[start - 1]) if start else 0
        for lsn, end in zip(self.lsns[start:stop].tolist(), self.ends[start:stop].tolist()):
            yield lsn, self.data[begin:end]
            begin = end

    def messages(self) -> list[bytes]:
        return [data for _, data in self.rows()]


FETCH_ROWS = 10_000
PREFETCH_ROWS = 8_192
PREFETCH_BLOCKS = 16
TERMINATE_WAIT_MS = 10_000

PEEK_QUERY = (
    "SELECT (lsn - '0/0')::int8, data"
    " FROM pg_logical_slot_peek_binary_changes(%s::name, %s::pg_lsn, %s::int4, VARIADIC %s::text[])"
)


def max_proto_version(major: int) -> int:
    """The highest pgoutput protocol a server speaks: 2 on 14, 3 on 15, 4 on 16+."""
    return 4 if major >= 16 else 3 if major == 15 else 2


def pgoutput_options(config: SourceConfig, major: int, *, two_phase: bool) -> list[str]:
    """The flat ``name, value, …`` pgoutput options for a server major version.

    ``two_phase`` is the slot's actual flag, never the configuration's wish: a single peek with
    ``two_phase 'on'`` turns a slot two-phase for good (invariant 6).
    """
    options = ["proto_version", str(max_proto_version(major)), "publication_names", config.publication]
    options += ["messages", "true"]
    if config.binary:
        options += ["binary", "true"]
    if config.streaming == "parallel" and major < 16:
        raise ConfigError(
            f"source.streaming: 'parallel' needs PostgreSQL 16 or later (the server is {major}); use 'on' or 'off'"
        )
    if config.streaming != "off":
        options += ["streaming", config.streaming if major >= 16 else "true"]  # 14/15 take a boolean
    if two_phase:
        if major < 15:
            raise ConfigError(f"two-phase decoding needs PostgreSQL 15 or later (the server is {major})")
        options += ["two_phase", "on"]
    return options


class SlotReader:
    """Peeks and advances the configured slot.

    ``conn`` is an autocommit connection the reader uses alone, for advancing and for what it
    checks; peeks run in a child process on a connection of its own, started here so that it
    gets ready while the caller prepares. :meth:`close` (or leaving ``with``) lets the child go.
    ``server_version`` is the major version; ``two_phase`` the slot's ``two_phase`` flag as read
    from ``pg_replication_slots`` (see :func:`~cdc_assets.source.slots.require_usable_slot`).
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        config: SourceConfig,
        server_version: int,
        two_phase: bool,
        *,
        fetch_rows: int = FETCH_ROWS,
    ) -> None:
        if not conn.autocommit:
            raise ValueError("SlotReader needs an autocommit connection (it manages its own transactions)")
        self._conn = conn
        self._config = config
        self._fetch_rows = fetch_rows
        self.options: tuple[str, ...] = tuple(pgoutput_options(config, server_version, two_phase=two_phase))
        self._conninfo = conninfo(config, purpose="peek")
        self._child: PeekChild | None = None
        self._finalizer: weakref.finalize[[], SlotReader] | None = None
        self._start_child()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    @property
    def receiver_pid(self) -> int | None:
        """The process id of the child that runs the peeks (None after :meth:`close`)."""
        return None if self._child is None else self._child.pid

    def close(self) -> None:
        """Give the child back to the pool (disconnected)."""
        child, self._child = self._child, None
        if self._finalizer is not None:
            self._finalizer.detach()
        if child is not None:
            POOL.release(child)

    def _start_child(self) -> PeekChild:
        if self._child is None:
            child = POOL.acquire()
            child.connect(self._conninfo)
            self._child = child
            self._finalizer = weakref.finalize(self, child.kill)
        return self._child

    def _ready_child(self) -> PeekChild:
        child = self._start_child()
        pid = child.ready()
        if isinstance(pid, ChildError):
            self._drop_child()
            raise connect_failure(self._config, "peek", pid.text)
        return child

    def _drop_child(self) -> None:
        """Stop the child for good; if it was reading, end its server session too, so that the
        slot is free when this returns."""
        child, self._child = self._child, None
        if self._finalizer is not None:
            self._finalizer.detach()
        if child is None:
            return
        backend = child.backend_pid
        child.kill()
        if backend is not None:
            with suppress(psycopg.Error):  # it may be gone already; the server ends it once it notices
                self._conn.execute("SELECT pg_terminate_backend(%s, %s)", (backend, TERMINATE_WAIT_MS))

    @contextmanager
    def peek(self, limit: int, upto_lsn: int | None = None) -> Iterator[Iterator[PeekBlock]]:
        """An iterator of :class:`PeekBlock` objects holding up to about ``limit`` messages in all (calls end
        on transaction boundaries) of transactions ending at or before ``upto_lsn`` (if given),
        inside one transaction with the pinned settings.

        The server builds the whole result first; the child receives it ``fetch_rows`` at a time
        and hands it on in blocks of ``PREFETCH_ROWS``.
        Server errors are raised as the :class:`~cdc_assets.errors.SourceError` subclass that
        explains them. Leaving the block early ends the query.
        """
        # PostgreSQL 18 only warns about a missing publication and decodes nothing for it.
        if not publication_exists(self._conn, self._config.publication):
            raise publication_missing_error(self._config.publication, self._config.slot)
        blocks = self._blocks(limit, upto_lsn)
        with closing(blocks):
            yield blocks

    def _blocks(self, limit: int, upto_lsn: int | None) -> Generator[PeekBlock, None, None]:
        """The rows, read from the child on a thread of their own a block at a time, so that the
        child receiving the next rows overlaps the caller's work on the previous ones."""
        child = self._ready_child()
        upto = None if upto_lsn is None else format_lsn(upto_lsn)
        request = {
            "setup": [pinned_settings_statement()],
            "query": PEEK_QUERY,
            "params": [self._config.slot, upto, limit, list(self.options)],
            "fetch_rows": self._fetch_rows,
            "block_rows": PREFETCH_ROWS,
        }
        blocks: queue.Queue[PeekFrameBlock | ChildError | BaseException | None] = queue.Queue(maxsize=PREFETCH_BLOCKS)
        stop = threading.Event()
        receiver = threading.Thread(target=_receive, args=(child, request, blocks, stop), name="slot-peek", daemon=True)
        receiver.start()
        lsn: int | None = None
        finished = False
        try:
            while (block := blocks.get()) is not None:
                if isinstance(block, BaseException):
                    raise block
                if isinstance(block, ChildError):
                    raise self._diagnose(_server_error(block), lsn)
                lsn = int(block.lsns[-1])
                yield PeekBlock(block.lsns, block.ends, block.data)
            finished = True
        finally:
            stop.set()
            if not finished:
                self._drop_child()  # the receiver then sees the pipe close
            receiver.join()

    def advance(self, lsn: int) -> int:
        """Confirm everything up to ``lsn``; returns the slot's new confirmed position.

        Equal to the confirmed position is a no-op; below it raises :class:`SlotGapError` (the
        slot is ahead of the caller's checkpoint); past the server's flush point it stops there.
        """
        slot = self._config.slot
        state = read_slot(self._conn, slot)
        if state is None:
            raise slot_missing(slot, lsn)
        if state.invalidated:
            raise slot_invalidated(state, lsn)
        confirmed = state.confirmed_flush_lsn or 0
        if lsn == confirmed:
            return confirmed
        if lsn < confirmed:
            raise SlotGapError(
                f"cannot move replication slot {slot} back to LSN {format_lsn(lsn)}: it has already confirmed "
                f"{format_lsn(confirmed)}, so the changes between the two are gone from the slot but not in "
                "the change log. Remedy: drop the slot and run `cdc-assets setup` again (re-snapshots)"
            )
        try:
            (end,) = one_row(
                self._conn.execute(
                    "SELECT (end_lsn - '0/0')::int8 FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
                    (slot, format_lsn(lsn)),
                )
            )
        except psycopg.Error as error:
            raise self._diagnose(error, lsn) from None
        return int(end)

    def _diagnose(self, error: psycopg.Error, lsn: int | None) -> SourceError:
        return diagnose(self._conn, error, slot=self._config.slot, publication=self._config.publication, lsn=lsn)


def _receive(child: PeekChild, request: dict[str, Any], blocks: queue.Queue[Any], stop: threading.Event) -> None:
    try:
        for block in child.peek(request):
            _offer(blocks, block, stop)
    except BaseException as error:  # noqa: BLE001 - handed to the consuming thread
        _offer(blocks, error, stop)
        return
    _offer(blocks, None, stop)


def _server_error(error: ChildError) -> psycopg.Error:
    """The child's report as the psycopg exception class of its SQLSTATE."""
    cls: type[psycopg.Error] = psycopg.OperationalError
    if error.sqlstate:
        try:
            cls = errors.lookup(error.sqlstate)
        except KeyError:
            cls = psycopg.DatabaseError
    return cls(error.message)


def _offer(blocks: queue.Queue[Any], item: Any, stop: threading.Event) -> None:
    """Put ``item`` unless the consumer has stopped listening."""
    while not stop.is_set():
        try:
            blocks.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
