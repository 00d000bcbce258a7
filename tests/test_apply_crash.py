"""Crash variant of the differential test: ``cdc-assets sync --maintain`` SIGKILLed again and again
while a random workload keeps writing, with change-log retention and Delta maintenance due all the
time; then one sync to completion, and every Delta table must equal its source and record the
checkpoint as its applied LSN, and so must every table rebuilt from the compacted change log
(docs/architecture.md, "Invariants": ≥ 6 kill points in the suite, 20 on demand; 0 mismatches, both readers agree).

* Retention and maintenance: ``changelog.retention_hours: 0`` with ``fold_min_share: 0`` folds every
  segment all tables have applied into the tables' compacted bases after each drain (``retention_every_minutes:
  0``: retention is due whenever ``sync`` runs it), and the maintenance
  thresholds (``compact_min_files: 2``, ``purge_min_deletion_vectors: 1``) make OPTIMIZE and the
  deletion-vector purge due after almost every merge; VACUUM runs each time (it deletes nothing:
  Delta's retention check keeps files a week).

* The source: one schema with the workload's eight tables (``tests/support/workload.py``: types,
  TOAST, cascades, REPLICA IDENTITY FULL / USING INDEX, keyless, row filter, truncates, prepared
  and large transactions). A writer thread runs it at a paced rate for the whole test.
* Each attempt starts ``python -m cdc_assets sync --wait -c cdc.yaml`` in a process group of its
  own (``PYTHONUNBUFFERED``, so its progress lines arrive as they are printed) and SIGKILLs the
  whole group — the Python process and its Spark JVM — at a point chosen by the attempt's
  *target phase*:

  ``drain``        after the drain lock is granted on the source, 0–0.2 s later (the attempt
                   starts after one transaction of :data:`BACKLOG` rows, so the drain lasts);
  ``spark-start``  after the drain's summary line, 0–15 s later (Spark takes 15–30 s to start
                   here, so this lands in the JVM start or in the first merge);
  ``merge``        after ``k`` (0–3) per-table summary lines — ``k = 0``: after the first new
                   file appears in the warehouse — then 0–4 s later;
  ``maintain``     after every table's apply line and ``k`` (0–3) maintenance lines, then 0–3 s
                   later (OPTIMIZE, REORG … APPLY (PURGE) or VACUUM of a table).

  The phase a kill actually hit is read off the evidence at the moment of the kill (lock,
  output lines, new files in the warehouse). The table order in the configuration is shuffled
  before each attempt, so kills land in different tables' merges. An attempt whose process ends
  before its kill point is a completed sync and does not count.
* After each kill the Delta tables are read with delta-rs: each must be readable, and its
  applied LSN never goes backwards and never passes the change log's checkpoint.
* After the last kill the writer stops, resolves what it left open and commits one transaction
  that touches every table (so every table has something to apply); one final sync runs through
  the library API on the shared Spark session; then the comparison of
  ``tests/test_apply_differential.py`` (both readers, ``tests/support/mirror_diff.py``) and, per table,
  delta-rs ``transaction_version("cdc_assets:<slot>:<schema.table>")`` = the checkpoint LSN; then
  every table is rebuilt from the change log (its compacted base and what followed) and compared
  again.

Attempts go on until ``CDC_CRASH_KILLS`` kills (default 4, one per phase; the large variant: 20) have hit a phase, every phase at
least once — an attempt that completes or lands before the drain does not count — bounded by
``CDC_CRASH_DEADLINE`` seconds (default 1800), past which the test fails and says how far it got.
Other knobs: ``CDC_CRASH_SEED`` (default 4242), ``CDC_CRASH_RATE`` (workload operations per
second, default 25).
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pytest

from cdc_assets.apply.runner import apply_tables, rebuild_table
from cdc_assets.apply.target import app_id, applied_lsn
from cdc_assets.changelog.checkpoint import read_checkpoint
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import LogStore
from cdc_assets.config import Config, load_config
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.setup import setup
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.database import Database
from tests.support.mirror_diff import compare_all, fast_spark, report, rust_table
from tests.support.pipeline import wait_until
from tests.support.processes import cdc_sessions, group_alive
from tests.support.workload import Workload, tables_section

pytestmark = pytest.mark.slow  # not in the quick tier

KILLS = int(os.environ.get("CDC_CRASH_KILLS", "4"))
SEED = int(os.environ.get("CDC_CRASH_SEED", "4242"))
RATE = float(os.environ.get("CDC_CRASH_RATE", "25"))
DEADLINE_S = float(os.environ.get("CDC_CRASH_DEADLINE", "1800"))  # the kill loop; ~3 minutes on a quiet machine
SLOT = "crash_slot"
SCHEMA = "crash"
ROOT = Path(__file__).resolve().parents[1]
PHASES = ("drain", "spark-start", "merge", "maintain")
MAINTENANCE = {"compact_min_files": 2, "purge_min_deletion_vectors": 1}
SPARK_CONF = {
    "spark.ui.enabled": "false",
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.driver.memory": "1g",
    "spark.databricks.delta.snapshotPartitions": "1",
}


def write_crash_config(folder: Path, tables: list[str]) -> Path:
    return write_config(
        folder,
        tables_section(tables),
        source={"publication": f"{SLOT}_pub", "slot": SLOT, "batch_changes": 2000},
        changelog={"path": "./changelog", "retention_hours": 0, "retention_every_minutes": 0, "fold_min_share": 0},
        warehouse={"path": "./warehouse", "maintenance": MAINTENANCE, "small_table_mb": 0},
        spark={"master": "local[2]", "conf": SPARK_CONF},
    )


class Writer(threading.Thread):
    """Runs the workload at about ``rate`` operations per second until :meth:`stop`."""

    def __init__(self, workload: Workload, rate: float) -> None:
        super().__init__(name="apply-crash-writer", daemon=True)
        self.workload = workload
        self.rate = rate
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.pace = random.Random(workload.seed + 1)

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                ops = self.pace.randint(5, 30)
                started = time.monotonic()
                self.workload.run(ops, allow_pending=False)
                # Pacing of the load generator (not synchronisation): about `rate` ops per second.
                self.stopping.wait(max(0.0, ops / self.rate - (time.monotonic() - started)))
        except BaseException as error:  # noqa: BLE001 — re-raised by stop()
            self.error = error

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=300)
        assert not self.is_alive(), "the writer did not stop"
        if self.error is not None:
            raise self.error


# One transaction the workload does not make: enough rows that a drain takes seconds.
BACKLOG = (
    "INSERT INTO {table} (kind, payload, at)"
    " SELECT 'backlog', jsonb_build_object('n', g, 'pad', repeat('x', 40)), now() FROM generate_series(1, 150000) g"
)


@dataclass
class Attempt:
    """One sync subprocess and what it printed (with arrival times)."""

    process: subprocess.Popen[str]
    started: float
    stdout: list[tuple[float, str]] = field(default_factory=list)
    stderr: list[tuple[float, str]] = field(default_factory=list)

    @classmethod
    def start(cls, config: Path, dsn: str) -> Attempt:
        env = {k: v for k, v in os.environ.items() if k not in ("CDC_ASSETS_FAULT", "CDC_CONFIG")}
        env.update({DSN_VARIABLE: dsn, "PYTHONUNBUFFERED": "1"})
        process = subprocess.Popen(
            [sys.executable, "-m", "cdc_assets", "sync", "--wait", "--maintain", "-c", str(config)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
            cwd=ROOT,
            start_new_session=True,
        )
        attempt = cls(process, time.monotonic())
        for stream, lines in ((process.stdout, attempt.stdout), (process.stderr, attempt.stderr)):
            threading.Thread(target=_pump, args=(stream, lines), daemon=True).start()
        return attempt

    def drained(self) -> bool:
        return any(line.startswith("drained ") for _, line in self.stdout)

    def tables_done(self) -> int:
        return sum(1 for _, line in self.stdout if " applied LSN " in line and not line.startswith("maintained "))

    def tables_maintained(self) -> int:
        return sum(1 for _, line in self.stdout if line.startswith("maintained "))

    def running(self) -> bool:
        return self.process.poll() is None

    def kill(self) -> None:
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()
        wait_until(lambda: not group_alive(self.process.pid), 60, "the killed sync's process group (JVM) to end")

    def output(self) -> str:
        lines = sorted(self.stdout + self.stderr)
        return "\n".join(line for _, line in lines if "WARN" not in line)[-4000:]


def _pump(stream: Any, lines: list[tuple[float, str]]) -> None:
    for line in stream:
        lines.append((time.monotonic(), line.rstrip("\n")))


def files_since(root: Path, since: float) -> int:
    """Files under ``root`` modified after wall-clock ``since``."""
    count = 0
    for folder, _, names in os.walk(root):
        for name in names:
            try:
                if os.stat(os.path.join(folder, name)).st_mtime > since:
                    count += 1
            except FileNotFoundError:
                pass
    return count


def lock_granted(conn: psycopg.Connection[Any]) -> bool:
    (held,) = conn.execute(
        "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
        " WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database()"
        " AND a.application_name = 'cdc-assets:drain-lock')"
    ).fetchone()
    return bool(held)


@dataclass
class Kill:
    target: str
    phase: str
    seconds: float  # after the sync started
    detail: str


def test_sync_killed_at_random_points(pg: Database, spark: Any, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    started = time.monotonic()
    workload = Workload(pg.dsn, SCHEMA, SEED, application_name="apply-crash-writer")
    workload.create()
    workload.populate()
    tables = workload.tables
    config_path = write_crash_config(tmp_path, tables)
    config = load_config(config_path, environ={DSN_VARIABLE: pg.dsn})
    setup(config)
    warehouse = Path(config.warehouse.path)
    writer = Writer(workload, RATE)
    writer.start()
    monitor = psycopg.connect(pg.dsn, autocommit=True, application_name="apply-crash-monitor")
    kills: list[Kill] = []
    completed = 0
    applied_before: dict[str, int] = {}
    hits: dict[str, int] = dict.fromkeys(PHASES, 0)  # kills that hit the drain, Spark's start, merges, maintenance
    deadline = started + DEADLINE_S
    try:
        while (target := _next_target(hits, rng)) is not None:
            assert time.monotonic() < deadline, (
                f"{KILLS} kills (each phase at least once) not reached in {DEADLINE_S:.0f} s (CDC_CRASH_DEADLINE):"
                f" kills by phase {hits}, {completed} syncs completed before their kill point"
            )
            order = list(tables)
            rng.shuffle(order)
            write_crash_config(tmp_path, order)
            wall = time.time()
            if target == "drain":  # a backlog that takes the drain seconds, not a fraction of one
                monitor.execute(BACKLOG.format(table=f"{SCHEMA}.events"))
            attempt = Attempt.start(config_path, pg.dsn)
            fired = _wait_for_target(attempt, target, monitor, warehouse, wall, rng, len(order))
            if fired:
                delay = {
                    "drain": rng.uniform(0, 0.2),
                    "spark-start": rng.uniform(0, 15),
                    "merge": rng.uniform(0, 4),
                    "maintain": rng.uniform(0, 3),
                }[target]
                with contextlib.suppress(subprocess.TimeoutExpired):
                    attempt.process.wait(timeout=delay)  # the random delay is the experiment
            if not attempt.running():
                attempt.process.wait()
                assert attempt.process.returncode == 0, f"a sync failed on its own:\n{attempt.output()}"
                completed += 1
                print(f"\nattempt aiming at {target}: the sync completed before its kill point", flush=True)
                continue
            phase, detail = _phase(attempt, monitor, warehouse, len(order), wall)
            attempt.kill()
            kills.append(Kill(target, phase, time.monotonic() - attempt.started, detail))
            if phase in PHASES:
                hits[phase] += 1
            print(
                f"\nkill {sum(hits.values())}/{KILLS}: aimed at {target}, hit {phase} ({detail}) at {kills[-1].seconds:.1f} s",
                flush=True,
            )
            # The killed drain's sessions end when the server notices; the next sync must not see them.
            wait_until(lambda: not cdc_sessions(monitor), 60, "the killed sync's sessions to end")
            _check_after_kill(config, applied_before)
    finally:
        monitor.close()
        writer.stop()
    workload.finish()
    workload.touch_all()
    # The final sync, to completion, on the shared Spark session; then every table rebuilt from the
    # compacted change log.
    with fast_spark(spark):
        drained = drain(config, wait=True)
        results = apply_tables(config, spark)
        parity = compare_all(config, pg.dsn, spark)
        assert not report(parity), report(parity)
        reader = ChangeLogReader(config.changelog.path)
        folded = sum(bool(state.folded) for state in reader.require_checkpoint().tables.values())
        for table in config.tables:
            rebuild_table(config, table, spark, reader)
        rebuilt = compare_all(config, pg.dsn, spark)
    workload.close()
    checkpoint = read_checkpoint(LogStore(config.changelog.path))
    assert checkpoint is not None
    lsns = {
        str(t.name): applied_lsn(config.target_path(t), app_id(config.source.slot, str(t.name))) for t in config.tables
    }
    rows = sum(p.rows_compared for p in parity)
    by_phase = {phase: sum(1 for k in kills if k.phase == phase) for phase in PHASES}
    print(
        f"\nCRASH TOTAL: {len(kills)} kills ({by_phase}), {completed} syncs completed between kills,"
        f" workload {workload.stats.line()}; final drain {drained.transactions:,} transactions;"
        f" checkpoint {format_lsn(checkpoint.lsn)}; {rows:,} rows compared,"
        f" {sum(len(p.problems) for p in parity)} mismatches; {time.monotonic() - started:.0f} s",
        flush=True,
    )
    for result in results:
        print(f"  {result.summary()}")
    assert not report(rebuilt), f"rebuilt from the compacted change log:\n{report(rebuilt)}"
    assert folded, "retention folded no table's segments into a base"
    wrong = {t: (format_lsn(v) if v is not None else None) for t, v in lsns.items() if v != checkpoint.lsn}
    assert not wrong, f"applied LSN differs from the checkpoint {format_lsn(checkpoint.lsn)}: {wrong}"
    assert sum(hits.values()) >= KILLS and all(hits.values()), f"kills by phase: {hits}"
    assert rows > 0


def _next_target(hits: dict[str, int], rng: random.Random) -> str | None:
    """The phase the next attempt aims at: one of those hit least so far; None once the quota is met.

    The phase a kill lands in is read off the evidence, so aiming is not hitting: attempts go on
    until every phase has been hit and the total reaches the quota."""
    if sum(hits.values()) >= KILLS and all(hits.values()):
        return None
    least = min(hits.values())
    return rng.choice([phase for phase in PHASES if hits[phase] == least])


def _wait_for_target(
    attempt: Attempt,
    target: str,
    monitor: psycopg.Connection[Any],
    warehouse: Path,
    wall: float,
    rng: random.Random,
    tables: int,
) -> bool:
    """Wait until the attempt reaches its target phase; False if it ended first."""
    if target == "drain":
        condition = lambda: lock_granted(monitor) or attempt.drained()  # noqa: E731
    elif target == "spark-start":
        condition = attempt.drained
    elif target == "maintain":
        k = rng.randint(0, 3)
        condition = lambda: attempt.tables_done() >= tables and attempt.tables_maintained() >= k  # noqa: E731
    else:
        k = rng.randint(0, 3)
        if k == 0:
            condition = lambda: files_since(warehouse, wall) > 0 or attempt.tables_done() > 0  # noqa: E731
        else:
            condition = lambda: attempt.tables_done() >= k  # noqa: E731
    return bool(
        wait_until(lambda: condition() or not attempt.running(), 600, f"{target} of a sync") and attempt.running()
    )


def _phase(
    attempt: Attempt, monitor: psycopg.Connection[Any], warehouse: Path, tables: int, wall: float
) -> tuple[str, str]:
    """What the sync is doing right now, from the evidence."""
    if not attempt.drained():
        return ("drain", "drain lock held") if lock_granted(monitor) else ("start-up", "before the drain lock")
    done = attempt.tables_done()
    if done >= tables:
        return "maintain", f"{attempt.tables_maintained()}/{tables} tables maintained"
    written = files_since(warehouse, wall)
    if done == 0 and written == 0:
        return "spark-start", "drained; no table written yet"
    return "merge", f"{done}/{tables} tables applied, {written} new warehouse files"


def _check_after_kill(config: Config, applied_before: dict[str, int]) -> None:
    """Every Delta table is readable; its applied LSN never regresses nor passes the checkpoint."""
    checkpoint = read_checkpoint(LogStore(config.changelog.path))
    assert checkpoint is not None, "a killed sync lost the checkpoint"
    for table in config.tables:
        name = str(table.name)
        path = config.target_path(table)
        lsn = applied_lsn(path, app_id(config.source.slot, name))
        if lsn is None:
            continue
        rust_table(path)
        assert lsn <= checkpoint.lsn, (
            f"{name}: applied LSN {format_lsn(lsn)} past the checkpoint {format_lsn(checkpoint.lsn)}"
        )
        assert lsn >= applied_before.get(name, 0), f"{name}: applied LSN went back to {format_lsn(lsn)}"
        applied_before[name] = lsn
