"""What a replication slot holds back: the WAL behind its ``restart_lsn`` and the transaction that pins it.

Logical decoding restarts at the slot's ``restart_lsn``, which cannot pass the first WAL record of the
oldest transaction still running that holds an xid (one that wrote something), in any database of
the cluster: an idle-in-transaction session, a long batch, a prepared transaction never finished.
Draining does not release that WAL; only ending the transaction does.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg

HELD_WAL_WARN_BYTES = 1 << 30
"""Held WAL above this (1 GiB) is a warning. It is PostgreSQL's default ``max_wal_size``, the WAL the
server keeps for its own checkpoints: beyond it the slot makes the server keep more than it would
for itself. And it is the default ``schedule.max_lag_bytes``: held WAL is the slot's lag plus the
stretch by which ``restart_lsn`` trails the confirmed position, normally the last seconds of WAL
(a running-transactions record comes every 15 s), so a slot within the lag bound stays about
within this one unless a transaction pins ``restart_lsn``."""

QUERY_CHARS = 200
"""How much of the pinning session's query text is reported."""

_HELD_WAL = f"""
WITH running AS (
  SELECT backend_xid AS xid, pid, leader_pid, NULL::text AS gid, state, left(query, {QUERY_CHARS}) AS query,
         xact_start AS started_at, query_start, application_name, usename::text AS username, datname::text AS database
    FROM pg_stat_activity
   WHERE backend_xid IS NOT NULL AND pid <> pg_backend_pid()
  UNION ALL
  SELECT transaction, NULL, NULL, gid, 'prepared', NULL, prepared, NULL, NULL, owner::text, database::text
    FROM pg_prepared_xacts
)
SELECT s.slot_name::text, (s.restart_lsn - '0/0')::int8, (s.confirmed_flush_lsn - '0/0')::int8,
       (pg_current_wal_lsn() - '0/0')::int8,
       o.xid::text::int8, age(o.xid), extract(epoch FROM now() - o.started_at)::float8, o.started_at,
       o.pid, o.gid, o.state, o.query, o.query_start, o.application_name, o.username, o.database
  FROM pg_replication_slots s
  LEFT JOIN LATERAL (
    SELECT * FROM running ORDER BY age(xid) DESC, leader_pid IS NOT NULL LIMIT 1
  ) o ON true
 WHERE s.slot_name = %s
"""


@dataclass(slots=True, frozen=True)
class PinningTransaction:
    """The oldest running transaction holding an xid: a session's (``pid``) or a prepared one's (``gid``).

    Without ``pg_read_all_stats`` (or superuser) a role sees another role's session's pid, xid,
    user and application, but not its state, query or start times (``None``; the query reads
    ``<insufficient privilege>``).
    """

    xid: int
    xid_age: int  # transaction ids assigned since it got its own
    age_seconds: float | None  # since ``started_at``
    started_at: datetime | None  # the session's xact_start; a prepared transaction's PREPARE time
    pid: int | None = None
    gid: str | None = None
    state: str | None = None  # pg_stat_activity's state; ``prepared`` for a prepared transaction
    query: str | None = None  # its first QUERY_CHARS characters
    query_start: datetime | None = None
    application_name: str | None = None
    user: str | None = None  # the session's user; a prepared transaction's owner
    database: str | None = None

    @property
    def prepared(self) -> bool:
        return self.gid is not None

    def describe(self) -> str:
        """One line: who, xid, state, age, the query."""
        who = f"prepared transaction '{self.gid}'" if self.prepared else f"pid {self.pid}"
        parts = [f"xid {self.xid}"]
        if not self.prepared and self.state:
            parts.append(self.state)
        if self.age_seconds is not None:
            parts.append(f"{'prepared' if self.prepared else 'started'} {self.age_seconds:,.0f} s ago")
        if self.query_start is not None:
            parts.append(f"query started {self.query_start.astimezone(UTC).isoformat(timespec='seconds')}")
        labelled = (("user", self.user), ("application", self.application_name), ("database", self.database))
        parts += [f"{label} {value}" for label, value in labelled if value]
        query = f": {' '.join(self.query.split())}" if self.query else ""
        return f"{who} ({', '.join(parts)}){query}"

    def remedy(self) -> str:
        if self.prepared:
            return f"COMMIT PREPARED or ROLLBACK PREPARED '{self.gid}' in database {self.database}"
        return f"end its transaction, or SELECT pg_terminate_backend({self.pid})"


@dataclass(slots=True, frozen=True)
class HeldWal:
    """The WAL a slot makes the server keep, and the transaction that keeps ``restart_lsn`` back."""

    slot: str
    restart_lsn: int | None  # None: the slot reserves no WAL (invalidated)
    confirmed_flush_lsn: int | None
    current_wal_lsn: int
    pinned_by: PinningTransaction | None

    @property
    def held_bytes(self) -> int | None:
        """``pg_current_wal_lsn() - restart_lsn``."""
        return None if self.restart_lsn is None else max(0, self.current_wal_lsn - self.restart_lsn)

    def over(self, bound: int = HELD_WAL_WARN_BYTES) -> bool:
        return self.held_bytes is not None and self.held_bytes > bound

    def warning(self, bound: int = HELD_WAL_WARN_BYTES) -> str | None:
        """A line for operators when the held WAL is above ``bound``, else None."""
        if not self.over(bound):
            return None
        head = f"slot {self.slot} holds {self.held_bytes:,} bytes of WAL (over {bound:,})"
        if self.pinned_by is None:
            return f"{head}; no running transaction holds an xid: drain the slot"
        return (
            f"{head}; its restart_lsn cannot pass the oldest running transaction, {self.pinned_by.describe()}"
            f" — draining does not release it: {self.pinned_by.remedy()}"
        )


def read_held_wal(conn: psycopg.Connection[Any], slot: str) -> HeldWal | None:
    """The slot's held WAL and the oldest transaction holding an xid (excluding ``conn``'s own
    session); None if there is no such slot."""
    row = conn.execute(_HELD_WAL, (slot,)).fetchone()
    if row is None:
        return None
    name, restart, confirmed, current, xid, xid_age, age_s, started, pid, gid, *rest = row
    state, query, query_start, application, user, database = rest
    pinned = (
        None
        if xid is None
        else PinningTransaction(
            xid, xid_age, age_s, started, pid, gid, state, query, query_start, application or None, user, database
        )
    )
    return HeldWal(name, restart, confirmed, current, pinned)
