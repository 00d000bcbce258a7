"""``cdc-assets snapshot``: copy configured tables again while the drain goes on.

Per table (see ``docs/architecture.md``, "Online snapshots"):

1. take the table's copy lock (one run per table at a time) and delete its runs that can no longer
   be used: unfinished ones, and complete ones older than the run the log last announced;
2. create a temporary slot with an exported snapshot: its consistent point ``C`` splits the stream
   exactly — the snapshot sees every transaction with end LSN ≤ ``C``, the slot would decode every
   later one, which is what the main slot's log holds after ``C``;
3. copy the table as of that snapshot into a new run folder and write the run's checkpoint last;
4. announce the run in the stream (a transactional logical decoding message). The drain records it,
   and the table's next apply replaces the Delta table's rows with the run's rows plus every change
   the log holds after ``C``, in one commit.

Killed anywhere, nothing is half-applied: before the announcement the run is ignored (and deleted by
the next run); after it the run is complete.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from cdc_assets.changelog.checkpoint import read_checkpoint, require_checkpoint, write_checkpoint
from cdc_assets.changelog.layout import CHECKPOINT, table_folder
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.snapshot_runs import (
    SNAPSHOT_RUN_PREFIX,
    SnapshotRunAnnouncement,
    is_base,
    new_run_id,
    run_consistent_point,
    run_store,
    runs_folder,
)
from cdc_assets.changelog.store import LogStore, changelog_store
from cdc_assets.config import Config, TableConfig
from cdc_assets.errors import CdcError
from cdc_assets.faults import fault_point
from cdc_assets.lsn import format_lsn, parse_lsn
from cdc_assets.names import TableName
from cdc_assets.pipeline.snapshot_copy import CopiedSnapshot, copy_snapshot
from cdc_assets.source import (
    TableCopyLock,
    connect,
    copy_again_when_rewritten,
    create_slot_with_snapshot,
    published_tables,
)
from cdc_assets.source.connection import one_row
from cdc_assets.source.copy_rows import SPLIT_IN

MAX_SLOT_NAME = 63


@dataclass(slots=True)
class CopyProgress:
    """Where one table's copy is: rows and chunks so far, against the planner's estimate;
    ``read`` once the table is read (its snapshot closed), before the run is announced."""

    table: str
    rows: int
    chunks: int
    estimated_rows: int
    elapsed_s: float
    read: bool = False

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def eta_s(self) -> float | None:
        """Seconds left at the current rate (None while unknown or past the estimate)."""
        left = self.estimated_rows - self.rows
        return left / self.rows_per_s if self.rows_per_s > 0 and left > 0 else None

    def line(self) -> str:
        if self.read:
            return f"snapshot {self.table}: {self.rows:,} rows read in {self.chunks} chunks; announcing the run"
        eta = "" if self.eta_s is None else f", ~{self.eta_s:,.0f} s left"
        estimate = f" of ~{self.estimated_rows:,}" if self.estimated_rows else ""
        return (
            f"snapshot {self.table}: {self.rows:,}{estimate} rows, {self.chunks} chunks,"
            f" {self.rows_per_s:,.0f} rows/s{eta} ({SPLIT_IN})"
        )


@dataclass(slots=True)
class TableCopied:
    """One finished run: the table as of ``consistent_point``, announced at ``announced_lsn``."""

    table: str
    run: str
    consistent_point: int
    announced_lsn: int
    rows: int
    chunks: int
    elapsed_s: float

    def lines(self) -> list[str]:
        return [f"copied {self.summary()}"]

    def summary(self) -> str:
        return (
            f"{self.table}: {self.rows:,} rows in {self.chunks} chunks as of LSN {format_lsn(self.consistent_point)}"
            f" (run {self.run}, {self.elapsed_s:.1f} s); announced at LSN {format_lsn(self.announced_lsn)}: the next"
            " drain and apply bring it into the Delta table"
        )


def snapshot_tables(
    config: Config, tables: Sequence[str | TableName], *, progress: Callable[[CopyProgress], None] | None = None
) -> list[TableCopied]:
    """Copy each of ``tables`` (configured, published) online, one after another."""
    selected = [config.table(t) for t in tables]
    store = changelog_store(config)
    require_checkpoint(store)
    with connect(config.source, purpose="snapshot") as conn:
        published = published_tables(conn, config.source.publication)
    unpublished = [str(t.name) for t in selected if t.name not in published]
    if unpublished:
        raise CdcError(
            f"publication {config.source.publication} does not publish {', '.join(unpublished)}: run"
            " `cdc-assets setup`, which adds configured tables to the publication and copies them"
        )
    return [copy_table(config, store, table, progress) for table in selected]


def copy_table(
    config: Config, store: LogStore, table: TableConfig, progress: Callable[[CopyProgress], None] | None = None
) -> TableCopied:
    """One online snapshot run of ``table``; see the module docstring."""
    name = str(table.name)
    started = time.monotonic()
    with TableCopyLock(config.source, name):
        remove_unusable_runs(store, name)
        estimated = _estimated_rows(config, table.name)
        chunks = 0

        def counted(_: str, rows: int) -> None:
            nonlocal chunks
            chunks += 1
            fault_point("copy-chunk")
            if progress is not None:
                progress(CopyProgress(name, rows, chunks, estimated, time.monotonic() - started))

        run, consistent_point, copied = _copy_run(config, store, table, counted)
        copy = run_store(store, name, run)
        write_checkpoint(copy, copied.checkpoint)  # the run is complete
        fault_point("copy-complete")
        if progress is not None:
            progress(CopyProgress(name, copied.rows[name], chunks, estimated, time.monotonic() - started, read=True))
        relation = copied.checkpoint.tables[name].relation
        announcement = SnapshotRunAnnouncement(name, run, consistent_point, relation)
        with connect(config.source, purpose="snapshot") as conn:
            (lsn,) = one_row(
                conn.execute(
                    "SELECT pg_logical_emit_message(true, %s, %s::bytea)::text",
                    (SNAPSHOT_RUN_PREFIX, announcement.encode()),
                )
            )
    fault_point("copy-announced")
    return TableCopied(
        name,
        run,
        consistent_point,
        parse_lsn(lsn),
        copied.rows[name],
        chunks,
        time.monotonic() - started,
    )


def _copy_run(
    config: Config, store: LogStore, table: TableConfig, progress: Callable[[str, int], None]
) -> tuple[str, int, CopiedSnapshot]:
    """Copy ``table`` into a new run as of a new temporary slot's snapshot: the run, its consistent
    point and the copy. A table found truncated or rewritten after the snapshot is copied again from
    a new one, the abandoned run deleted (the caller holds the table's copy lock)."""
    name = str(table.name)
    temporary = replace(config.source, slot=_temporary_slot(config.source.slot))
    runs: list[str] = []

    def attempt() -> tuple[str, int, CopiedSnapshot]:
        with create_slot_with_snapshot(temporary, temporary=True) as exported:
            runs.append(new_run_id(exported.consistent_point))
            copy = run_store(store, name, runs[-1])
            copied = copy_snapshot(config, copy, exported.snapshot_name, exported.consistent_point, [table], progress)
        return runs[-1], exported.consistent_point, copied

    return copy_again_when_rewritten(attempt, lambda: store.delete_folder(f"{runs_folder(name)}/{runs[-1]}"))


def tables_without_copy(config: Config, store: LogStore) -> list[TableConfig]:
    """The configured tables the log holds no copy of: not in the initial snapshot (the log's first
    batch, which starts at 0), no complete run (announced or about to be)."""
    reader = ChangeLogReader(store)
    checkpoint = reader.require_checkpoint()

    def copied(table: str) -> bool:
        state = checkpoint.tables.get(table)
        if state is not None and state.snapshot_run is not None:
            return True
        if any(s.name.batch_start == 0 for s in reader.segments(table_folder(table), checkpoint.lsn)):
            return True
        runs = store.folders(runs_folder(table))
        return any(run_store(store, table, run.rsplit("/", 1)[-1]).exists(CHECKPOINT) for run in runs)

    return [t for t in config.tables if not copied(str(t.name))]


def remove_unusable_runs(store: LogStore, table: str) -> None:
    """Delete the table's runs nobody can use: unfinished ones (call only under the table's copy
    lock) and complete ones older than the run the checkpoint names. A complete run newer than that
    one stays: its announcement may not be drained yet. Compacted bases are retention's to delete
    (it writes them under the drain lock)."""
    checkpoint = read_checkpoint(store)
    state = checkpoint.tables.get(table) if checkpoint else None
    current = state.snapshot_run if state else None
    for folder in store.folders(runs_folder(table)):
        run = folder.rsplit("/", 1)[-1]
        if is_base(run):
            continue
        complete = run_store(store, table, run).exists(CHECKPOINT)
        if not complete or (current is not None and run_consistent_point(run) < current.consistent_point):
            store.delete_folder(folder)


def _estimated_rows(config: Config, table: TableName) -> int:
    """The planner's row estimate (leaves summed for a partitioned table; 0 if never analyzed)."""
    with connect(config.source, purpose="snapshot") as conn:
        (rows,) = one_row(
            conn.execute(
                "SELECT coalesce(sum(greatest(c.reltuples, 0)), 0)::int8 FROM pg_partition_tree(%s::regclass) t"
                " JOIN pg_class c ON c.oid = t.relid WHERE t.isleaf",
                (table.sql,),
            )
        )
    return int(rows)


def _temporary_slot(slot: str) -> str:
    """A name no other copy uses at the same time (one process may copy tables side by side)."""
    suffix = f"_copy_{os.getpid()}_{secrets.token_hex(3)}"
    return slot[: MAX_SLOT_NAME - len(suffix)] + suffix
