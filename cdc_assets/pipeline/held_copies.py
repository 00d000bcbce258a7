"""Tables the change log holds for a copy, copied again without a person (``docs/architecture.md``,
"Schema migrations").

The drain holds a table whose rows a DDL rewrote (``TableState.awaiting_copy`` with its
``copy_reason``): the stream never carries a rewrite's rows. An online snapshot run from a point
after the rewrite releases it. ``sync`` copies such tables between its drain and its apply
(:func:`copy_held_tables`); ``sync --follow`` on a thread of its own while the drain and the other
tables' merges go on (:class:`HeldTableCopier`); Dagster's merge sensor requests the table's
partition of ``cdc/snapshot``. A table held after a lost slot is ``recover``'s, which copies it the
same way.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from cdc_assets.changelog.checkpoint import read_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config
from cdc_assets.pipeline.online_snapshot import CopyProgress, TableCopied, snapshot_tables

log = logging.getLogger(__name__)


def tables_held_for_copy(config: Config) -> dict[str, int]:
    """The configured tables held for a copy after a rewrite: the LSN each one's copy must start
    from or after."""
    checkpoint = read_checkpoint(changelog_store(config))
    if checkpoint is None:
        return {}
    configured = {str(t.name) for t in config.tables}
    return {
        name: state.awaiting_copy
        for name, state in checkpoint.tables.items()
        if name in configured and state.awaiting_copy is not None and state.copy_reason is not None
    }


def copy_held_tables(config: Config, progress: Callable[[CopyProgress], None] | None = None) -> list[TableCopied]:
    """Copy every table held for a copy after a rewrite, one after another (none: an empty list)."""
    held = tables_held_for_copy(config)
    return snapshot_tables(config, sorted(held), progress=progress) if held else []


def drain_with_copies(
    config: Config, drain: Callable[[], object], on_copied: Callable[[TableCopied], None] | None = None
) -> list[TableCopied]:
    """A one-shot sync's drain: ``drain()``, then copy the tables held after a rewrite and, if any
    was, ``drain()`` again up to their copies' announcements, so the apply that follows has them."""
    drain()
    copied = copy_held_tables(config)
    for done in copied:
        if on_copied is not None:
            on_copied(done)
    if copied:
        drain()
    return copied


class HeldTableCopier:
    """Copies the tables held after a rewrite on a thread of its own, once per hold, as a following
    drain makes batches durable; :meth:`close` waits for the copy under way and raises its failure."""

    def __init__(self, config: Config, on_copied: Callable[[TableCopied], None] | None = None) -> None:
        self._config = config
        self._on_copied = on_copied
        self._started: dict[str, int] = {}  # table → the hold its copy was started for
        self._thread: threading.Thread | None = None
        self._failure: BaseException | None = None

    def batch_durable(self) -> None:
        """Start copying the tables newly held, unless a copy is under way."""
        if self._thread is not None and self._thread.is_alive():
            return
        held = tables_held_for_copy(self._config)
        due = [t for t, hold in held.items() if self._started.get(t) != hold]
        if not due or self._failure is not None:
            return
        self._started |= {t: held[t] for t in due}
        self._thread = threading.Thread(target=self._copy, args=(due,), name="held-copies", daemon=True)
        self._thread.start()

    def _copy(self, tables: list[str]) -> None:
        try:
            for done in snapshot_tables(self._config, tables):
                log.info("copied again: %s", done.summary())
                if self._on_copied is not None:
                    self._on_copied(done)
        except BaseException as error:  # noqa: BLE001 - raised by close()
            self._failure = error

    def close(self) -> None:
        if self._thread is not None:
            self._thread.join()
        if self._failure is not None:
            raise self._failure

    def __enter__(self) -> HeldTableCopier:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
