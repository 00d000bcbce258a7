"""Reading the configured slot over the streaming replication protocol.

:class:`SlotStream` starts replication at the change log's checkpoint and hands out, in order,
blocks of pgoutput messages and the server's positions (keepalives). It moves the slot only
through :meth:`SlotStream.confirm`, which the caller calls once the transactions up to that
position are durable (invariant 2). The connection lives in a child process
(:mod:`cdc_assets.stream.child`), which receives while the caller works on the blocks before and
answers the server's keepalives on its own.
"""

from __future__ import annotations

import queue
import threading
import time
from contextlib import suppress
from types import TracebackType
from typing import Any, Self

import psycopg
from psycopg import errors

from cdc_assets.config import DrainConfig, SourceConfig
from cdc_assets.config.model import default
from cdc_assets.errors import DecodeError, SourceError, SourceUnavailableError
from cdc_assets.lsn import format_lsn
from cdc_assets.source.checks import require_replication_role
from cdc_assets.source.connection import PINNED_SETTINGS, connect_failure, conninfo
from cdc_assets.source.failures import diagnose, publication_missing_error
from cdc_assets.source.publication import publication_exists
from cdc_assets.source.reconnect import CONNECTION_LOST_SQLSTATES
from cdc_assets.source.standby_wait import standby_wait_error
from cdc_assets.stream.blocks import MessageBlock, StreamPosition
from cdc_assets.stream.options import start_replication_command
from cdc_assets.stream.process import POOL, ChildError, StreamChild

QUEUED_FRAMES = 16
BLOCK_ROWS = 8_192
"""Messages per block at most (a block also ends at 4 MiB, or when nothing more has arrived)."""
GATHER_SECONDS = 0.05
"""How long a following stream's partial block gathers messages, from its first, before it is sent."""
STATUS_SECONDS = 10.0
"""How often the child reports the flushed position unasked (``wal_sender_timeout`` is 60 s by
default; the server asks for a reply at half of it in any case)."""
STANDBY_PROBE_SECONDS = 10.0
"""How often a stream whose position stands still asks whether its walsender waits for standbys."""
TERMINATE_WAIT_MS = 10_000


class _Ended:
    """The child's frames ended without a request to stop."""


class StreamLostError(SourceUnavailableError):
    """The replication connection ended without an error of the slot's: the server went away or
    ended the walsender (``wal_sender_timeout``, a restart, ``pg_terminate_backend``)."""


