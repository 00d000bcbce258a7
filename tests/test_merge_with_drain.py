"""``schedule.merge_with_drain``: the drain's run also merges each table its drain brought changes
to, and the merge sensor stands back for a table while such a run (or a merge of the table) is
queued or running — evaluated as the daemon does, against a real PostgreSQL slot, the test run's Spark
session and a Dagster instance."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from cdc_assets.apply.consistent_points import PointLog
from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.checkpoint import read_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, load_config
from cdc_assets.pipeline.drain import drain
from dagster_project.naming import Naming
from tests.support.dagster_env import DSN_VARIABLE, TABLES, source_with_schedule, tick_merge_sensors
from tests.support.database import Database
from tests.support.mirror_diff import assert_delta_equals_source, holds_key
from tests.support.pipeline import wait_until

POINT_KEY = Naming().consistent_point

CUSTOMERS, ORDERS, NOTES = TABLES
SLOT = "cdc_merging_drain_slot"
FOLLOW_SECONDS = 40.0
MIRRORS = {t: dg.AssetKey(["delta", *t.split(".")]) for t in TABLES}


def tick(defs: dg.Definitions, instance: dg.DagsterInstance, name: str) -> Any:
    sensor = defs.resolve_sensor_def(name)
    context = dg.build_sensor_context(instance=instance, definitions=defs, resources=dict(defs.resources or {}))
    return sensor.evaluate_tick(context)


def drain_run(defs: dg.Definitions, instance: dg.DagsterInstance) -> dg.ExecuteInProcessResult:
    """What the drain sensor requests, executed as the daemon would launch it."""
    [request] = tick(defs, instance, "cdc_drain_on_lag").run_requests
    job = defs.resolve_job_def("cdc_drain")
    result = job.execute_in_process(instance=instance, tags={**request.tags, "dagster/run_key": request.run_key})
    assert result.success
    return result


def materialized(result: dg.ExecuteInProcessResult) -> set[str]:
    """The tables whose mirrors ``result`` materialized."""
    keys = [e.asset_key for e in result.get_asset_materialization_events()]
    return {".".join(k.path[1:]) for k in keys if k is not None and k.path[0] == "delta"}


def assert_equal_to_source(db: Database, config: Config) -> None:
    with db.connect() as conn:
        assert_delta_equals_source(conn, config, TABLES)


@pytest.mark.slow
def test_a_drain_run_merges_the_tables_it_brought_changes_to(
    pg: Database, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "merging"
    defs = source_with_schedule(pg, folder, monkeypatch, SLOT, {"drain_lag_bytes": 1, "merge_with_drain": True})
    config = load_config(folder / "cdc.yaml", environ={DSN_VARIABLE: pg.dsn})
    job = defs.resolve_job_def("cdc_drain")
    assert job.run_tags == {"cdc/drain": SLOT, "cdc/merges": SLOT} and job.executor_def.name == "in_process"
    assert defs.resolve_schedule_def("cdc_drain_schedule").job_name == "cdc_drain"  # the cron's runs merge too

    with dg.instance_for_test() as instance:
        # Right after setup every table has its snapshot to load: the first drain run loads all three.
        pg.execute("INSERT INTO public.scratch VALUES (1)")  # the slot behind
        first = drain_run(defs, instance)
        assert materialized(first) == set(TABLES)
        assert sorted(node.name for node in job.nodes) == ["cdc__changelog", "cdc__changelog_slot_held_wal"]
        checks = {(".".join(e.asset_key.path[1:]), e.check_name) for e in first.get_asset_check_evaluations()}
        # each merge brings its lag check, not parity; the drain its held-WAL check
        assert checks == {(t, "lag") for t in TABLES} | {("changelog", "slot_held_wal")}
        # the merges publish the point they make: the tables all hold the first drain's checkpoint
        assert {e.asset_key for e in first.get_asset_materialization_events()} >= {POINT_KEY}
        assert_equal_to_source(pg, config)

        # One table changes: the next drain run merges that table alone; the others are not
        # materialized (their sensors keep them fresh).
        pg.execute("UPDATE public.customers SET tier = 'gold' WHERE id = 1")
        pg.execute("INSERT INTO public.customers VALUES (9, 'customer 9', 'bronze', DATE '2024-03-01')")
        second = drain_run(defs, instance)
        assert materialized(second) == {CUSTOMERS}
        [event] = [e for e in second.get_asset_materialization_events() if e.asset_key == MIRRORS[CUSTOMERS]]
        metadata = {k: v.value for k, v in event.materialization.metadata.items()}
        assert (metadata["inserted"], metadata["updated"], metadata["deleted"]) == (1, 1, 0)
        checkpoint = read_checkpoint(changelog_store(config))
        assert checkpoint is not None
        assert table_applied_lsn(config, config.table(CUSTOMERS)) == checkpoint.lsn
        assert_equal_to_source(pg, config)
        # … and the run published the point the tables make at its checkpoint: the point's sensor,
        # idle while the drain run was in flight, finds nothing newer.
        latest = PointLog(config).latest()
        assert latest is not None and latest.lsn == checkpoint.lsn
        assert not tick(defs, instance, "cdc_consistent_point").run_requests

        # A change reaches the log but not the Delta table (a drain run's merge failed, say). While
        # a drain run that merges is queued, the merge sensor asks for no merge run of it …
        pg.execute("UPDATE public.orders SET amount = 99 WHERE id = 1")
        drain(config)
        queued = instance.create_run_for_job(job, tags=job.run_tags, status=dg.DagsterRunStatus.NOT_STARTED)
        assert tick(defs, instance, "cdc_drain_on_lag").skip_message == f"a drain of slot {SLOT} is queued or running"
        waiting = tick_merge_sensors(defs, instance)
        assert not waiting.run_requests
        reasons = waiting.reasons()
        assert reasons[ORDERS] == "a drain run, which merges it too, is queued or running"
        # … while an idle table still goes on to its "current" path (which reports the mirror
        # current once its last materialization is old enough: tests/test_mirror_freshness.py).
        assert reasons[NOTES] == "up to date"
        instance.report_run_canceled(queued)

        # Then the merge sensor catches up, one merge run at a time.
        [request] = tick_merge_sensors(defs, instance).run_requests
        assert request.job_name == "cdc_merge__public__orders"
        merge_job = defs.resolve_job_def(request.job_name)
        pending = instance.create_run_for_job(
            merge_job, tags=merge_job.run_tags, status=dg.DagsterRunStatus.NOT_STARTED
        )
        behind = tick_merge_sensors(defs, instance)
        assert not behind.run_requests
        assert behind.reasons()[ORDERS] == "a merge of it is queued or running"
        instance.report_run_canceled(pending)
        result = merge_job.execute_in_process(
            instance=instance, tags={**request.tags, "dagster/run_key": request.run_key}
        )
        assert result.success and materialized(result) == {ORDERS}
        assert_equal_to_source(pg, config)


@pytest.mark.slow
def test_a_following_drain_run_merges_after_each_durable_batch_and_reports_each_merge_as_it_goes(
    pg: Database, spark: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``drain.follow_seconds``, a drain run that merges does so while it follows: a change
    committed during the run reaches its Delta table, and the mirror's materialization the
    instance, before the run ends."""
    folder = tmp_path / "following"
    drain = {"follow_seconds": FOLLOW_SECONDS, "commit_seconds": 0.5}
    defs = source_with_schedule(
        pg, folder, monkeypatch, "cdc_following_merges_slot", {"merge_with_drain": True}, drain=drain
    )
    config = load_config(folder / "cdc.yaml", environ={DSN_VARIABLE: pg.dsn})
    notes = config.table(NOTES)
    job = defs.resolve_job_def("cdc_drain")
    seen: list[str] = []

    def during_the_run(instance: dg.DagsterInstance) -> None:
        path = config.target_path(notes)
        for i in (100, 101):
            pg.execute(f"INSERT INTO public.notes VALUES ({i}, 'while following', {i})")
            wait_until(
                lambda key=i: holds_key(path, key),
                timeout=FOLLOW_SECONDS / 2,
                what=f"row {i} merged",
            )
            seen.append(f"row {i} merged")
        wait_until(lambda: instance.fetch_materializations(MIRRORS[NOTES], limit=1).records, what="the mirror's report")
        seen.append("reported")

    with dg.instance_for_test() as instance:
        watcher = threading.Thread(target=lambda: during_the_run(instance))
        watcher.start()
        result = job.execute_in_process(instance=instance, tags=job.run_tags)
        watched_to_the_end = not watcher.is_alive()
        watcher.join()
        assert result.success
        assert seen == ["row 100 merged", "row 101 merged", "reported"] and watched_to_the_end
        [record, *_] = instance.fetch_materializations(MIRRORS[NOTES], limit=100).records
        assert record.run_id == result.run_id
    assert_equal_to_source(pg, config)
