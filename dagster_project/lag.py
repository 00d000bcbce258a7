"""A mirror's ``lag`` check: the WAL written since its applied LSN against ``schedule.max_lag_bytes``
— evaluated by the check's own step after a merge run, and logged by a drain run for each table
it merges."""

import dagster as dg

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.config import Config, TableConfig
from cdc_assets.lsn import format_lsn
from cdc_assets.source import connect
from cdc_assets.source.connection import one_row

LAG_CHECK = "lag"


def lag_result(config: Config, table: TableConfig) -> dg.AssetCheckResult:
    """The check's result now: the source's current WAL position less the table's applied LSN."""
    bound = config.schedule.max_lag_bytes
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


def lag_evaluation(config: Config, table: TableConfig, key: dg.AssetKey) -> dg.AssetCheckEvaluation:
    """:func:`lag_result` as an event a step of another asset logs (a drain run's merges)."""
    result = lag_result(config, table)
    return dg.AssetCheckEvaluation(
        asset_key=key, check_name=LAG_CHECK, passed=result.passed, metadata=result.metadata, severity=result.severity
    )
