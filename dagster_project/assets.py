"""Assets: the change log (the drain), one mirror Delta table per source table, per-table change
history partitioned by commit day, and, partitioned by table, the online snapshot and the rebuild
from the change log.

Keys (``naming.py``, behind the pipeline's key prefix): ``cdc/changelog``; ``delta/<schema>/<table>``;
``history/<schema>/<table>``; ``cdc/snapshot``; ``cdc/rebuild`` (``cdc/verify`` is in verify.py).
Pools keep one drain per slot and one writer per Delta table at a time (set the pools' limit to 1:
``concurrency: {pools: {default_limit: 1}}`` in ``dagster.yaml``).
"""

import time
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from functools import cache

import dagster as dg
from dagster import AssetExecutionContext
from pyspark.sql import SparkSession

from cdc_assets.apply.consistent_points import ConsistentPoint
from cdc_assets.apply.history import history_rows, write_history
from cdc_assets.apply.runner import TableApplied, merge_table, rebuild_table
from cdc_assets.apply.table_files import table_files
from cdc_assets.apply.target import delta_target
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.retention import RetentionResult
from cdc_assets.changelog.store import changelog_store
from cdc_assets.changelog.stream_writer import DrainProgress, DurableBatch
from cdc_assets.config import Config, TableConfig
from cdc_assets.errors import CdcError
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.drain import DrainResult
from cdc_assets.pipeline.online_snapshot import CopyProgress, TableCopied, snapshot_tables
from cdc_assets.pipeline.sync import DRAIN_ONLY, Described, sync
from cdc_assets.source.reconnect import connection_lost
from dagster_project.consistent import point_metadata
from dagster_project.lag import lag_evaluation
from dagster_project.naming import Naming
from dagster_project.resources import both_keys, source_keys, source_of, spark_of
from dagster_project.run_tags import MERGES_TAG
from dagster_project.settings import Settings

PROGRESS_INTERVAL_S = 10.0
REPORT_INTERVAL_S = 30.0


def history_path(config: Config, table: TableConfig) -> str:
    return f"{config.warehouse.path.rstrip('/')}/_cdc_history/{table.name.schema}/{table.name.name}"


def build_changelog_asset(settings: Settings) -> dg.AssetsDefinition:
    slot = settings.config.source.slot
    naming = settings.naming

    @dg.asset(
        key=naming.changelog,
        group_name="cdc",
        pool=naming.drain_pool(slot),
        required_resource_keys=both_keys(settings),
        kinds={"postgres", "parquet"},
        description=(
            f"Drains replication slot {slot} into the change log at {settings.config.changelog.path}: committed"
            " transactions as Parquet segments, then the checkpoint, then the slot's confirmed position (exactly"
            f" once); follows the stream for {settings.config.drain.follow_seconds:g} s after catching up"
            + (
                "; in a drain run, merges the tables after each durable batch"
                f" ({settings.config.spark.parallel_merges} at once)."
                if settings.config.schedule.merge_with_drain
                else "."
            )
        ),
    )
    def changelog(context: AssetExecutionContext) -> dg.MaterializeResult[None]:
        config = source_of(context, settings).config()
        spark = spark_of(context, settings)
        logged = [-PROGRESS_INTERVAL_S]

        def log(progress: DrainProgress) -> None:  # a line every PROGRESS_INTERVAL_S at most: a run follows for hours
            if progress.elapsed_s - logged[0] >= PROGRESS_INTERVAL_S:
                logged[0] = progress.elapsed_s
                context.log.info(progress.line())

        session = cache(spark.session)  # started by a run that merges (schedule.merge_with_drain) only
        steps = replace(DRAIN_ONLY, merge=MERGES_TAG in context.run.tags)
        report = drain_run_report(context, config, naming, session)
        batches = BatchReports(context, naming.changelog)
        result = sync(config, session, steps, wait=True, report=report, progress=log, on_batch=batches)
        return dg.MaterializeResult(metadata=drain_metadata(result.drains[0], result.retention))

    return changelog


