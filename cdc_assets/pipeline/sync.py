"""``sync``: a drain, change-log retention when it is due, then the apply (and the maintenance) —
composed once, for the command line (``drain``, ``sync``, ``apply``) and Dagster's drain runs alike.

The drain follows the stream ``follow_seconds`` after catching up (default ``drain.follow_seconds``).
:class:`SyncSteps` says what goes with it:

* ``merge``: the tables each durable batch changed are merged as the drain goes
  (:class:`~cdc_assets.apply.follower.MergeFollower`), and what the last batches brought once it
  stops — unless the drain does not follow and an apply comes after it, which merges them;
* ``copy_held``: the tables a DDL rewrote are copied again — after a one-shot drain, which then
  drains again up to their copies' announcements; while following, on a thread of their own
  (:mod:`cdc_assets.pipeline.held_copies`). Dagster leaves them to its merge sensor;
* then change-log retention, when due (:func:`~cdc_assets.pipeline.retention.retain_when_due`);
* ``apply``: then every table (:func:`apply`); ``maintain``: then every table's maintenance.

Spark starts only for a step that needs it. Every result is handed to ``report`` as it is done — a
drain, a copy, retention, a merge, a compaction, a consistent point, a maintenance — and describes
itself (:class:`Described`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Protocol

from pyspark.sql import SparkSession

from cdc_assets.apply.consistent_points import ConsistentPoint, publish_point
from cdc_assets.apply.follower import MergeFollower
from cdc_assets.apply.maintenance import maintain_tables
from cdc_assets.apply.runner import TableApplied, apply_tables
from cdc_assets.changelog.batch_demand import BatchDemand
from cdc_assets.changelog.checkpoint import require_checkpoint
from cdc_assets.changelog.retention import RetentionResult
from cdc_assets.changelog.store import changelog_store
from cdc_assets.changelog.stream_writer import DrainProgress, DurableBatch
from cdc_assets.config import Config
from cdc_assets.errors import ConfigError
from cdc_assets.names import TableName
from cdc_assets.pipeline.drain import DrainResult, drain
from cdc_assets.pipeline.held_copies import HeldTableCopier, drain_with_copies
from cdc_assets.pipeline.retention import retain_when_due


class Described(Protocol):
    """A result that says what it did, a line each."""

    def lines(self) -> list[str]: ...


def _unreported(_: Described) -> None:
    """The default ``report``: nothing."""


@dataclass(slots=True, frozen=True)
class SyncSteps:
    """What goes with the drain (see the module docstring)."""

    merge: bool = True
    copy_held: bool = True
    apply: bool = True
    maintain: bool = False


DRAIN_ONLY = SyncSteps(merge=False, copy_held=False, apply=False)
"""``cdc-assets drain`` and Dagster's drain runs (which merge with ``schedule.merge_with_drain``):
the drain, then retention."""


@dataclass(slots=True)
class SyncResult:
    """What a sync did (each of it was reported as it was done)."""

    drains: list[DrainResult] = field(default_factory=list)  # two when held tables were copied between them
    retention: RetentionResult | None = None  # None: not due, or a drain held the log
    applied: list[TableApplied] = field(default_factory=list)


def sync(
    config: Config,
    spark: Callable[[], SparkSession],
    steps: SyncSteps = SyncSteps(),
    *,
    wait: bool = False,
    follow_seconds: float | None = None,
    report: Callable[[Described], None] = _unreported,
    progress: Callable[[DrainProgress], None] | None = None,
    on_batch: Callable[[DurableBatch], None] | None = None,
) -> SyncResult:
    """Drain (``wait``: for another drain of the slot), with ``steps``; ``spark`` starts the session
    the steps that need one share; ``progress`` and ``on_batch`` are the drain's."""
    follow = config.drain.follow_seconds if follow_seconds is None else follow_seconds
    result = SyncResult()

    def drained(durable: Callable[[DurableBatch], None] | None = on_batch, demand: BatchDemand | None = None) -> None:
        result.drains.append(
            drain(config, wait=wait, progress=progress, follow_seconds=follow, on_batch=durable, demand=demand)
        )
        report(result.drains[-1])

    session = None
    if steps.merge and (follow > 0 or not steps.apply):
        session = _drain_merging(config, spark(), steps.copy_held, drained, report, on_batch)
    elif steps.copy_held:
        drain_with_copies(config, drained, report)
    else:
        drained()
    result.retention = retain_when_due(config)
    if result.retention is not None:
        report(result.retention)
    if steps.apply or steps.maintain:
        ready = session or spark()
        if steps.apply:
            result.applied = apply(config, lambda: ready, report=report).tables
        if steps.maintain:
            maintain_tables(config, ready, progress=report)
    return result


def _drain_merging(
    config: Config,
    session: SparkSession,
    copy_held: bool,
    drained: Callable[[Callable[[DurableBatch], None], BatchDemand], None],
    report: Callable[[Described], None],
    on_batch: Callable[[DurableBatch], None] | None,
) -> SparkSession:
    """A drain whose durable batches are merged as it goes (and the held tables copied, with
    ``copy_held``), each merge calling for a batch first (:class:`BatchDemand`); the session the
    merges ended on (a lost Connect session is replaced)."""
    demand = BatchDemand()
    with ExitStack() as beside:
        merges = beside.enter_context(MergeFollower(config, session, report, report, report, demand))
        copies = beside.enter_context(HeldTableCopier(config, report)) if copy_held else None

        def durable(batch: DurableBatch) -> None:
            if on_batch is not None:
                on_batch(batch)
            merges.batch_durable()
            if copies is not None:
                copies.batch_durable()

        drained(durable, demand)
    return merges.spark


@dataclass(slots=True)
class Applied:
    """What an apply did: each table's result and, when it was to publish one, the consistent
    point it published (or why there was none)."""

    tables: list[TableApplied]
    point: ConsistentPoint | str | None = None

    def lines(self) -> list[str]:
        """The consistent point (each table is reported as it is done)."""
        if isinstance(self.point, str):
            return [f"no new consistent point: {self.point}"]
        return [] if self.point is None else self.point.lines()


def apply(
    config: Config,
    spark: Callable[[], SparkSession],
    tables: Sequence[str | TableName] | None = None,
    *,
    consistent: bool = False,
    report: Callable[[Described], None] = _unreported,
) -> Applied:
    """Apply the change log to ``tables`` (default: every configured table); with ``consistent``,
    every table to the same checkpoint, then publish the consistent point they make. Nothing to
    apply before setup: said before ``spark`` starts a session."""
    if consistent and tables:
        raise ConfigError("apply --consistent merges every table: it takes no --table")
    require_checkpoint(changelog_store(config))
    applied = Applied(apply_tables(config, spark(), tables, progress=report))
    if consistent:
        applied.point = publish_point(config)
    report(applied)
    return applied
