"""Whether a standby can take over the slot: its synced copy of a failover slot (PostgreSQL 17+),
read on ``source.standby_dsn`` and compared with the primary's slot.

A standby's copy is ready when the slot-sync worker keeps it (``synced``, no longer
``temporary``: it is persisted only once the primary's slot has moved past what the standby's
WAL and catalog xmin allow), valid (no ``invalidation_reason``), and has a confirmed position.
Only such a copy survives promotion.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from cdc_assets.config import SourceConfig
from cdc_assets.lsn import format_lsn
from cdc_assets.source.connection import connect, one_row
from cdc_assets.source.slots import SlotState, read_slot


@dataclass(slots=True, frozen=True)
class StandbySlot:
    """The standby's copy of the slot (``copy`` None: none), and the primary's confirmed position
    (None: unknown). ``problem`` says what keeps it from being ready (None: ready)."""

    slot: str
    in_recovery: bool
    copy: SlotState | None
    primary_confirmed_lsn: int | None = None

    @property
    def synced(self) -> bool:
        return self.copy is not None and self.copy.synced

    @property
    def confirmed_flush_lsn(self) -> int | None:
        return None if self.copy is None else self.copy.confirmed_flush_lsn

    @property
    def invalidation_reason(self) -> str | None:
        return None if self.copy is None else self.copy.invalidation_reason

    @property
    def behind_bytes(self) -> int | None:
        """How far the copy's confirmed position is behind the primary's."""
        if self.confirmed_flush_lsn is None or self.primary_confirmed_lsn is None:
            return None
        return max(0, self.primary_confirmed_lsn - self.confirmed_flush_lsn)

    @property
    def problem(self) -> str | None:
        copy = self.copy
        if not self.in_recovery:
            return "source.standby_dsn reaches a server that is not in recovery (not a standby)"
        if copy is None:
            return (
                f"the standby has no copy of replication slot {self.slot}: set source.failover: true, and on the"
                " standby sync_replication_slots = on, hot_standby_feedback = on, primary_slot_name, and a dbname"
                " in primary_conninfo"
            )
        if not copy.synced:
            return f"the standby's slot {self.slot} was created there, not synced from the primary"
        if copy.invalidation_reason is not None:
            return f"the standby's copy of slot {self.slot} is invalidated ({copy.invalidation_reason})"
        if copy.temporary or copy.confirmed_flush_lsn is None:
            return (
                f"the standby's copy of slot {self.slot} is not kept yet (temporary): it is persisted once the"
                " primary's slot has moved past the standby's catalog xmin — after a drain that reads new WAL"
            )
        return None

    def describe(self) -> str:
        if self.problem is not None:
            return f"standby slot {self.slot}: not ready — {self.problem}"
        behind = self.behind_bytes
        return (
            f"standby slot {self.slot}: ready to take over, confirmed {format_lsn(self.confirmed_flush_lsn or 0)}"
            + ("" if behind is None else f", {behind:,} bytes behind the primary's")
        )


def read_standby_slot(source: SourceConfig, primary: SlotState | None) -> StandbySlot:
    """The standby's copy of the configured slot (``source.standby_dsn`` must be set)."""
    if source.standby_dsn is None:
        raise ValueError("source.standby_dsn is not set")
    with connect(replace(source, dsn=source.standby_dsn), purpose="standby-status") as conn:
        (in_recovery,) = one_row(conn.execute("SELECT pg_is_in_recovery()"))
        copy = read_slot(conn, source.slot)
    return StandbySlot(source.slot, bool(in_recovery), copy, primary.confirmed_flush_lsn if primary else None)
