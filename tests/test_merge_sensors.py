"""A merge sensor per table, under Dagster's own sensor daemon (``tests/support/sensor_daemon.py``):
the code location with three tables shows three merge sensors, and turning one off stops that
table's merges only. No Spark: the Delta tables hold the applied LSN delta-rs wrote
(``tests/support/applied_marker.py``), and the requested runs stay queued."""

from __future__ import annotations

import json
from pathlib import Path

import dagster as dg
import pytest
from dagster._core.scheduler.instigation import TickStatus

from cdc_assets.changelog.checkpoint import require_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import load_config
from cdc_assets.pipeline.drain import drain
from dagster_project.merge_verdict import TableCursor
from dagster_project.run_tags import TABLE_TAG
from tests.support.applied_marker import mark_applied
from tests.support.config_file import DSN_VARIABLE, FILE_NAME
from tests.support.dagster_env import TABLES, create_source
from tests.support.database import Database
from tests.support.pipeline import wait_until
from tests.support.sensor_daemon import sensor_daemon

SLOT = "cdc_sensors_slot"  # slots are per cluster: not the other Dagster tests' slot
CUSTOMERS, ORDERS, NOTES = TABLES
SENSORS = {table: f"cdc_merges__{table.replace('.', '__')}" for table in TABLES}
QUEUED = {"run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"}}
CHANGES = [
    "UPDATE public.customers SET tier = 'gold' WHERE id = 1",
    "UPDATE public.orders SET amount = 1 WHERE id = 1",
    "UPDATE public.notes SET stars = 9 WHERE id = 1",
]


def merge_runs(instance: dg.DagsterInstance) -> list[str]:
    """The tables of the merge runs the instance holds (their ``cdc/table`` tag), sorted."""
    slugs = {table.replace(".", "__"): table for table in TABLES}
    return sorted(slugs[run.tags[TABLE_TAG]] for run in instance.get_runs() if TABLE_TAG in run.tags)


@pytest.mark.slow
def test_three_tables_show_three_merge_sensors_and_turning_one_off_stops_that_tables_merges_only(
    pg: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDC_CONFIG", str(tmp_path / FILE_NAME))  # the code server inherits them
    monkeypatch.setenv(DSN_VARIABLE, pg.dsn)
    create_source(pg, tmp_path, slot=SLOT, schedule={"merge_check_seconds": 1})
    config = load_config(tmp_path / FILE_NAME, environ={DSN_VARIABLE: pg.dsn})
    for table in TABLES:  # the copies applied: no merge is due
        mark_applied(config, table, require_checkpoint(changelog_store(config)).lsn)

    with dg.instance_for_test(overrides=QUEUED) as instance, sensor_daemon(instance) as daemon:
        sensors = daemon.sensors()
        assert {name for name in sensors if name.startswith("cdc_merges")} == set(SENSORS.values())
        for table, name in SENSORS.items():
            assert sensors[name].default_status == dg.DefaultSensorStatus.RUNNING
            jobs = {target.job_name for target in sensors[name].get_targets()}
            slug = table.replace(".", "__")
            assert jobs == {f"cdc_merge__{slug}", f"cdc_copy_held__{slug}"}  # a job belongs to one sensor

        daemon.iterate()  # every table's sensor ticks: nothing to merge
        for name in SENSORS.values():
            assert daemon.ticks(name) == [TickStatus.SKIPPED], name
        daemon.stop(SENSORS[ORDERS])  # as the UI's toggle does
        with pg.connect() as conn:
            for statement in CHANGES:
                conn.execute(statement)
        drain(config)

        def requested() -> list[str]:
            daemon.iterate()
            return merge_runs(instance)

        wait_until(lambda: requested() == [CUSTOMERS, NOTES], timeout=60, what="the running sensors' merges")
        assert daemon.ticks(SENSORS[ORDERS]) == [TickStatus.SKIPPED]  # not evaluated since it was turned off
        assert daemon.ticks(SENSORS[CUSTOMERS])[0] == daemon.ticks(SENSORS[NOTES])[0] == TickStatus.SUCCESS
        assert all(run.status == dg.DagsterRunStatus.QUEUED for run in instance.get_runs())

        daemon.start(SENSORS[ORDERS])  # on again: its merge is requested; the others' are not again
        wait_until(lambda: requested() == [CUSTOMERS, NOTES, ORDERS], timeout=60, what="the orders merge")
        daemon.iterate()
        assert merge_runs(instance) == [CUSTOMERS, NOTES, ORDERS]


def test_a_shared_sensors_cursor_from_before_reads_as_the_checkpoint_requested() -> None:
    """The shared sensor's cursor was table → checkpoint LSN; it reads on, as that LSN requested."""
    assert TableCursor.from_json(42) == TableCursor(requested=42)
    cursor = TableCursor(requested=42, held=40, seen=1_700_000_000)
    assert TableCursor.from_json(json.loads(json.dumps(cursor.to_json()))) == cursor
