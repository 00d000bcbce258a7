"""What a merge sensor's tick does for one table, whichever sensor ticks for it (one per table, or
one for every table: ``merge_sensor.py``).

A table's :class:`TableCursor` keeps, between ticks, the checkpoint a merge of it was last requested
(or its mirror reported current) at, the last LSN logged for it that its Delta table was seen to
hold, and when its mirror was last known materialized. :func:`table_verdict` reads what it needs,
and no more: the change log's checkpoint is read once per tick by the caller; the Delta log
(delta-rs) only when the table's entry in the checkpoint moved past what its Delta table was seen
to hold and the checkpoint moved past the cursor (else nothing is done whatever it says); the runs
in flight only when a merge would be requested. :func:`confirmations` then reports, for each table
that holds all the log has for it while the checkpoint moved on, a runless materialization saying
it is current — once its mirror's last materialization is a sixth of the freshness window old,
which the cursor remembers, so an idle table's tick asks the instance nothing.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import dagster as dg

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.checkpoint import Checkpoint, awaiting_copy_reason
from cdc_assets.config import Config, TableConfig
from cdc_assets.lsn import format_lsn
from dagster_project.automation import IN_FLIGHT
from dagster_project.naming import Naming
from dagster_project.run_tags import MERGES_TAG, TABLE_TAG

COPY_REASON_TAG = "cdc/copy_reason"
"""Copies a table that a DDL rewrote (its partition of ``cdc/snapshot``), requested by the merge sensor."""
NAMES_SHOWN = 10
"""A skip message names at most this many tables per reason (a tick's message is stored)."""
UP_TO_DATE = "up to date"


@dataclass(slots=True, frozen=True)
class TableCursor:
    """What a table's merge sensor keeps between ticks: ``requested``, the checkpoint LSN a merge
    was last requested (or the mirror reported current) at; ``held``, the last LSN logged for the
    table that its Delta table was seen to hold; ``seen``, when its mirror was last known
    materialized (seconds since 1970)."""

    requested: int = -1
    held: int = -1
    seen: int = 0

    def to_json(self) -> list[int]:
        return [self.requested, self.held, self.seen]

    @classmethod
    def from_json(cls, value: Any) -> TableCursor:
        """From :meth:`to_json`, or the checkpoint LSN alone (the shared sensor's cursor before)."""
        return cls(value) if isinstance(value, int) else cls(*value)


class RunsInFlight(Protocol):
    """The runs queued or running that hold a table's merge back."""

    def merging(self, table: TableConfig) -> bool:
        """A merge run of ``table`` (tag ``cdc/table``)."""
        ...

    def drain_merging(self) -> bool:
        """A drain run of this pipeline's slot that merges (tag ``cdc/merges``)."""
        ...


@dataclass(slots=True)
class TableRuns:
    """One table's look: a count of the runs carrying its tag (and the merging drain's)."""

    instance: dg.DagsterInstance
    naming: Naming
    slot: str

    def merging(self, table: TableConfig) -> bool:
        return self._any({TABLE_TAG: self.naming.table_tag(table)})

    def drain_merging(self) -> bool:
        return self._any({MERGES_TAG: self.naming.slot_tag(self.slot)})

    def _any(self, tags: dict[str, str]) -> bool:
        return self.instance.get_runs_count(dg.RunsFilter(tags=tags, statuses=IN_FLIGHT)) > 0


@dataclass(slots=True)
class AllRuns:
    """Every table's look: the runs in flight fetched once, when a table first asks."""

    instance: dg.DagsterInstance
    naming: Naming
    slot: str
    tags: list[dict[str, str]] | None = field(default=None, init=False)

    def merging(self, table: TableConfig) -> bool:
        return any(tags.get(TABLE_TAG) == self.naming.table_tag(table) for tags in self._tags())

    def drain_merging(self) -> bool:
        return any(tags.get(MERGES_TAG) == self.naming.slot_tag(self.slot) for tags in self._tags())

    def _tags(self) -> list[dict[str, str]]:
        if self.tags is None:
            self.tags = [dict(run.tags) for run in self.instance.get_runs(dg.RunsFilter(statuses=IN_FLIGHT))]
        return self.tags


@dataclass(slots=True, frozen=True)
class Verdict:
    """What one tick does for one table — a run request, a report that it is current, or neither
    and why (``reason``) — and the table's cursor after it. ``current``: the table holds all the
    log has for it and the checkpoint moved past the cursor (:func:`confirmations` decides);
    ``applied``: its Delta table's applied LSN, when this tick read it."""

    table: TableConfig
    cursor: TableCursor
    request: dg.RunRequest | None = None
    event: dg.AssetMaterialization | None = None
    reason: str | None = None
    current: bool = False
    applied: int | None = None

    @property
    def name(self) -> str:
        return str(self.table.name)

    @property
    def done(self) -> bool:
        return self.request is not None or self.event is not None


def table_verdict(
    config: Config,
    naming: Naming,
    checkpoint: Checkpoint,
    runs: RunsInFlight,
    table: TableConfig,
    cursor: TableCursor,
    copy_job: str,
) -> Verdict:
    """What this tick does for ``table``, its cursor ``cursor`` (the module's docstring); a
    rewritten table is copied again by ``copy_job``."""
    name = str(table.name)
    state = checkpoint.tables.get(name)
    if state is None:
        return Verdict(table, cursor, reason="the change log holds nothing for it yet")
    moved = checkpoint.lsn > cursor.requested
    if state.awaiting_copy is not None and state.copy_reason is not None:  # rewritten: copied again
        key = f"{name}@copy:{state.awaiting_copy}"  # once per hold: Dagster skips a run key it launched
        why = {COPY_REASON_TAG: state.copy_reason}  # shown on the run's page
        request = dg.RunRequest(run_key=key, job_name=copy_job, partition_key=name, tags=why)
        return Verdict(table, replace(cursor, requested=checkpoint.lsn), request)
    if state.awaiting_copy is not None:
        return Verdict(table, cursor, reason=awaiting_copy_reason(state))
    applied = None
    if state.last_lsn > cursor.held:  # changed since its Delta table was last seen to hold it
        if not moved:  # nothing to do, whatever the Delta log says
            return Verdict(table, cursor, reason=f"a merge up to {format_lsn(cursor.requested)} was already requested")
        applied = table_applied_lsn(config, table)
        if not state.held_by(applied):
            if runs.merging(table):
                return Verdict(table, cursor, reason="a merge of it is queued or running")
            if config.schedule.merge_with_drain and runs.drain_merging():
                return Verdict(table, cursor, reason="a drain run, which merges it too, is queued or running")
            request = dg.RunRequest(run_key=f"{name}@{checkpoint.lsn}", job_name=naming.merge_job(table))
            return Verdict(table, replace(cursor, requested=checkpoint.lsn), request)
        cursor = replace(cursor, held=state.last_lsn)
    if not moved:
        return Verdict(table, cursor, reason=UP_TO_DATE)
    return Verdict(table, cursor, current=True, applied=applied)


def confirmations(
    config: Config,
    naming: Naming,
    instance: dg.DagsterInstance,
    verdicts: Sequence[Verdict],
    checkpoint_lsn: int,
    every_s: float,
) -> list[Verdict]:
    """``verdicts`` with each ``current`` one decided: a runless materialization saying the mirror
    is current as of the checkpoint when its last materialization is ``every_s`` old (the instance
    asked once, for the tables whose cursor does not know of a later one), else up to date."""
    now = time.time()  # the clock that stamps Dagster's events
    due = [v for v in verdicts if v.current and now - v.cursor.seen >= every_s]
    latest = instance.get_latest_materialization_events([naming.mirror(v.table) for v in due]) if due else {}
    decided = []
    for verdict in verdicts:
        if not verdict.current:
            decided.append(verdict)
            continue
        last = latest.get(naming.mirror(verdict.table))
        seen = max(verdict.cursor.seen, int(last.timestamp) if last is not None else 0)
        if now - seen < every_s:
            decided.append(
                replace(verdict, cursor=replace(verdict.cursor, seen=seen), reason=UP_TO_DATE, current=False)
            )
            continue
        applied = verdict.applied if verdict.applied is not None else table_applied_lsn(config, verdict.table)
        metadata = {
            "applied_lsn": format_lsn(applied) if applied is not None else "none",
            "checkpoint_lsn": format_lsn(checkpoint_lsn),
            "write": f"none: current, no change to {verdict.name} since the last merge",
        }
        event = dg.AssetMaterialization(naming.mirror(verdict.table), metadata=metadata)
        cursor = replace(verdict.cursor, requested=checkpoint_lsn, seen=int(now))
        decided.append(replace(verdict, cursor=cursor, event=event, current=False))
    return decided


def skip_message(verdicts: Sequence[Verdict]) -> str:
    """One line per reason: the reason, then the tables (at most :data:`NAMES_SHOWN` named)."""
    tables: dict[str, list[str]] = {}
    for verdict in verdicts:
        tables.setdefault(verdict.reason or "", []).append(verdict.name)
    lines = []
    for reason, names in tables.items():
        shown = ", ".join(names[:NAMES_SHOWN]) + (
            f" and {len(names) - NAMES_SHOWN} more" if len(names) > NAMES_SHOWN else ""
        )
        lines.append(f"{reason}: {shown}")
    return "\n".join(lines)
