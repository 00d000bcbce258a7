"""The merge sensor: one sensor for every table's merges (``cdc_merges``).

Each tick compares, per configured table, two small things — the change log's checkpoint file (the
end LSN of the last transaction that changed the table) and the Delta log's recorded applied LSN
(read with delta-rs) — and requests a merge run of the table (its job ``cdc_merge__<schema>__<table>``)
when the log is ahead. No Spark, no WAL decoding. One tick reads the checkpoint once and asks the
instance once for the runs in flight, whatever the number of tables: with a sensor per table,
each tick cost Dagster's daemon and code server about half a CPU-second (a call between them, the
sensor's view of the instance built anew), which 300 tables turned into a core.

The cursor maps each table to the checkpoint it was last requested (or confirmed) for, and the
run key names it, so each range is requested once. While a table has nothing to merge and the
drains move the checkpoint on, the tick reports a runless materialization saying the mirror is
current as of the new checkpoint — at most every sixth of ``schedule.freshness_minutes`` — since
the mirror's freshness policy counts materializations only: an idle table stays fresh, and a table
whose drain or merge stops goes stale.

Nothing is requested for a table while a merge of it is queued or running (its runs carry
``cdc/table``: a run merges everything the log holds when it starts, so a second one queued behind
it would only repeat its fixed costs), nor, with ``schedule.merge_with_drain``, while a drain run
that merges is (it merges the table itself; the sensor catches up what a failed run left).
"""

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass

import dagster as dg
from dagster import SensorEvaluationContext

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.checkpoint import awaiting_copy_reason, read_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import TableConfig
from cdc_assets.lsn import format_lsn
from cdc_assets.names import TableName
from dagster_project.automation import IN_FLIGHT, automation_job, idle_confirm_seconds, merge_selection
from dagster_project.naming import Naming
from dagster_project.run_tags import MERGES_TAG, TABLE_TAG
from dagster_project.settings import Settings

COPY_REASON_TAG = "cdc/copy_reason"
"""Copies a table that a DDL rewrote (its partition of ``cdc/snapshot``), requested by the merge sensor."""
NAMES_SHOWN = 10
"""A skip message names at most this many tables per reason (a tick's message is stored)."""


@dataclass(slots=True, frozen=True)
class Verdict:
    """What one tick does for one table: a merge request, a report that it is current, or neither
    and why (``reason``)."""

    table: str
    request: dg.RunRequest | None = None
    event: dg.AssetMaterialization | None = None
    reason: str | None = None


