"""A PostgreSQL 18 primary and its physical standby (``pg_basebackup``), for the failover tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import psycopg

from cdc_sandbox.pgcluster import ThrowawayCluster
from tests.support.database import Database, create_database
from tests.support.pipeline import wait_until

STANDBY_SLOT = "standby"
SYNCING = {"sync_replication_slots": "on", "hot_standby_feedback": "on"}


@dataclass(slots=True)
class Pair:
    """A PostgreSQL 18 primary, its physical standby (streaming from the physical slot ``standby``)
    and a database created on the primary before the standby was copied."""

    primary: ThrowawayCluster
    standby: ThrowawayCluster
    name: str

    @property
    def on_primary(self) -> Database:
        return Database(self.primary, self.name)

    @property
    def on_standby(self) -> Database:
        return Database(self.standby, self.name)

    def dsn(self) -> str:
        """Both servers; libpq picks whichever is the primary."""
        return (
            f"host=127.0.0.1,127.0.0.1 port={self.primary.port},{self.standby.port} dbname={self.name}"
            " user=postgres target_session_attrs=read-write"
        )

    def replayed(self) -> None:
        """Wait until the standby has replayed everything the primary has flushed."""
        (flushed,) = self.on_primary.execute("SELECT pg_current_wal_flush_lsn()")[0]
        wait_until(
            lambda: self.on_standby.execute("SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (flushed,))[0][0],
            what="the standby caught up",
        )

    def wait_slot_synced(self, slot: str, lsn: int, drain: Callable[[], object]) -> None:
        """Wait until the standby keeps a synced copy of failover slot ``slot`` confirmed up to
        ``lsn``. A copy is kept only once the slot's catalog xmin passes the standby's: each try
        logs a running-transactions record on the primary and drains it."""

        def synced() -> bool:
            rows = self.on_standby.execute(
                "SELECT NOT temporary, (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots"
                " WHERE slot_name = %s AND synced",
                (slot,),
            )
            if rows and rows[0][0] and (rows[0][1] or 0) >= lsn:
                return True
            self.on_primary.execute("SELECT pg_log_standby_snapshot()")
            drain()
            return False

        wait_until(synced, timeout=60, interval=1, what=f"the standby's copy of slot {slot} synced to {lsn:X}")

    def fail_over(self) -> None:
        """Lose the primary (an immediate shutdown) and promote the standby."""
        self.primary.halt()
        self.standby.promote()


def make_pair(*, sync_slots: bool) -> Iterator[Pair]:
    primary = ThrowawayCluster(18)
    primary.start()
    standby: ThrowawayCluster | None = None
    try:
        name = create_database(primary).name
        with psycopg.connect(primary.dsn(name), autocommit=True) as conn:
            conn.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        standby = ThrowawayCluster(18, settings=SYNCING if sync_slots else {})
        standby.start(standby_of=primary, standby_slot=STANDBY_SLOT)
        if sync_slots:  # set after the copy: a promoted standby must not wait for its own old slot
            with psycopg.connect(primary.dsn(), autocommit=True) as conn:
                conn.execute(f"ALTER SYSTEM SET synchronized_standby_slots = '{STANDBY_SLOT}'")
                conn.execute("SELECT pg_reload_conf()")
        yield Pair(primary, standby, name)
    finally:
        if standby is not None:
            standby.stop()
        primary.stop()


def write(db: Database, *statements: str) -> None:
    with db.connect() as conn, conn.transaction():
        for statement in statements:
            conn.execute(statement)
