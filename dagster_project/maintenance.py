"""Per table, a maintenance asset ``maintenance/<schema>/<table>`` (OPTIMIZE, REORG … APPLY
(PURGE), VACUUM as due: ``cdc_assets.apply.maintenance``) and its schedule
(``warehouse.maintenance.cron``).

The asset sits in the ``mirror`` group beside the table's mirror asset, which it depends on, and
in the same pool (``cdc_table__<schema>__<table>``): with the pool's limit of 1, a table's merge
and its maintenance never run at once, so neither has to lose a Delta conflict and start over. A
following drain's merges run in the drain's run, outside the pool: the maintenance and they take
the table's write lock on the source instead (``TableWriteLock``).
"""

import dagster as dg
from dagster import AssetExecutionContext

from cdc_assets.apply.maintenance import Maintained, maintain_configured_table
from cdc_assets.config import TableConfig
from cdc_assets.lsn import format_lsn
from dagster_project.assets import mirror_key, table_pool, table_slug
from dagster_project.automation import automation_job
from dagster_project.resources import CdcSource, SparkResource
from dagster_project.settings import Settings


def maintenance_key(table: TableConfig) -> dg.AssetKey:
    return dg.AssetKey(["maintenance", table.name.schema, table.name.name])


def build_maintenance_asset(settings: Settings, table: TableConfig) -> dg.AssetsDefinition:
    name = str(table.name)

    @dg.asset(
        key=maintenance_key(table),
        deps=[mirror_key(table)],
        group_name="mirror",
        pool=table_pool(table),
        kinds={"delta", "spark"},
        description=(
            f"Maintenance of the Delta mirror of {name}: OPTIMIZE small files, purge deletion vectors, VACUUM"
            " files older than the retention (each when due)."
        ),
        metadata={"dagster/uri": settings.config.target_path(table)},
    )
    def maintenance(
        context: AssetExecutionContext, source: CdcSource, spark: SparkResource
    ) -> dg.MaterializeResult[None]:
        config = source.config()
        result = maintain_configured_table(config, config.table(name), spark.session())
        context.log.info(result.summary())
        return dg.MaterializeResult(metadata=maintenance_metadata(result))

    return maintenance


def maintenance_metadata(result: Maintained) -> dict[str, dg.MetadataValue]:
    if result.skipped or result.before is None or result.after is None:
        return {"skipped": dg.MetadataValue.text(str(result.skipped))}
    before, after = result.before, result.after
    metadata: dict[str, dg.MetadataValue] = {
        "steps": dg.MetadataValue.text(", ".join(result.steps) or "nothing due"),
        "files": dg.MetadataValue.int(after.files),
        "files_before": dg.MetadataValue.int(before.files),
        "deletion_vectors": dg.MetadataValue.int(after.deletion_vectors),
        "deletion_vectors_before": dg.MetadataValue.int(before.deletion_vectors),
        "deleted_rows_in_files": dg.MetadataValue.int(after.deleted_rows),
        "size_mb": dg.MetadataValue.float(round(after.bytes / 1e6, 3)),
        "size_mb_before": dg.MetadataValue.float(round(before.bytes / 1e6, 3)),
        "delta_version": dg.MetadataValue.int(after.version),
        "applied_lsn": dg.MetadataValue.text("none" if result.applied_lsn is None else format_lsn(result.applied_lsn)),
        "duration_s": dg.MetadataValue.float(round(result.elapsed_s, 3)),
        "dagster/uri": dg.MetadataValue.path(result.path),
    }
    if result.vacuumed_files is not None:
        metadata["vacuumed_files"] = dg.MetadataValue.int(result.vacuumed_files)
    return metadata


def build_maintenance_schedule(
    settings: Settings, table: TableConfig, asset: dg.AssetsDefinition
) -> dg.ScheduleDefinition:
    return dg.ScheduleDefinition(
        name=f"cdc_maintain__{table_slug(table)}",
        cron_schedule=settings.config.warehouse.maintenance.cron,
        target=automation_job(f"cdc_maintain__{table_slug(table)}", [asset]),
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description=f"Maintains the Delta mirror of {table.name} (warehouse.maintenance).",
    )
