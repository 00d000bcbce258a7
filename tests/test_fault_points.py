"""Every fault point of ``cdc_assets/faults.py``, walked (docs/architecture.md, "Invariants"): the
real command SIGKILLed just after each durable step of the drain, retention, the online copy, the
apply (creation, schema change, data commit, catalog registration, consistent point, history,
rebuild), maintenance and ``recover``; the same command run again (then a drain and an apply,
where it does not leave every mirror current); and every mirror compared with its source, value
by value, with delta-rs after each step and with Spark too after the last (a session on the walk's
Spark Connect server: the walk does not need the test run's own session).

Each step first writes a few units of the differential workload (``tests/support/workload.py``:
keyed, TOAST and REPLICA IDENTITY FULL tables, key changes, truncates, large transactions) and,
for some points, prepares what the point needs (a column added for a schema change, the slot
dropped for ``recover``, maintenance settings that make one step due). The commands run as
processes of their own over one Spark Connect server, whose Hive metastore (``spark.metastore_dsn``)
takes the mirrors' catalog entries; a killed command must die by the fault point's SIGKILL, and
the command run again must succeed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg
import pytest

from cdc_assets.config import Config, load_config
from cdc_assets.faults import ENV as FAULT
from cdc_assets.faults import POINTS
from cdc_assets.pipeline.drain import drain
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.database import Database
from tests.support.mirror import ROOT, child_environ
from tests.support.mirror_diff import compare_all, fast_spark, report
from tests.support.pipeline import wait_until
from tests.support.processes import cdc_sessions
from tests.support.spark_server import (
    RunningServer,
    classic_mode_restored,  # noqa: F401 (the Connect session of the last step marks the process)
    connect_session,
    start_server,
)
from tests.support.workload import Workload, tables_section

pytestmark = pytest.mark.slow

SCHEMA = "walk"
SLOT = "walk_slot"
TABLES = [f"{SCHEMA}.kinds", f"{SCHEMA}.docs", f"{SCHEMA}.bag"]
MAINTENANCE = {"compact_min_files": 2, "purge_min_deletion_vectors": 1}
MAINTAIN_ONLY = {"compact_min_files": 0, "purge_min_deletion_vectors": 0, "vacuum_retention_hours": 0}
OPS_PER_STEP = 15


@dataclass(frozen=True, slots=True)
class Step:
    """Kill ``command`` at ``point``; ``prepare``: what the point needs first (see :func:`_prepare`);
    ``settles``: whether the command, run again, leaves every mirror current (else a drain and an
    apply follow); ``maintenance``, ``retention_hours`` and ``catalog`` (the mirrors registered in
    ``spark_catalog``, which costs each run a round of metastore calls): this step's settings."""

    command: tuple[str, ...]
    point: str
    prepare: str = ""
    settles: bool = True
    maintenance: dict[str, int] = field(default_factory=lambda: MAINTENANCE)
    retention_hours: float = 0
    catalog: bool = False


STEPS = (
    Step(("apply",), "apply-create", prepare="drain"),
    # before retention has folded anything (it keeps the log meanwhile): today's history is whole
    Step(("library", "history", f"{SCHEMA}.kinds"), "history-write", prepare="sync", retention_hours=1000),
    Step(("apply",), "apply-register", prepare="drain", catalog=True),
    Step(("apply",), "apply-commit", prepare="drain"),
    Step(("apply",), "apply-evolve", prepare="add column"),
    Step(("apply", "--consistent"), "consistent-point", prepare="drain"),
    Step(("sync",), "after-checkpoint"),
    Step(("sync",), "apply-commit"),
    Step(("sync", "--follow", "60"), "after-advance"),
    Step(("sync", "--follow", "60"), "apply-commit"),
    Step(("drain",), "mid-batch", settles=False),
    Step(("drain",), "after-segments", settles=False),
    Step(("drain",), "retention-base", settles=False),
    Step(("drain",), "retention-checkpoint", settles=False),
    Step(("drain",), "retention-delete", settles=False),
    Step(("snapshot", f"{SCHEMA}.docs"), "copy-chunk", settles=False),
    Step(("snapshot", f"{SCHEMA}.bag"), "copy-complete", settles=False),
    Step(("snapshot", f"{SCHEMA}.kinds"), "copy-announced", settles=False),
    # each maintenance step only does what it kills (the others cost a Spark job per table)
    Step(("maintain",), "maintain-optimize", prepare="sync", maintenance=MAINTAIN_ONLY | {"compact_min_files": 2}),
    Step(
        ("maintain",), "maintain-purge", prepare="sync", maintenance=MAINTAIN_ONLY | {"purge_min_deletion_vectors": 1}
    ),
    Step(("maintain",), "maintain-vacuum", prepare="sync", maintenance=MAINTAIN_ONLY | {"vacuum_retention_hours": 168}),
    Step(("recover",), "recover-slot", prepare="drop slot", settles=False),
    Step(("recover",), "recover-checkpoint", prepare="drop slot", settles=False),
    Step(("library", "rebuild", f"{SCHEMA}.docs"), "rebuild-commit", prepare="sync"),
)


