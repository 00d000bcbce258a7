"""``cdc-assets apply``: bring each configured Delta table up to the change log's checkpoint.

Per table, on its mirror opened for writing (:func:`~cdc_assets.apply.write_path.write_mirror`:
its write lock held, the checkpoint read once): read its applied LSN from the Delta log; read the
change records after it up to the checkpoint; plan them; write the plan in one commit that
records the checkpoint. Up to ``spark.parallel_merges`` tables are applied at once, each on its
own session of the one Spark application (Delta's idempotent-write settings are per session).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from queue import Empty, SimpleQueue
from threading import Lock

from pyspark.sql import SparkSession

from cdc_assets.apply.catalog import register_mirror
from cdc_assets.apply.column_moves import CarriedRange, carry_range, record_copy_columns, start_names
from cdc_assets.apply.merge import write_plan
from cdc_assets.apply.session import is_connect, table_session
from cdc_assets.apply.target import DeltaTarget, is_delta_conflict
from cdc_assets.apply.write_path import Mirror, write_mirror
from cdc_assets.changelog.checkpoint import TableState, awaiting_copy_reason
from cdc_assets.changelog.planner import fill_from_history, plan_changes
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, TableConfig
from cdc_assets.errors import CdcError
from cdc_assets.faults import fault_point
from cdc_assets.lsn import format_lsn
from cdc_assets.names import TableName

log = logging.getLogger(__name__)


@dataclass(slots=True)
class TableApplied:
    """What one table's apply did."""

    table: str
    path: str
    applied_lsn: int | None
    records: int = 0
    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    write: str = ""  # how the commit wrote them (MergeCounts.write)
    delta_version: int | None = None
    data_files: int | None = None  # the table's data files after the commit
    skipped: str | None = None
    columns: str = ""  # what the source's schema changes did to the table's columns (ColumnsMoved.describe)
    copied: str = ""  # the copy it was written from, and why (SnapshotRunRef.describe)
    elapsed_s: float = 0.0

    def lines(self) -> list[str]:
        return [self.summary()]

    def summary(self) -> str:
        if self.skipped:
            return f"{self.table}: {self.skipped} (applied LSN {_lsn(self.applied_lsn)})"
        return (
            f"{self.table}: {self.records:,} change records → {self.inserted:,} inserted, {self.updated:,} updated,"
            f" {self.deleted:,} deleted{f' by {self.write}' if self.write else ''}; applied LSN {_lsn(self.applied_lsn)}, Delta version {self.delta_version}"
            f" ({self.elapsed_s:.1f} s){f'; columns: {self.columns}' if self.columns else ''}"
            f"{f'; {self.copied}' if self.copied else ''}"
        )


def apply_tables(
    config: Config,
    spark: SparkSession,
    tables: Sequence[str | TableName] | None = None,
    *,
    progress: Callable[[TableApplied], None] | None = None,
) -> list[TableApplied]:
    """Apply the change log to the Delta tables of ``tables`` (default: every configured table),
    up to ``spark.parallel_merges`` at once, each worker on a session of its own for all its tables;
    ``progress`` gets each table's result as it is done, the return value has them in the tables'
    order. Every table is applied up to the checkpoint read once here, under its write lock. A table
    that fails does not stop the others; the first failure is raised once they are done."""
    reader = ChangeLogReader(changelog_store(config))
    checkpoint = reader.require_checkpoint()
    selected = [config.table(t) for t in tables] if tables else list(config.tables)
    workers = min(config.spark.parallel_merges, len(selected))
    if is_connect(spark) and config.spark.remote is None:
        workers = 1  # a Connect session handed in without its server's address: no second one to open
    failures: list[BaseException] = []
    done: dict[int, TableApplied] = {}

    def record(index: int, applied: Callable[[], TableApplied]) -> None:
        try:
            done[index] = applied()
        except Exception as error:  # noqa: BLE001 - raised once every other table is done
            failures.append(error)
            return
        if progress is not None:
            progress(done[index])

    def apply_one(table: TableConfig, session: SparkSession) -> TableApplied:
        with write_mirror(config, table, session, reader=reader, checkpoint=checkpoint) as mirror:
            return apply_table(mirror)

    if workers <= 1:
        for i, table in enumerate(selected):
            record(i, partial(apply_one, table, spark))
    else:
        idle: SimpleQueue[SparkSession] = SimpleQueue()  # the sessions opened so far, between tables
        opening = Lock()

        def one(table: TableConfig) -> TableApplied:
            try:
                session = idle.get_nowait()
            except Empty:  # at most one session per worker: a worker takes its own back after each table
                with opening:
                    session = sessions.enter_context(table_session(spark, config.spark))
            try:
                return apply_one(table, session)
            finally:
                idle.put(session)

        with ExitStack() as sessions, ThreadPoolExecutor(workers, thread_name_prefix="merge") as pool:
            futures = {pool.submit(one, t): i for i, t in enumerate(selected)}
            for future in as_completed(futures):
                record(futures[future], future.result)
    if failures:
        raise failures[0]
    return [done[i] for i in range(len(selected))]


