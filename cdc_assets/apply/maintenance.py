"""``cdc-assets maintain``: keep each mirrored Delta table small in files, free of piled-up
deletion vectors, and free of files no version within the retention needs.

Per table, in Delta SQL (which also works over Spark Connect), each step only when due:

1. ``OPTIMIZE`` (``ZORDER BY`` the first key column with ``zorder``) once the table has
   ``compact_min_files`` data files: small files from merges become few large ones; the deletion
   vectors of the files it rewrites go with them;
2. ``REORG TABLE … APPLY (PURGE)`` once ``purge_min_deletion_vectors`` files still carry one;
3. ``VACUUM … RETAIN <hours> HOURS``: deletes files that left the table more than the retention
   ago (the configuration refuses a retention below Delta's safety check) — but never a file the
   table's version in the latest consistent point reads: the retention grows to reach back to
   the commit that followed that version.

None of these commits carries the idempotent-write marker, and none removes one: Delta keeps the
latest ``SetTransaction`` of each application id through every later commit and checkpoint, so a
table's applied LSN is the same after maintenance and a replayed merge is still skipped. The
merge and the maintenance of one table never run at once: both write through
:func:`~cdc_assets.apply.write_path.write_mirror`, which holds the table's write lock.
Checkpoints of the Delta log are Delta's own: one every ``delta.checkpointInterval`` commits
(default 10, maintenance commits included), and log files past ``delta.logRetentionDuration``
are removed when a checkpoint is written.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from pyspark.sql import SparkSession

from cdc_assets.apply.consistent_points import point_files_since
from cdc_assets.apply.spark_literals import backquote
from cdc_assets.apply.table_files import TableFiles, table_files
from cdc_assets.apply.target import DeltaTarget
from cdc_assets.apply.write_path import Mirror, write_mirror
from cdc_assets.config import Config, MaintenanceConfig, TableConfig
from cdc_assets.faults import fault_point
from cdc_assets.lsn import format_lsn
from cdc_assets.names import TableName


@dataclass(slots=True)
class Maintained:
    """What one table's maintenance did."""

    table: str
    path: str
    before: TableFiles | None = None
    after: TableFiles | None = None
    applied_lsn: int | None = None
    steps: tuple[str, ...] = ()  # the statements run, e.g. ("OPTIMIZE", "VACUUM")
    vacuumed_files: int | None = None  # files VACUUM deleted (None: not run, or not reported)
    elapsed_s: float = 0.0
    skipped: str | None = None
    kind: str = "maintained"  # "compacted": a following drain's compaction (compact_table)

    def lines(self) -> list[str]:
        return [f"{self.kind} {self.summary()}"]

    def summary(self) -> str:
        if self.skipped or self.before is None or self.after is None:
            return f"{self.table}: {self.skipped}"
        done = ", ".join(self.steps) or "nothing due"
        if self.vacuumed_files is not None:
            done += f" ({self.vacuumed_files:,} files deleted)"
        before, after = self.before, self.after
        lsn = "none" if self.applied_lsn is None else format_lsn(self.applied_lsn)
        return (
            f"{self.table}: {done}; files {before.files:,} → {after.files:,}, deletion vectors"
            f" {before.deletion_vectors:,} → {after.deletion_vectors:,}, {before.bytes / 1e6:,.1f} →"
            f" {after.bytes / 1e6:,.1f} MB, Delta version {before.version} → {after.version};"
            f" applied LSN {lsn} ({self.elapsed_s:.1f} s)"
        )


