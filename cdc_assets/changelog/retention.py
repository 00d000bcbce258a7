"""Change-log retention: a table's segments older than ``changelog.retention_hours`` that its
readers no longer need are folded into a compacted base and deleted (``docs/architecture.md``,
"Change-log retention").

Per configured table, what its readers still need is the changes after :func:`needed_after`: its
Delta table's applied LSN (the checkpoint once it has applied its last change), or the consistent
point of the copy it will start from. Whole batches of its segments, in log order, are folded
while each holds only changes at or below that LSN and committed before the retention's cutoff;
the first batch that is younger stops it, and the first that is old but still needed *holds* the
rest (:func:`table_hold`, for ``status``). When the table's latest copy does not already hold the
folded changes, they are first folded into a new compacted base (:mod:`cdc_assets.changelog.compacted_base`)
— a rewrite of the whole table, so only once they are worth it (:func:`_worth_a_base`); until then
they stay, readable as before, and are not reported as held.

Crash safety — the order is always: the base (complete once its own checkpoint is written), then
the log's checkpoint naming it, then the deletions. A kill before the checkpoint leaves an unused
base (deleted by the next retention); a kill after it leaves segments every reader skips (they hold
changes at or below the base) and the next retention deletes. Run only under the drain lock; the
checkpoint records when it last ran (:func:`retention_due`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

from cdc_assets.changelog.checkpoint import Checkpoint, Folded, TableState, awaiting_copy_reason, write_checkpoint
from cdc_assets.changelog.column_lineage import carry_columns, copy_names, with_attnums
from cdc_assets.changelog.compacted_base import write_base
from cdc_assets.changelog.layout import CHECKPOINT, COPY_BATCH, MESSAGES, TRANSACTIONS, SegmentName, table_folder
from cdc_assets.changelog.reader import ChangeLogReader, Segment
from cdc_assets.changelog.segment_stats import SegmentStats, segment_stats
from cdc_assets.changelog.snapshot_runs import SnapshotRunRef, is_base, run_consistent_point, run_store, runs_folder
from cdc_assets.changelog.store import LogStore
from cdc_assets.config import Config, TableConfig
from cdc_assets.errors import CdcError
from cdc_assets.faults import fault_point
from cdc_assets.lsn import format_lsn

HOUR_US = 3_600_000_000
MINUTE_US = 60_000_000


@dataclass(slots=True, frozen=True)
class Hold:
    """Segments past the retention that a reader still needs: how many, their bytes, the oldest's
    commit time."""

    segments: int
    bytes: int
    oldest_commit_time_us: int


@dataclass(slots=True)
class TableRetention:
    """What retention did for one table: segments removed, the base written, or why it did not."""

    table: str
    removed_segments: int = 0
    removed_bytes: int = 0
    base: str | None = None
    folded_lsn: int | None = None
    skipped: str | None = None


@dataclass(slots=True)
class RetentionResult:
    tables: list[TableRetention] = field(default_factory=list)
    removed_log_files: int = 0  # transactions/ and messages/ files

    def lines(self) -> list[str]:
        """What was removed or refused, one line per table (nothing when retention had nothing to do)."""
        out = []
        for t in self.tables:
            if t.skipped:
                out.append(f"retention: {t.table}: not folded: {t.skipped}")
            elif t.removed_segments:
                base = f"; compacted base {t.base}" if t.base else ""
                out.append(
                    f"retention: {t.table}: removed {t.removed_segments} segments ({t.removed_bytes:,} bytes), changes"
                    f" up to LSN {format_lsn(t.folded_lsn or 0)} folded{base}"
                )
        if self.removed_log_files:
            out.append(f"retention: removed {self.removed_log_files} transactions and messages files")
        return out


@dataclass(slots=True)
class _Scan:
    fold: list[list[SegmentStats]]  # whole batches
    held: list[SegmentStats]


def needed_after(state: TableState, applied: int | None, checkpoint_lsn: int) -> int:
    """The end LSN after which the table's readers need its changes (every one: -1): its Delta
    table's applied LSN, unless its next apply or a rebuild starts from its latest copy; the
    checkpoint for a table that has applied its last change (an apply with nothing to do for a
    table leaves its applied LSN behind, and a quiet table must not hold the log back)."""
    run = state.snapshot_run
    if applied is None or (run is not None and applied < run.position):
        return run.consistent_point if run is not None else -1
    return checkpoint_lsn if state.held_by(applied) else applied


def retention_due(config: Config, checkpoint: Checkpoint) -> bool:
    """Whether retention is due: ``changelog.retention_every_minutes`` have passed since it last ran."""
    last = checkpoint.retained_at_us
    every = round(config.changelog.retention_every_minutes * MINUTE_US)
    return last is None or time.time_ns() // 1000 - last >= every


def retain(
    config: Config, reader: ChangeLogReader, checkpoint: Checkpoint, applied: Mapping[str, int | None]
) -> RetentionResult:
    """Fold and delete what retention allows, for every configured table, then the transactions and
    messages no table needs, and record in the checkpoint that it ran; ``applied``: each table's
    applied LSN (None: not created), read before the call (a position read earlier is never past
    the one its table holds at the fold). Call only while holding the drain lock."""
    started_us = time.time_ns() // 1000
    cutoff = _cutoff(config)
    result = RetentionResult()
    needs = []
    for table in config.tables:
        state = checkpoint.tables.get(str(table.name))
        if state is None:
            continue
        if state.awaiting_copy is not None:  # its copy will replace what the log holds for it: not folded
            needs.append(state.awaiting_copy)
            result.tables.append(TableRetention(str(table.name), skipped=awaiting_copy_reason(state)))
            continue
        needed = needed_after(state, applied.get(str(table.name)), checkpoint.lsn)
        needs.append(needed)
        try:
            outcome, checkpoint = _fold_table(config, reader, checkpoint, table, needed, cutoff)
        except CdcError as error:  # the drain's batches are durable: report, keep the segments
            outcome = TableRetention(str(table.name), skipped=str(error))
        result.tables.append(outcome)
    shared = min(needs, default=-1)
    for folder in (TRANSACTIONS, MESSAGES):
        for stats in [
            s for batch in _scan(reader, folder, checkpoint.lsn, shared, cutoff, count_held=False).fold for s in batch
        ]:
            reader.store.delete(stats.path)
            result.removed_log_files += 1
    write_checkpoint(reader.store, replace(checkpoint, retained_at_us=started_us))
    return result


def table_hold(
    config: Config, reader: ChangeLogReader, checkpoint: Checkpoint, table: str, applied: int | None
) -> Hold | None:
    """The segments of ``table`` past the retention that its readers still need (its Delta table
    has applied ``applied``), or None."""
    state = checkpoint.tables.get(table)
    if state is None:
        return None
    needed = needed_after(state, applied, checkpoint.lsn)
    held = _scan(reader, table_folder(table), checkpoint.lsn, needed, _cutoff(config), count_held=True).held
    if not held:
        return None
    oldest = min(s.max_commit_time_us for s in held if s.max_commit_time_us is not None)
    return Hold(len(held), sum(s.bytes for s in held), oldest)


def _cutoff(config: Config) -> int:
    """Changes committed before this (µs since 1970) are past the retention."""
    return time.time_ns() // 1000 - round(config.changelog.retention_hours * HOUR_US)


def _fold_table(
    config: Config, reader: ChangeLogReader, checkpoint: Checkpoint, table: TableConfig, needed: int, cutoff: int
) -> tuple[TableRetention, Checkpoint]:
    name = str(table.name)
    state = checkpoint.tables[name]
    outcome = TableRetention(name)
    batches = _scan(reader, table_folder(name), checkpoint.lsn, needed, cutoff, count_held=False).fold
    run = state.snapshot_run
    if run is not None and batches and run.position > _last_lsn(batches[-1]):
        # A copy announced after these changes: fold only what it covers (the Delta table may
        # still start from it, with the changes after its consistent point).
        batches = [b for b in batches if _last_lsn(b) <= run.consistent_point]
    fold = [stats for batch in batches for stats in batch]
    if all(s.max_lsn is None for s in fold):
        return outcome, checkpoint  # no changes (an empty table's snapshot): folded with the next ones
    lsn = _last_lsn(batches[-1])
    commit_time = max([s.max_commit_time_us or 0 for s in fold] + [state.folded.commit_time_us if state.folded else 0])
    if run is not None and lsn <= run.consistent_point:
        copy = run  # the folded changes are in it already
    elif run is None and _batch_start(fold[0]) != COPY_BATCH:
        outcome.skipped = "no copy of the table to fold into (its initial snapshot is not in the log)"
        return outcome, checkpoint
    elif not _worth_a_base(config, reader, name, state, fold):
        return outcome, checkpoint  # later, with more of them
    else:
        chunks = list(reader.read_table(name, state, upto=lsn))
        ddls = reader.schema_changes_read(name, state, upto=lsn)
        relation = with_attnums(chunks[-1].relation, copy_names(chunks))  # the columns as of ``lsn``
        if ddls:  # the records carried through the table's schema changes, by attnum
            lineage = carry_columns(None, chunks, ddls, state.relation)
            if lineage.recopy is not None or lineage.relation is None:
                outcome.skipped = f"its schema changes cannot be folded: {lineage.recopy}"
                return outcome, checkpoint
            chunks, relation = lineage.chunks, lineage.relation
        outcome.base = write_base(
            reader.store, checkpoint.slot, name, chunks, relation, lsn, commit_time, table.truncate
        )
        fault_point("retention-base")
        copy = SnapshotRunRef(outcome.base, lsn, lsn)
    folded = Folded(max(lsn, state.folded.lsn if state.folded else -1), commit_time)
    tables = {**checkpoint.tables, name: replace(state, snapshot_run=copy, folded=folded)}
    checkpoint = replace(checkpoint, tables=tables)
    write_checkpoint(reader.store, checkpoint)
    fault_point("retention-checkpoint")
    for stats in fold:
        reader.store.delete(stats.path)
        fault_point("retention-delete")
        outcome.removed_segments += 1
        outcome.removed_bytes += stats.bytes
    _remove_superseded_copies(reader.store, name, copy)
    outcome.folded_lsn = folded.lsn
    return outcome, checkpoint


def _worth_a_base(
    config: Config, reader: ChangeLogReader, table: str, state: TableState, fold: list[SegmentStats]
) -> bool:
    """Whether the changes retention could fold are enough to rewrite the table's base for: a
    share ``changelog.fold_min_share`` of its current copy's bytes, or ``fold_max_segments``
    segments. Folding whenever retention runs would rewrite the whole table each time."""
    changes = [s for s in fold if _batch_start(s) != COPY_BATCH]
    if len(changes) >= config.changelog.fold_max_segments:
        return True
    run = state.snapshot_run
    if run is None:  # the initial snapshot: the table folder's copy batch
        copy_bytes = sum(s.bytes for s in fold if _batch_start(s) == COPY_BATCH)
    else:
        copy_bytes = run_store(reader.store, table, run.run).total_bytes()
    return sum(s.bytes for s in changes) >= config.changelog.fold_min_share * copy_bytes


def _remove_superseded_copies(store: LogStore, table: str, current: SnapshotRunRef) -> None:
    """Delete the table's bases the checkpoint does not name (left by a kill, or superseded) and its
    complete runs older than its current copy."""
    for folder in store.folders(runs_folder(table)):
        run = folder.rsplit("/", 1)[-1]
        if run == current.run:
            continue
        older = run_consistent_point(run) < current.consistent_point
        if is_base(run) or (older and run_store(store, table, run).exists(CHECKPOINT)):
            store.delete_folder(folder)


def _scan(reader: ChangeLogReader, folder: str, upto: int, needed: int, cutoff: int, *, count_held: bool) -> _Scan:
    """Whole batches of ``folder``, in log order: those to fold (only changes ≤ ``needed``, all
    committed before ``cutoff``) up to the first that is not; then, with ``count_held``, the old
    ones that are still needed, up to the first younger than the cutoff."""
    scan = _Scan([], [])
    for start, segments in _batches(reader.segments(folder, upto)):
        if start >= needed and not count_held:
            break  # every change of the batch ends after its start
        batch = [segment_stats(reader.store, s.path) for s in segments]
        times = [s.max_commit_time_us for s in batch if s.max_commit_time_us is not None]
        if times and max(times) >= cutoff:
            break
        if not scan.held and _last_lsn(batch) <= needed:
            scan.fold.append(batch)
        elif count_held:
            scan.held += [s for s in batch if s.max_commit_time_us is not None]  # empty ones hold nothing
        else:
            break
    return scan


def _batches(segments: list[Segment]) -> Iterator[tuple[int, list[Segment]]]:
    """``segments`` (in name order) grouped by batch."""
    group: list[Segment] = []
    for segment in segments:
        if group and group[0].name.batch_start != segment.name.batch_start:
            yield group[0].name.batch_start, group
            group = []
        group.append(segment)
    if group:
        yield group[0].name.batch_start, group


def _batch_start(stats: SegmentStats) -> int:
    name = SegmentName.parse(stats.path)
    assert name is not None  # listed as a segment
    return name.batch_start


def _last_lsn(batch: list[SegmentStats]) -> int:
    """The largest LSN a batch holds (its start when its segments are empty)."""
    return max((s.max_lsn for s in batch if s.max_lsn is not None), default=_batch_start(batch[0]))