_fenced: set[str] = set()
"""The Delta tables this process has fenced (:meth:`DeltaTarget.fence`) on a Spark Connect server,
which finishes a killed client's operations; a local Spark ends with its process."""


def forget_fences() -> None:
    """This process lost its Spark Connect session (the server went away or was started again):
    a merge it started may still run there, so each table is fenced again before its next write."""
    _fenced.clear()


CONFLICT_ATTEMPTS = 5
"""How often a table's apply starts again after losing a Delta commit to another writer."""


def merge_table(config: Config, table: TableConfig, spark: SparkSession) -> TableApplied:
    """Apply one table up to the checkpoint read once its write lock is held."""
    with write_mirror(config, table, spark) as mirror:
        return apply_table(mirror)


def apply_table(mirror: Mirror) -> TableApplied:
    """Apply one table up to its mirror's checkpoint; a table found or made is registered in
    ``warehouse.catalog``.

    A commit that loses to another writer's (a merge of a killed process that its Spark Connect
    server finished, a writer outside cdc-assets) starts the table's apply again from the table's
    new state: Delta refuses a commit whose applied LSN another commit changed since it read it,
    so the changes are applied exactly once whoever wins."""
    attempts = 1
    while True:
        try:
            return _registered(mirror, _apply_table(mirror))
        except Exception as error:
            if not is_delta_conflict(error) or attempts == CONFLICT_ATTEMPTS:
                raise
            attempts += 1
            log.warning("%s: another writer committed to its Delta table meanwhile; applying again", mirror.name)


def _registered(mirror: Mirror, result: TableApplied) -> TableApplied:
    """``result``, its table registered by name in ``warehouse.catalog`` when there is one and the
    table exists."""
    catalog = mirror.config.warehouse.catalog
    if catalog is not None and result.applied_lsn is not None:
        register_mirror(mirror.target.spark, catalog, mirror.table.name, result.path)
        fault_point("apply-register")
    return result