def drain_run_report(
    context: AssetExecutionContext, config: Config, naming: Naming, session: Callable[[], SparkSession]
) -> Callable[[Described], None]:
    """What a drain run does with each result of its sync: logs its lines; records a merge (a run
    that merges) as a materialization of the table's mirror with its ``lag`` check's evaluation, and
    a consistent point as a materialization of ``cdc/consistent_point``."""

    def report(result: Described) -> None:
        for line in result.lines():
            context.log.info(line)
        if isinstance(result, TableApplied):
            table = config.table(result.table)
            key = naming.mirror(table)
            metadata = table_metadata(result, mirror_metadata(session(), config, table))
            context.log_event(dg.AssetMaterialization(asset_key=key, metadata=metadata))
            try:
                context.log_event(lag_evaluation(config, table, key))
            except Exception as error:
                if not connection_lost(error):
                    raise
                context.log.warning(f"lag check of {table.name} skipped: {error}")  # the source is restarting
        elif isinstance(result, ConsistentPoint):
            point = dg.AssetMaterialization(asset_key=naming.consistent_point, metadata=point_metadata(config, result))
            context.log_event(point)

    return report


class BatchReports:
    """While a drain follows the stream, a materialization of ``cdc/changelog`` per durable batch
    that brought changes, at most one every :data:`REPORT_INTERVAL_S` (the changes of the batches
    in between are summed in): the UI sees the log grow during an hour-long run."""

    def __init__(self, context: AssetExecutionContext, key: dg.AssetKey) -> None:
        self._context = context
        self._key = key
        self._last = time.monotonic()
        self._transactions = 0
        self._changes: dict[str, int] = {}

    def __call__(self, batch: DurableBatch) -> None:
        self._transactions += batch.transactions
        for table, count in batch.changes.items():
            self._changes[table] = self._changes.get(table, 0) + count
        now = time.monotonic()
        if not self._changes or now - self._last < REPORT_INTERVAL_S:
            return
        metadata: dict[str, dg.MetadataValue] = {
            "transactions": dg.MetadataValue.int(self._transactions),
            "changes": dg.MetadataValue.int(sum(self._changes.values())),
            "checkpoint_lsn": dg.MetadataValue.text(format_lsn(batch.checkpoint_lsn)),
        }
        if batch.commit_time_us is not None:
            metadata["commit_time"] = dg.MetadataValue.timestamp(batch.commit_time_us / 1e6)
        for table, count in sorted(self._changes.items()):
            metadata[f"changes/{table}"] = dg.MetadataValue.int(count)
        self._context.log_event(dg.AssetMaterialization(asset_key=self._key, metadata=metadata))
        self._last, self._transactions, self._changes = now, 0, {}


def drain_metadata(result: DrainResult, retention: RetentionResult | None = None) -> dict[str, dg.MetadataValue]:
    """A drain's metadata, with what the change-log retention run after it did (if it ran)."""
    slot = result.slot
    lag = slot.lag_bytes if slot and slot.lag_bytes is not None else 0
    metadata: dict[str, dg.MetadataValue] = {
        "transactions": dg.MetadataValue.int(result.transactions),
        "changes": dg.MetadataValue.int(result.total_changes),
        "batches": dg.MetadataValue.int(result.batches),
        "checkpoint_lsn": dg.MetadataValue.text(format_lsn(result.checkpoint_lsn)),
        "slot_lag_bytes": dg.MetadataValue.int(lag),
        "slot_lag_mb": dg.MetadataValue.float(round(lag / 1e6, 3)),
        "wal_status": dg.MetadataValue.text(str(slot.wal_status if slot else "unknown")),
        "duration_s": dg.MetadataValue.float(round(result.elapsed_s, 3)),
    }
    held = result.held
    if held is not None and held.held_bytes is not None:
        metadata["held_wal_bytes"] = dg.MetadataValue.int(held.held_bytes)
        if held.pinned_by is not None:
            metadata["held_wal_pinned_by"] = dg.MetadataValue.text(held.pinned_by.describe())
        if (warning := held.warning()) is not None:
            metadata["held_wal_warning"] = dg.MetadataValue.text(warning)
    for table, count in sorted(result.changes.items()):
        metadata[f"changes/{table}"] = dg.MetadataValue.int(count)
    if retention is not None and (lines := retention.lines()):
        metadata["retention"] = dg.MetadataValue.text("\n".join(lines))
    return metadata


