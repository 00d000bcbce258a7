"""Which server the source is: its system identifier and timeline, and where each timeline of its
history ended — read with ``IDENTIFY_SYSTEM`` and ``TIMELINE_HISTORY`` on a replication connection.

A physical standby has its primary's system identifier; promoting it starts a new timeline that
forks from the old one at a WAL position, which the new timeline's history file records. The
change log records the identity it was drained from, so a drain recognises another cluster, and
a promotion whose fork point lies before what the log already holds (see
:func:`require_same_history`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import pq

from cdc_assets.config import SourceConfig
from cdc_assets.errors import ServerMismatchError, SourceError
from cdc_assets.lsn import format_lsn, parse_lsn
from cdc_assets.source.connection import connect


@dataclass(slots=True, frozen=True)
class ServerIdentity:
    """A server's ``system_identifier`` (the same on a physical standby and its primary; text, as
    it is an unsigned 64-bit number) and the timeline it writes or replays."""

    system_identifier: str
    timeline: int

    def to_json(self) -> dict[str, Any]:
        return {"system_identifier": self.system_identifier, "timeline": self.timeline}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ServerIdentity:
        return cls(str(data["system_identifier"]), int(data["timeline"]))

    def __str__(self) -> str:
        return f"system identifier {self.system_identifier}, timeline {self.timeline}"


@dataclass(slots=True, frozen=True)
class ServerLineage:
    """A server's identity and, for each earlier timeline of its history, the WAL position where
    that timeline ended (its successor starts there)."""

    identity: ServerIdentity
    timeline_ends: dict[int, int] = field(default_factory=dict)


def read_lineage(source: SourceConfig) -> ServerLineage:
    """The source server's identity and timeline history."""
    with connect(source, purpose="identify", replication=True) as conn:
        row = _command(conn, "IDENTIFY_SYSTEM")
        identity = ServerIdentity(row[0], int(row[1]))
        if identity.timeline == 1:
            return ServerLineage(identity)
        history = _command(conn, f"TIMELINE_HISTORY {identity.timeline}")[1]
    return ServerLineage(identity, parse_timeline_history(history))


def parse_timeline_history(text: str) -> dict[int, int]:
    """A timeline history file (``<parent timeline>\\t<switch LSN>\\t<reason>`` per line, ``#``
    comments) as timeline → the LSN where it ended."""
    ends: dict[int, int] = {}
    for line in text.splitlines():
        fields = line.split("\t") if "\t" in line else line.split()
        if not line.strip() or line.lstrip().startswith("#") or len(fields) < 2:
            continue
        ends[int(fields[0])] = parse_lsn(fields[1].strip())
    return ends


def require_same_history(recorded: ServerIdentity, lineage: ServerLineage, checkpoint_lsn: int, slot: str) -> None:
    """Raise :class:`ServerMismatchError` unless the server continues the history the change log
    was read from, as far as the log's ``checkpoint_lsn``: the same system (a promoted standby
    keeps it), and the log's timeline, or a later one that left it at or after the checkpoint.

    A fork before the checkpoint means the log may hold transactions — and Delta tables positions —
    of the old timeline that the new one never had, while the new one writes different WAL at
    those positions: nothing can continue from there exactly."""
    current = lineage.identity
    remedy = (
        f"Nothing was read or advanced. If source.dsn points at the wrong server, fix it; if the source"
        f" really is this server now, the slot's position means nothing to the change log (slot {slot}): run"
        " `cdc-assets recover`, which creates a new slot and copies every table again online"
    )
    if current.system_identifier != recorded.system_identifier:
        raise ServerMismatchError(
            f"source.dsn reaches the server with {current}, but the change log was read from the server with"
            f" {recorded}",
            f"another cluster (a restore from a dump, a new server), not a standby of it. {remedy}",
        )
    if current.timeline == recorded.timeline:
        return
    end = lineage.timeline_ends.get(recorded.timeline)
    if current.timeline < recorded.timeline or end is None:
        raise ServerMismatchError(
            f"source.dsn reaches a server on timeline {current.timeline} whose history does not contain timeline"
            f" {recorded.timeline}, which the change log was read from up to {format_lsn(checkpoint_lsn)}"
            f" (system identifier {recorded.system_identifier})",
            f"a server restored from an older backup, or a standby that never followed the old primary. {remedy}",
        )
    if checkpoint_lsn > end:
        raise ServerMismatchError(
            "the server was promoted",
            f"timeline {current.timeline} left timeline {recorded.timeline} at"
            f" {format_lsn(end)}, but the change log already holds timeline {recorded.timeline} up to"
            f" {format_lsn(checkpoint_lsn)}: the old primary sent the drain WAL its standby had not received when"
            f" it was promoted, and the new primary writes other transactions at those positions. Failover slots"
            f" with synchronized_standby_slots on the primary prevent this (the primary then sends logical"
            f" consumers only what the standby has). {remedy}",
        )


def _command(conn: psycopg.Connection[Any], command: str) -> list[str]:
    """The one row a replication command answers, as text."""
    result = conn.pgconn.exec_(command.encode())
    if result.status != pq.ExecStatus.TUPLES_OK or result.ntuples != 1:
        message = (result.error_message or b"").decode(errors="replace").strip()
        raise SourceError(f"{command} on the source failed: {message or pq.ExecStatus(result.status).name}")
    return [(result.get_value(0, i) or b"").decode() for i in range(result.nfields)]