class SlotStream:
    """The slot's stream from ``start_lsn`` (0: from the slot's confirmed position); see the module
    docstring.

    ``conn`` is an autocommit connection for checks and diagnosis; ``options`` pgoutput's
    (:func:`~cdc_assets.stream.options.pgoutput_options`). The stream starts in the constructor and
    reports ``start_lsn`` as flushed at once (0 reports nothing). A stream whose position stands
    still for ``standby_wait_seconds`` while its walsender waits for ``synchronized_standby_slots``
    raises :class:`~cdc_assets.errors.StandbyWaitError`. A partial block is sent once nothing
    more has arrived, or, with ``gather_seconds`` (a following drain: :data:`GATHER_SECONDS`), once
    that long has passed since its first message — so that a light stream does not send a block
    per transaction; a drain that ends once caught up would wait that long for its last block.
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        config: SourceConfig,
        options: list[tuple[str, str]],
        start_lsn: int,
        *,
        status_seconds: float = STATUS_SECONDS,
        settings: dict[str, str] | None = None,
        standby_wait_seconds: float = default(DrainConfig, "standby_wait_seconds"),
        gather_seconds: float = 0.0,
    ) -> None:
        self.command = start_replication_command(config.slot, start_lsn, options)
        require_replication_role(conn)  # else the connection is refused with nothing to diagnose
        for publication in config.publication.split(","):  # PostgreSQL 18 only warns and sends nothing
            if not publication_exists(conn, publication.strip()):
                raise publication_missing_error(publication.strip(), config.slot, start_lsn)
        self._conn = conn
        self._config = config
        self.confirmed = start_lsn
        self.last_lsn = start_lsn
        self._standby_wait_s = standby_wait_seconds
        self._moved = (start_lsn, time.monotonic())  # the position last seen to move, and when
        self._probed_at = 0.0
        self._frames: queue.Queue[MessageBlock | StreamPosition | ChildError | BaseException | _Ended] = queue.Queue(
            maxsize=QUEUED_FRAMES
        )
        self._stop = threading.Event()
        self._ended = False
        self._ahead: MessageBlock | StreamPosition | ChildError | BaseException | _Ended | None = None
        child = POOL.acquire()
        self._child: StreamChild | None = child
        started = child.start(
            {
                "conninfo": conninfo(config, purpose="stream", replication=True),
                "setup": [f"SET {name} = '{value}'" for name, value in (PINNED_SETTINGS | (settings or {})).items()],
                "start": self.command,
                "flushed": start_lsn,
                "status_seconds": status_seconds,
                "block_rows": BLOCK_ROWS,
                "gather_seconds": gather_seconds,
            }
        )
        if isinstance(started, ChildError):
            POOL.release(child)
            self._child = None
            raise self._error(started)
        self.backend_pid: int | None = started
        self._receiver = threading.Thread(target=self._receive, name="slot-stream", daemon=True)
        self._receiver.start()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.stop()
        else:
            self.abort()

    @property
    def receiver_pid(self) -> int | None:
        """The process id of the child that holds the connection (None once it is let go)."""
        return None if self._child is None else self._child.pid

    def next(self, timeout: float | None = None) -> MessageBlock | StreamPosition | None:
        """The next block or position, or None if nothing came within ``timeout`` seconds.

        A server error is raised as the :class:`~cdc_assets.errors.SourceError` subclass that
        explains it, a connection that ended as :class:`StreamLostError`."""
        if self._ended:
            raise SourceError(f"the stream of replication slot {self._config.slot} has ended")
        frame, self._ahead = self._ahead, None
        if frame is None:
            try:
                frame = self._frames.get(timeout=timeout)
            except queue.Empty:
                self._watch_standby_wait(None)
                return None
        if isinstance(frame, MessageBlock):
            frame = self._gathered(frame)
            self.last_lsn = max(self.last_lsn, int(frame.lsns.max()))
            self._watch_standby_wait(self.last_lsn)
            return frame
        if isinstance(frame, StreamPosition):
            self._watch_standby_wait(frame.lsn)
            return frame
        self._ended = True
        self._let_child_go(kill=True)
        if isinstance(frame, ChildError):
            raise self._error(frame)
        if isinstance(frame, _Ended):
            raise StreamLostError(f"the stream of replication slot {self._config.slot} ended unasked")
        raise frame

    def _watch_standby_wait(self, lsn: int | None) -> None:
        """Note a position the stream reached; when it has stood still long enough, ask whether the
        walsender waits for ``synchronized_standby_slots`` and raise if so."""
        now = time.monotonic()
        if lsn is not None and lsn > self._moved[0]:
            self._moved = (lsn, now)
            return
        waited = now - self._moved[1]
        if waited < self._standby_wait_s or now - self._probed_at < STANDBY_PROBE_SECONDS or self.backend_pid is None:
            return
        self._probed_at = now
        error = standby_wait_error(self._conn, self.backend_pid, self._config.slot, self._moved[0], waited)
        if error is not None:
            self.abort()
            raise error

    def _gathered(self, block: MessageBlock) -> MessageBlock:
        """``block`` and the blocks queued right behind it, as one (up to :data:`BLOCK_ROWS`
        messages): a caller that fell behind catches up in larger blocks."""
        blocks = [block]
        rows = len(block)
        while rows < BLOCK_ROWS:
            try:
                frame = self._frames.get_nowait()
            except queue.Empty:
                break
            if not isinstance(frame, MessageBlock):
                self._ahead = frame
                break
            blocks.append(frame)
            rows += len(frame)
        return MessageBlock.joined(blocks)

    def confirm(self, lsn: int) -> None:
        """Report everything up to ``lsn`` as flushed: the slot's ``confirmed_flush_lsn`` moves there.
        Only for what the change log holds durably."""
        if lsn > self.confirmed:
            self.confirmed = lsn
            self._send({"flushed": lsn})

    def ping(self) -> None:
        """Ask the server for its position (a :class:`StreamPosition` follows what it sent before)."""
        self._send({"ping": True})

    def stop(self) -> None:
        """End the stream (CopyDone) and wait until the server has let the slot go."""
        child = self._child
        if child is None or self._ended:
            self._let_child_go(kill=False)
            return
        self._stop.set()
        try:
            self._send({"stop": True})
        except BaseException:
            self.abort()
            raise
        self._receiver.join()
        self._ended = True
        leftovers: list[Any] = [] if self._ahead is None else [self._ahead]
        while not self._frames.empty():
            leftovers.append(self._frames.get_nowait())
        errors_ = [f for f in leftovers if isinstance(f, ChildError | BaseException)]
        self._let_child_go(kill=bool(errors_) or child.streaming)
        if errors_ and isinstance(errors_[0], ChildError):
            raise self._error(errors_[0])

    def abort(self) -> None:
        """Stop at once (an error or an interrupt): kill the child and end its walsender, so that the
        slot is free when this returns."""
        self._stop.set()
        self._ended = True
        self._let_child_go(kill=True)

    def _send(self, request: dict[str, Any]) -> None:
        if self._child is not None and not self._ended:
            self._child.send(request)

    def _receive(self) -> None:
        """Move the child's frames to the queue (on a thread of their own, so that the child's pipe
        is read while the caller works)."""
        child = self._child
        assert child is not None
        try:
            for frame in child.frames():
                self._offer(frame)
                if isinstance(frame, ChildError):
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the consuming thread
            self._offer(error)
            return
        if not self._stop.is_set():
            self._offer(_Ended())

    def _offer(self, item: Any) -> None:
        """Put ``item`` for the consumer; once it has stopped listening, only an error, and without
        waiting for room."""
        while True:
            if self._stop.is_set():
                if isinstance(item, ChildError | BaseException):
                    with suppress(queue.Empty):
                        self._frames.get_nowait()  # what is left is read by nobody
                    with suppress(queue.Full):
                        self._frames.put_nowait(item)
                return
            try:
                self._frames.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def _let_child_go(self, *, kill: bool) -> None:
        child, self._child = self._child, None
        if child is None:
            return
        backend = self.backend_pid
        if kill:
            child.kill()
            if backend is not None:
                with suppress(psycopg.Error):  # it may be gone already; the server ends it once it notices
                    self._conn.execute("SELECT pg_terminate_backend(%s, %s)", (backend, TERMINATE_WAIT_MS))
        else:
            POOL.release(child)
        if self._receiver.is_alive() and kill:
            self._receiver.join(timeout=5)

    def _error(self, error: ChildError) -> SourceError | DecodeError:
        slot, at = self._config.slot, self.last_lsn
        if error.decode is not None:
            return DecodeError(**error.decode).at(lsn=at, slot=slot)
        if error.connecting:
            return connect_failure(self._config, "stream", error.text, error.sqlstate)
        if error.sqlstate is None or error.sqlstate in CONNECTION_LOST_SQLSTATES:
            return StreamLostError(
                f"the replication connection of slot {slot} ended at LSN {format_lsn(at)}: {error.message}"
            )
        return diagnose(self._conn, _server_error(error), slot=slot, publication=self._config.publication, lsn=at)


def _server_error(error: ChildError) -> psycopg.Error:
    """The child's report as the psycopg exception class of its SQLSTATE."""
    cls: type[psycopg.Error] = psycopg.DatabaseError
    if error.sqlstate:
        with suppress(KeyError):
            cls = errors.lookup(error.sqlstate)
    return cls(error.message)