def maintain_table(
    target: DeltaTarget,
    settings: MaintenanceConfig,
    name: str,
    key: str | None = None,
    keep_since_ms: int | None = None,
) -> Maintained:
    """Run the maintenance steps due on ``target``; ``key`` is the column ``zorder`` orders by;
    VACUUM keeps every file removed since ``keep_since_ms`` (ms since 1970), whatever the retention."""
    started = time.monotonic()
    result = Maintained(name, target.path)
    if not target.exists():
        result.skipped = "no Delta table yet (nothing applied)"
        return result
    files = result.before = table_files(target.path, target.storage_options)
    steps = []
    if settings.compact_min_files and files.files >= settings.compact_min_files:
        order = f" ZORDER BY ({backquote(key)})" if settings.zorder and key else ""
        target.execute(f"OPTIMIZE {target.sql_name}{order}")
        fault_point("maintain-optimize")
        steps.append("OPTIMIZE" + (" ZORDER" if order else ""))
        files = table_files(target.path, target.storage_options)
    if settings.purge_min_deletion_vectors and files.deletion_vectors >= settings.purge_min_deletion_vectors:
        target.execute(f"REORG TABLE {target.sql_name} APPLY (PURGE)")
        fault_point("maintain-purge")
        steps.append("REORG PURGE")
    if settings.vacuum_retention_hours:
        hours = vacuum_hours(settings.vacuum_retention_hours, keep_since_ms, time.time() * 1000)
        target.execute(f"VACUUM {target.sql_name} RETAIN {hours} HOURS")
        fault_point("maintain-vacuum")
        steps.append("VACUUM" if hours == settings.vacuum_retention_hours else f"VACUUM (retaining {hours} hours)")
        result.vacuumed_files = _vacuumed_files(target)
    result.steps = tuple(steps)
    result.after = table_files(target.path, target.storage_options)
    result.applied_lsn = target.applied_lsn()
    result.elapsed_s = time.monotonic() - started
    return result


def vacuum_hours(configured: int, keep_since_ms: int | None, now_ms: float) -> int:
    """VACUUM's retention: the configured hours, or more, so that every file removed since
    ``keep_since_ms`` stays (one hour to spare)."""
    if keep_since_ms is None:
        return configured
    return max(configured, math.ceil((now_ms - keep_since_ms) / 3_600_000) + 1)


def maintain_tables(
    config: Config,
    spark: SparkSession,
    tables: Sequence[str | TableName] | None = None,
    *,
    progress: Callable[[Maintained], None] | None = None,
) -> list[Maintained]:
    """Maintain the Delta tables of ``tables`` (default: every configured table)."""
    selected = [config.table(t) for t in tables] if tables else list(config.tables)
    results = []
    for table in selected:
        results.append(maintain_configured_table(config, table, spark))
        if progress is not None:
            progress(results[-1])
    return results


def maintain_configured_table(config: Config, table: TableConfig, spark: SparkSession) -> Maintained:
    """:func:`maintain_table` for a configured table, on its mirror opened for writing (its merges
    wait meanwhile, and it waits for theirs)."""
    with write_mirror(config, table, spark) as mirror:
        keep = point_files_since(config, mirror.name)
        return maintain_table(mirror.target, config.warehouse.maintenance, mirror.name, _first_key_column(mirror), keep)


def compact_table(mirror: Mirror) -> Maintained:
    """OPTIMIZE one table now, and nothing else of the maintenance — what a following drain does to
    a table its merges brought to ``follow_compact_files`` data files, under the merge's lock."""
    only = replace(
        mirror.config.warehouse.maintenance,
        compact_min_files=1,
        purge_min_deletion_vectors=0,
        vacuum_retention_hours=0,
    )
    return replace(maintain_table(mirror.target, only, mirror.name, _first_key_column(mirror)), kind="compacted")


def _first_key_column(mirror: Mirror) -> str | None:
    """The first replica-identity key column of the mirror's table as the change log last saw it."""
    keys = mirror.state.relation.key_columns if mirror.state else ()
    return keys[0] if keys else None


def _vacuumed_files(target: DeltaTarget) -> int | None:
    """Files the VACUUM just run deleted, from its ``VACUUM END`` commit."""
    last = target.spark.sql(f"DESCRIBE HISTORY {target.sql_name} LIMIT 1").collect()[0]
    metrics = last["operationMetrics"] or {}
    return int(metrics["numDeletedFiles"]) if last["operation"] == "VACUUM END" and metrics else None
