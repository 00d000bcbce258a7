"""A ``cdc-assets spark-server`` in a subprocess for tests (``tests/conftest.py`` has the
``connect_server`` fixture), the sessions that reach it, and the fixture that takes a test's
Connect mark off the process again (pyspark marks the whole process once a Connect session is
opened): a module that opens Connect sessions imports it, so it is autouse there."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from tests.support.pipeline import wait_until

CONNECT_MODE = "SPARK_CONNECT_MODE_ENABLED"
START_TIMEOUT_S = 600.0  # a first start resolves Delta's jars through Ivy
STOP_TIMEOUT_S = 90.0


@dataclass(slots=True)
class RunningServer:
    """A ``cdc-assets spark-server`` subprocess and the lines it printed."""

    process: subprocess.Popen[str]
    port: int
    lines: list[str]

    @property
    def address(self) -> str:
        return f"sc://127.0.0.1:{self.port}"

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(STOP_TIMEOUT_S)

    def crash(self) -> None:
        """SIGKILL the server's JVM (a process group of its own) and the command that started it."""
        children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True, check=False)
        for pid in children.stdout.split():
            os.killpg(int(pid), signal.SIGKILL)
        self.process.kill()
        self.process.wait(STOP_TIMEOUT_S)
        wait_until(lambda: not listening(self.port), 30, "the killed server's port to close")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def listening(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return True
    except OSError:
        return False


def start_server(
    folder: Path, *options: str, environ: dict[str, str] | None = None, port: int | None = None
) -> RunningServer:
    """``cdc-assets spark-server [options]`` in ``folder`` (no configuration file there: a plain
    server with Delta, unless ``options`` name one) on ``port`` (None: a free one), waited on until
    it prints its address."""
    folder.mkdir(parents=True, exist_ok=True)
    port = port or free_port()
    environ = {k: v for k, v in os.environ.items() if k != "CDC_CONFIG"} | (environ or {})
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "cdc_assets",
            "spark-server",
            "--port",
            str(port),
            "--log",
            str(folder / "server.log"),
            *options,
        ],
        cwd=folder,
        env=environ,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = RunningServer(process, port, [])

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            server.lines.append(line.rstrip("\n"))

    threading.Thread(target=read, daemon=True).start()
    try:
        wait_until(
            lambda: any("listening at" in line for line in server.lines) or process.poll() is not None,
            timeout=START_TIMEOUT_S,
            what="the Spark Connect server to listen",
        )
    except BaseException:
        process.kill()
        raise
    assert process.poll() is None, server.lines
    return server


def connect_session(server: RunningServer) -> SparkSession:
    return SparkSession.builder.remote(server.address).create()


@pytest.fixture(autouse=True)
def classic_mode_restored() -> Iterator[None]:
    """A Connect session marks the whole process as Spark Connect (pyspark's
    ``SPARK_CONNECT_MODE_ENABLED``, which makes ``pyspark.sql.functions`` build Connect columns);
    the other test modules share a classic session, so the mark goes with each test."""
    before = os.environ.get(CONNECT_MODE)
    yield
    if before is None:
        os.environ.pop(CONNECT_MODE, None)
    else:
        os.environ[CONNECT_MODE] = before
