"""``cdc/consistent_point``: every mirror as of one source position, for assets downstream that
need the tables to agree (docs/architecture.md, "Consistent points").

The asset depends on every mirror; a run of it publishes the newest point past the latest one that
every table holds, and materializes with its LSN, source commit time and lag behind the change
log's checkpoint (no Spark: delta-rs and the change log). Its sensor (automation.py) looks for such
a point, read-only, and requests a run when there is one, once per point; a drain run that merges
(``schedule.merge_with_drain``) publishes the points its merges make itself.
"""

from collections.abc import Iterator
from datetime import timedelta

import dagster as dg
from dagster import AssetExecutionContext

from cdc_assets.apply.consistent_points import ConsistentPoint, points_path, publish_point
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config
from cdc_assets.lsn import format_lsn
from dagster_project.resources import source_keys, source_of
from dagster_project.settings import Settings


def build_consistent_point_asset(settings: Settings, mirrors: list[dg.AssetsDefinition]) -> dg.AssetsDefinition:
    fresh = timedelta(minutes=settings.config.schedule.freshness_minutes)

    @dg.asset(
        key=settings.naming.consistent_point,
        deps=[mirror.key for mirror in mirrors],
        group_name="mirror",
        required_resource_keys=source_keys(settings),
        kinds={"delta"},
        freshness_policy=dg.FreshnessPolicy.time_window(fail_window=fresh, warn_window=fresh / 2),
        description=(
            "The latest consistent point: a Delta version of every mirror, all as of one source position"
            f" (read them together through cdc_assets.apply.consistent_points; kept at {points_path(settings.config)})."
        ),
        metadata={"dagster/uri": points_path(settings.config)},
        output_required=False,  # no new point: nothing to materialize
    )
    def consistent_point(context: AssetExecutionContext) -> Iterator[dg.MaterializeResult[None]]:
        config = source_of(context, settings).config()
        point = publish_point(config)
        if isinstance(point, str):
            context.log.info(f"no new consistent point: {point}")
            return
        context.log.info(f"consistent point {point.summary()}")
        yield dg.MaterializeResult(metadata=point_metadata(config, point))

    return consistent_point


def point_metadata(config: Config, point: ConsistentPoint) -> dict[str, dg.MetadataValue]:
    checkpoint = ChangeLogReader(changelog_store(config)).require_checkpoint()
    metadata: dict[str, dg.MetadataValue] = {
        "lsn": dg.MetadataValue.text(format_lsn(point.lsn)),
        "lag_bytes": dg.MetadataValue.int(max(0, checkpoint.lsn - point.lsn)),
        "tables": dg.MetadataValue.json(dict(sorted(point.tables.items()))),
        "dagster/uri": dg.MetadataValue.path(points_path(config)),
    }
    if point.commit_time is not None:
        metadata["commit_time"] = dg.MetadataValue.timestamp(point.commit_time)
    return metadata
