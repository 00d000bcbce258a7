"""The drain's side of :mod:`cdc_assets.peek_child`: child processes that receive peeks.

A :class:`PeekChild` is one child process; it connects for one reader and disconnects when the
reader is done, and the process is kept for the next reader in this process (starting Python
and psycopg takes a few tenths of a second; connecting takes milliseconds).
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

import cdc_assets
from cdc_assets.errors import SourceError
from cdc_assets.peek_child import BLOCK, DONE, ERROR, HEADER, READY

MAX_IDLE = 2
"""Disconnected children kept for later readers."""
EXIT_WAIT_S = 5.0
"""How long a child that stopped answering is given to exit, for its exit code."""


@dataclass(slots=True, frozen=True)
class PeekFrameBlock:
    """The payload of a ``B`` frame: LSNs, end offsets and the joined messages."""

    lsns: np.ndarray
    ends: np.ndarray
    data: bytes


@dataclass(slots=True, frozen=True)
class ChildError:
    """An ``E`` frame: the server's SQLSTATE (None if the failure was not the server's) and message."""

    sqlstate: str | None
    message: str
    text: str


class PeekChild:
    """A child process running :mod:`cdc_assets.peek_child`."""

    def __init__(self) -> None:
        root = str(Path(cdc_assets.__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - open for the child's lifetime, closed in close()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "cdc_assets.peek_child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        self.backend_pid: int | None = None
        self.connected = False

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def connect(self, conninfo: str) -> None:
        """Ask for a connection; :meth:`ready` waits for it."""
        self._send({"conninfo": conninfo})
        self.connected = True

    def ready(self) -> int | ChildError:
        """The connection's backend pid once connected, or why connecting failed."""
        if self.backend_pid is None:
            kind, a, _ = self._header()
            if kind == ERROR:
                self.connected = False
                return self._error(a)
            if kind != READY:
                raise self._broken(f"unexpected frame {kind!r} instead of ready")
            self.backend_pid = a
        return self.backend_pid

    def peek(self, request: dict[str, Any]) -> Iterator[PeekFrameBlock | ChildError]:
        """Run one peek; yields its blocks, then a :class:`ChildError` if it failed."""
        self._send(request)
        while True:
            kind, a, b = self._header()
            if kind == DONE:
                return
            if kind == ERROR:
                yield self._error(a)
                return
            if kind != BLOCK:
                raise self._broken(f"unexpected frame {kind!r} in a peek")
            lsns = np.frombuffer(self._read(8 * a), dtype=np.int64)
            ends = np.frombuffer(self._read(8 * a), dtype=np.int64)
            yield PeekFrameBlock(lsns, ends, self._read(b))

    def disconnect(self) -> None:
        """End the connection (closing standard input ends the process: see :meth:`close`)."""
        self._send({"disconnect": True})
        self.connected = False
        self.backend_pid = None

    def kill(self) -> None:
        """Stop at once (leaves the server backend to notice; see ``SlotReader``)."""
        self._process.kill()
        self.close()

    def close(self) -> None:
        if self._process.stdin is not None and not self._process.stdin.closed:
            with suppress(OSError):
                self._process.stdin.close()
        self._process.wait()
        for stream in (self._process.stdout, self._stderr):
            if stream is not None:
                stream.close()

    def _send(self, message: dict[str, Any]) -> None:
        stdin = self._pipe(self._process.stdin)
        try:
            stdin.write(json.dumps(message).encode() + b"\n")
            stdin.flush()
        except OSError:
            raise self._broken("it stopped reading requests") from None

    def _header(self) -> tuple[bytes, int, int]:
        return HEADER.unpack(self._read(HEADER.size))

    def _read(self, size: int) -> bytes:
        data = self._pipe(self._process.stdout).read(size)
        if len(data) != size:
            raise self._broken("it ended in the middle of an answer")
        return data

    def _error(self, size: int) -> ChildError:
        fields = json.loads(self._read(size))
        return ChildError(fields["sqlstate"], fields["message"], fields["text"])

    def _pipe(self, stream: IO[bytes] | None) -> IO[bytes]:
        assert stream is not None  # both pipes are opened in __init__
        return stream

    def _broken(self, what: str) -> SourceError:
        try:
            code: int | None = self._process.wait(timeout=EXIT_WAIT_S)
        except subprocess.TimeoutExpired:
            code = None
        self._stderr.seek(0)
        detail = self._stderr.read().decode(errors="replace").strip()[-2000:]
        status = "is running" if code is None else f"exited with code {code}"
        return SourceError(
            f"the peek's receiving process (pid {self.pid}) failed: {what}; it {status}"
            + (f"; its error output: {detail}" if detail else "")
        )


class PeekChildPool:
    """Idle children, shared by the readers of this process."""

    def __init__(self) -> None:
        self._idle: list[PeekChild] = []
        self._lock = threading.Lock()
        atexit.register(self.clear)

    def prestart(self) -> None:
        """Start a child now if none is idle, so that it is ready by the time a reader needs it."""
        with self._lock:
            if not self._idle:
                self._idle.append(PeekChild())

    def acquire(self) -> PeekChild:
        """An idle child that is still alive, or a new one."""
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.alive:
                    return child
                child.close()
        return PeekChild()

    def release(self, child: PeekChild) -> None:
        """Back to the pool, disconnected (a child that fails to disconnect is closed)."""
        try:
            if child.connected and not isinstance(child.ready(), ChildError):
                child.disconnect()
        except SourceError:
            child.kill()
            return
        with self._lock:
            if len(self._idle) < MAX_IDLE:
                self._idle.append(child)
                return
        child.close()

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for child in idle:
            child.close()


POOL = PeekChildPool()