def build_mirror_asset(settings: Settings, table: TableConfig) -> dg.AssetsDefinition:
    name = str(table.name)
    fresh = timedelta(minutes=settings.config.schedule.freshness_minutes)
    catalog = settings.config.warehouse.catalog
    by_name = {} if catalog is None else {"dagster/table_name": f"{catalog}.{name}"}  # warehouse.catalog's name
    naming = settings.naming

    @dg.asset(
        key=naming.mirror(table),
        deps=[naming.changelog],
        group_name="mirror",
        pool=naming.table_pool(table),
        required_resource_keys=both_keys(settings),
        kinds={"delta", "spark"},
        # materialized by each merge, and by the merge sensor while the table has nothing to merge
        freshness_policy=dg.FreshnessPolicy.time_window(fail_window=fresh, warn_window=fresh / 2),
        description=f"Delta mirror of {name} at {settings.config.target_path(table)}, merged from the change log.",
        metadata={"source_table": name, "dagster/uri": settings.config.target_path(table), **by_name},
    )
    def mirror(context: AssetExecutionContext) -> dg.MaterializeResult[None]:
        config = source_of(context, settings).config()
        session = spark_of(context, settings).session()
        result = merge_table(config, config.table(name), session)  # under the table's write lock
        context.log.info(result.summary())
        return dg.MaterializeResult(metadata=table_metadata(result, mirror_metadata(session, config, table)))

    return mirror


def table_metadata(result: TableApplied, mirror: dict[str, dg.MetadataValue]) -> dict[str, dg.MetadataValue]:
    """A merge's metadata; ``mirror``: the table's own (:func:`mirror_metadata`)."""
    metadata: dict[str, dg.MetadataValue] = {
        "inserted": dg.MetadataValue.int(result.inserted),
        "updated": dg.MetadataValue.int(result.updated),
        "deleted": dg.MetadataValue.int(result.deleted),
        "change_records": dg.MetadataValue.int(result.records),
        "applied_lsn": dg.MetadataValue.text(
            format_lsn(result.applied_lsn) if result.applied_lsn is not None else "none"
        ),
        "delta_version": dg.MetadataValue.int(result.delta_version if result.delta_version is not None else -1),
        "write": dg.MetadataValue.text(result.write or "none"),
        "dagster/uri": dg.MetadataValue.path(result.path),
    }
    if result.columns:
        metadata["schema_change"] = dg.MetadataValue.text(result.columns)
    if result.copied:
        metadata["copied"] = dg.MetadataValue.text(result.copied)
    if result.skipped:
        metadata["skipped"] = dg.MetadataValue.text(result.skipped)
    return metadata | mirror


def mirror_metadata(session: object, config: Config, table: TableConfig) -> dict[str, dg.MetadataValue]:
    """The Delta table's rows — from its files' statistics (delta-rs, no Spark job), else counted —
    and its columns (``dagster/column_schema``, the metadata columns included); nothing before it
    exists."""
    target = delta_target(config, table, session)  # type: ignore[arg-type]
    if not target.exists():
        return {}
    rows = table_files(target.path, target.storage_options).rows
    columns = dg.TableSchema(
        columns=[dg.TableColumn(f.name, f.dataType.simpleString()) for f in target.spark_schema().fields]
    )
    return {
        "dagster/row_count": dg.MetadataValue.int(rows if rows is not None else target.read().count()),
        "dagster/column_schema": dg.MetadataValue.table_schema(columns),
    }


def table_partitions(settings: Settings) -> dg.StaticPartitionsDefinition:
    """One partition per configured table (a table added to the config appears on reload)."""
    return dg.StaticPartitionsDefinition([str(t.name) for t in settings.config.tables])


