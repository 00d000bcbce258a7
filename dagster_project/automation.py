"""The drain schedule and one sensor per table.

A table's sensor compares two small things — the change log's checkpoint file (the end LSN of the
last transaction that changed the table) and the Delta log's recorded applied LSN (read with
delta-rs) — and requests a merge when the log is ahead. No Spark, no WAL decoding: well inside
Dagster's sensor time limit. Its cursor is the checkpoint it last requested for, and the run key
names it, so each range is requested once.
"""

import dagster as dg
from dagster import SensorEvaluationContext

from cdc_assets.apply.target import app_id, applied_lsn
from cdc_assets.changelog.checkpoint import read_checkpoint
from cdc_assets.config import TableConfig
from cdc_assets.lsn import format_lsn
from dagster_project.assets import table_slug
from dagster_project.settings import Settings


def build_drain_schedule(settings: Settings, changelog: dg.AssetsDefinition) -> dg.ScheduleDefinition:
    return dg.ScheduleDefinition(
        name="cdc_drain_schedule",
        cron_schedule=settings.config.schedule.drain_cron,
        target=[changelog],
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Drains the replication slot into the change log.",
    )


def build_table_sensor(settings: Settings, table: TableConfig, mirror: dg.AssetsDefinition) -> dg.SensorDefinition:
    config = settings.config
    name = str(table.name)
    path = config.target_path(table)
    app = app_id(config.source.slot, name)

    # The merge and its cheap lag check; not the parity check, which scans the whole source
    # table (and drains the slot): that runs on demand, not after every merge.
    merge = dg.AssetSelection.assets(mirror).without_checks() | dg.AssetSelection.checks(
        dg.AssetCheckKey(mirror.key, "lag")
    )

    @dg.sensor(
        name=f"cdc_merge__{table_slug(table)}",
        target=merge,
        minimum_interval_seconds=30,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Requests a merge of {name} when the change log holds changes beyond its applied LSN.",
    )
    def merge_sensor(context: SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        checkpoint = read_checkpoint(config.changelog_store())
        state = checkpoint.tables.get(name) if checkpoint else None
        if checkpoint is None or state is None:
            return dg.SkipReason(f"the change log holds nothing for {name} yet")
        applied = applied_lsn(path, app, config.delta_storage_options)
        if applied is not None and state.last_change_lsn <= applied:
            return dg.SkipReason(f"{name} is up to date (applied {format_lsn(applied)})")
        requested = int(context.cursor) if context.cursor else -1
        if checkpoint.lsn <= requested:
            return dg.SkipReason(f"a merge up to {format_lsn(requested)} was already requested")
        return dg.SensorResult(
            run_requests=[dg.RunRequest(run_key=f"{name}@{checkpoint.lsn}", tags={"cdc/table": table_slug(table)})],
            cursor=str(checkpoint.lsn),
        )

    return merge_sensor
