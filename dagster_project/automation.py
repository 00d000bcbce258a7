"""The drain schedule (and, with ``schedule.drain_lag_bytes``, a drain sensor on the slot's lag),
the consistent point's sensor, and what the sensors' jobs share (the tables' merge sensor is in
merge_sensor.py).

The drain schedule requests a drain only when no drain of the slot is queued or running (drain
runs carry the ``cdc/drain`` tag): with ``drain.follow_seconds`` a run follows the slot's stream
for that long, and the next tick after it ends starts the next. The drain sensor reads one row of
``pg_replication_slots`` and asks for a drain when the slot is ``drain_lag_bytes`` behind and no
drain of the slot is queued or running: the drain then follows the writes instead of the clock.

With ``schedule.merge_with_drain`` the drain's runs also merge (they carry ``cdc/merges``): the
drain step merges each table its durable batches brought changes to, ``spark.parallel_merges`` at
once, logging each mirror's materialization and lag check — one run per cycle instead of one per
table, for the lowest latency and for hundreds of tables — and the merge sensor requests a merge
run only while no such run is queued or running (to catch up what a failed run left).

Each launches a job of its own (:data:`automation_job`), named here and given to the code location
beside them, whose steps run in the run's process: the default multiprocess executor would start
one more Python process per step before any work.
"""

import functools
import time

import dagster as dg
from dagster import SensorEvaluationContext

from cdc_assets.apply.consistent_points import PointLog, find_point
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config
from cdc_assets.lsn import format_lsn
from cdc_assets.source.connection import connect
from cdc_assets.source.slots import read_slot
from dagster_project.resources import source_keys, source_of
from dagster_project.run_tags import DRAIN_TAG, MERGES_TAG, POINT_TAG
from dagster_project.settings import Settings


def idle_confirm_seconds(config: Config) -> float:
    """How often an unchanged state is reported again as the checkpoint moves on — a mirror as
    current, the same versions as a later consistent point: a sixth of ``freshness_minutes``."""
    return config.schedule.freshness_minutes * 60 / 6


IN_FLIGHT = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
]


automation_job = functools.partial(dg.define_asset_job, executor_def=dg.in_process_executor)
"""A job that a schedule or sensor launches (``automation_job(name, selection, tags=…)``), executed
in the run's own process, one step at a time (one asset or check each)."""


def merge_selection(mirror: dg.AssetsDefinition) -> dg.AssetSelection:
    """A merge: the mirror and its cheap lag check; not the parity check, which scans the whole
    source table (and drains the slot): that runs on demand, not after every merge."""
    return dg.AssetSelection.assets(mirror).without_checks() | dg.AssetSelection.checks(
        dg.AssetCheckKey(mirror.key, "lag")
    )


def drain_run_tags(settings: Settings) -> dict[str, str]:
    """The tags of the drain job's runs (launched by the schedule and the drain sensor): ``cdc/drain``;
    with ``schedule.merge_with_drain`` also ``cdc/merges``, as their drain step merges the tables too
    and publishes the consistent point they make whenever the merges catch up. Selecting the drain
    asset selects its ``slot_held_wal`` check, evaluated after the drain."""
    slot = settings.naming.slot_tag(settings.config.source.slot)
    return {DRAIN_TAG: slot} | ({MERGES_TAG: slot} if settings.config.schedule.merge_with_drain else {})


def build_drain_schedule(settings: Settings) -> dg.ScheduleDefinition:
    slot = settings.config.source.slot
    tag = settings.naming.slot_tag(slot)

    @dg.schedule(
        name=settings.naming.drain_schedule,
        cron_schedule=settings.config.schedule.drain_cron,
        job_name=settings.naming.drain_job,
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=(
            "Drains the replication slot into the change log (and follows its stream for drain.follow_seconds),"
            " unless a drain of the slot is queued or running."
        ),
    )
    def drain_schedule(context: dg.ScheduleEvaluationContext) -> dg.RunRequest | dg.SkipReason:
        if context.instance.get_runs_count(dg.RunsFilter(tags={DRAIN_TAG: tag}, statuses=IN_FLIGHT)):
            return dg.SkipReason(f"a drain of slot {slot} is queued or running")
        return dg.RunRequest()

    return drain_schedule


def build_drain_sensor(settings: Settings, lag_bytes: int) -> dg.SensorDefinition:
    schedule = settings.config.schedule
    slot = settings.config.source.slot
    tag = settings.naming.slot_tag(slot)

    @dg.sensor(
        name=settings.naming.drain_sensor,
        job_name=settings.naming.drain_job,
        required_resource_keys=source_keys(settings),
        minimum_interval_seconds=schedule.drain_check_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=f"Requests a drain when slot {slot} is {lag_bytes:,} WAL bytes behind or more.",
    )
    def drain_sensor(context: SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        if context.instance.get_runs_count(dg.RunsFilter(tags={DRAIN_TAG: tag}, statuses=IN_FLIGHT)):
            return dg.SkipReason(f"a drain of slot {slot} is queued or running")
        with connect(source_of(context, settings).config().source, purpose="drain-sensor") as conn:
            state = read_slot(conn, slot)
        if state is None:
            return dg.SkipReason(f"slot {slot} does not exist yet: run `cdc-assets setup`")
        lag = state.lag_bytes or 0
        if lag < lag_bytes:
            return dg.SkipReason(f"slot {slot} is {lag:,} bytes behind (a drain from {lag_bytes:,})")
        return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"drain@{state.current_wal_lsn}")])

    return drain_sensor


def build_consistent_point_sensor(settings: Settings) -> dg.SensorDefinition:
    config = settings.config
    slot = settings.naming.slot_tag(config.source.slot)
    refresh_s = idle_confirm_seconds(config)
    in_flight = [({POINT_TAG: slot}, "a run publishing a point is queued or running")]
    if config.schedule.merge_with_drain:
        in_flight.append(({MERGES_TAG: slot}, "a drain run, which publishes the point, is queued or running"))

    @dg.sensor(
        name=settings.naming.point_job,
        job_name=settings.naming.point_job,
        minimum_interval_seconds=config.schedule.merge_check_seconds,
        default_status=dg.DefaultSensorStatus.RUNNING,
        description=(
            "Requests a run publishing a consistent point when every mirror holds a newer source position"
            " (with the same versions as the latest point, at most every sixth of freshness_minutes)."
        ),
    )
    def point_sensor(context: SensorEvaluationContext) -> dg.SensorResult | dg.SkipReason:
        for tags, busy in in_flight:
            if context.instance.get_runs_count(dg.RunsFilter(tags=tags, statuses=IN_FLIGHT)):
                return dg.SkipReason(busy)
        reader = ChangeLogReader(changelog_store(config))
        if reader.checkpoint() is None:
            return dg.SkipReason("the change log is not set up yet")
        latest = PointLog(config).latest()
        found = find_point(config, reader, latest)
        if isinstance(found, str):
            return dg.SkipReason(f"no new consistent point: {found}")
        if latest is not None and found.tables == latest.tables and time.time() - latest.published_us / 1e6 < refresh_s:
            return dg.SkipReason(
                f"no table changed since the point at {format_lsn(latest.lsn)}: a later position of the same"
                f" versions is published every {refresh_s:g} s"
            )
        return dg.SensorResult(run_requests=[dg.RunRequest(run_key=f"point@{found.lsn}")])

    return point_sensor