def build_snapshot_asset(settings: Settings) -> dg.AssetsDefinition:
    @dg.asset(
        key=settings.naming.snapshot,
        deps=[settings.naming.changelog],
        partitions_def=table_partitions(settings),
        group_name="cdc",
        required_resource_keys=source_keys(settings),
        kinds={"postgres", "parquet"},
        description=(
            "Copies tables again while the drain and the other tables' merges go on (an online snapshot; partition"
            " = table). The table's next merge, once the drain has passed the copy, makes its Delta table equal to"
            " the source: a repair. Launch a backfill over the tables to copy."
        ),
    )
    def snapshot(context: AssetExecutionContext) -> dg.MaterializeResult[None]:
        config = source_of(context, settings).config()
        last = 0.0

        def show(progress: CopyProgress) -> None:
            nonlocal last
            if progress.elapsed_s - last >= PROGRESS_INTERVAL_S:
                last = progress.elapsed_s
                context.log.info(progress.line())

        (copied,) = snapshot_tables(config, [context.partition_key], progress=show)
        context.log.info(copied.summary())
        return dg.MaterializeResult(metadata=copy_metadata(copied))

    return snapshot


def copy_metadata(copied: TableCopied) -> dict[str, int | float | str]:
    """A finished online copy, as ``cdc/snapshot`` metadata."""
    return {
        "rows": copied.rows,
        "chunks": copied.chunks,
        "run": copied.run,
        "consistent_point": format_lsn(copied.consistent_point),
        "announced_lsn": format_lsn(copied.announced_lsn),
        "rows_per_s": round(copied.rows / copied.elapsed_s) if copied.elapsed_s else copied.rows,
        "elapsed_s": round(copied.elapsed_s, 2),
    }


def build_rebuild_asset(settings: Settings) -> dg.AssetsDefinition:
    naming = settings.naming

    @dg.asset(
        key=naming.rebuild,
        deps=[naming.changelog],
        partitions_def=table_partitions(settings),
        group_name="cdc",
        required_resource_keys=both_keys(settings),
        kinds={"delta", "spark"},
        description=(
            "Rewrites mirror tables from the change log alone — the table's latest copy (initial snapshot or online"
            " snapshot) and every change since — without reading the source (partition = table): for a Delta table"
            " lost, moved or restored from elsewhere. To repair a table from the source, use cdc/snapshot."
        ),
    )
    def rebuild(context: AssetExecutionContext) -> dg.MaterializeResult[None]:
        config = source_of(context, settings).config()
        table = config.table(context.partition_key)
        session = spark_of(context, settings).session()
        result = rebuild_table(config, table, session)
        context.log.info(f"rebuilt {result.summary()}")
        metadata = table_metadata(result, mirror_metadata(session, config, table))
        rebuilt = dg.AssetMaterialization(asset_key=naming.mirror(table), metadata={**metadata, "rebuilt": True})
        context.log_event(rebuilt)
        return dg.MaterializeResult(metadata=metadata)

    return rebuild


HISTORY_START = "2026-01-01"
"""The first day of every history asset's daily partitions: a fixed day, so that loading the code
location reads nothing from the change log; no change log holds a commit of an earlier day but one
replayed from upstream (its origin's commit time), and a day without changes is an empty partition."""


def build_history_asset(settings: Settings, table: TableConfig) -> dg.AssetsDefinition:
    name = str(table.name)
    naming = settings.naming

    @dg.asset(
        key=naming.history(table),
        deps=[naming.changelog],
        partitions_def=dg.DailyPartitionsDefinition(start_date=HISTORY_START, timezone="UTC"),
        group_name="history",
        pool=naming.history_pool(table),
        required_resource_keys=both_keys(settings),
        kinds={"delta", "spark"},
        description=f"Every change of {name} (operation, LSNs, commit time, before and after), by commit day.",
        metadata={"dagster/uri": history_path(settings.config, table)},
    )
    def history(context: AssetExecutionContext) -> dg.MaterializeResult[None]:
        config = source_of(context, settings).config()
        reader = ChangeLogReader(changelog_store(config))
        checkpoint = reader.checkpoint()
        state = checkpoint.tables.get(name) if checkpoint else None
        if state is None:
            raise CdcError(f"the change log at {config.changelog.path} holds nothing for {name}")
        day = context.partition_time_window.start.date()
        rows = history_rows(reader, name, state, day)
        written = write_history(
            spark_of(context, settings).session(),
            history_path(config, table),
            rows,
            day,
            config.warehouse.table_properties,
            config.delta_storage_options,
        )
        return dg.MaterializeResult(
            metadata={
                "dagster/partition_row_count": dg.MetadataValue.int(written),
                "day": dg.MetadataValue.text(day.isoformat()),
            }
        )

    return history