def _apply_table(mirror: Mirror) -> TableApplied:
    started = time.monotonic()
    name, target, reader, table, lsn = mirror.name, mirror.target, mirror.reader, mirror.table, mirror.checkpoint.lsn
    if is_connect(target.spark) and target.path not in _fenced:  # the first write of this table in this process
        target.fence()
        _fenced.add(target.path)
    applied = target.applied_lsn()
    result = TableApplied(name, target.path, applied)
    state = mirror.state
    if state is None:
        result.skipped = "not in the change log (not published, or set up before it was configured)"
        return result
    if state.awaiting_copy is not None:
        result.skipped = awaiting_copy_reason(state)
        return result
    if applied is not None and applied >= lsn:
        result.skipped = "up to date"
        return result
    after = -1 if applied is None else applied
    run = reader.due_snapshot_run(state, after, lsn)
    copied = applied is None or run is not None
    nothing_new = not copied and state.last_change_lsn <= after  # then no segment is opened
    chunks = [] if nothing_new else list(reader.read_table(name, state, after, lsn))
    ddls = reader.schema_changes_read(name, state, after, lsn)
    if not ddls and (not chunks or (not copied and sum(c.records.num_rows for c in chunks) == 0)):
        result.skipped = "no changes"
        return result
    start = None if copied else start_names(target, after)
    carried = carry_range(target, name, state.relation, chunks, ddls, start, after, lsn)
    if carried.recopy is not None:
        result.skipped = f"held for a copy of the table: {carried.recopy}"
        return result
    result.columns = carried.moved.describe()
    if not copied and sum(c.records.num_rows for c in carried.chunks) == 0:  # schema changes alone
        target.record_applied(lsn)
        return _finished(result, target, started)
    if run is not None:
        result.copied = target.note = run.describe()
    plan = plan_changes(carried.chunks, carried.relation, truncate=table.truncate)
    if table.row_filter and plan.has_unresolved:  # rows moving into the filter are not in Delta to fill from
        history = _carried_history(reader, name, state, lsn)
        plan = fill_from_history(plan, plan_changes(history.chunks, history.relation, truncate=table.truncate))
    if copied:
        record_copy_columns(target, carried, lsn)
    counts = write_plan(target, plan, lsn, row_filter=table.row_filter)
    if copied:
        record_copy_columns(target, carried, lsn)
    result.records = plan.records
    result.inserted, result.updated, result.deleted = counts.inserted, counts.updated, counts.deleted
    result.write = counts.write
    return _finished(result, target, started)


def _finished(result: TableApplied, target: DeltaTarget, started: float) -> TableApplied:
    result.applied_lsn = target.applied_lsn()
    result.delta_version = target.version()
    result.data_files = target.data_files()
    result.elapsed_s = time.monotonic() - started
    return result


def _carried_history(reader: ChangeLogReader, table: str, state: TableState, lsn: int) -> CarriedRange:
    """The table's whole log from its copy, carried through its schema changes (not applied)."""
    history = list(reader.read_table(table, state, upto=lsn))
    return carry_range(
        None, table, state.relation, history, reader.schema_changes_read(table, state, upto=lsn), None, -1, lsn
    )


def rebuild_table(
    config: Config, table: TableConfig, spark: SparkSession, reader: ChangeLogReader | None = None
) -> TableApplied:
    """Rewrite one Delta table, under its write lock, from its latest snapshot (the initial one, or
    the latest online run or compacted base) and every change since, up to the checkpoint, in one
    commit (time travel keeps the old versions)."""
    with write_mirror(config, table, spark, reader=reader) as mirror:
        return _registered(mirror, _rebuild(mirror))


def _rebuild(mirror: Mirror) -> TableApplied:
    started = time.monotonic()
    name, target, table, lsn = mirror.name, mirror.target, mirror.table, mirror.checkpoint.lsn
    state = mirror.state
    if state is None:
        raise CdcError(f"cannot rebuild {name}: the change log at {mirror.config.changelog.path} holds nothing for it")
    if state.awaiting_copy is not None:
        raise CdcError(f"cannot rebuild {name}: {awaiting_copy_reason(state)}")
    history = _carried_history(mirror.reader, name, state, lsn)
    if history.recopy is not None:
        raise CdcError(f"cannot rebuild {name}: {history.recopy}; copy it again with `cdc-assets snapshot {name}`")
    target.check_column_types(name, history.chunks)
    plan = plan_changes(history.chunks, history.relation, truncate=table.truncate)
    if not plan.truncate:
        raise CdcError(f"cannot rebuild {name}: the change log has no snapshot of it to start from")
    record_copy_columns(target, history, lsn)
    counts = write_plan(target, plan, lsn, row_filter=table.row_filter, rebuild=True)
    record_copy_columns(target, history, lsn)
    fault_point("rebuild-commit")
    result = TableApplied(
        name,
        target.path,
        target.applied_lsn(),
        plan.records,
        counts.inserted,
        counts.updated,
        counts.deleted,
        counts.write,
    )
    result.delta_version = target.version()
    result.elapsed_s = time.monotonic() - started
    return result


def _lsn(value: int | None) -> str:
    return "none" if value is None else format_lsn(value)
