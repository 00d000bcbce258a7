"""The database fixture type: a fresh database on a throwaway PostgreSQL cluster.

:class:`ClusterPool` starts at most one cluster per major version for a test run;
:func:`create_database` / :func:`drop_database` make and remove one :class:`Database` on it (its
replication slots and prepared transactions first). ``tests/conftest.py`` holds the fixtures
(``pg``, ``pg_module``, ``pg_any``) built from these.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass
from typing import Any

import psycopg

from cdc_assets.config import SourceConfig
from cdc_sandbox.pgcluster import ThrowawayCluster

_database_numbers = itertools.count()


class ClusterPool:
    """Starts at most one cluster per major version, on first use, for the whole test run."""

    def __init__(self) -> None:
        self._clusters: dict[int, ThrowawayCluster] = {}

    def get(self, major: int) -> ThrowawayCluster:
        if major not in self._clusters:
            cluster = ThrowawayCluster(major)
            cluster.start()
            self._clusters[major] = cluster
        return self._clusters[major]

    def stop_all(self) -> None:
        for cluster in self._clusters.values():
            cluster.stop()


@dataclass(slots=True)
class Database:
    """A fresh database on a throwaway cluster."""

    cluster: ThrowawayCluster
    name: str

    @property
    def version(self) -> int:
        return self.cluster.version

    @property
    def dsn(self) -> str:
        return self.cluster.dsn(self.name)

    def connect(self, **kwargs: Any) -> psycopg.Connection[Any]:
        kwargs.setdefault("autocommit", True)
        return psycopg.connect(self.dsn, **kwargs)

    def execute(self, sql: str, params: Any = None) -> list[tuple[Any, ...]]:
        """Run one statement in autocommit mode; return its rows (empty if it returns none)."""
        with self.connect() as conn:
            cur = conn.execute(sql, params)
            return cur.fetchall() if cur.description else []


def create_database(cluster: ThrowawayCluster) -> Database:
    name = f"t{os.getpid()}_{next(_database_numbers)}"
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return Database(cluster, name)


def drop_database(db: Database) -> None:
    """Drop ``db`` with its replication slots (their holders terminated) and prepared transactions."""
    with psycopg.connect(db.cluster.dsn(), autocommit=True) as conn:
        for (slot,) in conn.execute(
            "SELECT slot_name FROM pg_replication_slots WHERE database = %s", (db.name,)
        ).fetchall():
            conn.execute(
                "SELECT pg_terminate_backend(active_pid) FROM pg_replication_slots"
                " WHERE slot_name = %s AND active_pid IS NOT NULL",
                (slot,),
            )
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
        for (gid,) in conn.execute("SELECT gid FROM pg_prepared_xacts WHERE database = %s", (db.name,)).fetchall():
            with psycopg.connect(db.dsn, autocommit=True) as owner:
                owner.execute(f"ROLLBACK PREPARED '{gid}'")
        conn.execute(f'DROP DATABASE "{db.name}" WITH (FORCE)')


def as_role(db: Database, role: str) -> SourceConfig:
    """A source configuration that reaches ``db`` as ``role`` (slot ``s_<database>``)."""
    return SourceConfig(dsn=db.cluster.dsn(db.name, user=role), slot=f"s_{db.name}")
