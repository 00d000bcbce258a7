"""The mirrors' freshness policy (``schedule.freshness_minutes``) and what keeps an idle mirror
fresh: its merge sensor reports a runless materialization — current as of the log's checkpoint —
when the table has nothing to merge, the drains have moved the checkpoint on, and the last
materialization is a sixth of the window old. Evaluated as the daemon does, against a real slot
and a Dagster instance; the clock (``time.time``, which the sensor and Dagster's event stamps read)
is moved forward."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import dagster as dg
import pytest

from cdc_assets.changelog.checkpoint import read_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import load_config
from cdc_assets.lsn import format_lsn
from dagster_project import merge_verdict
from dagster_project.naming import Naming
from tests.support.applied_marker import mark_applied
from tests.support.dagster_env import (
    DSN_VARIABLE,
    TABLES,
    MergeTick,
    create_source,
    load_code_location,
    tick_merge_sensors,
)
from tests.support.database import Database

mirror_key = Naming().mirror

SLOT = "cdc_fresh_slot"
FRESHNESS_MINUTES = 12  # confirmations at most every 2 minutes


@contextmanager
def clock_moved(monkeypatch: pytest.MonkeyPatch, seconds: float) -> Iterator[None]:
    """``time.time`` stopped ``seconds`` ahead of now: the merge sensor's clock and the one Dagster
    stamps the events it stores with."""
    ahead = time.time() + seconds
    with monkeypatch.context() as patch:
        patch.setattr(time, "time", lambda: ahead)
        yield


def test_an_idle_mirror_is_reported_current_as_the_drains_move_on(
    pg: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDC_CONFIG", str(tmp_path / "cdc.yaml"))
    monkeypatch.setenv(DSN_VARIABLE, pg.dsn)
    # heartbeat: every drain moves the checkpoint
    create_source(  # one table: the merge sensor's ticks are about it alone
        pg,
        tmp_path,
        slot=SLOT,
        source={"heartbeat": True},
        schedule={"freshness_minutes": FRESHNESS_MINUTES},
        tables=[TABLES[0]],
    )
    config = load_config(tmp_path / "cdc.yaml", environ={DSN_VARIABLE: pg.dsn})
    defs = load_code_location()
    table = config.table(TABLES[0])
    key = mirror_key(table)

    policy = next(iter(defs.resolve_assets_def(key).specs)).freshness_policy
    assert policy is not None
    assert (policy.fail_window.to_timedelta(), policy.warn_window.to_timedelta()) == (  # type: ignore[union-attr]
        timedelta(minutes=FRESHNESS_MINUTES),
        timedelta(minutes=FRESHNESS_MINUTES / 2),
    )

    drain = defs.resolve_job_def("cdc_drain")
    with dg.instance_for_test() as instance:
        cursors: dict[str, str | None] = {}

        def tick() -> MergeTick:
            result = tick_merge_sensors(defs, instance, cursors)
            for event in result.asset_events:  # as the daemon stores a sensor's asset events
                instance.report_runless_asset_event(event)
            return result

        def drained() -> int:
            assert drain.execute_in_process(instance=instance).success
            checkpoint = read_checkpoint(changelog_store(config))
            assert checkpoint is not None
            return checkpoint.lsn

        first = drained()
        not_applied = tick()  # the snapshot is not applied: a merge, no confirmation
        assert len(not_applied.run_requests) == 1 and not not_applied.asset_events

        # Applied up to the checkpoint (as a merge records it): current, said once.
        mark_applied(config, TABLES[0], first)
        cursors.clear()
        current = tick()
        assert not current.run_requests
        [event] = current.asset_events
        assert event.asset_key == key and event.metadata["checkpoint_lsn"].value == format_lsn(first)
        assert "no change to public.customers" in event.metadata["write"].value
        assert instance.get_latest_materialization_event(key) is not None
        assert tick().reasons() == {TABLES[0]: "up to date"}  # the checkpoint has not moved

        # A drain moves the checkpoint, the table has no change: too soon to say it again …
        second = drained()
        assert second > first
        reads: list[str] = []  # what that tick looks at besides the checkpoint file
        with monkeypatch.context() as patch:
            patch.setattr(merge_verdict, "table_applied_lsn", lambda *a: reads.append("delta log"))
            patch.setattr(instance, "get_latest_materialization_events", lambda *a: reads.append("materializations"))
            soon = tick()
        assert not soon.asset_events and soon.reasons() == {TABLES[0]: "up to date"}
        assert reads == []  # the cursor knows its Delta table held its last change, and when it was last said
        # … a sixth of the window later, it is said again, at the new checkpoint.
        with clock_moved(monkeypatch, FRESHNESS_MINUTES * 60 / 6 + 1):
            later = tick()
        assert [e.metadata["checkpoint_lsn"].value for e in later.asset_events] == [format_lsn(second)]

        # A change to the table: a merge is requested, not a confirmation.
        pg.execute("UPDATE public.customers SET tier = 'gold' WHERE id = 1")
        third = drained()
        with clock_moved(monkeypatch, FRESHNESS_MINUTES * 60):
            due = tick()
        assert not due.asset_events
        assert [r.run_key for r in due.run_requests] == [f"{TABLES[0]}@{third}"]
