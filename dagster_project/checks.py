"""Asset checks: on each mirror table, parity with the source and lag within a bound; on the drain,
the WAL its slot holds behind ``restart_lsn`` and, with a standby, whether its copy of the slot is ready."""

import dagster as dg

from cdc_assets.config import TableConfig
from cdc_assets.errors import SourceError
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.parity import Parity, Uncompared, read_parity
from cdc_assets.source import HELD_WAL_WARN_BYTES, HeldWal, connect, read_held_wal, read_slot
from cdc_assets.source.standby_slot import read_standby_slot
from dagster_project.lag import LAG_CHECK, lag_result
from dagster_project.resources import both_keys, source_keys, source_of, spark_of
from dagster_project.settings import Settings


def build_parity_check(settings: Settings, table: TableConfig) -> dg.AssetChecksDefinition:
    name = str(table.name)
    wait = settings.config.schedule.parity_wait_seconds

    @dg.asset_check(
        asset=settings.naming.mirror(table),
        name="parity",
        required_resource_keys=both_keys(settings),
        description=(
            f"{name} in Delta equals the source: row count and content checksum at one LSN (a temporary slot's"
            f" snapshot point), compared with the Delta version that holds the source's state there. Reads only: it"
            f" waits up to {wait} s (schedule.parity_wait_seconds) for the drain and the table's merge to pass that"
            " point, else warns that it could not compare. cdc/verify drains and merges up to the point itself."
        ),
    )
    def parity(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        config = source_of(context, settings).config()
        session = spark_of(context, settings).session()
        result = read_parity(config, config.table(name), session, wait_seconds=wait)
        if isinstance(result, Uncompared):
            return dg.AssetCheckResult(
                passed=False,
                severity=dg.AssetCheckSeverity.WARN,
                description=f"{name} not compared at LSN {format_lsn(result.snapshot_lsn)}: {result.reason}"
                " (is the drain running? cdc/verify drains and merges up to the point itself)",
                metadata={"compared_at_lsn": dg.MetadataValue.text(format_lsn(result.snapshot_lsn))},
            )
        return parity_result(result)

    return parity


def parity_result(result: Parity) -> dg.AssetCheckResult:
    """The ``parity`` check's result for a comparison (the check's own, or cdc/verify's)."""
    return dg.AssetCheckResult(
        passed=result.ok,
        description=None
        if result.ok
        else f"{result.table} differs from its source at LSN {format_lsn(result.snapshot_lsn)}",
        metadata=parity_metadata(result),
    )


def parity_metadata(result: Parity) -> dict[str, dg.MetadataValue]:
    metadata: dict[str, dg.MetadataValue] = {
        "source_rows": dg.MetadataValue.int(result.source.rows),
        "delta_rows": dg.MetadataValue.int(result.delta.rows),
        "source_checksum": dg.MetadataValue.text(str(result.source.checksum)),
        "delta_checksum": dg.MetadataValue.text(str(result.delta.checksum)),
        "compared_at_lsn": dg.MetadataValue.text(format_lsn(result.snapshot_lsn)),
    }
    if result.delta_version is not None:
        metadata["delta_version"] = dg.MetadataValue.int(result.delta_version)
    return metadata


def build_lag_check(settings: Settings, table: TableConfig) -> dg.AssetChecksDefinition:
    name = str(table.name)
    bound = settings.config.schedule.max_lag_bytes

    @dg.asset_check(
        asset=settings.naming.mirror(table),
        name=LAG_CHECK,
        required_resource_keys=source_keys(settings),
        description=f"WAL written since {name}'s applied LSN stays under {bound:,} bytes (schedule.max_lag_bytes).",
    )
    def lag(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        return lag_result(source_of(context, settings).config(), table)

    return lag


def build_held_wal_check(settings: Settings, bound: int = HELD_WAL_WARN_BYTES) -> dg.AssetChecksDefinition:
    """Warns when the slot holds more than ``bound`` bytes of WAL behind its restart_lsn, naming the
    oldest running transaction with an xid, which keeps restart_lsn back. Runs after each drain."""
    slot = settings.config.source.slot

    @dg.asset_check(
        asset=settings.naming.changelog,
        name="slot_held_wal",
        required_resource_keys=source_keys(settings),
        description=(
            f"Replication slot {slot} holds at most {bound:,} bytes of WAL behind its restart_lsn (the server keeps"
            " that WAL for it); the metadata names the oldest running transaction with an xid, which keeps"
            " restart_lsn back until it ends (an idle-in-transaction session, a forgotten prepared transaction)."
        ),
    )
    def slot_held_wal(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        config = source_of(context, settings).config()
        with connect(config.source, purpose="held-wal-check") as conn:
            held = read_held_wal(conn, config.source.slot)
        if held is None:
            return dg.AssetCheckResult(
                passed=False,
                severity=dg.AssetCheckSeverity.WARN,
                description=f"replication slot {slot} does not exist (run `cdc-assets setup`)",
            )
        return dg.AssetCheckResult(
            passed=not held.over(bound),
            severity=dg.AssetCheckSeverity.WARN,
            description=held.warning(bound),
            metadata=held_wal_metadata(held, bound),
        )

    return slot_held_wal


def build_standby_slot_check(settings: Settings) -> dg.AssetChecksDefinition:
    """With ``source.standby_dsn``: fails (WARN) while the standby's synced copy of the failover
    slot could not take over. Runs after each drain."""
    slot = settings.config.source.slot

    @dg.asset_check(
        asset=settings.naming.changelog,
        name="standby_slot_ready",
        required_resource_keys=source_keys(settings),
        description=(
            f"The standby (source.standby_dsn) keeps a synced, valid copy of failover slot {slot}, so that the drain"
            " goes on after a promotion; the metadata has its confirmed LSN and how far it is behind the primary's."
        ),
    )
    def standby_slot_ready(context: dg.AssetCheckExecutionContext) -> dg.AssetCheckResult:
        config = source_of(context, settings).config()
        with connect(config.source, purpose="standby-check") as conn:
            primary = read_slot(conn, config.source.slot)
        try:
            standby = read_standby_slot(config.source, primary)
        except SourceError as error:
            return dg.AssetCheckResult(
                passed=False, severity=dg.AssetCheckSeverity.WARN, description=f"standby unreachable: {error}"
            )
        confirmed = standby.confirmed_flush_lsn
        return dg.AssetCheckResult(
            passed=standby.problem is None,
            severity=dg.AssetCheckSeverity.WARN,
            description=standby.describe(),
            metadata={
                "synced": dg.MetadataValue.bool(standby.synced),
                "confirmed_flush_lsn": dg.MetadataValue.text(
                    format_lsn(confirmed) if confirmed is not None else "none"
                ),
                "behind_bytes": dg.MetadataValue.int(standby.behind_bytes or 0),
                "invalidation_reason": dg.MetadataValue.text(standby.invalidation_reason or "none"),
            },
        )

    return standby_slot_ready


def held_wal_metadata(held: HeldWal, bound: int) -> dict[str, dg.MetadataValue]:
    held_bytes = held.held_bytes or 0
    metadata: dict[str, dg.MetadataValue] = {
        "held_bytes": dg.MetadataValue.int(held_bytes),
        "held_mb": dg.MetadataValue.float(round(held_bytes / 1e6, 3)),
        "restart_lsn": dg.MetadataValue.text(format_lsn(held.restart_lsn) if held.restart_lsn is not None else "none"),
        "warn_bytes": dg.MetadataValue.int(bound),
        "pinned_by": dg.MetadataValue.text(held.pinned_by.describe() if held.pinned_by else "none"),
    }
    pinned = held.pinned_by
    if pinned is None:
        return metadata
    if pinned.pid is not None:
        metadata["pinned_pid"] = dg.MetadataValue.int(pinned.pid)
    if pinned.gid is not None:
        metadata["pinned_gid"] = dg.MetadataValue.text(pinned.gid)
    metadata["pinned_xid"] = dg.MetadataValue.int(pinned.xid)
    if pinned.age_seconds is not None:
        metadata["pinned_age_s"] = dg.MetadataValue.float(round(pinned.age_seconds, 3))
    if pinned.state is not None:
        metadata["pinned_state"] = dg.MetadataValue.text(pinned.state)
    if pinned.query_start is not None:
        metadata["pinned_query_start"] = dg.MetadataValue.timestamp(pinned.query_start)
    if pinned.query is not None:
        metadata["pinned_query"] = dg.MetadataValue.text(pinned.query)
    return metadata
