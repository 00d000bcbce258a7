"""Transactions with a chosen commit time, for tests of what depends on commit days and ages."""

from __future__ import annotations

from datetime import datetime

from tests.support.database import Database


def commit_at(db: Database, moment: datetime, *statements: str) -> None:
    """One transaction whose commit time, as logical decoding reports it, is ``moment``.

    A session with a replication origin set up commits with the origin's timestamp in its commit
    record, and logical decoding (hence pgoutput's BEGIN and COMMIT) reports that timestamp as the
    commit time — how a subscriber replays an upstream transaction. The transaction itself is
    real: real rows, a real LSN, decoded and drained like any other."""
    with db.connect() as conn:
        if not conn.execute("SELECT 1 FROM pg_replication_origin WHERE roname = 'history_test'").fetchall():
            conn.execute("SELECT pg_replication_origin_create('history_test')")
        conn.execute("SELECT pg_replication_origin_session_setup('history_test')")
        try:
            with conn.transaction():
                lsn = conn.execute("SELECT pg_current_wal_lsn()").fetchone()[0]
                conn.execute("SELECT pg_replication_origin_xact_setup(%s, %s)", (lsn, moment))
                for statement in statements:
                    conn.execute(statement)
        finally:
            conn.execute("SELECT pg_replication_origin_session_reset()")
