"""Replication slot state (``pg_replication_slots``), its validation, and dropping a slot.

The message builders here are shared by the checks and by :mod:`~cdc_assets.source.failures`,
which explains server errors by the slot's state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

import psycopg
from psycopg import errors

from cdc_assets.config import SourceConfig
from cdc_assets.errors import (
    ConfigError,
    SlotActiveError,
    SlotGapError,
    SlotInvalidatedError,
    SlotMismatchError,
    SlotMissingError,
)
from cdc_assets.lsn import format_lsn
from cdc_assets.names import quote_identifier
from cdc_assets.source.connection import connect, server_major

FAILOVER_MAJOR = 17
log = logging.getLogger(__name__)

RECOVER = (
    "run `cdc-assets recover`: it creates a new slot and copies every table again online while the source"
    " takes writes, so each Delta table converges to the source"
)
_SETUP_AGAIN = (
    "drop the slot (SELECT pg_drop_replication_slot('{slot}')) and run `cdc-assets setup` again, "
    "which re-snapshots the tables"
)


@dataclass(slots=True, frozen=True)
class SlotState:
    """One row of ``pg_replication_slots`` (LSNs as ints) plus the server's current WAL position
    (on a standby: its replay position) and the connection's database, for lag and database checks."""

    name: str
    plugin: str | None
    slot_type: str
    database: str | None
    two_phase: bool
    wal_status: str | None
    confirmed_flush_lsn: int | None
    restart_lsn: int | None
    safe_wal_size: int | None
    active_pid: int | None
    invalidation_reason: str | None  # PostgreSQL 17+
    temporary: bool
    failover: bool  # PostgreSQL 17+ (false before)
    synced: bool  # PostgreSQL 17+: a standby's copy of a primary's failover slot
    current_wal_lsn: int
    current_database: str

    @property
    def invalidated(self) -> bool:
        return self.wal_status == "lost"

    @property
    def lag_bytes(self) -> int | None:
        """WAL bytes written since the slot's confirmed position."""
        if self.confirmed_flush_lsn is None:
            return None
        return max(0, self.current_wal_lsn - self.confirmed_flush_lsn)


def read_slot(conn: psycopg.Connection[Any], slot: str) -> SlotState | None:
    """The slot's state, or None if there is no such slot."""
    row = conn.execute(
        "SELECT s.slot_name::text, s.plugin::text, s.slot_type, s.database::text, s.two_phase, s.wal_status,"
        " (s.confirmed_flush_lsn - '0/0')::int8, (s.restart_lsn - '0/0')::int8, s.safe_wal_size, s.active_pid,"
        " to_jsonb(s) ->> 'invalidation_reason', s.temporary, coalesce((to_jsonb(s) ->> 'failover')::bool, false),"
        " coalesce((to_jsonb(s) ->> 'synced')::bool, false),"
        " (CASE WHEN pg_is_in_recovery() THEN pg_last_wal_replay_lsn() ELSE pg_current_wal_lsn() END - '0/0')::int8,"
        " current_database()::text"
        " FROM pg_replication_slots s WHERE s.slot_name = %s",
        (slot,),
    ).fetchone()
    return None if row is None else SlotState(*row)


