"""The one way into a mirror (``docs/architecture.md``, "One write path").

Every writer of a Delta table — the apply (``apply``, ``sync``, a following drain's merges,
Dagster's merge runs, the parity check's merge), the rebuild, maintenance and compaction — opens
it with :func:`write_mirror`: the table's write lock on the source is held
(:class:`~cdc_assets.source.lock.TableWriteLock`, a PostgreSQL advisory lock keyed by slot and
table, which a second writer waits for) and the change log's checkpoint read once, after the lock
(or handed in: one read for every table of an apply). The writers take the :class:`Mirror` it
yields, so none writes without the lock, and none loses a Delta conflict to another.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from pyspark.sql import SparkSession

from cdc_assets.apply.target import DeltaTarget, delta_target
from cdc_assets.changelog.checkpoint import Checkpoint, TableState
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, TableConfig
from cdc_assets.source.lock import TableWriteLock


@dataclass(slots=True, frozen=True)
class Mirror:
    """A mirror open for writing: its table's write lock is held; ``checkpoint`` is the change
    log's position it is written up to."""

    config: Config
    table: TableConfig
    target: DeltaTarget
    reader: ChangeLogReader
    checkpoint: Checkpoint

    @property
    def name(self) -> str:
        return str(self.table.name)

    @property
    def state(self) -> TableState | None:
        """The table's entry in the checkpoint (None: the log holds nothing for it)."""
        return self.checkpoint.tables.get(self.name)


@contextmanager
def write_mirror(
    config: Config,
    table: TableConfig,
    spark: SparkSession,
    *,
    reader: ChangeLogReader | None = None,
    checkpoint: Checkpoint | None = None,
) -> Iterator[Mirror]:
    """Hold ``table``'s write lock (waiting for its other writer) and yield its mirror, with the
    checkpoint read now (:class:`~cdc_assets.errors.NotSetUpError` before setup) or ``checkpoint``."""
    with TableWriteLock(config.source, str(table.name)):
        reader = reader or ChangeLogReader(changelog_store(config))
        current = checkpoint or reader.require_checkpoint()
        yield Mirror(config, table, delta_target(config, table, spark), reader, current)
