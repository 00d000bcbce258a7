"""Commands run as a user runs them, in a subprocess, and the processes they start: for the tests
that stop a command with SIGTERM and check that nothing it started survives, and for those that
kill one and wait until its processes (:func:`group_alive`) and its sessions on the source
(:func:`cdc_sessions`) are gone."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psutil
import psycopg

from tests.support.pipeline import wait_until


class Command:
    """``cdc-assets <args>`` in a subprocess, its output collected line by line as it comes."""

    def __init__(self, *args: str, cwd: Path, env: dict[str, str] | None = None, unset: tuple[str, ...] = ()) -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        for name in ("DAGSTER_HOME", *unset):
            env.pop(name, None)
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


JAVA_PROGRAMS = ("java", "javac", "jar", "jshell", "keytool")


def path_without_java(folder: Path) -> str:
    """A ``PATH`` of one folder, made in ``folder``, with every program of this ``PATH`` but Java's."""
    folder.mkdir(parents=True, exist_ok=True)
    for directory in os.environ.get("PATH", "").split(os.pathsep):
        if not os.path.isdir(directory):
            continue
        for entry in os.scandir(directory):
            link = folder / entry.name
            if entry.name not in JAVA_PROGRAMS and not link.exists() and os.access(entry.path, os.X_OK):
                link.symlink_to(entry.path)
    return str(folder)


def gone(process: psutil.Process) -> bool:
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def process_name(process: psutil.Process) -> str:
    """Its command line; empty once it has ended."""
    try:
        return " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return ""


def sigterm_and_check(command: Command, started: list[psutil.Process], exit_code: int) -> None:
    """SIGTERM the command's own process; it must exit and take everything it started with it."""
    command.process.send_signal(signal.SIGTERM)
    output = command.finish(timeout=120)
    assert command.process.returncode == exit_code, f"exit {command.process.returncode}\n{output}"

    def survivors() -> list[str]:
        return [f"{p.pid} {process_name(p)[:200]}" for p in started if not gone(p)]

    try:
        wait_until(lambda: not survivors(), 60, "every process the command started to end")
    except TimeoutError:
        raise AssertionError(f"still running 60 s after the command ended: {survivors()}") from None


def group_alive(pgid: int) -> bool:
    """Whether a live (non-zombie) process of process group ``pgid`` is left."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            return True
    return False


def cdc_sessions(conn: psycopg.Connection[Any]) -> list[tuple[Any, ...]]:
    """The sessions of ``conn``'s database that cdc-assets opened (every one is named
    ``cdc-assets:<purpose>``): pid, application name, state, wait event."""
    return conn.execute(
        "SELECT pid, application_name, state, wait_event FROM pg_stat_activity WHERE datname = current_database()"
        " AND application_name LIKE 'cdc-assets:%' AND pid <> pg_backend_pid()"
    ).fetchall()
