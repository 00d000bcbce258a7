"""The receiving end of a peek, run as a child process (``python -m cdc_assets.peek_child``).

psycopg's per-row work and the drain's assembling both need the GIL, so in one process they take
turns. Here a child process with its own connection runs the peek and sends the rows to the drain
in blocks through its standard output, while the drain works on the blocks before — two cores
instead of one. The child needs nothing but psycopg: this module must not import the rest of the
package (``cdc_assets.source`` pulls in pyarrow, seconds of start-up).

Requests come on standard input, one JSON object per line: ``{"conninfo": …}`` connects,
``{"disconnect": true}`` disconnects, and
``{"setup": [[sql, params], …], "query": sql, "params": […], "fetch_rows": n, "block_rows": n}``
runs a peek (the setup statements and the query in one transaction, rolled back at the end).
Answers are frames: a header ``<kind, a, b>`` (:data:`HEADER`) and a payload —

* ``R`` ready, ``a`` = the connection's backend pid;
* ``B`` a block of ``a`` rows and ``b`` bytes of messages: ``a`` LSNs (int64), ``a`` end offsets
  (int64) and the messages joined;
* ``D`` the peek is done, ``a`` rows in all;
* ``E`` an error, ``a`` bytes of JSON ``{"sqlstate", "message", "text"}``.

The child exits when its parent does or closes standard input.
"""

from __future__ import annotations

import json
import os
import signal
import struct
import sys
import threading
import time
from array import array
from collections.abc import Iterator
from itertools import accumulate, islice
from operator import itemgetter
from typing import Any, BinaryIO

import psycopg
from psycopg.pq import TransactionStatus

HEADER = struct.Struct("<cqq")
READY, BLOCK, DONE, ERROR = b"R", b"B", b"D", b"E"
PARENT_CHECK_S = 0.2
_LSN, _DATA = itemgetter(0), itemgetter(1)


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
    return json.dumps({"sqlstate": sqlstate, "message": message, "text": str(error)}).encode()


def _die_with_parent() -> None:
    """Exit when the parent does (checked every :data:`PARENT_CHECK_S`, whatever the child is
    doing); leave interrupts (Ctrl-C reaches the whole process group) to the parent.

    ``PR_SET_PDEATHSIG`` would not do: it fires when the *thread* that started the child ends.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def _blocks(conn: psycopg.Connection[Any], request: dict[str, Any]) -> Iterator[tuple[array[int], array[int], bytes]]:
    stream = conn.cursor(binary=True).stream(request["query"], request["params"], size=request["fetch_rows"])
    try:
        while rows := list(islice(stream, request["block_rows"])):
            datas = list(map(_DATA, rows))
            yield array("q", map(_LSN, rows)), array("q", accumulate(map(len, datas))), b"".join(datas)
    finally:
        stream.close()  # type: ignore[attr-defined]  # a generator, which psycopg annotates as Iterator


def _peek(conn: psycopg.Connection[Any], request: dict[str, Any], out: int) -> None:
    conn.execute("BEGIN")
    try:
        for sql, params in request["setup"]:
            conn.execute(sql, params)
        total = 0
        for lsns, ends, data in _blocks(conn, request):
            write_frame(out, BLOCK, len(lsns), len(data), lsns, ends, data)
            total += len(lsns)
        write_frame(out, DONE, total)
    finally:
        if conn.info.transaction_status != TransactionStatus.IDLE:
            conn.execute("ROLLBACK")


def serve(requests: BinaryIO, out: int) -> None:
    """Answer requests until standard input ends."""
    conn: psycopg.Connection[Any] | None = None
    for line in requests:
        request = json.loads(line)
        try:
            if "conninfo" in request:
                conn = psycopg.connect(request["conninfo"], autocommit=True)
                write_frame(out, READY, conn.info.backend_pid)
            elif "disconnect" in request:
                if conn is not None:
                    conn.close()
                conn = None
            elif conn is None:
                raise RuntimeError("a peek was asked for without a connection")
            else:
                _peek(conn, request, out)
        except psycopg.Error as error:
            write_frame(out, ERROR, *_sized(error_payload(error)))
    if conn is not None:
        conn.close()


def _sized(payload: bytes) -> tuple[int, int, bytes]:
    return len(payload), 0, payload


if __name__ == "__main__":
    _die_with_parent()
    serve(sys.stdin.buffer, sys.stdout.fileno())
