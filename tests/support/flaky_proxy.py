"""A TCP proxy in front of a server of the test run (the S3 server), which a test can cut for a
while: every connection through it is reset, and new ones are reset as they arrive, until it is
restored — an object store that fails every request for a while."""

from __future__ import annotations

import socket
import struct
import threading
from types import TracebackType

BUFFER = 1 << 16


class FlakyProxy:
    """Forwards ``127.0.0.1:<port>`` to ``127.0.0.1:<target_port>`` until :meth:`cut`."""

    def __init__(self, target_port: int) -> None:
        self._target = ("127.0.0.1", target_port)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._cut = False
        self.resets = 0  # connections reset by a cut (both ends count) and while cut
        threading.Thread(target=self._accept, name="flaky-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def cut(self) -> None:
        """Reset every open connection, and each new one, until :meth:`restore`."""
        with self._lock:
            self._cut = True
            self.resets += len(self._open)
            for conn in self._open:
                _reset(conn)
            self._open.clear()

    def restore(self) -> None:
        with self._lock:
            self._cut = False

    def __enter__(self) -> FlakyProxy:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._listener.close()
        self.cut()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._cut:
                    self.resets += 1
                    _reset(client)
                    continue
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._open.update((client, upstream))
            for source, sink in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(BUFFER):
                sink.sendall(data)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            _reset(sink)
        with self._lock:
            self._open.discard(source)


def _reset(conn: socket.socket) -> None:
    """Close ``conn`` with a TCP reset (the peer reads ECONNRESET, not an orderly end)."""
    try:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()
    except OSError:
        pass
