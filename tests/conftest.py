"""Shared fixtures: real PostgreSQL servers (one throwaway cluster per major version per test run).

``pg`` is a fresh database on the default server (``CDC_TEST_PG``, default 16); ``pg_any`` is
parametrized over every version in ``CDC_TEST_PG_VERSIONS`` (default ``15,16,18``). Each test gets
its own database; its replication slots and the database are dropped afterwards. ``bucket`` is a
new bucket on a real S3 API server (moto's, one per test run, started on first use).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import pytest

from cdc_assets.storage import StorageConfig
from cdc_sandbox.pgcluster import ThrowawayCluster
from cdc_sandbox.s3server import ThrowawayS3Server
from tests.support.bucket import Bucket

ALL_VERSIONS = [int(v) for v in os.environ.get("CDC_TEST_PG_VERSIONS", "15,16,18").split(",") if v]
DEFAULT_VERSION = int(os.environ.get("CDC_TEST_PG", "16"))

_database_numbers = itertools.count()
_bucket_numbers = itertools.count()


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


def _create_database(cluster: ThrowawayCluster) -> Database:
    name = f"t{os.getpid()}_{next(_database_numbers)}"
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return Database(cluster, name)


def _drop_database(db: Database) -> None:
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


@pytest.fixture(scope="session")
def clusters() -> Iterator[ClusterPool]:
    pool = ClusterPool()
    yield pool
    pool.stop_all()


@pytest.fixture
def pg(clusters: ClusterPool) -> Iterator[Database]:
    """A fresh database on the default PostgreSQL version."""
    db = _create_database(clusters.get(DEFAULT_VERSION))
    yield db
    _drop_database(db)


@pytest.fixture(scope="module")
def pg_module(clusters: ClusterPool) -> Iterator[Database]:
    """A fresh database on the default version, shared by one test module."""
    db = _create_database(clusters.get(DEFAULT_VERSION))
    yield db
    _drop_database(db)


@pytest.fixture(params=ALL_VERSIONS, ids=lambda v: f"pg{v}")
def pg_any(request: pytest.FixtureRequest, clusters: ClusterPool) -> Iterator[Database]:
    """A fresh database, once per PostgreSQL version under test."""
    db = _create_database(clusters.get(request.param))
    yield db
    _drop_database(db)


@pytest.fixture(scope="session")
def s3_server() -> Iterator[ThrowawayS3Server]:
    with ThrowawayS3Server() as server:
        yield server


@pytest.fixture
def bucket(s3_server: ThrowawayS3Server) -> Bucket:
    return Bucket(s3_server, s3_server.create_bucket(f"t{os.getpid()}-{next(_bucket_numbers)}"))


@pytest.fixture(scope="session")
def spark() -> Iterator[Any]:
    """One Spark session (local, with Delta) for the whole test run."""
    from cdc_assets.apply.session import spark_session
    from cdc_assets.config import SparkConfig

    session = spark_session(
        SparkConfig(
            storage=StorageConfig(),  # the s3a jars; a bucket's test points its own session at the server
            master="local[2]",
            conf={
                "spark.ui.enabled": "false",
                "spark.sql.shuffle.partitions": "4",
                "spark.default.parallelism": "2",
                "spark.driver.memory": "2g",
            },
        ),
        app_name="cdc-assets-tests",
    )
    session.sparkContext.setLogLevel("ERROR")
    yield session
    session.stop()


@pytest.fixture
def make_role(pg: Database) -> Iterator[Callable[..., str]]:
    """Creates LOGIN roles (cluster-wide, so uniquely named) and drops them afterwards."""
    made: list[str] = []

    def make(suffix: str, attributes: str = "") -> str:
        name = f"r_{pg.name}_{suffix}"
        pg.execute(f'CREATE ROLE "{name}" LOGIN {attributes}')
        made.append(name)
        return name

    yield make
    with pg.connect() as conn:
        for name in made:
            conn.execute(f'DROP OWNED BY "{name}"')
            conn.execute(f'DROP ROLE "{name}"')
