"""Shared fixtures: real PostgreSQL servers (one throwaway cluster per major version per test run).

``pg`` is a fresh database on the default server (``CDC_TEST_PG``, default 16); ``pg_any`` is
parametrized over every version in ``CDC_TEST_PG_VERSIONS`` (default ``15,16,18``; the versions
other than the default are in the slow tier, so the quick tier runs each such test once). Each test gets
its own database; its replication slots and the database are dropped afterwards. ``bucket`` is a
new bucket on a real S3 API server (moto's, one per test run, started on first use).

A run started in the background of a script (``nohup``, ``cmd &``) inherits SIGINT ignored;
Dagster gives SIGTERM the handler SIGINT has, so the processes a run in this process starts
(its compute-log tails) would ignore the SIGTERM that ends them, and each run would wait out
Dagster's 30-second timeouts. Python's own SIGINT handler is put back first.
"""

from __future__ import annotations

import itertools
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cdc_assets.apply.session import close_connect_sessions
from cdc_assets.storage import StorageConfig
from cdc_sandbox.s3server import ThrowawayS3Server
from tests.support import class_archive, jvm_options, spark_host
from tests.support.bucket import Bucket
from tests.support.database import ClusterPool, Database, create_database, drop_database
from tests.support.spark_server import RunningServer, start_server
from tests.support.standby_pair import Pair, make_pair

ALL_VERSIONS = [int(v) for v in os.environ.get("CDC_TEST_PG_VERSIONS", "15,16,18").split(",") if v]
DEFAULT_VERSION = int(os.environ.get("CDC_TEST_PG", "16"))

_bucket_numbers = itertools.count()

if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_configure(config: pytest.Config) -> None:
    """Every JVM of the run maps Spark's classes from an archive (``tests/support/class_archive.py``;
    a run that includes the slow tier builds it where it is missing) and compiles fewer methods
    (``tests/support/jvm_options.py``). A worker of a parallel run inherits what its controller set."""
    if not hasattr(config, "workerinput"):
        class_archive.use(build_missing="not slow" not in (config.getoption("markexpr") or ""))
        jvm_options.add(jvm_options.FEWER_COMPILATIONS)


# The longest groups off the run's Spark session, started first so that neither worker ends the run
# alone on one of them (BENCHMARKS.md, "Test suite")
LONGEST_GROUPS = (
    "test_fault_points",
    "test_drain_crash",
    "test_world_faults",
    "connect_server",
    "test_demo",
    "test_catalog",
    "test_drain",
    "test_cluster",
)


@pytest.hookimpl(tryfirst=True)  # before xdist names each test's group from its mark
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The run's two workers (``-n 2 --dist loadgroup``): the tests on the run's one Spark session
    (``spark``) on one, in the order collected; the others a group at a time on the other — those
    on the run's one Spark Connect server (``connect_server``) together, the rest a module at a
    time (its module fixtures set up once) — the longest first."""
    groups = {item: _group(item) for item in items}
    order = {name: rank for rank, name in enumerate(("spark", *LONGEST_GROUPS))}
    items.sort(key=lambda item: order.get(groups[item], len(order)))
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[item]))


def _group(item: pytest.Item) -> str:
    fixtures = set(getattr(item, "fixturenames", ()))
    for shared in ("spark", "connect_server"):
        if shared in fixtures:
            return shared
    return item.path.stem


@pytest.fixture(scope="session")
def clusters() -> Iterator[ClusterPool]:
    pool = ClusterPool()
    yield pool
    pool.stop_all()


@pytest.fixture
def pg(clusters: ClusterPool) -> Iterator[Database]:
    """A fresh database on the default PostgreSQL version."""
    db = create_database(clusters.get(DEFAULT_VERSION))
    yield db
    drop_database(db)


@pytest.fixture
def pg_other(clusters: ClusterPool) -> Iterator[Database]:
    """Another fresh database on the default version, beside ``pg`` (a second source)."""
    db = create_database(clusters.get(DEFAULT_VERSION))
    yield db
    drop_database(db)


@pytest.fixture(scope="module")
def pg_module(clusters: ClusterPool) -> Iterator[Database]:
    """A fresh database on the default version, shared by one test module."""
    db = create_database(clusters.get(DEFAULT_VERSION))
    yield db
    drop_database(db)


@pytest.fixture(
    params=[pytest.param(v, id=f"pg{v}", marks=() if v == DEFAULT_VERSION else pytest.mark.slow) for v in ALL_VERSIONS]
)
def pg_any(request: pytest.FixtureRequest, clusters: ClusterPool) -> Iterator[Database]:
    """A fresh database, once per PostgreSQL version under test."""
    db = create_database(clusters.get(request.param))
    yield db
    drop_database(db)


@pytest.fixture
def metastore(pg: Database) -> Iterator[str]:
    """The DSN of an empty database for the Hive metastore, on the source's cluster."""
    name = f"{pg.name}_metastore"
    pg.execute(f'CREATE DATABASE "{name}"')
    try:
        yield pg.cluster.dsn(name)
    finally:
        pg.execute(f'DROP DATABASE "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def s3_server() -> Iterator[ThrowawayS3Server]:
    with ThrowawayS3Server() as server:
        yield server


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """A ``cdc-assets spark-server`` shared by the test run: the commands a test runs in a
    subprocess connect to it (``spark.remote``) instead of starting a Spark of their own each."""
    server = start_server(tmp_path_factory.mktemp("connect"))
    try:
        yield server
    finally:
        close_connect_sessions()  # the runs' sessions kept for the process, released while it answers
        if server.process.poll() is None:
            server.stop()


@pytest.fixture
def bucket(s3_server: ThrowawayS3Server) -> Bucket:
    return Bucket(s3_server, s3_server.create_bucket(f"t{os.getpid()}-{next(_bucket_numbers)}"))


@pytest.fixture(scope="session")
def spark(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One Spark session (local, with Delta) for the whole test run, which serves Spark Connect to
    the commands the tests run (``tests/support/spark_host.py``). A second one in the same run (a
    parallel run whose groups were not applied) fails instead of sharing the two cores."""
    from cdc_assets.apply.session import spark_session
    from cdc_assets.config import SparkConfig

    run_folder = tmp_path_factory.getbasetemp()
    if hasattr(request.config, "workerinput"):
        run_folder = run_folder.parent  # a worker's folder is inside the run's
    marker = run_folder / "spark-session"
    try:
        marker.open("x").close()
    except FileExistsError:
        pytest.fail(
            f"a second Spark session in one test run ({marker} exists): the tests on the run's session"
            " belong on one worker (the xdist group `spark`, tests/conftest.py)"
        )
    session = spark_session(
        SparkConfig(
            storage=StorageConfig(),  # the s3a jars; a bucket's test points its own session at the server
            master="local[2]",
            conf={
                "spark.ui.enabled": "false",
                "spark.sql.shuffle.partitions": "4",
                "spark.default.parallelism": "2",
                "spark.driver.memory": "3g",
                **spark_host.SETTINGS,
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


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A PostgreSQL 18 primary and its standby, without slot synchronisation."""
    yield from make_pair(sync_slots=False)


@pytest.fixture
def syncing_pair() -> Iterator[Pair]:
    """A PostgreSQL 18 primary and its standby that syncs failover slots."""
    yield from make_pair(sync_slots=True)
