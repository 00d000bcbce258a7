"""Maintenance of every mirror in one step: per table an asset ``maintenance/<schema>/<table>``
(OPTIMIZE, REORG … APPLY (PURGE), VACUUM as due: ``cdc_assets.apply.maintenance``), all of them
outputs of one subsettable multi-asset, and one schedule (``warehouse.maintenance.cron``) that
maintains every table in one run — a run per table would cost hundreds of Dagster runs an hour.

Each asset sits in the ``mirror`` group beside the table's mirror asset, which it depends on. A
table's maintenance and its merges (the mirror's runs, a following drain's) write it through the
one write path, which holds the table's write lock on the source
(``cdc_assets.apply.write_path``): the second waits, so neither loses a Delta conflict.
"""

from collections.abc import Iterator

import dagster as dg
from dagster import AssetExecutionContext

from cdc_assets.apply.maintenance import Maintained, maintain_configured_table
from cdc_assets.errors import CdcError
from cdc_assets.lsn import format_lsn
from dagster_project.automation import automation_job
from dagster_project.resources import both_keys, source_of, spark_of
from dagster_project.settings import Settings


def build_maintenance_asset(settings: Settings) -> dg.AssetsDefinition:
    """Every table's maintenance asset, materialized by one step over the selected tables (a table
    that fails does not stop the others; the step fails at the end naming it)."""
    config = settings.config
    naming = settings.naming
    specs = [
        dg.AssetSpec(
            naming.maintenance(table),
            deps=[naming.mirror(table)],
            group_name="mirror",
            kinds={"delta", "spark"},
            skippable=True,
            description=(
                f"Maintenance of the Delta mirror of {table.name}: OPTIMIZE small files, purge deletion vectors,"
                " VACUUM files older than the retention (each when due)."
            ),
            metadata={"dagster/uri": config.target_path(table)},
        )
        for table in config.tables
    ]

    @dg.multi_asset(
        name=naming.maintenance_op, specs=specs, can_subset=True, required_resource_keys=both_keys(settings)
    )
    def maintenance(context: AssetExecutionContext) -> Iterator[dg.MaterializeResult[None]]:
        config = source_of(context, settings).config()
        session = spark_of(context, settings).session()
        selected = [t for t in config.tables if naming.maintenance(t) in context.selected_asset_keys]
        failed: list[str] = []
        for done, table in enumerate(selected, 1):
            try:
                result = maintain_configured_table(config, table, session)
            except Exception as error:  # noqa: BLE001 - the other tables go on; the step fails at the end
                context.log.error(f"maintenance of {table.name} failed: {error}")
                failed.append(str(table.name))
                continue
            context.log.info(f"[{done}/{len(selected)}] {result.summary()}")
            yield dg.MaterializeResult(asset_key=naming.maintenance(table), metadata=maintenance_metadata(result))
        if failed:
            raise CdcError(f"maintenance failed for {len(failed)} of {len(selected)} tables: {', '.join(failed)}")

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


def build_maintenance_schedule(settings: Settings, asset: dg.AssetsDefinition) -> dg.ScheduleDefinition:
    name = settings.naming.maintain
    return dg.ScheduleDefinition(
        name=name,
        cron_schedule=settings.config.warehouse.maintenance.cron,
        target=automation_job(name, [asset]),
        execution_timezone="UTC",
        default_status=dg.DefaultScheduleStatus.RUNNING,
        description="Maintains every Delta mirror in one run (warehouse.maintenance).",
    )
