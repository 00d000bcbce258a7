"""The drain sensor (``schedule.drain_lag_bytes``): a drain requested when the slot falls behind,
never while a drain of the slot is queued or running — evaluated as the daemon does, against a
real PostgreSQL slot and a Dagster instance."""

from __future__ import annotations

import threading
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from dagster_project.merge_sensor import merge_sensors
from dagster_project.naming import Naming
from tests.support.dagster_env import source_with_schedule
from tests.support.database import Database

SLOT = "cdc_lag_slot"
LAG_BYTES = 200_000
FOLLOW_SECONDS = 6.0


def tick(defs: dg.Definitions, instance: dg.DagsterInstance) -> Any:
    sensor = next(s for s in defs.sensors if s.name == "cdc_drain_on_lag")
    # the resources the daemon hands the sensor from the code location's definitions
    context = dg.build_sensor_context(instance=instance, definitions=defs, resources=dict(defs.resources or {}))
    return sensor, sensor.evaluate_tick(context)


def test_the_drain_follows_the_slot_lag_one_run_at_a_time(
    pg: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    schedule = {"drain_lag_bytes": LAG_BYTES, "drain_check_seconds": 10, "merge_check_seconds": 5}
    defs = source_with_schedule(pg, tmp_path / "lag", monkeypatch, SLOT, schedule)
    with dg.instance_for_test() as instance:
        sensor, quiet = tick(defs, instance)
        assert sensor.minimum_interval_seconds == 10
        assert {s.minimum_interval_seconds for s in merge_sensors(defs, Naming())} == {5}
        assert not quiet.run_requests and "bytes behind (a drain from 200,000)" in (quiet.skip_message or ""), quiet

        pg.execute("INSERT INTO public.scratch SELECT generate_series(1, 20000)")  # WAL the slot has not read
        _, due = tick(defs, instance)
        [request] = due.run_requests
        assert request.run_key.startswith("drain@")
        # the drain's job: its runs carry the slot's tag, its step runs in the run's process
        job = defs.resolve_job_def(sensor.job_name)
        assert job.run_tags["cdc/drain"] == SLOT and job.executor_def.name == "in_process"

        # Requested again while that drain waits to start: nothing more.
        queued = instance.create_run_for_job(job, tags=job.run_tags, status=dg.DagsterRunStatus.NOT_STARTED)
        _, waiting = tick(defs, instance)
        assert not waiting.run_requests and waiting.skip_message == f"a drain of slot {SLOT} is queued or running"
        instance.report_run_canceled(queued)

        # The drain itself (the sensor's job, with its tags): the slot caught up, nothing requested.
        result = job.execute_in_process(instance=instance, tags={**request.tags, "dagster/run_key": request.run_key})
        assert result.success
        _, done = tick(defs, instance)
        assert not done.run_requests and "bytes behind" in (done.skip_message or ""), done.skip_message

    # The schedule launches the same job, so the sensor waits for its drains too.
    assert defs.resolve_schedule_def("cdc_drain_schedule").job_name == sensor.job_name == "cdc_drain"


@pytest.mark.slow
def test_the_schedule_starts_a_following_drain_only_when_none_runs_and_the_run_reports_as_it_goes(
    pg: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With ``drain.follow_seconds`` a drain run follows the stream; the schedule requests a drain
    only while no drain of the slot is queued or running (runs never pile up behind a following
    one), and the run reports a materialization of ``cdc/changelog`` for the batches that bring
    changes while it follows, besides the one its step ends with."""
    from dagster_project import assets

    monkeypatch.setattr(assets, "REPORT_INTERVAL_S", 0.0)
    folder = tmp_path / "follow"
    drain = {"follow_seconds": FOLLOW_SECONDS, "commit_seconds": 0.5}
    defs = source_with_schedule(pg, folder, monkeypatch, "cdc_follow_slot", {}, drain=drain)
    schedule = defs.resolve_schedule_def("cdc_drain_schedule")
    job = defs.resolve_job_def(schedule.job_name)
    tick_at = datetime(2026, 1, 5, tzinfo=UTC)
    with dg.instance_for_test() as instance, dg.build_schedule_context(instance, tick_at) as context:
        [request] = schedule.evaluate_tick(context).run_requests or []
        running = instance.create_run_for_job(job, tags=job.run_tags, status=dg.DagsterRunStatus.STARTED)
        waiting = schedule.evaluate_tick(context)
        assert (
            not waiting.run_requests and waiting.skip_message == "a drain of slot cdc_follow_slot is queued or running"
        )
        instance.report_run_canceled(running)

        stop = threading.Event()

        def write() -> None:  # changes while the run follows
            for i in range(100, 1000):
                if stop.wait(0.3):
                    return
                pg.execute(f"INSERT INTO public.notes VALUES ({i}, 'while following', {i})")

        writer = threading.Thread(target=write)
        writer.start()
        try:
            result = job.execute_in_process(instance=instance, tags=request.tags)
        finally:
            stop.set()
            writer.join()
        assert result.success
        # the first report reached the instance while the drain still followed, seconds before
        # its step ended (the follow lasts FOLLOW_SECONDS after catching up)
        [step_done] = instance.all_logs(result.run_id, of_type=dg.DagsterEventType.STEP_SUCCESS)[:1]
        first = instance.fetch_materializations(dg.AssetKey(["cdc", "changelog"]), limit=100).records[-1]
        assert first.timestamp < step_done.timestamp - FOLLOW_SECONDS / 2
        events = instance.fetch_materializations(dg.AssetKey(["cdc", "changelog"]), limit=100).records
        reports = [e for e in events if e.run_id == result.run_id]
        assert len(reports) >= 3, [e.asset_materialization.metadata for e in reports]  # type: ignore[union-attr]
        following = [r.asset_materialization for r in reports[1:]]  # newest first: the step's own is first
        assert all(m is not None and m.metadata["changes/public.notes"].value > 0 for m in following)
