"""Change-log retention as a use case of its own (``docs/architecture.md``, "Change-log retention").

When due — ``changelog.retention_every_minutes`` after it last ran, as the checkpoint records —
:func:`retain_when_due` takes the drain lock without waiting (retention rewrites the checkpoint,
which only the lock's holder may do; a drain under way keeps the log, and a later run folds it),
reads each Delta table's applied LSN (delta-rs) and folds what
:func:`~cdc_assets.changelog.retention.retain` allows. The commands ``drain`` and ``sync`` run it
after their drain and apply, Dagster's drain runs after their drain and merges; the drain itself
never does.
"""

from __future__ import annotations

import logging

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.checkpoint import require_checkpoint
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.retention import RetentionResult, retain, retention_due
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config
from cdc_assets.errors import DrainLockedError
from cdc_assets.pipeline.slot_check import slot_checkpoint
from cdc_assets.source import DrainLock

log = logging.getLogger(__name__)


def retain_when_due(config: Config) -> RetentionResult | None:
    """Run change-log retention if it is due and no drain holds the log; None when it did not run."""
    store = changelog_store(config)
    if not retention_due(config, require_checkpoint(store)):
        return None
    try:
        with DrainLock(config.source, wait=False):
            checkpoint = slot_checkpoint(config, store)
            if not retention_due(config, checkpoint):  # another process ran it meanwhile
                return None
            applied = {str(t.name): table_applied_lsn(config, t) for t in config.tables}
            return retain(config, ChangeLogReader(store), checkpoint, applied)
    except DrainLockedError as busy:
        log.info("change-log retention is left for a later run: %s", busy)
        return None
