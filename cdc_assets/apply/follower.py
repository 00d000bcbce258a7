"""Merges while a drain follows the slot's stream: after each durable batch, the tables whose
entry in the change log's checkpoint changed are applied up to it, on a thread of their own — a
change reaches its Delta table seconds after its commit, with no run or process per merge.

The drain never waits for a merge: batches that land while a merge runs are taken together by the
next one (each apply reads the checkpoint it starts at). What a merge does is exactly what
``cdc-assets apply`` does for the table; a failed merge stops the follower, and the drain's next
durable batch raises its error.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from types import TracebackType

from pyspark.sql import SparkSession

from cdc_assets.apply.runner import TableApplied, apply_tables
from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.checkpoint import TableState, read_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config
from cdc_assets.errors import CdcError


class MergeFollower:
    """Apply, on a background thread, the tables each durable batch changed (:meth:`batch_durable`).

    Used as a context manager around a following drain: leaving it normally merges what the last
    batches brought and waits for it; leaving it on an exception lets the merge under way finish
    and starts no other."""

    def __init__(self, config: Config, spark: SparkSession, on_applied: Callable[[TableApplied], None]) -> None:
        self._config = config
        self._spark = spark
        self._on_applied = on_applied
        self._configured = {str(table.name) for table in config.tables}
        self._seen: dict[str, TableState] | None = None
        self._wake = threading.Event()
        self._closing = False
        self._finish = True
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="merge-follower", daemon=True)

    def __enter__(self) -> MergeFollower:
        self._thread.start()
        self._wake.set()  # the first look merges every table the log holds changes for
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close(finish=kind is None)

    def batch_durable(self) -> None:
        """A batch is durable: merge the tables it changed (raises a merge's failure)."""
        self._raise_failure()
        self._wake.set()

    def close(self, *, finish: bool = True) -> None:
        """Stop following: with ``finish``, merge what is pending first; raises a merge's failure."""
        self._closing, self._finish = True, finish
        self._wake.set()
        self._thread.join()
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self._error is not None:
            raise CdcError(f"a merge while following the stream failed: {self._error}") from self._error

    def _run(self) -> None:
        try:
            while True:
                self._wake.wait()
                self._wake.clear()
                if self._closing and not self._finish:
                    return
                due = self._due()
                if due:
                    apply_tables(self._config, self._spark, due, progress=self._report)
                if self._closing and not self._wake.is_set():
                    return
        except BaseException as error:  # noqa: BLE001 - handed to the drain's thread, which raises it
            self._error = error

    def _due(self) -> list[str]:
        """The configured tables whose checkpoint entry changed since the last look (at the first
        look: whose Delta table does not hold every change the log has for it)."""
        checkpoint = read_checkpoint(changelog_store(self._config))
        if checkpoint is None:
            return []
        tables = {name: state for name, state in checkpoint.tables.items() if name in self._configured}
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

    def _report(self, result: TableApplied) -> None:
        if result.skipped is None:
            self._on_applied(result)
