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
from dagster_project.assets import PROGRESS_INTERVAL_S, SNAPSHOT_KEY, copy_metadata
from dagster_project.resources import CdcSource
from dagster_project.settings import Settings

RECOVER_JOB = "cdc_recover"


def build_recover_job(settings: Settings) -> dg.JobDefinition:
    @dg.op(
        name="recover",
        description=(
            "After the slot was lost (dropped, invalidated, a failover without a failover slot): creates a new slot"
            " and copies every table again online while the source takes writes and the other tables keep flowing."
        ),
    )
    def recover_op(context: OpExecutionContext, source: CdcSource) -> None:
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
                dg.AssetMaterialization(asset_key=SNAPSHOT_KEY, partition=done.table, metadata=copy_metadata(done))
            )

        result = recover(source.config(), progress=show, on_gap=gap, on_copied=copied)
        for line in result.lines():
            context.log.info(line)

    @dg.job(name=RECOVER_JOB, description=recover_op.description, tags={"cdc/kind": "recover"})
    def recover_job() -> None:
        recover_op()

    return recover_job