def require_usable_slot(state: SlotState | None, config: SourceConfig, checkpoint_lsn: int | None = None) -> SlotState:
    """``state`` if the slot can be drained as configured (from the change log's ``checkpoint_lsn``,
    when given), else the error that says why."""
    if state is None:
        raise slot_missing(config.slot)
    if state.invalidated:
        raise slot_invalidated(state)
    if state.slot_type != "logical":
        raise SlotMismatchError(
            f"replication slot {state.name} is a {state.slot_type} slot; cdc-assets needs a logical pgoutput slot: "
            "set source.slot to another name, or drop it and run `cdc-assets setup`"
        )
    if state.plugin != "pgoutput":
        raise SlotMismatchError(
            f"replication slot {state.name} uses output plugin {state.plugin}, not pgoutput, which is the only "
            "plugin cdc-assets decodes: set source.slot to another name, or " + _SETUP_AGAIN.format(slot=state.name)
        )
    if state.database != state.current_database:
        raise SlotMismatchError(
            f"replication slot {state.name} decodes database {state.database}, but source.dsn connects to "
            f"database {state.current_database}: a logical slot belongs to one database; fix source.dsn or source.slot"
        )
    if state.two_phase and not config.two_phase:
        raise SlotMismatchError(
            f"replication slot {state.name} is two-phase (pg_replication_slots.two_phase = true) but source.two_phase "
            "is false: the slot was created two-phase, or flipped to two-phase for good by a decoding session with "
            "two_phase 'on'. Set source.two_phase: true to decode prepared transactions, or "
            + _SETUP_AGAIN.format(slot=state.name)
        )
    if config.two_phase and not state.two_phase:
        raise SlotMismatchError(
            f"source.two_phase is true but replication slot {state.name} is not two-phase (it was created without "
            "it): set source.two_phase: false, or " + _SETUP_AGAIN.format(slot=state.name)
        )
    if checkpoint_lsn is not None and (state.confirmed_flush_lsn or 0) > checkpoint_lsn:
        raise SlotGapError(  # behind the checkpoint is fine: the stream starts there and confirms it at once
            f"replication slot {state.name} has confirmed LSN {format_lsn(state.confirmed_flush_lsn or 0)}, past the"
            f" change log's checkpoint {format_lsn(checkpoint_lsn)}",
            "transactions between the two were consumed by"
            " something else and are not in the log (a slot dropped and created again, or advanced by hand)."
            " Nothing was advanced. Remedy: " + RECOVER,
        )
    return state


def require_failover_server(major: int) -> None:
    """Failover slots need PostgreSQL 17 or later."""
    if major < FAILOVER_MAJOR:
        raise ConfigError(
            f"source.failover: failover slots need PostgreSQL {FAILOVER_MAJOR} or later (the server is {major});"
            " set source.failover: false"
        )


def ensure_failover(source: SourceConfig, state: SlotState) -> SlotState:
    """``state``, after turning the slot into a failover slot when ``source.failover`` asks and it
    is not one yet (the slot must not be in use)."""
    if not source.failover or state.failover:
        return state
    with connect(source, purpose="alter-slot", replication=True) as conn:
        require_failover_server(server_major(conn))
        try:
            conn.execute(f"ALTER_REPLICATION_SLOT {quote_identifier(state.name)} (FAILOVER true)")
        except errors.ObjectInUse:
            raise slot_active(state.name, state.active_pid) from None
    log.info("replication slot %s is now a failover slot", state.name)
    return replace(state, failover=True)


def drop_slot(conn: psycopg.Connection[Any], slot: str) -> bool:
    """Drop the slot; False if it did not exist. A slot in use raises :class:`SlotActiveError`."""
    try:
        row = conn.execute(
            "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    except errors.ObjectInUse:
        state = read_slot(conn, slot)
        raise slot_active(slot, state.active_pid if state else None) from None
    return row is not None


def slot_missing(slot: str, lsn: int | None = None) -> SlotMissingError:
    return SlotMissingError(
        f"replication slot {slot} does not exist{_at(lsn)}",
        "the changes after the change log's checkpoint went"
        " with it (dropped, lost in a failover or a restore). If source.slot names the wrong slot, fix it; else "
        + RECOVER,
    )


def slot_invalidated(state: SlotState, lsn: int | None = None) -> SlotInvalidatedError:
    reason = f", reason {state.invalidation_reason}" if state.invalidation_reason else ""
    confirmed = format_lsn(state.confirmed_flush_lsn) if state.confirmed_flush_lsn is not None else "unknown"
    return SlotInvalidatedError(
        f"replication slot {state.name} was invalidated by the server{_at(lsn)} (wal_status 'lost'{reason})",
        f"the server removed WAL the slot still needed (it fell more than max_slot_wal_keep_size behind, or "
        f"another limit hit it), so the changes after its restart position (confirmed up to {confirmed}) are "
        "gone and can never be decoded. Remedy: "
        + RECOVER
        + "; to prevent it, drain more often or raise max_slot_wal_keep_size",
    )


def slot_active(slot: str, pid: int | None, lsn: int | None = None) -> SlotActiveError:
    holder = f"process {pid}" if pid is not None else "another process"
    return SlotActiveError(
        f"replication slot {slot} is in use by {holder}{_at(lsn)}: a subscriber, a walsender or another "
        "drain is reading it; stop that reader (SELECT pg_terminate_backend(pid)) and retry"
    )


def _at(lsn: int | None) -> str:
    return "" if lsn is None else f" (at LSN {format_lsn(lsn)})"
