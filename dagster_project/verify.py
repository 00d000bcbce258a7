"""``cdc/verify`` (partition = table): a mirror brought to one source point and compared with it.

What the ``parity`` check did before it was made read-only: a temporary slot's snapshot point
``C``, the drain up to ``C``, the table's merge to the new checkpoint, then the comparison
(``cdc_assets.pipeline.parity.verify_table``). Everything it writes is recorded where the UI
shows it: the drain as a materialization of ``cdc/changelog``, the merge as one of the mirror, the
verdict as an evaluation of the mirror's ``parity`` check. A difference fails the run.
"""

import dagster as dg
from dagster import AssetExecutionContext

from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.parity import verify_table
from dagster_project.assets import drain_metadata, mirror_metadata, table_metadata, table_partitions
from dagster_project.checks import parity_result
from dagster_project.resources import both_keys, source_of, spark_of
from dagster_project.settings import Settings


def build_verify_asset(settings: Settings) -> dg.AssetsDefinition:
    naming = settings.naming

    @dg.asset(
        key=naming.verify,
        deps=[naming.changelog],
        partitions_def=table_partitions(settings),
        group_name="cdc",
        required_resource_keys=both_keys(settings),
        kinds={"postgres", "delta", "spark"},
        description=(
            "Brings mirror tables to one source point and compares them (partition = table): a temporary slot's"
            " snapshot point, the drain up to it, the table's merge, then row count and checksum of both sides."
            " Records the drain as a cdc/changelog materialization, the merge as the mirror's, and the verdict as"
            " the mirror's parity check; a difference fails the run. Launch a backfill over the tables to verify."
        ),
    )
    def verify(context: AssetExecutionContext) -> dg.MaterializeResult[None]:
        config = source_of(context, settings).config()
        table = config.table(context.partition_key)
        session = spark_of(context, settings).session()
        done = verify_table(config, table, session)
        context.log_event(dg.AssetMaterialization(asset_key=naming.changelog, metadata=drain_metadata(done.drained)))
        applied = table_metadata(done.applied, mirror_metadata(session, config, table))
        context.log_event(dg.AssetMaterialization(asset_key=naming.mirror(table), metadata=applied))
        verdict = parity_result(done.parity)
        context.log_event(
            dg.AssetCheckEvaluation(
                asset_key=naming.mirror(table),
                check_name="parity",
                passed=verdict.passed,
                metadata=verdict.metadata,
                description=verdict.description,
            )
        )
        if not done.parity.ok:
            raise dg.Failure(description=verdict.description, metadata=verdict.metadata)
        context.log.info(f"{table.name} equals its source at LSN {format_lsn(done.parity.snapshot_lsn)}")
        return dg.MaterializeResult(metadata=verdict.metadata)

    return verify
