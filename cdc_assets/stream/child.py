"""The receiving end of a slot's replication stream, run as a child process
(``python -m cdc_assets.stream.child``).

Receiving the stream (libpq, one CopyData message per pgoutput message) and the drain's assembling
both need the GIL, so in one process they would take turns. Here a child process holds the
replication connection and sends the messages to the drain in blocks through its standard output,
while the drain works on the blocks before — two cores instead of one. It also answers the server
on its own: a keepalive that asks for a reply, and every ``status_seconds``, get a status update
with the flushed position the drain last confirmed, so a drain busy with a long flush is not
disconnected by ``wal_sender_timeout``. The child needs nothing but psycopg and the protocol
module: it must not import the rest of the package (pyarrow is seconds of start-up).

Requests come on standard input, one JSON object per line:

* ``{"conninfo", "setup": [sql, …], "start": sql, "flushed": lsn, "status_seconds": s,
  "block_rows": n, "gather_seconds": s}`` connects
  (a replication connection), runs the setup statements, starts replication and reports the
  flushed position;
* ``{"flushed": lsn}`` reports a new flushed position at once;
* ``{"ping": true}`` sends a status update that asks the server for a keepalive (its position);
* ``{"stop": true}`` ends the stream (CopyDone) and the connection.

Answers are frames, a header ``<kind, a, b>`` (:data:`HEADER`) and a payload —

* ``R`` streaming, ``a`` = the connection's backend pid;
* ``B`` a block of ``a`` messages and ``b`` bytes: ``a`` LSNs (int64), ``a`` end offsets (int64),
  the messages joined;
* ``P`` a keepalive: ``a`` = the server's position, every transaction committed before it has
  been sent in the blocks before this frame;
* ``D`` the stream ended on request;
* ``E`` an error, ``a`` bytes of JSON ``{"sqlstate", "message", "text"}``; the child then waits
  for the next connect request.

The child exits when its parent does or closes standard input.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import struct
import sys
import threading
import time
from array import array
from collections import deque
from contextlib import suppress
from typing import Any

import psycopg
from psycopg import pq

from cdc_assets.errors import DecodeError
from cdc_assets.stream.protocol import (
    PRIMARY_KEEPALIVE,
    XLOG_DATA,
    PrimaryKeepalive,
    StandbyStatusUpdate,
    XLogData,
    decode_server_message,
)

HEADER = struct.Struct("<cqq")
READY, BLOCK, POSITION, DONE, ERROR = b"R", b"B", b"P", b"D", b"E"
BLOCK_BYTES = 4 << 20
QUEUED_FRAMES = 16
"""Frames waiting for the drain; while they are this many, the socket is not read."""
PARENT_CHECK_S = 0.2
_XLOG_TYPE = XLogData.TYPE[0]
_KEEPALIVE_TYPE = PrimaryKeepalive.TYPE[0]
_HEADER_SIZE = XLOG_DATA.size
_LSN_AT = struct.Struct(">Q").unpack_from


class StreamEnded(Exception):
    """The server ended the copy: its error, if it sent one, is the ``result``."""

    def __init__(self, result: pq.abc.PGresult | None) -> None:
        self.result = result
        message = (result.error_message.decode(errors="replace").strip() if result is not None else "") or (
            "the server ended the replication stream"
        )
        super().__init__(message)


class ConnectFailed(Exception):
    """Connecting failed: libpq's message, and the server's SQLSTATE if it refused."""

    def __init__(self, message: str, sqlstate: str | None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def write_frame(fd: int, kind: bytes, a: int, b: int = 0, *payload: bytes | array[int]) -> None:
    """One frame, whole, to the file descriptor ``fd``."""
    pieces = [memoryview(HEADER.pack(kind, a, b)), *(memoryview(p).cast("B") for p in payload)]
    while pieces:
        written = os.writev(fd, pieces)
        while pieces and written >= len(pieces[0]):
            written -= len(pieces[0])
            pieces.pop(0)
        if pieces and written:
            pieces[0] = pieces[0][written:]


def error_payload(error: BaseException) -> bytes:
    """The JSON of an ``E`` frame."""
    sqlstate = getattr(error, "sqlstate", None)
    diag = getattr(error, "diag", None)
    message = (diag.message_primary if diag is not None else None) or str(error)
    if isinstance(error, ConnectFailed):
        fields = {"sqlstate": error.sqlstate, "message": str(error), "text": str(error), "connecting": True}
        return json.dumps(fields).encode()
    if isinstance(error, DecodeError):
        decode = {"reason": error.reason, "message_type": error.message_type, "offset": error.offset}
        return json.dumps({"sqlstate": None, "message": str(error), "text": str(error), "decode": decode}).encode()
    if isinstance(error, StreamEnded) and error.result is not None:
        sqlstate = error.result.error_field(pq.DiagnosticField.SQLSTATE)
        sqlstate = sqlstate.decode() if sqlstate else None
        primary = error.result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
        message = primary.decode(errors="replace") if primary else message
    return json.dumps({"sqlstate": sqlstate, "message": message, "text": str(error)}).encode()


class Frames:
    """The frames for the drain, written by a thread of their own so that the receiving loop never
    blocks on the pipe (it must keep answering the server). While :attr:`full`, the loop stops
    reading the socket; ``wake_fd`` becomes readable when the frames are taken again."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._queue: queue.Queue[tuple[bytes, int, int, tuple[Any, ...]]] = queue.Queue()
        self.wake_fd, self._wake_write = os.pipe()
        os.set_blocking(self.wake_fd, False)
        threading.Thread(target=self._write, name="frames", daemon=True).start()

    @property
    def full(self) -> bool:
        return self._queue.qsize() >= QUEUED_FRAMES

    def put(self, kind: bytes, a: int, b: int = 0, *payload: bytes | array[int]) -> None:
        self._queue.put((kind, a, b, payload))

    def woken(self) -> None:
        """Empty the wake-up pipe."""
        with suppress(BlockingIOError):
            os.read(self.wake_fd, 1 << 12)

    def _write(self) -> None:
        while True:
            kind, a, b, payload = self._queue.get()
            write_frame(self._fd, kind, a, b, *payload)
            if self._queue.qsize() == QUEUED_FRAMES - 1:
                os.write(self._wake_write, b"w")


