"""Asset checks on each mirror table: parity with the source, and lag within a bound."""

import dagster as dg

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.config import TableConfig
from cdc_assets.lsn import format_lsn
from cdc_assets.parity import check_parity
from cdc_assets.source import connect
from cdc_assets.source.connection import one_row
from dagster_project.assets import mirror_key, table_pool
from dagster_project.resources import CdcSource, SparkResource
from dagster_project.settings import Settings


def build_parity_check(settings: Settings, table: TableConfig) -> dg.AssetChecksDefinition:
    name = str(table.name)

    @dg.asset_check(
        asset=mirror_key(table),
        name="parity",
        pool=table_pool(table),
        description=(
            f"{name} in Delta equals the source: row count and content checksum, compared at one LSN (a temporary"
            " slot's snapshot point; the log is drained and the table merged up to it first)."
        ),
    )
    def parity(source: CdcSource, spark: SparkResource) -> dg.AssetCheckResult:
        config = source.config()
        result = check_parity(config, config.table(name), spark.session())
        return dg.AssetCheckResult(
            passed=result.ok,
            description=None
            if result.ok
            else f"{name} differs from its source at LSN {format_lsn(result.snapshot_lsn)}",
            metadata={
                "source_rows": dg.MetadataValue.int(result.source.rows),
                "delta_rows": dg.MetadataValue.int(result.delta.rows),
                "source_checksum": dg.MetadataValue.text(str(result.source.checksum)),
                "delta_checksum": dg.MetadataValue.text(str(result.delta.checksum)),
                "compared_at_lsn": dg.MetadataValue.text(format_lsn(result.snapshot_lsn)),
            },
        )

    return parity


def build_lag_check(settings: Settings, table: TableConfig) -> dg.AssetChecksDefinition:
    name = str(table.name)
    bound = settings.config.schedule.max_lag_bytes

    @dg.asset_check(
        asset=mirror_key(table),
        name="lag",
        description=f"WAL written since {name}'s applied LSN stays under {bound:,} bytes (schedule.max_lag_bytes).",
    )
    def lag(source: CdcSource) -> dg.AssetCheckResult:
        config = source.config()
        applied = table_applied_lsn(config, table)
        with connect(config.source, purpose="lag-check") as conn:
            (current,) = one_row(conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::int8"))
        behind = int(current) - (applied or 0)
        return dg.AssetCheckResult(
            passed=applied is not None and behind <= bound,
            severity=dg.AssetCheckSeverity.WARN,
            metadata={
                "lag_bytes": dg.MetadataValue.int(behind),
                "lag_mb": dg.MetadataValue.float(round(behind / 1e6, 3)),
                "applied_lsn": dg.MetadataValue.text(format_lsn(applied) if applied is not None else "none"),
                "bound_bytes": dg.MetadataValue.int(bound),
            },
        )

    return lag
