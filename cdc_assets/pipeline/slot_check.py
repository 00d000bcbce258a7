"""Whether the slot can still be drained into the change log: the refusals that only
``cdc-assets recover`` resolves (a lost slot, or a server whose history the log does not continue)."""

from __future__ import annotations

from cdc_assets.changelog.checkpoint import Checkpoint, require_checkpoint
from cdc_assets.changelog.store import LogStore
from cdc_assets.config import Config, SourceConfig
from cdc_assets.errors import CdcError, LostPositionError
from cdc_assets.source import SlotState, require_usable_slot
from cdc_assets.source.server_identity import read_lineage, require_same_history


def lost_slot_error(source: SourceConfig, slot: SlotState | None, checkpoint: Checkpoint) -> LostPositionError | None:
    """The drain's refusal of ``slot`` (as read from the source; None: missing) from ``checkpoint``
    when the slot or its server is lost to the log (None: it is not). Other errors — a slot of the
    wrong kind, an unreachable server — are raised."""
    try:
        if checkpoint.server is not None:
            require_same_history(checkpoint.server, read_lineage(source), checkpoint.lsn, source.slot)
        require_usable_slot(slot, source, checkpoint.lsn)
    except LostPositionError as error:
        return error
    return None


def slot_checkpoint(config: Config, store: LogStore) -> Checkpoint:
    """The change log's checkpoint, refused when the log belongs to another slot than the configured one."""
    checkpoint = require_checkpoint(store)
    if checkpoint.slot != config.source.slot:
        raise CdcError(
            f"the change log at {config.changelog.path} belongs to slot {checkpoint.slot}, not {config.source.slot}"
        )
    return checkpoint
