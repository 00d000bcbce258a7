"""A Spark Connect server with Delta: one long-lived Spark application that every run talks to.

``cdc-assets spark-server`` runs pyspark's own ``spark-submit`` with the Connect server class that
the pyspark wheel ships (``jars/spark-connect_2.13-*.jar``) and the settings a classic session of
the same configuration would start with (:func:`~cdc_assets.apply.session.session_settings`:
Delta's SQL extension and catalog, Delta's jars, s3a for a warehouse on S3, ``spark.conf``). A run
then sets ``spark.remote: sc://host:port`` and pays no JVM start: it only opens a session.

Over Connect only Delta's SQL reaches the server (Delta's Python ``DeltaTable`` needs a Connect
plugin that is not published for this Spark), which is all cdc-assets uses (docs/architecture.md,
"Spark Connect").
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import pyspark

from cdc_assets.apply.java_runtime import ensure_java
from cdc_assets.apply.session import DEFAULT_CONNECT_PORT, session_settings
from cdc_assets.config import SparkConfig
from cdc_assets.errors import CdcError

SERVER_CLASS = "org.apache.spark.sql.connect.service.SparkConnectServer"
STOP_TIMEOUT_S = 60.0
PR_SET_PDEATHSIG = 1  # prctl(2)'s option, <linux/prctl.h>


class ConnectServerError(CdcError):
    """The Spark Connect server did not start, or stopped on its own."""


@dataclass(slots=True)
class ConnectServer:
    """How to start one server: the Spark settings, where it listens, where its log goes."""

    spark: SparkConfig
    host: str = "127.0.0.1"
    port: int = DEFAULT_CONNECT_PORT
    master: str = "local[*]"
    log: Path | None = None

    @property
    def address(self) -> str:
        return f"sc://{self.host}:{self.port}"

    def settings(self) -> dict[str, str]:
        """The server's Spark settings: a classic session's for the same configuration, and where
        it listens."""
        settings = session_settings(replace(self.spark, master=self.master, remote=None))
        return settings | {
            "spark.app.name": "cdc-assets Spark Connect server",
            "spark.connect.grpc.binding.address": self.host,
            "spark.connect.grpc.binding.port": str(self.port),
        }

    def command(self, properties: Path) -> list[str]:
        """The ``spark-submit`` command line, its settings in the file ``properties`` (so the S3
        keys a ``storage`` section may hold are not on a command line that ``ps`` shows)."""
        return [
            str(_spark_submit()),
            "--master",
            self.master,
            "--properties-file",
            str(properties),
            "--class",
            SERVER_CLASS,
        ]


def serve(server: ConnectServer, ready: Callable[[str], None], start_timeout_s: float = 600.0) -> int:
    """Run ``server`` in the foreground until it stops or this process is interrupted (SIGINT, or
    SIGTERM raised as :class:`KeyboardInterrupt`); ``ready`` gets its ``sc://`` address once it
    accepts connections. Returns the server's exit status (0 after an interrupt). Runs on the main
    thread: the server gets SIGTERM when the thread that started it ends, and so dies with this
    process, even a SIGKILLed one (on Linux)."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("serve() runs on the main thread: its server dies when the thread that started it ends")
    ensure_java()
    with tempfile.TemporaryDirectory(prefix="cdc-connect-") as folder:
        properties = Path(folder, "spark.properties")
        properties.touch(mode=0o600)
        properties.write_text("".join(f"{key}={_escaped(value)}\n" for key, value in server.settings().items()))
        return _run(server, properties, ready, start_timeout_s)


def _escaped(value: str) -> str:
    """A value as a Java properties file reads it back."""
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace(":", "\\:").replace("=", "\\=")


def _run(server: ConnectServer, properties: Path, ready: Callable[[str], None], start_timeout_s: float) -> int:
    out = open(server.log, "ab") if server.log else subprocess.DEVNULL  # noqa: SIM115 (closed below)
    try:
        process = subprocess.Popen(
            server.command(properties),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a Ctrl-C reaches this process only, which stops the server in order
            preexec_fn=_dying_with(os.getpid()),
        )
        try:
            _wait_until_listening(server, process, start_timeout_s)
            ready(server.address)
            return process.wait()
        except KeyboardInterrupt:
            return _stop(process)
        finally:
            if process.poll() is None:
                _stop(process)
    finally:
        if server.log:
            out.close()  # type: ignore[union-attr]


def _dying_with(parent: int) -> Callable[[], None] | None:
    """What the server's process runs between fork and exec: Linux's parent-death signal set to
    SIGTERM (it survives the exec of ``spark-submit`` and of the JVM), so that the JVM stops when
    ``parent`` — this process — dies, however it dies, instead of holding its port; it exits at once
    if ``parent`` died before that. Elsewhere, nothing."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it

    def die_with_parent() -> None:
        if prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM)) != 0 or os.getppid() != parent:
            os._exit(1)

    return die_with_parent


def _wait_until_listening(server: ConnectServer, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    where = f" (its log: {server.log})" if server.log else ""
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise ConnectServerError(f"the Spark Connect server exited with status {process.returncode}{where}")
        try:
            with socket.create_connection((server.host, server.port), timeout=1.0):
                return
        except OSError:
            time.sleep(0.5)
    raise ConnectServerError(f"the Spark Connect server did not listen on {server.address} in {timeout_s:.0f} s{where}")


def _stop(process: subprocess.Popen[bytes]) -> int:
    """SIGTERM (the JVM's shutdown hooks stop the server and Spark), SIGKILL if it hangs."""
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    return 0


def _spark_submit() -> Path:
    """pyspark's own ``spark-submit`` (``$SPARK_HOME``'s when set)."""
    home = Path(os.environ.get("SPARK_HOME") or Path(pyspark.__file__).resolve().parent)
    script = home / "bin" / "spark-submit"
    if not script.exists():
        raise ConnectServerError(f"no spark-submit at {script}")
    return script
