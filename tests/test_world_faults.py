"""A following ``sync`` (or drain) rides out the faults of the world it runs in, under a write load
(docs/architecture.md, "Interrupts and lost connections"): its PostgreSQL server crashing
(``pg_ctl -m immediate stop``) and starting again — every connection is reopened and the drain
lock taken again — and its Spark Connect server killed mid-merge and started again — the merges
wait, then go on with new sessions. Nothing is lost or duplicated, and every mirror ends equal to
its source.

Each test crashes a server of its own (never the shared cluster of the ``pg`` fixture). The
writer (:class:`~tests.support.crash.WriterThread` with ``restarts``) reconnects by itself and
settles a COMMIT the crash cut off by its ledger row. A crash waits until the drain has noticed
and failed to reach the server at least once more (its "reconnecting" warnings) before the server
starts again, so the reconnects meet a server that is down.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Protocol

import psycopg
import pytest

from cdc_assets.apply import follower
from cdc_assets.apply.follower import MergeFollower
from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, load_config
from cdc_assets.pipeline.drain import DrainResult, drain
from cdc_sandbox.pgcluster import ThrowawayCluster
from tests.support.bucket import Bucket
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.crash import (
    EVENTS,
    LEDGER,
    SCHEMA_SQL,
    LedgerWorkload,
    WriterThread,
    assert_no_litter,
    describe,
    run_cli,
    verify_log,
)
from tests.support.database import Database, create_database
from tests.support.flaky_proxy import FlakyProxy
from tests.support.mirror_diff import assert_delta_equals_source
from tests.support.pipeline import wait_until
from tests.support.spark_host import COMMANDS_SPARK, OWN_SPARK
from tests.support.spark_server import start_server

SLOT = "restart_slot"
WRITER_RATE = 30.0  # transactions per second
COMMIT_SECONDS = 0.5  # drain.commit_seconds: many durable batches (and merges) between the crashes
DRAIN_FOLLOW_S = 15.0  # the crash and restart take about 5 s of it here
FOLLOW_UNTIL_STOPPED_S = 900.0  # a follow the test ends (SIGTERM) once every table is merged to the checkpoint
STORAGE_OUTAGE_S = 20.0
RECONNECTING = "reconnecting in"
CONNECT_LOST = "the Spark Connect server went away or was started again"


@pytest.fixture
def server() -> Iterator[Database]:
    """A fresh database on a throwaway cluster of its own, which the test may crash."""
    with ThrowawayCluster(int(os.environ.get("CDC_TEST_PG", "16"))) as cluster:
        yield create_database(cluster)


def _setup(db: Database, folder: Path, *, spark: dict[str, Any] | None = None, **sections: dict[str, Any]) -> Path:
    """The ledger schema, ``cdc.yaml`` (``spark`` and ``sections``: its sections) and ``cdc-assets setup``."""
    with db.connect() as conn:
        for sql in SCHEMA_SQL:
            conn.execute(sql)
    path = write_config(
        folder,
        [EVENTS, LEDGER],
        source={"publication": f"{SLOT}_pub", "slot": SLOT, "batch_changes": 200},
        drain={"commit_seconds": COMMIT_SECONDS},
        spark=spark,
        **sections,
    )
    result = run_cli(path, db.dsn, "setup")
    assert result.returncode == 0, describe(result)
    return path


def _config(path: Path, dsn: str) -> Config:
    """The test's configuration as its commands read it: this process's environment (a bucket's
    keys) and the server's DSN."""
    return load_config(path, environ={**os.environ, DSN_VARIABLE: dsn})


def _checkpoint_lsn(config: Config) -> int:
    checkpoint = ChangeLogReader(changelog_store(config)).checkpoint()
    assert checkpoint is not None
    return checkpoint.lsn