class Requests:
    """Standard input, read without blocking: whole JSON lines."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._partial = b""
        self._ready: deque[dict[str, Any]] = deque()
        self.closed = False

    def take(self) -> list[dict[str, Any]]:
        """Every request that has arrived, without waiting."""
        self._read()
        taken = list(self._ready)
        self._ready.clear()
        return taken

    def wait(self) -> dict[str, Any] | None:
        """The next request, waiting for it; None once standard input is closed."""
        while not self._ready and not self.closed:
            select.select([self.fd], [], [])
            self._read()
        return self._ready.popleft() if self._ready else None

    def _read(self) -> None:
        try:
            chunk = os.read(self.fd, 1 << 16)
        except BlockingIOError:
            return
        if not chunk:
            self.closed = True
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        self._ready.extend(json.loads(line) for line in lines if line.strip())


class Stream:
    """One replication connection, streaming."""

    def __init__(self, request: dict[str, Any], frames: Frames) -> None:
        self.frames = frames
        self.flushed = int(request["flushed"])
        self.status_seconds = float(request["status_seconds"])
        self.block_rows = int(request["block_rows"])
        self.gather_seconds = float(request["gather_seconds"])  # how long a partial block gathers
        try:
            self.conn = psycopg.connect(request["conninfo"], autocommit=True)
        except psycopg.Error as error:
            raise ConnectFailed(str(error), error.sqlstate) from None
        self.pgconn = self.conn.pgconn
        try:
            for sql in request["setup"]:
                self.conn.execute(sql)
            self.pgconn.send_query(request["start"].encode())
            result = self.pgconn.get_result()
            if result is None or result.status != pq.ExecStatus.COPY_BOTH:
                raise StreamEnded(result)
        except BaseException:
            self.conn.close()
            raise
        self._lsns = array("q")
        self._ends = array("q")
        self._data: list[bytes] = []
        self._size = 0
        self._first_at = 0.0  # when the partial block's first message arrived
        self._position: int | None = None  # the newest keepalive's position, until reported
        self.status(reply_requested=False)

    def status(self, *, reply_requested: bool) -> None:
        """Send the flushed position (and ask for a keepalive)."""
        update = StandbyStatusUpdate.durable(self.flushed, reply_requested=reply_requested)
        self.pgconn.put_copy_data(update.encode())
        self.pgconn.flush()
        self.last_status = time.monotonic()

    def receive(self, requests_fd: int) -> None:
        """Take what libpq holds, until it holds no whole message or a block is full and the drain
        is behind. A block is sent when full, once ``gather_seconds`` have passed since its first
        message, or when a request arrives on ``requests_fd`` meanwhile (:meth:`_gather`)."""
        pgconn = self.pgconn
        while not self.frames.full:
            size, data = pgconn.get_copy_data(1)
            if size == 0:
                if self._lsns and self._gather(requests_fd):
                    pgconn.consume_input()
                    continue
                break
            if size < 0:
                raise StreamEnded(pgconn.get_result())
            kind = data[0]
            if kind == _XLOG_TYPE and size >= _HEADER_SIZE:
                (lsn,) = _LSN_AT(data, 1)
                if not self._lsns:
                    self._first_at = time.monotonic()
                message = bytes(data[_HEADER_SIZE:])
                self._lsns.append(lsn)
                self._size += len(message)
                self._ends.append(self._size)
                self._data.append(message)
                if len(self._lsns) >= self.block_rows or self._size >= BLOCK_BYTES:
                    self._send_block()
            elif kind == _KEEPALIVE_TYPE and size == PRIMARY_KEEPALIVE.size:
                _, wal_end, _, reply = PRIMARY_KEEPALIVE.unpack_from(data)
                self._position = wal_end
                if not self._lsns:
                    self._send_position()
                if reply:
                    self.status(reply_requested=False)
            else:
                self._send_block()
                raise _malformed(bytes(data))
        self._send_block()

    def _gather(self, requests_fd: int) -> bool:
        """Whether more of the stream can join the partial block: what the socket holds already,
        else what arrives while the rest of the block's gathering time passes — unless the drain
        sends a request meanwhile (a flushed position is reported to the server at once). Waiting
        on the requests alone, not on the socket, lets the messages of a light stream (a
        transaction every few milliseconds) pile up, so that neither this loop nor the drain
        wakes per message: a block per transaction or two would make them pay a block's fixed
        cost that often."""
        if select.select([self.pgconn.socket], [], [], 0)[0]:
            return True
        left = self._first_at + self.gather_seconds - time.monotonic()
        return left > 0 and not select.select([requests_fd], [], [], left)[0]

    def _send_block(self) -> None:
        """The partial block, then the position of the keepalives that came with its messages."""
        if self._lsns:
            self.frames.put(BLOCK, len(self._lsns), self._size, self._lsns, self._ends, b"".join(self._data))
            self._lsns, self._ends, self._data, self._size = array("q"), array("q"), [], 0
        self._send_position()

    def _send_position(self) -> None:
        """A ``P`` frame with the position of the newest keepalive not reported yet (every message
        before it is in the blocks already put). The server sends one whenever it has sent all the
        WAL there is — after each transaction of a light stream: a frame, and a block cut short,
        per transaction would be the drain's largest cost at a few hundred transactions a second."""
        if self._position is not None:
            self.frames.put(POSITION, self._position)
            self._position = None

    def stop(self) -> None:
        """CopyDone, then wait for the server's end of the copy and of the command."""
        pgconn = self.pgconn
        pgconn.put_copy_end()
        pgconn.flush()
        while True:
            size, _ = pgconn.get_copy_data(0)
            if size < 0:
                break
        while (result := pgconn.get_result()) is not None:
            if result.status == pq.ExecStatus.FATAL_ERROR:
                raise StreamEnded(result)
        self.conn.close()