@dataclass(slots=True)
class Walk:
    """The configuration files, the database and the workload of one walk."""

    folder: Path
    pg: Database
    server: RunningServer
    workload: Workload

    def write_config(self, step: Step) -> Path:
        return write_config(
            self.folder,
            tables_section(TABLES),
            source={"publication": f"{SLOT}_pub", "slot": SLOT, "batch_changes": 200},
            changelog={"retention_hours": step.retention_hours, "retention_every_minutes": 0, "fold_min_share": 0},
            warehouse={
                "maintenance": step.maintenance,
                "small_table_mb": 0,
                **({"catalog": "spark_catalog"} if step.catalog else {}),
            },
            spark={"remote": self.server.address},
        )

    def config(self) -> Config:
        return load_config(self.folder / "cdc.yaml", environ={DSN_VARIABLE: self.pg.dsn})

    def drain(self) -> None:
        """Drain in this process (no Spark needed)."""
        drain(self.config(), wait=True)

    def run(self, *command: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
        """A command of ``cdc-assets`` (or ``library …``: :mod:`tests.support.library_step`) in a
        process of its own, killed at ``fault`` if given."""
        env = {k: v for k, v in child_environ().items() if k not in (FAULT, "CDC_CONFIG")}
        env[DSN_VARIABLE] = self.pg.dsn
        if fault is not None:
            env[FAULT] = fault
        config = str(self.folder / "cdc.yaml")
        if command[0] == "library":
            argv = [sys.executable, "-m", "tests.support.library_step", command[1], config, *command[2:]]
        else:
            argv = [sys.executable, "-m", "cdc_assets", *command, "-c", config]
        done = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT, env=env, timeout=600, check=False)
        if fault is None:
            assert done.returncode == 0, f"{' '.join(command)} failed:\n{_without_traces(done.stderr)}"
        return done


@pytest.fixture
def walk(pg: Database, metastore: str, tmp_path: Path) -> Iterator[Walk]:
    workload = Workload(pg.dsn, SCHEMA, 4848, application_name="walk-writer")
    workload.create()
    workload.populate()
    server_config = write_config(
        tmp_path,
        tables_section(TABLES),
        spark={"metastore_dsn": metastore, "conf": {"spark.sql.warehouse.dir": str(tmp_path / "spark-warehouse")}},
        name="server.yaml",
    )
    server = start_server(tmp_path / "connect", "-c", str(server_config), environ={DSN_VARIABLE: pg.dsn})
    try:
        yield Walk(tmp_path, pg, server, workload)
    finally:
        workload.close()
        if server.process.poll() is None:
            server.stop()


def test_every_fault_point_killed_and_run_again_leaves_every_mirror_equal_to_its_source(walk: Walk) -> None:
    assert {step.point for step in STEPS} == set(POINTS), "a fault point the walk does not visit"
    walk.write_config(STEPS[0])
    walk.run("setup")
    for number, step in enumerate(STEPS, 1):
        started = time.monotonic()
        walk.write_config(step)
        walk.workload.run(OPS_PER_STEP, allow_pending=False)
        _prepare(walk, step.prepare)
        killed = walk.run(*step.command, fault=step.point)
        assert killed.returncode == -signal.SIGKILL, (
            f"step {number}: {' '.join(step.command)} did not reach {step.point} (exit {killed.returncode}):\n"
            f"{killed.stdout[-3000:]}{_without_traces(killed.stderr)}"
        )
        _wait_for_killed_sessions(walk.pg)
        walk.run(*_again(step.command))
        if not step.settles:
            walk.drain()
            walk.run("apply")
        last = number == len(STEPS)
        if last:  # delta-rs after each step; Spark too after the last
            spark = connect_session(walk.server)
            try:
                with fast_spark(spark):
                    problems = report(compare_all(walk.config(), walk.pg.dsn, spark))
            finally:
                spark.stop()
        else:
            problems = report(compare_all(walk.config(), walk.pg.dsn, None))
        assert not problems, f"step {number} ({' '.join(step.command)} killed at {step.point}):\n{problems}"
        print(
            f"step {number}: {' '.join(step.command)} killed at {step.point}, run again: every mirror exact"
            f" ({time.monotonic() - started:.1f} s)"
        )


def _prepare(walk: Walk, what: str) -> None:
    """``drain``: the change log holds the new changes (an apply has work); ``sync``: the mirrors
    too (maintenance, a rebuild and the history have tables); ``add column``: a mirrored table
    gains a column, with changes under it, drained; ``drop slot``: the slot is lost (``recover``
    has work)."""
    if what == "add column":
        walk.pg.execute(f"ALTER TABLE {SCHEMA}.docs ADD COLUMN IF NOT EXISTS walked int")
        walk.pg.execute(f"UPDATE {SCHEMA}.docs SET walked = id WHERE id % 3 = 0")
    if what in ("drain", "sync", "add column"):
        walk.drain()
    if what == "sync":
        walk.run("apply")
    elif what == "drop slot":
        walk.pg.execute("SELECT pg_drop_replication_slot(%s)", (SLOT,))


def _again(command: tuple[str, ...]) -> tuple[str, ...]:
    """The command run again after its kill: a following sync only briefly."""
    return (*command[:2], "1") if "--follow" in command else command


def _wait_for_killed_sessions(pg: Database) -> None:
    """The killed command's sessions end when the server notices; the next command must not meet them."""
    with psycopg.connect(pg.dsn, autocommit=True) as conn:
        wait_until(lambda: not cdc_sessions(conn), 60, "the killed command's sessions to end")


def _without_traces(stderr: str) -> str:
    """A command's error output without the JVM's stack frames and Spark's warnings."""
    lines = [line for line in stderr.splitlines() if not line.lstrip().startswith("at ") and " WARN " not in line]
    return "\n".join(lines)[-4000:]
