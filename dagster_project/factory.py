"""Everything one pipeline (one source database) defines, built from its settings: what the code
location holds, and what each ``CdcComponent`` of a project adds to it."""

from __future__ import annotations

import dagster as dg

from dagster_project.assets import (
    build_changelog_asset,
    build_history_asset,
    build_mirror_asset,
    build_rebuild_asset,
    build_snapshot_asset,
)
from dagster_project.automation import (
    automation_job,
    build_consistent_point_sensor,
    build_drain_schedule,
    build_drain_sensor,
    drain_run_tags,
)
from dagster_project.checks import (
    build_held_wal_check,
    build_lag_check,
    build_parity_check,
    build_standby_slot_check,
)
from dagster_project.consistent import build_consistent_point_asset
from dagster_project.maintenance import build_maintenance_asset, build_maintenance_schedule
from dagster_project.merge_sensor import build_merge_sensors
from dagster_project.recover import build_recover_job
from dagster_project.resources import pipeline_resources
from dagster_project.run_tags import POINT_TAG
from dagster_project.settings import Settings
from dagster_project.verify import build_verify_asset


def build_definitions(settings: Settings) -> dg.Definitions:
    """Named by ``settings.naming``: the drain asset, its held-WAL (and standby) checks and its
    schedule; per table a mirror asset (and its merge job, which its merge sensor launches — or the
    one shared by every table), a maintenance asset, a history asset
    and checks; one maintenance step and schedule for every table; the consistent point and its
    sensor; the snapshot, rebuild and verify assets; the recover job; the resources. It reads the
    configuration file only: every look at the change log, the warehouse or the source waits for a
    sensor's tick or a run. No executor: that is the code location's (:func:`run_executor`)."""
    config = settings.config
    naming = settings.naming
    changelog = build_changelog_asset(settings)
    mirrors = {table.name: build_mirror_asset(settings, table) for table in config.tables}
    maintenance = build_maintenance_asset(settings)
    lag = config.schedule.drain_lag_bytes
    points = (
        [build_consistent_point_asset(settings, list(mirrors.values()))] if config.warehouse.consistent_points else []
    )
    # The jobs that the drain schedule and sensor and the point's sensor launch by name (the merge
    # sensor and the maintenance schedule hold their own jobs).
    jobs = [automation_job(naming.drain_job, [changelog], tags=drain_run_tags(settings))]
    if points:
        jobs.append(automation_job(naming.point_job, points, tags={POINT_TAG: naming.slot_tag(config.source.slot)}))
    return dg.Definitions(
        assets=[
            changelog,
            build_snapshot_asset(settings),
            build_rebuild_asset(settings),
            build_verify_asset(settings),
            *mirrors.values(),
            *points,
            maintenance,
            *(build_history_asset(settings, table) for table in config.tables),
        ],
        asset_checks=[
            build_held_wal_check(settings),
            *([build_standby_slot_check(settings)] if config.source.standby_dsn else []),
            *(
                check
                for table in config.tables
                for check in (build_parity_check(settings, table), build_lag_check(settings, table))
            ),
        ],
        schedules=[
            build_drain_schedule(settings),
            build_maintenance_schedule(settings, maintenance),
        ],
        sensors=[
            *([] if lag is None else [build_drain_sensor(settings, lag)]),
            *([build_consistent_point_sensor(settings)] if points else []),
            *build_merge_sensors(settings, mirrors),
        ],
        jobs=[*jobs, build_recover_job(settings)],
        resources=pipeline_resources(settings),
    )


def run_executor(settings: Settings) -> dg.ExecutorDefinition:
    """The executor of the runs launched from the UI (several mirrors, a backfill): at most
    ``schedule.run_max_concurrent`` steps at once. The code location's own; in a project of
    components, the project's executor applies (a ``Definitions`` holds one)."""
    return dg.multiprocess_executor.configured({"max_concurrent": settings.config.schedule.run_max_concurrent})