def _malformed(data: bytes) -> DecodeError:
    """The error that names what is wrong with a message the stream cannot carry."""
    try:
        message = decode_server_message(data)
    except DecodeError as error:
        return error
    return DecodeError(f"{len(data)} bytes that do not fit {type(message).__name__}", message_type=None, offset=0)


def _sized(payload: bytes) -> tuple[int, int, bytes]:
    return len(payload), 0, payload


def follow(stream: Stream, requests: Requests) -> None:
    """Receive until the drain asks to stop (or standard input closes)."""
    sock = stream.pgconn.socket
    while True:
        readable = [requests.fd, stream.frames.wake_fd] if stream.frames.full else [requests.fd, sock]
        wait = max(0.0, stream.last_status + stream.status_seconds - time.monotonic())
        ready, _, _ = select.select(readable, [], [], wait)
        if stream.frames.wake_fd in ready:
            stream.frames.woken()
        if sock in ready:
            stream.pgconn.consume_input()
        if not stream.frames.full:
            stream.receive(requests.fd)
        for request in requests.take() if requests.fd in ready else []:
            if request.get("stop"):
                stream.stop()
                stream.frames.put(DONE, 0)
                return
            if "flushed" in request:
                stream.flushed = max(stream.flushed, int(request["flushed"]))
            stream.status(reply_requested=bool(request.get("ping")))
        if requests.closed:
            return
        if time.monotonic() - stream.last_status >= stream.status_seconds:
            stream.status(reply_requested=False)


def serve(requests: Requests, frames: Frames) -> None:
    """Answer requests until standard input ends."""
    while (request := requests.wait()) is not None:
        if "conninfo" not in request:
            continue  # a late request for a stream that already ended
        stream: Stream | None = None
        try:
            stream = Stream(request, frames)
            frames.put(READY, stream.pgconn.backend_pid)
            follow(stream, requests)
        except (psycopg.Error, StreamEnded, DecodeError, ConnectFailed) as error:
            frames.put(ERROR, *_sized(error_payload(error)))
        finally:
            if stream is not None and not stream.conn.closed:
                stream.conn.close()


def _die_with_parent() -> None:
    """Exit when the parent does (checked every :data:`PARENT_CHECK_S`, whatever the child is
    doing); leave interrupts (Ctrl-C reaches the whole process group) to the parent.

    ``PR_SET_PDEATHSIG`` would not do: it fires when the *thread* that started the child ends.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


if __name__ == "__main__":
    _die_with_parent()
    serve(Requests(sys.stdin.fileno()), Frames(sys.stdout.fileno()))
