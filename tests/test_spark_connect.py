"""Spark Connect: ``cdc-assets spark-server``, and the apply path run over a Connect session
(docs/architecture.md, "Spark Connect") — the differential test's smaller variant, and a Dagster
sensor's merge run with ``spark.remote``."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import dagster as dg
import psutil
import pytest

from cdc_assets.apply.session import is_connect
from cdc_assets.lsn import format_lsn
from tests.support.dagster_env import (
    DEMO_INSTANCE,
    DSN_VARIABLE,
    MIRROR_KEYS,
    ROOT,
    DagsterEnv,
    create_source,
    materialization,
    requested,
    tick_time,
)
from tests.support.dagster_rounds import ROUND_1
from tests.support.database import Database
from tests.support.differential import SMALL_OPS, SMALL_SEEDS, SeedResult, run_seed
from tests.support.pipeline import wait_until
from tests.support.spark_server import (  # the fixtures: used by name
    CONNECT_MODE,
    STOP_TIMEOUT_S,
    RunningServer,
    classic_mode_restored,  # noqa: F401
    connect_session,
    listening,
    start_server,
)

pytestmark = pytest.mark.slow


def test_spark_server_prints_its_address_and_stops_on_sigterm(tmp_path: Path) -> None:
    """The server listens where it says, serves a Delta statement, and SIGTERM stops it: exit 0,
    the port closed, no JVM left behind."""
    server = start_server(tmp_path)
    assert f"listening at {server.address} (Ctrl-C stops it)" in server.lines, server.lines
    session = connect_session(server)
    path = tmp_path / "t"
    session.sql(f"CREATE TABLE delta.`{path}` (id bigint) USING delta").collect()
    session.sql(f"INSERT INTO delta.`{path}` VALUES (1), (2)").collect()
    assert session.read.format("delta").load(str(path)).count() == 2
    session.stop()
    assert server.stop() == 0, server.lines
    assert not listening(server.port)
    assert server.lines[-1] == "stopped", server.lines


def test_the_server_dies_with_its_command_when_that_is_killed(tmp_path: Path) -> None:
    """SIGKILL the ``cdc-assets spark-server`` command (no clean-up of its own can run): its JVM, in
    a session of its own, stops too — the port free, the process gone — rather than living on."""
    server = start_server(tmp_path)
    [jvm] = psutil.Process(server.process.pid).children()
    try:
        assert jvm.is_running() and listening(server.port)
        server.process.kill()
        assert server.process.wait(STOP_TIMEOUT_S) == -signal.SIGKILL
        wait_until(lambda: not listening(server.port) and gone(jvm), STOP_TIMEOUT_S, "the server's JVM to stop")
    finally:
        if not gone(jvm):
            jvm.kill()


def gone(process: psutil.Process) -> bool:
    """Ended (a zombie no one reaped has ended too)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_process_with_a_connect_session_exits_at_once_after_its_server_stopped(tmp_path: Path) -> None:
    """A session opened through ``spark_session`` is kept for the process (a Dagster run's): at
    exit cdc-assets closes it itself — pyspark's own exit clean-up would call the stopped server
    and retry for minutes."""
    server = start_server(tmp_path)
    script = (
        "import sys\n"
        "from cdc_assets.apply.session import spark_session\n"
        "from cdc_assets.config import SparkConfig\n"
        f"spark_session(SparkConfig(remote={server.address!r})).sql('SELECT 1').collect()\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        assert child.stdout.readline().strip() == "ready"
        assert server.stop() == 0, server.lines
        child.stdin.close()
        assert child.wait(timeout=60) == 0
    finally:
        child.kill()
        child.wait()


def test_differential_over_spark_connect(pg: Database, connect_server: RunningServer, tmp_path: Path) -> None:
    """The differential test's smaller variant with every merge, schema change and read over a
    Spark Connect session: exact, read back by Spark (over Connect) and by delta-rs."""

    def one(seed: int) -> SeedResult:
        session = connect_session(connect_server)
        assert is_connect(session)
        try:
            return run_seed(pg, session, tmp_path / f"seed{seed}", seed, ops=SMALL_OPS, remote=connect_server.address)
        finally:
            session.stop()

    with ThreadPoolExecutor(len(SMALL_SEEDS), thread_name_prefix="seed") as pool:
        results = list(pool.map(one, SMALL_SEEDS))
    assert not [p for r in results for p in r.problems], "\n\n".join(p for r in results for p in r.problems)
    assert all(r.rows_compared > 0 and r.changes > 0 for r in results), [(r.rows_compared, r.changes) for r in results]
    writes = {w for r in results for w, n in r.writes.items() if n}
    assert {"create", "MERGE", "REPLACE ON"} <= writes, writes


def test_dagster_sensor_merge_runs_over_spark_connect(
    pg: Database, connect_server: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``spark.remote`` in the configuration, the drain schedule's run and each sensor's merge
    run (executed as the daemon launches them) merge over the Connect server: every table equals
    its source after the first merges and after a round of inserts, updates and deletes."""
    folder = tmp_path / "dagster"
    monkeypatch.setenv("CDC_CONFIG", str(folder / "cdc.yaml"))
    monkeypatch.setenv(DSN_VARIABLE, pg.dsn)
    create_source(pg, folder, spark={"remote": connect_server.address})  # spark.remote in place of the master
    with dg.instance_for_test(overrides=DEMO_INSTANCE) as instance:
        env = DagsterEnv(pg, folder, instance)
        for minute, transactions in ((0, []), (5, ROUND_1)):
            env.transactions(*transactions)
            env.run_schedule(tick_time(minute))
            ticks = env.evaluate_sensors()
            assert requested(ticks), {t: tick.skip_message for t, tick in ticks.items()}
            results = env.merge_requested(ticks)
            env.assert_delta_equals_source()
            for table, result in results.items():
                metadata = materialization(result, MIRROR_KEYS[table])
                assert metadata["applied_lsn"] == format_lsn(env.checkpoint_lsn()) == format_lsn(env.applied(table))
    assert os.environ.get(CONNECT_MODE) == "1"  # the runs' Spark sessions were Connect sessions
