"""The merge sensors: one per table (``cdc_merges__<schema>__<table>``), or one for every table
(``cdc_merges``) — ``schedule.merge_sensors``; ``auto``, the default, gives each table its own up to
:data:`PER_TABLE_SENSORS_MAX` tables.

Each tick compares, per table, two small things — the change log's checkpoint file (the end LSN of
the last transaction that changed the table) and the Delta log's recorded applied LSN (read with
delta-rs) — and requests a merge run of the table (its job ``cdc_merge__<schema>__<table>``) when
the log is ahead; it reports an idle mirror current as the drains move the checkpoint on, at most
every sixth of ``schedule.freshness_minutes`` (the mirror's freshness policy counts
materializations only: an idle table stays fresh, a table whose drain or merge stops goes stale).
No Spark, no WAL decoding. Both shapes decide each table by :func:`~dagster_project.merge_verdict.table_verdict`
on the table's cursor; they differ in what one tick covers. A table's own sensor can be paused,
read and tested alone in the UI; each of its ticks is a call from Dagster's daemon to the code
server, a cost the shared sensor pays once for every table (BENCHMARKS.md, "Merge sensors").

The run key names the checkpoint, so each range is requested once. Nothing is requested for a
table while a merge of it is queued or running (its runs carry ``cdc/table``: a run merges
everything the log holds when it starts, so a second one queued behind it would only repeat its
fixed costs), nor, with ``schedule.merge_with_drain``, while a drain run that merges is (it merges
the table itself; the sensor catches up what a failed run left).
"""

import json
from collections.abc import Mapping, Sequence
from typing import Any

import dagster as dg
from dagster import SensorEvaluationContext

from cdc_assets.changelog.checkpoint import read_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, TableConfig
from cdc_assets.names import TableName
from dagster_project.automation import automation_job, idle_confirm_seconds, merge_selection
from dagster_project.merge_verdict import (
    AllRuns,
    RunsInFlight,
    TableCursor,
    TableRuns,
    Verdict,
    confirmations,
    skip_message,
    table_verdict,
)
from dagster_project.naming import Naming
from dagster_project.run_tags import TABLE_TAG
from dagster_project.settings import Settings

Jobs = list[Any]
"""What :data:`~dagster_project.automation.automation_job` makes (its class is not Dagster's public API)."""
PER_TABLE_SENSORS_MAX = 30
"""``merge_sensors: auto`` gives each table its own sensor up to this many tables: a tick costs the
daemon and the code server about 0.1 CPU-second (BENCHMARKS.md, "Merge sensors"), so 30 sensors
ticking every 30 s take about a tenth of a core."""


def merge_sensors(defs: dg.Definitions, naming: Naming) -> list[dg.SensorDefinition]:
    """The merge sensors of ``naming``'s pipeline in a code location: every table's, or the shared one."""
    return [s for s in defs.sensors or () if naming.is_merge_sensor(s.name)]


def shares_one_sensor(config: Config) -> bool:
    """Whether one merge sensor serves every table (``schedule.merge_sensors``)."""
    choice = config.schedule.merge_sensors
    return choice == "shared" or (choice == "auto" and len(config.tables) > PER_TABLE_SENSORS_MAX)


def build_merge_sensors(
    settings: Settings, mirrors: Mapping[TableName, dg.AssetsDefinition]
) -> list[dg.SensorDefinition]:
    config, naming = settings.config, settings.naming
    jobs = {
        t.name: automation_job(
            naming.merge_job(t), merge_selection(mirrors[t.name]), tags={TABLE_TAG: naming.table_tag(t)}
        )
        for t in config.tables
    }
    if shares_one_sensor(config):
        return [shared_sensor(config, naming, [*jobs.values(), automation_job(naming.copy_job, [naming.snapshot])])]
    # a copy job per table: a job belongs to one sensor (a component's definitions are copied, and
    # one job shared by sensors would become several of one name)
    return [
        table_sensor(config, naming, t, [jobs[t.name], automation_job(naming.table_copy_job(t), [naming.snapshot])])
        for t in config.tables
    ]


def shared_sensor(config: Config, naming: Naming, jobs: Jobs) -> dg.SensorDefinition:
    @dg.sensor(
        name=naming.merge_sensor,
        jobs=jobs,
        minimum_interval_seconds=config.schedule.merge_check_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            "Requests a merge run of each table whose change log holds changes beyond its Delta table's applied"
            " LSN, and reports an idle mirror current as the change log's checkpoint moves on."
        ),
    )
    def merge_sensor(context: SensorEvaluationContext) -> dg.SensorResult:
        cursors = {name: TableCursor.from_json(v) for name, v in json.loads(context.cursor or "{}").items()}
        runs = AllRuns(context.instance, naming, config.source.slot)
        verdicts = tick(context, config, naming, config.tables, cursors, runs, naming.copy_job)
        cursor = cursors | {v.name: v.cursor for v in verdicts}
        return result(verdicts, json.dumps({n: c.to_json() for n, c in cursor.items()}, sort_keys=True))

    return merge_sensor


def table_sensor(config: Config, naming: Naming, table: TableConfig, jobs: Jobs) -> dg.SensorDefinition:
    @dg.sensor(
        name=naming.table_merge_sensor(table),
        jobs=jobs,
        minimum_interval_seconds=config.schedule.merge_check_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            f"Requests a merge run of {table.name} when its change log holds changes beyond its Delta table's"
            " applied LSN, and reports the mirror current as the change log's checkpoint moves on."
        ),
    )
    def merge_sensor(context: SensorEvaluationContext) -> dg.SensorResult:
        cursor = TableCursor.from_json(json.loads(context.cursor)) if context.cursor else TableCursor()
        runs = TableRuns(context.instance, naming, config.source.slot)
        verdicts = tick(context, config, naming, [table], {str(table.name): cursor}, runs, naming.table_copy_job(table))
        return result(verdicts, json.dumps(verdicts[0].cursor.to_json()) if verdicts else context.cursor)

    return merge_sensor


def tick(
    context: SensorEvaluationContext,
    config: Config,
    naming: Naming,
    tables: Sequence[TableConfig],
    cursors: Mapping[str, TableCursor],
    runs: RunsInFlight,
    copy_job: str,
) -> list[Verdict]:
    """Each of ``tables``' verdicts for this tick (none before the change log is set up);
    ``copy_job``: the job that copies a rewritten table again."""
    checkpoint = read_checkpoint(changelog_store(config))
    if checkpoint is None:
        return []
    verdicts = [
        table_verdict(config, naming, checkpoint, runs, table, cursors.get(str(table.name), TableCursor()), copy_job)
        for table in tables
    ]
    return confirmations(config, naming, context.instance, verdicts, checkpoint.lsn, idle_confirm_seconds(config))


def result(verdicts: list[Verdict], cursor: str | None) -> dg.SensorResult:
    """The tick's runs and events, or why there are none, and the cursor."""
    done = [v for v in verdicts if v.done]
    if not verdicts:
        return dg.SensorResult(skip_reason="the change log is not set up yet", cursor=cursor)
    if not done:
        return dg.SensorResult(skip_reason=skip_message(verdicts), cursor=cursor)
    return dg.SensorResult(
        run_requests=[v.request for v in done if v.request is not None],
        asset_events=[v.event for v in done if v.event is not None],
        cursor=cursor,
    )
