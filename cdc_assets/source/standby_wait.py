"""A walsender that waits for ``synchronized_standby_slots`` (PostgreSQL 17+).

A primary with that setting sends a failover slot's changes only once every standby slot it names
has received the WAL. A standby that is down, or a slot that no longer exists (a promoted standby
inherits the setting through ``pg_basebackup``), makes every logical walsender wait — silently: it
sends keepalives at the old position and nothing else. :func:`standby_wait_error` recognises that
wait (the walsender's ``wait_event``) and says which setting and slots hold it.
"""

from __future__ import annotations

from typing import Any

import psycopg

from cdc_assets.errors import StandbyWaitError
from cdc_assets.lsn import format_lsn

WAIT_EVENT = "WaitForStandbyConfirmation"


def standby_wait_error(
    conn: psycopg.Connection[Any], walsender_pid: int, slot: str, lsn: int, waited_s: float
) -> StandbyWaitError | None:
    """The error for the walsender ``walsender_pid`` of ``slot`` if it is waiting for the standbys
    of ``synchronized_standby_slots``, else None."""
    row = conn.execute(
        "SELECT wait_event, current_setting('synchronized_standby_slots', true) FROM pg_stat_activity WHERE pid = %s",
        (walsender_pid,),
    ).fetchone()
    if row is None or row[0] != WAIT_EVENT:
        return None
    names = [name.strip() for name in (row[1] or "").split(",") if name.strip()]
    states = dict(
        conn.execute(
            "SELECT n, CASE WHEN s.slot_name IS NULL THEN 'does not exist'"
            " WHEN s.active THEN 'is connected, behind at ' || coalesce(s.restart_lsn::text, 'no position')"
            " ELSE 'has no standby connected' END"
            " FROM unnest(%s::text[]) n LEFT JOIN pg_replication_slots s ON s.slot_name = n",
            (names,),
        ).fetchall()
    )
    held = "; ".join(f"{name} {states.get(name, 'is unknown')}" for name in names) or "(none listed)"
    return StandbyWaitError(
        f"replication slot {slot}: the server has sent nothing past LSN {format_lsn(lsn)} for {waited_s:.0f} s"
        f" because it waits until the standby slots of synchronized_standby_slots = '{row[1]}' have the WAL"
        f" ({held}). Nothing was lost or advanced. Bring the standby back, or remove its slot from"
        " synchronized_standby_slots on this server (ALTER SYSTEM SET synchronized_standby_slots = '...';"
        " SELECT pg_reload_conf()) — a promoted standby keeps the setting its primary had"
    )
