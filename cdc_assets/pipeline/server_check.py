"""The change log's record of the server it is read from: checked before every read of the slot,
and brought up to date after a promotion that continues the log's history."""

from __future__ import annotations

from dataclasses import replace

from cdc_assets.changelog.checkpoint import Checkpoint, write_checkpoint
from cdc_assets.changelog.store import LogStore
from cdc_assets.config import SourceConfig
from cdc_assets.source.server_identity import read_lineage, require_same_history


def recognise_server(source: SourceConfig, store: LogStore, checkpoint: Checkpoint) -> Checkpoint:
    """``checkpoint``, recording the source server's identity when it has none or the server has
    moved to a later timeline that continues the log's history (written at once; call under the
    drain lock). Another cluster, or a timeline that forked before the checkpoint, raises
    :class:`~cdc_assets.errors.ServerMismatchError`."""
    lineage = read_lineage(source)
    if checkpoint.server is not None:
        require_same_history(checkpoint.server, lineage, checkpoint.lsn, source.slot)
    if checkpoint.server == lineage.identity:
        return checkpoint
    checkpoint = replace(checkpoint, server=lineage.identity)
    write_checkpoint(store, checkpoint)
    return checkpoint
