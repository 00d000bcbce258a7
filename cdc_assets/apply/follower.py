"""Merges while a drain follows the slot's stream: after each durable batch, the tables whose
entry in the change log's checkpoint changed are applied, on threads of their own — a change
reaches its Delta table seconds after its commit, with no run or process per merge.

The drain never waits for a merge. Up to ``spark.parallel_merges`` tables merge at once, each
worker on its own session (one worker uses the session it is given); a table is merged by one
worker at a time, and a table that changes again while it merges is merged again after. The
table whose oldest unmerged change came with the oldest durable batch is merged first (by name
among the tables of one batch), so no table waits behind a busy one. Each merge reads the
checkpoint when it starts, so it takes every batch durable by then: the tables queued behind a
long merge are not held to the position of an older look. A worker about to take a table, or
done with one, first calls on the drain for a batch of what it has received
(:class:`~cdc_assets.changelog.batch_demand.BatchDemand`) and waits for the look at it, at most
``drain.commit_seconds`` — once a round (not again until every table due after the call has been
merged), while the drain holds changes not yet durable and the last look is older than
:data:`CALL_AFTER_SECONDS`: a table merged back to back takes the changes that came during its
last merge, not those of a batch up to ``commit_seconds`` old. What a merge does is
exactly what ``cdc-assets apply`` does for the table, on its mirror opened for writing
(:func:`~cdc_assets.apply.write_path.write_mirror`: the table's write lock on the source, which the
table's maintenance takes too — no Dagster pool orders a follower's merges). While the source
cannot be reached (a restart), a merge waits for the lock, trying again after the drain's
reconnect pauses. A merge that leaves its table with
``warehouse.maintenance.follow_compact_files`` data files or more is followed, under the same lock,
by the table's compaction (:func:`~cdc_assets.apply.maintenance.compact_table`). A failed merge
stops the follower, and the drain's next durable batch raises its error — except a table stopped
on its own (:class:`~cdc_assets.apply.column_types.ColumnTypeError`): it is logged and merged no
more, the other tables go on, and closing the follower raises it. Whenever the merges have
caught up (nothing queued, nothing merging), the follower publishes the consistent point the
tables make, if it is new (``warehouse.consistent_points``). The callbacks that report merges,
compactions and points run in order on a thread of their own, so a report (a Dagster event, the
table's files read for its metadata, the lag check's query) never holds up the next merge.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from queue import SimpleQueue
from types import TracebackType

from pyspark.sql import SparkSession

from cdc_assets.apply.column_types import ColumnTypeError
from cdc_assets.apply.connect_loss import connect_lost
from cdc_assets.apply.consistent_points import ConsistentPoint, publish_point
from cdc_assets.apply.maintenance import Maintained, compact_table
from cdc_assets.apply.runner import TableApplied, apply_table, forget_fences
from cdc_assets.apply.session import (
    connect_session_closed,
    discard_connect_session,
    spark_session,
    table_session,
)
from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.apply.write_path import Mirror, write_mirror
from cdc_assets.changelog.batch_demand import BatchDemand
from cdc_assets.changelog.checkpoint import TableState, read_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config
from cdc_assets.errors import CdcError
from cdc_assets.source.reconnect import Backoff, connection_lost

log = logging.getLogger(__name__)

CALL_AFTER_SECONDS = 0.25
"""A worker calls for a batch only when the last look is at least this old: after a younger one
the batch would bring little, for a durable write and a wait."""


class MergeFollower:
    """Apply, on background threads, the tables each durable batch changed (:meth:`batch_durable`).

    Used as a context manager around a following drain: leaving it normally merges what the last
    batches brought and waits for it; leaving it on an exception lets the merges under way finish
    and starts no other."""

    def __init__(
        self,
        config: Config,
        spark: SparkSession,
        on_applied: Callable[[TableApplied], None],
        on_point: Callable[[ConsistentPoint], None] | None = None,
        on_compacted: Callable[[Maintained], None] | None = None,
        demand: BatchDemand | None = None,
    ) -> None:
        self._config = config
        self._demand = demand
        self._spark = spark
        self._on_applied = on_applied
        self._on_point = on_point
        self._on_compacted = on_compacted
        self._configured = {str(table.name) for table in config.tables}
        self._seen: dict[str, TableState] | None = None
        self._changed = threading.Event()  # a batch is durable: look for tables to merge
        self._lock = threading.Condition()
        self._looks = 0  # the looks so far: a table's age is the look that found its oldest unmerged change
        self._looked_at = 0.0  # when the last look read the checkpoint (monotonic)
        self._queue: dict[str, int] = {}  # tables due: the look that found each one due
        self._merging: dict[str, int] = {}  # tables being merged: the look they were due since
        self._again: dict[str, int] = {}  # changed while merging: due once that merge ends, since this look
        self._round: set[str] = set()  # due after the last call for a batch, not merged since
        self._closing = False
        self._finish = True
        self._error: BaseException | None = None
        self._stopped: dict[str, ColumnTypeError] = {}  # tables stopped on their own, merged no more
        self._reports: SimpleQueue[Callable[[], None] | None] = SimpleQueue()  # None: no more
        self._reporter = threading.Thread(target=self._report_all, name="merge-reports", daemon=True)
        workers = max(1, min(config.spark.parallel_merges, len(config.tables)))
        self._threads = [threading.Thread(target=self._look, name="merge-follower", daemon=True)] + [
            threading.Thread(target=self._work, args=(workers > 1,), name=f"merge-{i}", daemon=True)
            for i in range(workers)
        ]

    def __enter__(self) -> MergeFollower:
        self._reporter.start()
        for thread in self._threads:
            thread.start()
        self._changed.set()  # the first look merges every table the log holds changes for
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close(finish=kind is None)

    @property
    def spark(self) -> SparkSession:
        """The session the follower was given, or the one that replaced it once lost."""
        return self._given_session()

    def batch_durable(self) -> None:
        """A batch is durable: merge the tables it changed (raises a merge's failure)."""
        self._raise_failure()
        self._changed.set()

    def close(self, *, finish: bool = True) -> None:
        """Stop following: with ``finish``, merge what is due first; raises a merge's failure."""
        self._closing, self._finish = True, finish
        if self._demand is not None:
            self._demand.close()  # the drain has ended: no batch will answer a call
        self._changed.set()
        self._threads[0].join()  # the last look, when finishing
        with self._lock:
            self._lock.notify_all()
        for thread in self._threads[1:]:
            thread.join()
        self._reports.put(None)
        self._reporter.join()  # every merge done is reported
        self._raise_failure()
        if self._stopped:
            raise next(iter(self._stopped.values()))

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise CdcError(f"a merge while following the stream failed: {self._error}") from self._error

    def _failed(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error
            self._closing, self._finish = True, False
            self._lock.notify_all()

    def _look(self) -> None:
        """Queue the tables each durable batch changed, until closed (after a last look)."""
        try:
            while True:
                self._changed.wait()
                self._changed.clear()
                if self._closing and not self._finish:
                    return
                looked_at = time.monotonic()
                due = self._due()
                with self._lock:
                    self._looks += 1
                    self._looked_at = looked_at
                    for table in due:
                        if table in self._stopped:
                            continue
                        if table in self._merging:
                            self._again.setdefault(table, self._looks)
                        else:
                            self._queue.setdefault(table, self._looks)
                    self._lock.notify_all()
                if self._closing:
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the drain's thread, which raises it
            self._failed(error)

    def _work(self, own_session: bool) -> None:
        """Merge queued tables one at a time until closed and (when finishing) nothing is left. A
        merge whose Spark Connect session was lost (:func:`connect_lost`) is merged again on a new
        session, after each pause of a :class:`Backoff`."""
        try:
            backoff = Backoff()
            with ExitStack() as held:
                session = given = None
                merged = False
                while True:
                    self._call_for_batch(merged)
                    if (table := self._next()) is None:
                        break
                    merged = True
                    pause = None
                    try:
                        if session is None:
                            given = self._given_session()
                            session = (
                                held.enter_context(table_session(given, self._config.spark)) if own_session else given
                            )
                        self._merge(table, session)
                        backoff.reset()
                    except ColumnTypeError as error:
                        log.error("%s", error)
                        with self._lock:
                            self._stopped[table] = error
                            self._again.pop(table, None)
                    except Exception as error:
                        if not connect_lost(error):
                            raise
                        pause = backoff.next_pause()
                        log.warning(
                            "merge of %s: the Spark Connect server went away or was started again (%s);"
                            " merging again on a new session in %.0f s",
                            table,
                            str(error).splitlines()[0],
                            pause,
                        )
                        held.close()  # this worker's own session
                        self._session_lost(given)
                        session = None
                        with self._lock:  # still due since the look that queued it
                            self._again[table] = min(self._again.get(table, self._looks), self._merging[table])
                    finally:
                        with self._lock:
                            self._merging.pop(table)
                            self._round.discard(table)
                            if table in self._again:
                                self._queue[table] = self._again.pop(table)
                            lined_up = not self._queue and not self._merging
                            self._lock.notify_all()
                    if pause is not None:
                        with self._lock:
                            self._lock.wait_for(lambda: self._closing and not self._finish, timeout=pause)
                    elif lined_up and self._config.warehouse.consistent_points:
                        self._publish_point()
        except BaseException as error:  # noqa: BLE001 - handed to the drain's thread, which raises it
            self._failed(error)

    def _given_session(self) -> SparkSession:
        """The session the follower was given, or the new one that replaced it once lost."""
        with self._lock:
            if connect_session_closed(self._spark):
                self._spark = spark_session(self._config.spark)
            return self._spark

    def _session_lost(self, given: SparkSession | None) -> None:
        """A merge lost its Spark Connect session: so did ``given`` (the server's sessions end
        together), unless another worker replaced it already; a merge of the lost session may still
        run on the server, so every table is fenced again before its next write."""
        with self._lock:
            if given is not None and given is self._spark:
                discard_connect_session(given)
        forget_fences()

    def _call_for_batch(self, merged: bool) -> None:
        """Call on the drain for a batch and wait for a look after it (each at most
        ``drain.commit_seconds``) — so the next merge takes the changes received meanwhile, and a
        table they changed is due now rather than at the drain's next batch — when tables are
        queued or this worker has ``merged`` one, the drain holds changes not yet durable, the last
        look is older than :data:`CALL_AFTER_SECONDS`, and every table due after the last call's
        batch has been merged since (one call a round: with many tables due, a batch a merge would
        only make the drain's batches small)."""
        demand, wait = self._demand, self._config.drain.commit_seconds
        if demand is None or not self._calls_now(demand, merged):
            return
        if demand.call(wait):
            with self._lock:
                looks = self._looks
                self._changed.set()  # a look after the batch (the batch's own may be done already)
                self._lock.wait_for(lambda: self._looks > looks or self._closing, wait)
                self._round = set(self._queue) | set(self._merging) | set(self._again)

    def _calls_now(self, demand: BatchDemand, merged: bool) -> bool:
        """Whether a worker that has ``merged`` a table (or not) calls for a batch now (see
        :meth:`_call_for_batch`)."""
        with self._lock:
            if self._round or self._closing or not (self._queue or merged) or not demand.received:
                return False
            return time.monotonic() - self._looked_at >= CALL_AFTER_SECONDS

    def _next(self) -> str | None:
        """The next table to merge, or None once closed with nothing left to do (or not finishing)."""
        with self._lock:
            while True:
                if self._closing and not self._finish:
                    return None
                if self._queue:
                    table = min(self._queue, key=lambda name: (self._queue[name], name))
                    self._merging[table] = self._queue.pop(table)
                    return table
                if self._closing and not self._threads[0].is_alive():
                    return None  # the last look is done and its tables are merged or being merged
                self._lock.wait(timeout=1.0)

    def _merge(self, table: str, session: SparkSession) -> None:
        bound = self._config.warehouse.maintenance.follow_compact_files
        compacted = None
        with ExitStack() as held:
            mirror = self._open(table, session, held)
            if mirror is None:
                return  # stopping without finishing: this merge does not start
            result = apply_table(mirror)
            if bound and (result.data_files or 0) >= bound:
                compacted = compact_table(mirror)
        if result.skipped is None:
            self._reports.put(lambda: self._on_applied(result))
        if compacted is not None and (on_compacted := self._on_compacted) is not None:
            self._reports.put(lambda: on_compacted(compacted))

    def _open(self, table: str, session: SparkSession, held: ExitStack) -> Mirror | None:
        """The table's mirror opened for writing into ``held`` (the table's maintenance waits, or
        this waits for it). While the source cannot be reached, try again after each pause of a
        :class:`Backoff`, at once when the follower is closing (and then only once); None if it
        stops without finishing meanwhile."""
        backoff = Backoff()
        while True:
            closing = self._closing
            try:
                return held.enter_context(write_mirror(self._config, self._config.table(table), session))
            except Exception as error:
                if closing or not connection_lost(error):
                    raise
                pause = backoff.next_pause()
                log.warning("merge of %s: %s; trying again in %.0f s", table, error, pause)
                with self._lock:
                    self._lock.wait_for(lambda: self._closing, timeout=pause)
                    if self._closing and not self._finish:
                        return None

    def _publish_point(self) -> None:
        """Every due table is merged: publish the consistent point the tables make, if new."""
        point = publish_point(self._config)
        if not isinstance(point, str) and (on_point := self._on_point) is not None:
            self._reports.put(lambda: on_point(point))

    def _report_all(self) -> None:
        """Run the reports in the order they came, until told there are no more."""
        while (report := self._reports.get()) is not None:
            try:
                report()
            except BaseException as error:  # noqa: BLE001 - handed to the drain's thread, which raises it
                self._failed(error)

    def _due(self) -> list[str]:
        """The configured tables whose checkpoint entry changed since the last look (at the first
        look: whose Delta table does not hold every change the log has for it)."""
        checkpoint = read_checkpoint(changelog_store(self._config))
        if checkpoint is None:
            return []
        tables = {
            name: state
            for name, state in checkpoint.tables.items()
            if name in self._configured and state.awaiting_copy is None
        }
        if self._seen is None:
            due = [
                name
                for name, state in tables.items()
                if not state.held_by(table_applied_lsn(self._config, self._config.table(name)))
            ]
        else:
            due = [name for name, state in tables.items() if self._seen.get(name) != state]
        self._seen = tables
        return sorted(due)