def _flush_lsn(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        (lsn,) = conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0')::int8").fetchone()
    return int(lsn)


class Drain(Protocol):
    """A following drain under test."""

    def running(self) -> bool: ...

    def output(self) -> str:
        """How it ended (for a failure's message)."""

    def reconnecting(self) -> int:
        """How many "reconnecting" warnings it has given."""


def _streaming(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)).fetchone()
    return row is not None and row[0] is not None


def _drained_past_now(path: Path, dsn: str, drain: Drain, what: str, timeout: float = 90) -> None:
    """Wait until the drain streams the slot and its checkpoint reaches the server's WAL flush
    position of then."""
    wait_until(lambda: not drain.running() or _streaming(dsn), timeout, f"the stream, for {what}")
    lsn = _flush_lsn(dsn)
    config = _config(path, dsn)
    wait_until(lambda: not drain.running() or _checkpoint_lsn(config) >= lsn, timeout, what)
    assert drain.running(), f"the drain ended while waiting for {what}:\n{drain.output()}"


def _crash_and_restart(cluster: ThrowawayCluster, drain: Drain) -> None:
    """Crash the server; start it again once the drain has reported the lost stream and one failed
    attempt to reach the server (two more "reconnecting" warnings)."""
    before = drain.reconnecting()
    cluster.crash()
    try:
        wait_until(
            lambda: not drain.running() or drain.reconnecting() >= before + 2,
            60,
            "the drain to fail to reach the server",
        )
        assert drain.running(), f"the drain ended while the server was down:\n{drain.output()}"
    finally:
        cluster.resume()


@dataclass
class _InProcess:
    """A drain on a thread of this process, its warnings read from ``caplog``."""

    following: Future[DrainResult]
    caplog: pytest.LogCaptureFixture

    def running(self) -> bool:
        return not self.following.done()

    def output(self) -> str:
        return repr(self.following.exception()) if self.following.done() else "running"

    def reconnecting(self) -> int:
        return self.caplog.text.count(RECONNECTING)


