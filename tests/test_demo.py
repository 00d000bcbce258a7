"""``cdc-assets demo`` as a user runs it, and every server a command starts ends with it.

The demo runs as the real command in a subprocess: once to its end (``parity OK``), then
``demo --ui`` on the folder it left (PostgreSQL again, ``dagster dev`` with its webserver, daemon
and code server), and once more SIGTERMed in the middle, while its PostgreSQL and its Spark JVM
run. A service manager or ``docker stop`` sends SIGTERM to the command's own process only; after
it, no process the command started may survive: neither its descendants nor the PostgreSQL
postmaster, which ``pg_ctl`` detaches (found through the cluster's ``postmaster.pid``).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from tests.support.pipeline import wait_until

pytestmark = pytest.mark.slow


class Command:
    """``cdc-assets <args>`` in a subprocess, its output collected line by line as it comes."""

    def __init__(self, *args: str, cwd: Path) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        env.pop("DAGSTER_HOME", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cdc_assets", *args],
            cwd=cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # signals from the terminal or pytest do not reach it
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def printed(self, text: str) -> bool:
        if self.process.poll() is not None and not any(text in line for line in self.lines):
            raise AssertionError(
                f"the command ended ({self.process.returncode}) before printing {text!r}:\n{self.output}"
            )
        return any(text in line for line in self.lines)

    def finish(self, timeout: float) -> str:
        self.process.wait(timeout=timeout)
        self._reader.join(timeout=10)
        return self.output

    def kill_group(self) -> None:
        """Teardown after a failed test: whatever is left of the command's process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)


def _postmaster(demo: Path) -> psutil.Process | None:
    """The running PostgreSQL server of a demo folder (``pg_ctl`` detached it from the command)."""
    cluster = Path(json.loads((demo / "demo.json").read_text())["cluster"])
    pid_file = cluster / "data" / "postmaster.pid"
    if not pid_file.exists():
        return None
    try:
        return psutil.Process(int(pid_file.read_text().split()[0]))
    except (psutil.NoSuchProcess, ValueError, IndexError):
        return None


def _started_by(command: Command, demo: Path) -> list[psutil.Process]:
    """Every process ``command`` started and that runs now: its descendants, and the postmaster
    with its backends."""
    processes = psutil.Process(command.process.pid).children(recursive=True)
    postmaster = _postmaster(demo)
    if postmaster is not None:
        processes += [postmaster, *postmaster.children(recursive=True)]
    return processes


def _gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _name(process: psutil.Process) -> str:
    """Its command line; empty once it has ended."""
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def _sigterm_and_check(command: Command, demo: Path, started: list[psutil.Process], exit_code: int) -> None:
    """SIGTERM the command's own process; it must exit and take everything it started with it."""
    command.process.send_signal(signal.SIGTERM)
    output = command.finish(timeout=120)
    assert command.process.returncode == exit_code, f"exit {command.process.returncode}\n{output}"
    def survivors() -> list[str]:
        return [f"{p.pid} {_name(p)[:200]}" for p in started if not _gone(p)]

    try:
        wait_until(lambda: not survivors(), 60, "every process the command started to end")
    except TimeoutError:
        raise AssertionError(f"still running 60 s after the command ended: {survivors()}") from None
    postmaster = _postmaster(demo)
    assert postmaster is None or _gone(postmaster), "PostgreSQL outlived the command"


@pytest.fixture(scope="module")
def finished_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A demo run to its end: its folder and its output."""
    work = tmp_path_factory.mktemp("demo")
    command = Command("demo", "--dir", "shop", cwd=work)
    try:
        output = command.finish(timeout=900)
    finally:
        command.kill_group()
    assert command.process.returncode == 0, output
    yield work / "shop", output


def test_demo_ends_with_parity_ok(finished_demo: tuple[Path, str]) -> None:
    folder, output = finished_demo
    assert output.rstrip().splitlines()[-1] == f"Open the Dagster UI on it:  cdc-assets demo --ui --dir {folder}"
    assert "\nparity OK\n" in output, output
    for table in ("public.customers", "public.orders", "public.order_lines"):
        assert any(line.startswith(table) and line.rstrip().endswith("OK") for line in output.splitlines()), output
    assert _postmaster(folder) is None, "the demo left its PostgreSQL running"


def test_sigterm_stops_demo_ui_and_everything_it_started(finished_demo: tuple[Path, str], tmp_path: Path) -> None:
    folder, _ = finished_demo
    port = _free_port()
    command = Command("demo", "--ui", "--dir", str(folder), "--port", str(port), cwd=tmp_path)
    try:
        wait_until(lambda: command.printed("Dagster UI on"), 120, "the demo's PostgreSQL to start")
        wait_until(lambda: _serves(port, command), 180, "the Dagster webserver to answer")
        started = _started_by(command, folder)
        names = " ".join(_name(p) for p in started)
        for part in ("dagster_webserver", "dagster._daemon", "code-server", "postgres"):
            assert part in names, f"{part} is not among the processes the command started: {names[:2000]}"
        _sigterm_and_check(command, folder, started, exit_code=0)  # stopping is how the UI ends
    finally:
        command.kill_group()


def test_sigterm_stops_the_demo_midway_with_its_postgres_and_spark(tmp_path: Path) -> None:
    command = Command("demo", "--dir", "shop", cwd=tmp_path)
    folder = tmp_path / "shop"
    try:
        wait_until(lambda: command.printed("sensors request merges"), 600, "the demo's first merges")

        def spark_runs() -> bool:
            command.printed("sensors request merges")  # raises if the demo ended
            return any("java" in _name(p) for p in psutil.Process(command.process.pid).children(recursive=True))

        wait_until(spark_runs, 300, "the demo's Spark JVM")
        started = _started_by(command, folder)
        assert _postmaster(folder) is not None
        _sigterm_and_check(command, folder, started, exit_code=130)
        assert "parity" not in command.output, "the demo went on after SIGTERM"
    finally:
        command.kill_group()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _serves(port: int, command: Command) -> bool:
    command.printed("Dagster UI on")  # raises if the command ended
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
