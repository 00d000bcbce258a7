"""The drain's side of :mod:`cdc_assets.stream.child`: child processes that receive the stream.

A :class:`StreamChild` is one child process; it holds one replication connection at a time, and
the process is kept for the next stream in this process (starting Python and psycopg takes a few
tenths of a second; connecting takes milliseconds).
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
from cdc_assets.stream.blocks import MessageBlock, StreamPosition
from cdc_assets.stream.child import BLOCK, DONE, ERROR, HEADER, POSITION, READY

MAX_IDLE = 2
"""Idle children kept for later streams."""
EXIT_WAIT_S = 5.0
"""How long a child that stopped answering is given to exit, for its exit code."""
PIPE_BYTES = 1 << 20
"""The pipe's buffer (Linux's default is 64 KiB: a block would take many context switches)."""


@dataclass(slots=True, frozen=True)
class ChildError:
    """An ``E`` frame: the server's SQLSTATE (None if the failure was not the server's), its
    message, and for a message the stream cannot carry, the decoder's fields."""

    sqlstate: str | None
    message: str
    text: str
    decode: dict[str, Any] | None = None
    connecting: bool = False


Frame = MessageBlock | StreamPosition | ChildError


class StreamChild:
    """A child process running :mod:`cdc_assets.stream.child`."""

    def __init__(self) -> None:
        root = str(Path(cdc_assets.__file__).resolve().parent.parent)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115 - open for the child's lifetime, closed in close()
        self._process = subprocess.Popen(
            [sys.executable, "-m", "cdc_assets.stream.child"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env=env,
        )
        stdout = self._pipe(self._process.stdout)
        with suppress(OSError, AttributeError):  # Linux only; a smaller pipe still works
            import fcntl

            fcntl.fcntl(stdout.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
        self.backend_pid: int | None = None
        self.streaming = False

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def alive(self) -> bool:
        return self._process.poll() is None

    def send(self, request: dict[str, Any]) -> None:
        stdin = self._pipe(self._process.stdin)
        try:
            stdin.write(json.dumps(request).encode() + b"\n")
            stdin.flush()
        except OSError:
            raise self._broken("it stopped reading requests") from None

    def start(self, request: dict[str, Any]) -> int | ChildError:
        """Connect and start streaming; the connection's backend pid, or why it failed."""
        self.send(request)
        kind, a, _ = self._header()
        if kind == ERROR:
            return self._error(a)
        if kind != READY:
            raise self._broken(f"unexpected frame {kind!r} instead of ready")
        self.backend_pid = a
        self.streaming = True
        return a

    def frames(self) -> Iterator[Frame]:
        """The stream's frames until it ends: on request (nothing more), or with an error (the last)."""
        while True:
            kind, a, b = self._header()
            if kind == DONE:
                self.streaming = False
                return
            if kind == ERROR:
                self.streaming = False
                yield self._error(a)
                return
            if kind == POSITION:
                yield StreamPosition(a)
            elif kind == BLOCK:
                lsns = np.frombuffer(self._read(8 * a), dtype=np.int64)
                ends = np.frombuffer(self._read(8 * a), dtype=np.int64)
                yield MessageBlock(lsns, ends, self._read(b))
            else:
                raise self._broken(f"unexpected frame {kind!r} in the stream")

    def kill(self) -> None:
        """Stop at once (leaves the server's walsender to notice; see ``SlotStream``)."""
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

    def _header(self) -> tuple[bytes, int, int]:
        return HEADER.unpack(self._read(HEADER.size))

    def _read(self, size: int) -> bytes:
        data = self._pipe(self._process.stdout).read(size)
        if len(data) != size:
            raise self._broken("it ended in the middle of an answer")
        return data

    def _error(self, size: int) -> ChildError:
        fields = json.loads(self._read(size))
        return ChildError(
            fields["sqlstate"], fields["message"], fields["text"], fields.get("decode"), fields.get("connecting", False)
        )

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
            f"the stream's receiving process (pid {self.pid}) failed: {what}; it {status}"
            + (f"; its error output: {detail}" if detail else "")
        )


class StreamChildPool:
    """Idle children, shared by the streams of this process."""

    def __init__(self) -> None:
        self._idle: list[StreamChild] = []
        self._lock = threading.Lock()
        atexit.register(self.clear)

    def prestart(self) -> None:
        """Start a child now if none is idle, so that it is ready by the time a stream needs it."""
        with self._lock:
            if not self._idle:
                self._idle.append(StreamChild())

    def acquire(self) -> StreamChild:
        """An idle child that is still alive, or a new one."""
        with self._lock:
            while self._idle:
                child = self._idle.pop()
                if child.alive:
                    return child
                child.close()
        return StreamChild()

    def release(self, child: StreamChild) -> None:
        """Back to the pool: only a child whose stream ended (a streaming one is killed)."""
        if child.streaming or not child.alive:
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


POOL = StreamChildPool()