@pytest.mark.slow
def test_a_following_drain_rides_out_a_crash_of_its_server(
    server: Database, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """``drain(config, follow_seconds=…)`` on a thread; the server crashes and starts again while it
    follows: the drain ends normally, and the change log holds every committed transaction exactly
    once, in commit order (the full check of ``tests/test_drain_crash.py``)."""
    path = _setup(server, tmp_path)
    config = _config(path, server.dsn)
    caplog.set_level(logging.WARNING, logger="cdc_assets.pipeline.drain")
    workload = LedgerWorkload(server.dsn, seed=11, large_share=0.02)
    writer = WriterThread(workload, WRITER_RATE, restarts=True)
    writer.start()
    with ThreadPoolExecutor(1) as pool:
        following = _InProcess(pool.submit(drain, config, follow_seconds=DRAIN_FOLLOW_S), caplog)
        try:
            _drained_past_now(path, server.dsn, following, "a first durable batch")
            _crash_and_restart(server.cluster, following)
            _drained_past_now(path, server.dsn, following, "a durable batch after the restart")
        finally:
            writer.stop()
        _drained_past_now(path, server.dsn, following, "the writer's last transaction")
        result = following.following.result(timeout=DRAIN_FOLLOW_S + 60)
    assert writer.outages >= 1
    assert result.reconnects >= 2
    verified = verify_log(tmp_path / "changelog", server.dsn, SLOT, workload)
    assert verified.transactions == workload.count
    workload.close()
    assert_no_litter(verified)


def test_a_following_drains_merges_wait_for_a_crashed_server(
    server: Database, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """:class:`MergeFollower` while the server is down: a merge that cannot take its table's write
    lock tries again with the drain's backoff, and merges once the server is back (the apply itself
    stubbed: no Spark; one worker, which uses the session it is given)."""
    path = _setup(server, tmp_path, spark={"parallel_merges": 1})
    config = _config(path, server.dsn)
    caplog.set_level(logging.WARNING, logger="cdc_assets.apply.follower")
    merged: list[str] = []

    def apply_table(mirror: Any) -> SimpleNamespace:
        merged.append(mirror.name)
        return SimpleNamespace(skipped=None, data_files=0)

    monkeypatch.setattr(follower, "apply_table", apply_table)
    applied: list[object] = []
    server.cluster.crash()
    with MergeFollower(config, None, applied.append):  # type: ignore[arg-type]
        wait_until(lambda: "trying again in" in caplog.text, 30, "a merge to fail to reach the server")
        server.cluster.resume()
        wait_until(lambda: len(applied) == 2, 60, "both tables merged")
    assert sorted(merged) == [EVENTS, LEDGER]


class _Sync:
    """``cdc-assets sync --follow <seconds>`` in a process group of its own, its output collected."""

    def __init__(self, path: Path, dsn: str, follow_s: float) -> None:
        env = {k: v for k, v in os.environ.items() if k not in ("CDC_ASSETS_FAULT", "CDC_CONFIG")}
        env.update({DSN_VARIABLE: dsn, "PYTHONUNBUFFERED": "1"})
        env.pop("SPARK_CONNECT_MODE_ENABLED", None)
        self.process = subprocess.Popen(
            [sys.executable, "-m", "cdc_assets", "sync", "--follow", str(follow_s), "-c", str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=path.parent,
            start_new_session=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._pumps = [
            threading.Thread(target=_pump, args=(stream, lines), daemon=True)
            for stream, lines in ((self.process.stdout, self.stdout), (self.process.stderr, self.stderr))
        ]
        for pump in self._pumps:
            pump.start()

    def running(self) -> bool:
        return self.process.poll() is None

    def count(self, text: str, *, err: bool = True) -> int:
        return sum(text in line for line in list(self.stderr if err else self.stdout))

    def reconnecting(self) -> int:
        return self.count(RECONNECTING)

    def merged(self) -> int:
        """How many merges it has reported."""
        return self.count(" applied LSN ", err=False)

    def wait(self, timeout: float) -> int:
        try:
            code = self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout:.0f} s:\n{self.output()}") from None
        for pump in self._pumps:
            pump.join(timeout=30)
        return code

    def kill(self) -> None:
        if self.running():
            os.killpg(self.process.pid, signal.SIGKILL)
        self.wait(60)

    def output(self) -> str:
        return describe((self.process.returncode, "\n".join(self.stdout), "\n".join(self.stderr)))


def _pump(stream: object, lines: list[str]) -> None:
    for line in stream:  # type: ignore[attr-defined]
        lines.append(line.rstrip("\n"))


def _terminate_walsender(server: Database) -> None:
    """Terminate the backend streaming the slot, once it has one (the drain may be between
    connections), and check that one was terminated."""

    def terminated() -> bool:
        with server.connect() as conn:
            row = conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                " WHERE slot_name = %s AND active_pid IS NOT NULL",
                (SLOT,),
            ).fetchone()
        return row is not None and bool(row[0])

    wait_until(terminated, 60, "a walsender streaming the slot, terminated")


@pytest.mark.slow
def test_sync_follow_rides_out_a_terminated_walsender_and_two_crashes_of_its_server(
    server: Database, spark: Any, tmp_path: Path
) -> None:
    """``cdc-assets sync --follow``: the drain follows and merges into Delta while a writer commits;
    its walsender is terminated once, then the server crashes and starts again twice. The command goes
    on and merges every table to the checkpoint; SIGTERM then ends it (exit 130), and the change log
    holds every transaction exactly once and every Delta table equals its source at the checkpoint."""
    path = _setup(server, tmp_path, spark=COMMANDS_SPARK)  # the test run's Spark: only PostgreSQL fails here
    # No non-transactional messages: the drain's retention deletes a batch that holds nothing else
    # once the tables are merged past it (it has no commit time to keep it for retention_hours).
    workload = LedgerWorkload(server.dsn, seed=12, large_share=0.02, plain_share=0.0)
    writer = WriterThread(workload, WRITER_RATE, restarts=True)
    writer.start()
    sync = _Sync(path, server.dsn, FOLLOW_UNTIL_STOPPED_S)

    try:
        wait_until(lambda: not sync.running() or sync.merged() > 0, 240, "a first merge")
        assert sync.running(), sync.output()
        _drained_past_now(path, server.dsn, sync, "a durable batch")
        before = sync.reconnecting()
        _terminate_walsender(server)  # the stream reconnects
        terminated = time.monotonic()
        wait_until(lambda: not sync.running() or sync.reconnecting() > before, 60, "the drain to reconnect")
        _drained_past_now(path, server.dsn, sync, "a durable batch after the walsender was terminated")
        print(f"after the walsender was terminated: durable again in {time.monotonic() - terminated:.1f} s")
        for _ in range(2):
            _drained_past_now(path, server.dsn, sync, "a durable batch")
            _crash_and_restart(server.cluster, sync)
            resumed = time.monotonic()
            _drained_past_now(path, server.dsn, sync, "a durable batch after the restart")
            durable = time.monotonic() - resumed
            before = sync.merged()
            wait_until(lambda b=before: not sync.running() or sync.merged() > b, 120, "a merge after the restart")
            assert sync.running(), sync.output()
            print(
                f"after PostgreSQL started again: durable again in {durable:.1f} s,"
                f" merging again in {time.monotonic() - resumed:.1f} s"
            )
        writer.stop()
        code = _stopped_when_merged(path, server.dsn, sync)
    finally:
        writer.stopping.set()
        sync.kill()
    assert code == 130, sync.output()
    assert writer.outages >= 2
    _assert_exact(path, server, workload)


def _off_checkpoint(config: Config) -> dict[str, int | None]:
    """The tables whose Delta table misses a change the change log holds for it, or is past the
    checkpoint: table → its applied LSN."""
    checkpoint = ChangeLogReader(changelog_store(config)).require_checkpoint()
    applied = {str(t.name): table_applied_lsn(config, t) for t in config.tables}
    return {
        table: lsn
        for table, lsn in applied.items()
        if not (checkpoint.tables[table].held_by(lsn) and lsn <= checkpoint.lsn)  # type: ignore[operator]
    }


def _stopped_when_merged(path: Path, dsn: str, sync: _Sync) -> int:
    """Once the change log holds everything the (stopped) writer wrote and every table is merged
    to the checkpoint, SIGTERM the following sync; its exit status — its own where it ended
    first (each caller says which it accepts)."""
    lsn = _flush_lsn(dsn)
    config = _config(path, dsn)
    wait_until(
        lambda: not sync.running() or (_checkpoint_lsn(config) >= lsn and not _off_checkpoint(config)),
        180,
        "the writer's last transaction drained and every table merged to the checkpoint",
    )
    if sync.running():
        sync.process.send_signal(signal.SIGTERM)
    return sync.wait(timeout=120)


def _assert_exact(path: Path, server: Database, workload: LedgerWorkload) -> None:
    """The change log holds every transaction exactly once, each table's Delta table every change
    the log holds for it (nothing past the checkpoint), and each equals its source."""
    config = _config(path, server.dsn)
    verified = verify_log(changelog_store(config), server.dsn, SLOT, workload)
    assert verified.transactions == workload.count
    workload.close()
    assert not _off_checkpoint(config), _off_checkpoint(config)
    with server.connect() as conn:
        assert_delta_equals_source(conn, config)
    assert_no_litter(verified)


@pytest.mark.slow
def test_sync_follow_rides_out_its_spark_connect_server_killed_mid_merge(server: Database, tmp_path: Path) -> None:
    """``cdc-assets sync --follow`` over a Spark Connect server while a writer commits: the server
    is SIGKILLed just as a merge starts, and started again on its port once the drain has made a
    batch durable without it; the merges wait (the client's retries), then find their session gone and merge again
    on new sessions, fenced first; every table is merged to the checkpoint, SIGTERM ends the command
    (exit 130) and every mirror equals its source. (Spark's merges: a table this small is otherwise
    merged by delta-rs in the command's own process, which the server's crash does not touch.)"""
    connect = start_server(tmp_path / "connect")
    path = _setup(server, tmp_path, spark={"remote": connect.address}, warehouse={"small_table_writer": "spark"})
    workload = LedgerWorkload(server.dsn, seed=13, large_share=0.02, plain_share=0.0)
    writer = WriterThread(workload, WRITER_RATE)
    writer.start()
    sync = _Sync(path, server.dsn, FOLLOW_UNTIL_STOPPED_S)

    try:
        wait_until(lambda: not sync.running() or sync.merged() > 0, 240, "a first merge")
        before = sync.merged()
        wait_until(lambda: not sync.running() or sync.merged() > before, 60, "a merge ending (the next one starts)")
        assert sync.running(), sync.output()
        connect.crash()
        _drained_past_now(path, server.dsn, sync, "a durable batch while the Spark Connect server is down")
        connect = start_server(tmp_path / "connect", port=connect.port)
        back, before = time.monotonic(), sync.merged()
        wait_until(lambda: not sync.running() or sync.merged() > before, 120, "a merge after the server is back")
        assert sync.running(), sync.output()
        print(f"merging again {time.monotonic() - back:.1f} s after the Spark Connect server listened again")
        assert sync.count(CONNECT_LOST) >= 1, sync.output()
        writer.stop()
        code = _stopped_when_merged(path, server.dsn, sync)
    finally:
        writer.stopping.set()
        sync.kill()
        if connect.process.poll() is None:
            connect.stop()
    assert code == 130, sync.output()
    _assert_exact(path, server, workload)


@pytest.mark.slow
def test_sync_follow_over_object_storage_failing_for_a_while(
    server: Database, bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cdc-assets sync --follow`` with the change log and the Delta tables in an S3 bucket, reached
    through a proxy that resets every connection for :data:`STORAGE_OUTAGE_S` while a writer
    commits: the command exits with a message naming the bucket (no traceback), or rides it out;
    the next ``sync`` exits 0, and the log holds every transaction once and every mirror equals
    its source."""
    for variable, value in bucket.environ().items():
        monkeypatch.setenv(variable, value)
    with FlakyProxy(bucket.server.port) as proxy:
        path = _setup(
            server,
            tmp_path,
            spark=OWN_SPARK,
            changelog={"path": f"{bucket.uri}/changelog"},
            warehouse={"path": f"{bucket.uri}/warehouse"},
            storage=bucket.section() | {"endpoint": proxy.endpoint},
        )
        workload = LedgerWorkload(server.dsn, seed=14, large_share=0.02, plain_share=0.0)
        writer = WriterThread(workload, WRITER_RATE)
        writer.start()
        sync = _Sync(path, server.dsn, FOLLOW_UNTIL_STOPPED_S)
        try:
            wait_until(lambda: not sync.running() or sync.merged() > 0, 240, "a first merge")
            assert sync.running(), sync.output()
            proxy.cut()
            writer.stopping.wait(STORAGE_OUTAGE_S)  # the outage's length
            proxy.restore()
            assert proxy.resets > 0
            writer.stop()
            code = _stopped_when_merged(path, server.dsn, sync)  # 130: rode it out; 1: ended by the outage
        finally:
            writer.stopping.set()
            sync.kill()
        said = "\n".join(sync.stderr)
        assert code == 130 or (code == 1 and bucket.uri in said and "Traceback" not in said), sync.output()
        started = time.monotonic()
        again = run_cli(path, server.dsn, "sync", timeout=600)
        assert again.returncode == 0, describe(again)
        print(
            f"sync --follow exited {code}; the next sync made every mirror current in {time.monotonic() - started:.1f} s"
        )
        _assert_exact(path, server, workload)
