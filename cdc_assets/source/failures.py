"""Turn a server error from a slot operation into the error class that explains it.

The diagnosis reads the slot's and publication's state after the failure instead of matching
message text, which changes between versions (PostgreSQL 18 says "can no longer access", 15
"can no longer get changes") and languages.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import errors

from cdc_assets.errors import (
    PublicationMissingError,
    SourceError,
    SourcePermissionError,
)
from cdc_assets.lsn import format_lsn
from cdc_assets.source.publication import publication_exists
from cdc_assets.source.slots import (
    read_slot,
    slot_active,
    slot_invalidated,
    slot_missing,
)


def diagnose(
    conn: psycopg.Connection[Any], error: psycopg.Error, *, slot: str, publication: str, lsn: int | None = None
) -> SourceError:
    """The error to raise for ``error``; ``conn`` must be usable (outside the failed transaction)."""
    reason = error.diag.message_primary or str(error)
    at = "" if lsn is None else f", LSN {format_lsn(lsn)}"
    if isinstance(error, errors.InsufficientPrivilege):
        return SourcePermissionError(
            f"permission denied on replication slot {slot}{at}: {reason}; the source role needs the REPLICATION "
            "attribute (ALTER ROLE ... REPLICATION) or superuser"
        )
    try:
        state = read_slot(conn, slot)
        publication_missing = not publication_exists(conn, publication)
    except psycopg.Error:
        return SourceError(f"replication slot {slot}{at}: {reason}")
    if state is None:
        return slot_missing(slot, lsn)
    if state.invalidated:
        return slot_invalidated(state, lsn)
    if isinstance(error, errors.ObjectInUse):
        return slot_active(slot, state.active_pid, lsn)
    if publication_missing:
        return publication_missing_error(publication, slot, lsn)
    return SourceError(f"replication slot {slot}{at}: {reason}")


def publication_missing_error(
    publication: str, slot: str | None = None, lsn: int | None = None
) -> PublicationMissingError:
    where = ""
    if slot is not None:
        at = "" if lsn is None else f" at LSN {format_lsn(lsn)}"
        where = f" (reading replication slot {slot}{at})"
    return PublicationMissingError(
        f"publication {publication} does not exist{where}: run `cdc-assets setup` "
        "to create it, or fix source.publication. A publication must exist before the changes it should "
        "publish: one created after the slot's position is not seen by the slot, so re-create the slot too"
    )
