"""A heartbeat: a tiny committed transaction so an idle slot has something to decode and confirm.

Without one, a slot on a database whose published tables are idle never moves while other
databases and tables keep writing WAL, which the slot then retains.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.pq import TransactionStatus

from cdc_assets.source.connection import one_row

HEARTBEAT_PREFIX = "cdc_assets.heartbeat"


def emit_heartbeat(conn: psycopg.Connection[Any]) -> int:
    """Write a transactional logical decoding message (prefix :data:`HEARTBEAT_PREFIX`, content
    the server's ``now()``) in its own transaction; returns the message's LSN.

    Privilege: none beyond connecting — PostgreSQL 15–18 grant EXECUTE on
    ``pg_logical_emit_message`` to PUBLIC (checked with a role lacking REPLICATION); it needs
    ``wal_level = logical`` and a primary (it writes WAL). The drain sees it only with the
    pgoutput option ``messages 'true'``, which it always sends.
    """
    if conn.info.transaction_status != TransactionStatus.IDLE:
        raise ValueError("emit_heartbeat runs its own transaction: the connection has one open")
    with conn.transaction():
        (lsn,) = one_row(
            conn.execute("SELECT (pg_logical_emit_message(true, %s, now()::text) - '0/0')::int8", (HEARTBEAT_PREFIX,))
        )
    return int(lsn)
