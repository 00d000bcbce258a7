"""``cdc-assets recover`` and failover under load, against real PostgreSQL (15 and 18 with a
``pg_basebackup`` standby), real Spark and Delta tables read with Spark and delta-rs: a slot
invalidated by ``max_slot_wal_keep_size`` and a promotion without a failover slot stop the drain
with the recovery command, and ``recover`` (the CLI and the Dagster job) brings every table to its
source while the source takes writes; a failover slot carries the mirrors through a promotion
with drains SIGKILLed around it. Then the pieces: the gap in the checkpoint, the history and the
consistent points; a usable slot left alone; a slot of another kind never dropped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from cdc_assets.apply.consistent_points import find_point
from cdc_assets.apply.history import GAP_OP, history_rows
from cdc_assets.apply.runner import apply_tables
from cdc_assets.changelog.checkpoint import Checkpoint, Gap, TableState, require_checkpoint
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config
from cdc_assets.errors import SlotInvalidatedError, SlotMismatchError, SlotMissingError
from cdc_assets.faults import ENV as FAULT
from cdc_assets.pgoutput.messages import unix_time
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.recover import recover
from cdc_assets.pipeline.setup import setup
from cdc_assets.pipeline.status import read_status
from dagster_project.factory import build_definitions
from dagster_project.naming import Naming
from dagster_project.settings import load_settings
from tests.support.config_file import DSN_VARIABLE
from tests.support.dagster_env import tick_merge_sensors
from tests.support.database import Database
from tests.support.load import running_load, workload_config
from tests.support.mirror_diff import compare_all, fast_spark, report
from tests.support.pipeline import Pipeline, invalidate_slot, wait_until
from tests.support.standby_pair import Pair
from tests.support.workload import Workload

RECOVER_JOB = Naming().recover_job

TABLES = ["kinds", "docs", "bag", "orders"]
RECOVER_HINT = "run `cdc-assets recover`"


def checkpoint_of(config: Config) -> Checkpoint:
    return require_checkpoint(changelog_store(config))


def merged(config: Config, session: Any) -> None:
    """Drain, then merge every table."""
    drain(config, wait=True)
    apply_tables(config, session)


def assert_equal_to_source(config: Config, dsn: str, session: Any) -> None:
    """Every Delta table, read with Spark and with delta-rs, equals its source table."""
    problems = report(compare_all(config, dsn, session))
    assert not problems, problems


def more_writes(ops: Any, count: int) -> None:
    then = ops()
    wait_until(lambda: ops() >= then + count, timeout=120, what=f"{count} more writes")


def cli(config: Config, dsn: str, *args: str, fault: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, DSN_VARIABLE: dsn, **({FAULT: fault} if fault else {})}
    command = [sys.executable, "-m", "cdc_assets", *args, "-c", str(config.path)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)


def mirrored_under_load(
    db: Database, dsn: str, folder: Path, schema: str, seed: int, session: Any, **source: Any
) -> tuple[Workload, Config]:
    """A workload in ``schema`` of ``db``, its tables set up (source ``dsn``) and merged once while it writes."""
    workload = Workload(db.dsn, schema, seed=seed)
    workload.create()
    workload.populate(30)
    config = workload_config(dsn, folder, schema, workload, TABLES, **source)
    setup(config)
    with running_load(workload) as ops:
        more_writes(ops, 100)
        merged(config, session)
    return workload, config


# -- a lost slot, recovered under load -----------------------------------------------------------


@pytest.mark.slow
def test_recover_after_the_slot_was_invalidated_under_load(
    pg: Database, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    schema = "invalidated"
    session = spark.newSession()
    with fast_spark(session):
        workload, config = mirrored_under_load(pg, pg.dsn, tmp_path, schema, 3011, session)
        lost_after = checkpoint_of(config).lsn
        with running_load(workload) as ops:
            invalidate_slot(pg, schema)
            with pytest.raises(SlotInvalidatedError, match=rf"was invalidated by the server .*{RECOVER_HINT}"):
                drain(config)
            assert checkpoint_of(config).lsn == lost_after  # nothing advanced
            status = read_status(config)
            assert status.slot_problem is not None and RECOVER_HINT in status.slot_problem
            assert any("the drain refuses the slot" in line for line in status.lines())

            monkeypatch.setenv(DSN_VARIABLE, pg.dsn)
            definitions = build_definitions(load_settings(str(config.path)))
            with dg.instance_for_test() as instance:
                run = definitions.resolve_job_def(RECOVER_JOB).execute_in_process(instance=instance)
                tick = tick_merge_sensors(definitions, instance)
            assert run.success
            reasons = tick.reasons()
            assert not tick.run_requests and sorted(reasons) == sorted(str(t.name) for t in config.tables), reasons
            assert all("held until its copy" in reason for reason in reasons.values()), reasons
            copies = run.asset_materializations_for_node("recover")
            assert sorted(m.partition or "" for m in copies) == sorted(str(t.name) for t in config.tables)

            checkpoint = checkpoint_of(config)
            [gap] = checkpoint.gaps
            assert gap.lost_after == lost_after and gap.slot_point == checkpoint.lsn > lost_after
            assert "was invalidated by the server" in gap.reason
            assert checkpoint.tables_awaiting_copy() == sorted(str(t.name) for t in config.tables)
            held = apply_tables(config, session)  # the copies are announced, not drained yet
            assert all(r.skipped and r.skipped.startswith("held until its copy") for r in held), held
            found = find_point(config, ChangeLogReader(changelog_store(config)))
            assert isinstance(found, str) or found.lsn <= lost_after, found  # no point across the gap

            more_writes(ops, 100)
            merged(config, session)
            assert checkpoint_of(config).tables_awaiting_copy() == []
            more_writes(ops, 50)
        merged(config, session)
        assert_equal_to_source(config, pg.dsn, session)

    reader = ChangeLogReader(changelog_store(config))
    checkpoint = reader.require_checkpoint()
    docs = workload.qualified("docs")
    history = history_rows(reader, docs, checkpoint.tables[docs], unix_time(gap.time_us).date())
    marks = [row for row in history.to_pylist() if row["_cdc_op"] == GAP_OP]
    assert [(m["_cdc_commit_lsn"], m["_cdc_end_lsn"]) for m in marks] == [(gap.lost_after, gap.slot_point)]
    found = find_point(config, reader)
    assert not isinstance(found, str) and found.lsn >= checkpoint.lsn - 0, found
    status = read_status(config)
    assert status.slot_problem is None and status.gaps == (gap,)
    workload.close()


@pytest.mark.slow
def test_recover_after_a_promotion_without_a_failover_slot(pair: Pair, spark: Any, tmp_path: Path) -> None:
    schema = "promoted"
    session = spark.newSession()
    with fast_spark(session):
        workload, config = mirrored_under_load(pair.on_primary, pair.dsn(), tmp_path, schema, 3023, session)
        workload.run(100, allow_pending=False)  # reaches the standby, not the change log
        pair.replayed()
        pair.fail_over()
        workload.conn = psycopg.connect(pair.on_standby.dsn, autocommit=True)
        with pytest.raises(SlotMissingError, match=rf"replication slot {schema} does not exist: .*{RECOVER_HINT}"):
            drain(config)
        with running_load(workload) as ops:
            done = cli(config, pair.dsn(), "recover")
            assert done.returncode == 0, done.stderr
            assert f"recover: replication slot {schema} does not exist; a new slot starts at LSN" in done.stdout
            assert done.stdout.count("recover: copied ") == len(TABLES), done.stdout
            more_writes(ops, 100)
            merged(config, session)
        merged(config, session)
        assert_equal_to_source(config, pair.on_standby.dsn, session)
    workload.close()


# -- a failover slot through a promotion ------------------------------------------------------------


@pytest.mark.slow
def test_a_failover_slot_carries_the_mirrors_through_a_promotion_with_killed_drains(
    syncing_pair: Pair, spark: Any, tmp_path: Path
) -> None:
    pair = syncing_pair
    schema = "failover"
    source = {"failover": True, "streaming": "on", "two_phase": True}
    session = spark.newSession()
    with fast_spark(session):
        workload, config = mirrored_under_load(pair.on_primary, pair.dsn(), tmp_path, schema, 3037, session, **source)
        pair.wait_slot_synced(schema, checkpoint_of(config).lsn, lambda: drain(config, wait=True))
        workload.run(150, allow_pending=False, large_at=50)  # a streamed transaction among them
        killed = cli(config, pair.dsn(), "drain", fault="after-checkpoint")  # logged, the slot not told
        assert killed.returncode == -signal.SIGKILL, killed.stderr
        workload.run(50, allow_pending=False)  # only in WAL: drained from the new primary
        pair.replayed()
        pair.fail_over()
        workload.conn = psycopg.connect(pair.on_standby.dsn, autocommit=True)
        with running_load(workload) as ops:
            killed = cli(config, pair.dsn(), "drain", fault="mid-batch")
            assert killed.returncode == -signal.SIGKILL, killed.stderr
            more_writes(ops, 100)
            merged(config, session)
            assert checkpoint_of(config).server.timeline == 2  # type: ignore[union-attr]
        merged(config, session)
        assert checkpoint_of(config).gaps == ()
        assert_equal_to_source(config, pair.on_standby.dsn, session)
    stats = workload.stats
    assert stats.truncates and stats.key_changes and stats.prepared_commits and stats.large_transactions, stats.line()
    workload.close()


# -- the pieces ----------------------------------------------------------------------------------


def test_a_gap_overlaps_the_ranges_that_may_hold_its_transactions() -> None:
    gap = Gap(lost_after=100, slot_point=200, time_us=1, reason="lost")
    assert gap.overlaps(50, 101) and gap.overlaps(150, 160) and gap.overlaps(199, 300)
    assert not gap.overlaps(50, 100) and not gap.overlaps(200, 300)
    relation = RelationSchema(1, "public", "t", "d", ())
    checkpoint = Checkpoint("s", 300, {"public.t": TableState(10, 1, relation, awaiting_copy=200)}, gaps=(gap,))
    again = Checkpoint.from_json(checkpoint.to_json())
    assert again == checkpoint and again.tables_awaiting_copy() == ["public.t"]
    assert checkpoint.gap_between(90, 120) == gap and checkpoint.gap_between(200, 300) is None


def test_recover_leaves_a_usable_slot_and_refuses_a_slot_of_another_kind(pg: Database, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pipe.setup()
    pg.execute("INSERT INTO t VALUES (1, 'a')")
    pipe.drain()
    before = pipe.checkpoint_bytes()
    assert recover(pipe.config()).lines() == [
        "recover: nothing to recover: the slot can be drained and no table awaits a copy"
    ]
    assert pipe.checkpoint_bytes() == before
    pg.execute("SELECT pg_drop_replication_slot('cdc_slot')")
    pg.execute("SELECT pg_create_physical_replication_slot('cdc_slot')")  # the cluster's, not the database's
    try:
        with pytest.raises(SlotMismatchError, match="replication slot cdc_slot is a physical slot"):
            recover(pipe.config())
        assert pg.execute("SELECT slot_type FROM pg_replication_slots WHERE slot_name = 'cdc_slot'") == [("physical",)]
        assert pipe.checkpoint_bytes() == before
    finally:
        pg.execute("SELECT pg_drop_replication_slot('cdc_slot')")


def test_recover_killed_then_rerun(pg: Database, tmp_path: Path) -> None:
    """Killed after creating its slot (before the checkpoint), then after announcing one table's
    copy: run again, recover replaces the slot once more and copies what is still held; the log,
    replayed from each table's copy, equals the source."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE u (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t", "public.u"])
    pipe.setup()
    pg.execute("INSERT INTO t SELECT g, 'drained' FROM generate_series(1, 50) g")
    pipe.drain()
    lost_after = pipe.checkpoint().lsn  # type: ignore[union-attr]
    pg.execute("INSERT INTO t VALUES (100, 'lost'); DELETE FROM t WHERE id <= 5; INSERT INTO u VALUES (1, 'lost')")
    pg.execute("SELECT pg_drop_replication_slot('cdc_slot')")
    before = pipe.checkpoint_bytes()
    killed = pipe.cli("recover", env={**pipe.environ, FAULT: "recover-slot"})
    assert killed.returncode == -signal.SIGKILL, killed
    assert pipe.checkpoint_bytes() == before and pipe.confirmed_flush() is not None  # a slot, not recorded
    pg.execute("UPDATE t SET v = 'between the kills' WHERE id = 10")
    killed = pipe.cli("recover", env={**pipe.environ, FAULT: "copy-announced:1"})
    assert killed.returncode == -signal.SIGKILL, killed
    assert "a new slot starts at LSN" in killed.stdout, killed
    pg.execute("INSERT INTO u VALUES (2, 'after the gap')")
    done = pipe.cli("recover")
    assert done.returncode == 0, done
    assert done.stdout.count("recover: copied ") == 2, done.stdout  # the announced copy is not drained yet
    assert "a new slot starts" not in done.stdout
    pipe.drain()
    checkpoint = pipe.checkpoint()
    assert checkpoint is not None and [g.lost_after for g in checkpoint.gaps] == [lost_after]
    assert checkpoint.tables_awaiting_copy() == []
    pipe.assert_mirrors()
