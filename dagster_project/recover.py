"""The ``cdc_recover`` job: ``cdc-assets recover`` from the UI, with progress per table.

Each table's copy is logged as it goes and recorded, when done, as a materialization of
``cdc/snapshot`` for the table's partition, so the snapshot asset's partitions show which tables
are copied again; the merge sensor releases each table once the drain has recorded its copy.
"""

import dagster as dg
from dagster import OpExecutionContext

from cdc_assets.changelog.checkpoint import Gap
from cdc_assets.pipeline.online_snapshot import CopyProgress, TableCopied
from cdc_assets.pipeline.recover import recover
from dagster_project.assets import PROGRESS_INTERVAL_S, copy_metadata
from dagster_project.resources import source_keys, source_of
from dagster_project.settings import Settings


def build_recover_job(settings: Settings) -> dg.JobDefinition:
    naming = settings.naming

    @dg.op(
        name=naming.recover_op,
        required_resource_keys=source_keys(settings),
        description=(
            "After the slot was lost (dropped, invalidated, a failover without a failover slot): creates a new slot"
            " and copies every table again online while the source takes writes and the other tables keep flowing."
        ),
    )
    def recover_op(context: OpExecutionContext) -> None:
        logged: dict[str, float] = {}

        def show(progress: CopyProgress) -> None:
            last = logged.get(progress.table, -PROGRESS_INTERVAL_S)
            if progress.read or progress.elapsed_s - last >= PROGRESS_INTERVAL_S:
                logged[progress.table] = progress.elapsed_s
                context.log.info(progress.line())

        def gap(found: Gap) -> None:
            context.log.warning(f"recover: {found.describe()}")

        def copied(done: TableCopied) -> None:
            context.log.info(done.summary())
            context.log_event(
                dg.AssetMaterialization(asset_key=naming.snapshot, partition=done.table, metadata=copy_metadata(done))
            )

        result = recover(source_of(context, settings).config(), progress=show, on_gap=gap, on_copied=copied)
        for line in result.lines():
            context.log.info(line)

    @dg.job(name=naming.recover_job, description=recover_op.description, tags={"cdc/kind": "recover"})
    def recover_job() -> None:
        recover_op()

    return recover_job