def build_merge_sensor(settings: Settings, mirrors: Mapping[TableName, dg.AssetsDefinition]) -> dg.SensorDefinition:
    config = settings.config
    naming = settings.naming
    jobs = {
        str(t.name): automation_job(
            naming.merge_job(t), merge_selection(mirrors[t.name]), tags={TABLE_TAG: naming.table_tag(t)}
        )
        for t in config.tables
    }
    copy_job = automation_job(naming.copy_job, [naming.snapshot])
    every_s = idle_confirm_seconds(config)

    @dg.sensor(
        name=naming.merge_sensor,
        jobs=[*jobs.values(), copy_job],
        minimum_interval_seconds=config.schedule.merge_check_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            "Requests a merge run of each table whose change log holds changes beyond its Delta table's applied"
            " LSN, and reports an idle mirror current as the change log's checkpoint moves on."
        ),
    )
    def merge_sensor(context: SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        checkpoint = read_checkpoint(changelog_store(config))
        if checkpoint is None:
            return dg.SkipReason("the change log is not set up yet")
        requested: dict[str, int] = json.loads(context.cursor) if context.cursor else {}
        runs = context.instance.get_runs(dg.RunsFilter(statuses=IN_FLIGHT))
        merging = {run.tags[TABLE_TAG] for run in runs if TABLE_TAG in run.tags}
        slot = naming.slot_tag(config.source.slot)
        drain_merges = config.schedule.merge_with_drain and any(run.tags.get(MERGES_TAG) == slot for run in runs)
        verdicts: list[Verdict] = []
        current: dict[str, int] = {}  # held tables whose checkpoint moved past the cursor: applied LSN
        for table in config.tables:
            name = str(table.name)
            state = checkpoint.tables.get(name)
            if state is None:
                verdicts.append(Verdict(name, reason="the change log holds nothing for it yet"))
                continue
            if state.awaiting_copy is not None and state.copy_reason is not None:  # rewritten: copied again
                key = f"{name}@copy:{state.awaiting_copy}"  # once per hold: Dagster skips a run key it launched
                why = {COPY_REASON_TAG: state.copy_reason}  # shown on the run's page
                request = dg.RunRequest(run_key=key, job_name=naming.copy_job, partition_key=name, tags=why)
                verdicts.append(Verdict(name, request))
                continue
            if state.awaiting_copy is not None:
                verdicts.append(Verdict(name, reason=awaiting_copy_reason(state)))
                continue
            applied = table_applied_lsn(config, table)
            before = requested.get(name, -1)
            if applied is not None and state.held_by(applied):
                if checkpoint.lsn <= before:
                    verdicts.append(Verdict(name, reason="up to date"))
                else:
                    current[name] = applied
            elif naming.table_tag(table) in merging:
                verdicts.append(Verdict(name, reason="a merge of it is queued or running"))
            elif drain_merges:
                verdicts.append(Verdict(name, reason="a drain run, which merges it too, is queued or running"))
            elif checkpoint.lsn <= before:
                verdicts.append(Verdict(name, reason=f"a merge up to {format_lsn(before)} was already requested"))
            else:
                request = dg.RunRequest(run_key=f"{name}@{checkpoint.lsn}", job_name=jobs[name].name)
                verdicts.append(Verdict(name, request=request))
        verdicts += confirmations(context, naming, config.tables, current, checkpoint.lsn, every_s)
        done = [v for v in verdicts if v.request is not None or v.event is not None]
        if not done:
            return dg.SkipReason(skip_message(verdicts))
        cursor = requested | {v.table: checkpoint.lsn for v in done}
        return dg.SensorResult(
            run_requests=[v.request for v in done if v.request is not None],
            asset_events=[v.event for v in done if v.event is not None],
            cursor=json.dumps(cursor, sort_keys=True),
        )

    return merge_sensor


def confirmations(
    context: SensorEvaluationContext,
    naming: Naming,
    tables: tuple[TableConfig, ...],
    current: dict[str, int],
    checkpoint_lsn: int,
    every_s: float,
) -> list[Verdict]:
    """For each mirror in ``current`` (it holds every change of its table up to the checkpoint,
    which has moved past the cursor): a runless materialization saying it is current as of the
    checkpoint, when its last materialization is ``every_s`` old (one query for them all)."""
    if not current:
        return []
    keys = {str(t.name): naming.mirror(t) for t in tables if str(t.name) in current}
    latest = context.instance.get_latest_materialization_events(list(keys.values()))
    now = time.time()  # the clock that stamps Dagster's events
    verdicts = []
    for name, key in keys.items():
        last = latest.get(key)
        if last is not None and now - last.timestamp < every_s:
            verdicts.append(Verdict(name, reason="up to date"))
            continue
        metadata = {
            "applied_lsn": format_lsn(current[name]),
            "checkpoint_lsn": format_lsn(checkpoint_lsn),
            "write": f"none: current, no change to {name} since the last merge",
        }
        verdicts.append(Verdict(name, event=dg.AssetMaterialization(key, metadata=metadata)))
    return verdicts


def skip_message(verdicts: list[Verdict]) -> str:
    """One line per reason: the reason, then the tables (at most :data:`NAMES_SHOWN` named)."""
    tables: dict[str, list[str]] = {}
    for verdict in verdicts:
        tables.setdefault(verdict.reason or "", []).append(verdict.table)
    lines = []
    for reason, names in tables.items():
        shown = ", ".join(names[:NAMES_SHOWN]) + (
            f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
        )
        lines.append(f"{reason}: {shown}")
    return "\n".join(lines) or "no table configured"
