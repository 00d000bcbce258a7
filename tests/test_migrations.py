"""Exact through schema migrations (docs/architecture.md, "Schema migrations"), against real
PostgreSQL, the real drain and real Spark with Delta: each common ``ALTER TABLE`` of a 200-row
table, followed by writes, then a drain and an apply — after each, every column of the Delta table
equals the source by name, read by Spark and by delta-rs."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest
from deltalake import DeltaTable

from cdc_assets.apply.runner import TableApplied
from cdc_assets.faults import ENV as FAULT_ENV
from cdc_assets.pipeline.sync import sync
from tests.support.database import Database
from tests.support.mirror_diff import compare_all, fast_spark, report
from tests.support.pipeline import Pipeline, wait_until
from tests.support.spark_host import COMMANDS_SPARK

TABLE = "public.t"
WRITES = (
    "INSERT INTO t ({key}, a, d) SELECT g, g, 'new ' || g FROM generate_series({n}, {n} + 4) g;"
    " UPDATE t SET a = a + 1 WHERE {key} % 37 = {m}; DELETE FROM t WHERE {key} % 53 = {m}"
)
MIGRATIONS = [
    ("constant default", "ALTER TABLE t ADD COLUMN e integer DEFAULT 7"),
    ("not null default", "ALTER TABLE t ADD COLUMN e2 text NOT NULL DEFAULT 'x'"),
    ("stable default", "ALTER TABLE t ADD COLUMN f timestamptz DEFAULT now()"),
    ("rename", "ALTER TABLE t RENAME COLUMN b TO b2"),
    ("varchar widened", "ALTER TABLE t ALTER COLUMN d TYPE varchar(50)"),
    ("drop and add", "ALTER TABLE t DROP COLUMN c; ALTER TABLE t ADD COLUMN c text"),
    ("set default", "ALTER TABLE t ALTER COLUMN a SET DEFAULT 5"),
    ("key renamed", "ALTER TABLE t RENAME COLUMN id TO item_id"),
]


def _applied(pipe: Pipeline, spark: Any) -> TableApplied:
    """``sync``: drain (copying the tables held for a copy), retention when due, then apply."""
    (applied,) = sync(pipe.config(), lambda: spark, wait=True).applied
    return applied


def _assert_exact(pipe: Pipeline, spark: Any, what: str) -> None:
    problems = report(compare_all(pipe.config(), pipe.db.dsn, spark))
    assert not problems, f"after {what}:\n{problems}"


@pytest.mark.slow
def test_each_migration_leaves_the_mirror_equal_to_its_source(pg_any: Database, spark: Any, tmp_path: Path) -> None:
    """The migrations that broke the mirror (a constant, NOT NULL or stable default, a rename, a
    drop and an add of the same name, the key renamed) and those that did not, one after another,
    each between writes: the mirror equals the source by name after each, with no copy."""
    _migrate_each(pg_any, spark, tmp_path, capture=True)


@pytest.mark.slow
def test_without_ddl_capture_each_migration_is_copied_again_where_it_cannot_be_told(
    pg_any: Database, spark: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """With ``ddl_capture: false`` the Relation messages alone cannot tell a rename from a drop and
    an add, nor whether an added column has a default: such a migration holds the table, with a
    warning naming DDL capture, and ``sync`` copies it again — never a silent difference."""
    _migrate_each(pg_any, spark, tmp_path, capture=False)
    assert "DDL capture (`source.ddl_capture`) applies such changes in place" in caplog.text


def _migrate_each(pg: Database, spark: Any, tmp_path: Path, *, capture: bool) -> None:
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, a int, b text, c text, d varchar(20));"
        " INSERT INTO t SELECT g, g, 'b' || g, 'c' || g, 'd' FROM generate_series(1, 200) g"
    )
    pipe = Pipeline(pg, tmp_path, [TABLE], source={"ddl_capture": capture})
    pipe.setup()
    session = spark.newSession()
    with fast_spark(session):
        assert _applied(pipe, session).skipped is None
        _assert_exact(pipe, session, "the copy")
        for i, (what, ddl) in enumerate(MIGRATIONS):
            n, m = 1000 + 10 * i, i
            pg.execute(WRITES.format(key="id", n=n, m=m))
            with _writes_meanwhile(pg.dsn, KEYLESS_UPDATE):
                pg.execute(ddl)
            pg.execute(WRITES.format(key="item_id" if what == "key renamed" else "id", n=n + 5, m=m + 1))
            applied = _applied(pipe, session)
            assert applied.skipped is None, f"{what}: {applied.summary()}"
            _assert_exact(pipe, session, what)


@pytest.mark.parametrize("writes_after", [True, False])
def test_a_ddl_inside_a_transaction_with_writes_before_and_after(
    pg: Database, spark: Any, tmp_path: Path, writes_after: bool
) -> None:
    """Rows written before an ADD COLUMN … DEFAULT in the same transaction read the default; rows
    after carry their own values; a column added and dropped between two drains leaves nothing;
    a schema change with no write after it still reaches the mirror."""
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, a int, b text);"
        " INSERT INTO t SELECT g, g, 'b' FROM generate_series(1, 50) g"
    )
    pipe = Pipeline(pg, tmp_path, [TABLE])
    pipe.setup()
    session = spark.newSession()
    with fast_spark(session):
        _applied(pipe, session)
        with pg.connect() as conn, conn.transaction():
            conn.execute("INSERT INTO t VALUES (100, 100, 'before')")
            conn.execute("UPDATE t SET a = -1 WHERE id = 1")
            conn.execute("ALTER TABLE t ADD COLUMN e int DEFAULT 7")
            conn.execute("ALTER TABLE t RENAME COLUMN b TO b2")
            if writes_after:
                conn.execute("INSERT INTO t VALUES (101, 101, 'after', 8)")
                conn.execute("UPDATE t SET e = 9 WHERE id = 2")
        pg.execute("ALTER TABLE t ADD COLUMN gone int DEFAULT 3")
        pg.execute("ALTER TABLE t DROP COLUMN gone")
        applied = _applied(pipe, session)
        assert applied.skipped is None, applied.summary()
        assert "renamed b to b2" in applied.columns and "added e" in applied.columns, applied.columns
        _assert_exact(pipe, session, "the transaction")


@pytest.mark.slow
def test_a_rewrite_is_copied_again_by_sync(pg: Database, spark: Any, tmp_path: Path) -> None:
    """``ALTER TYPE … USING`` and a volatile default rewrite the table, whose rows the stream never
    carries: the drain holds the table, ``sync`` copies it again online (no person involved) and the
    mirror equals the source afterwards; ``status`` said why it was held."""
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, a int, b text); INSERT INTO t SELECT g, g, 'b' FROM generate_series(1, 200) g"
    )
    pipe = Pipeline(pg, tmp_path, [TABLE], spark=COMMANDS_SPARK)
    pipe.setup()
    assert pipe.cli("sync").returncode == 0
    for i, ddl in enumerate(
        [
            "ALTER TABLE t ALTER COLUMN a TYPE bigint USING a * 1000 + 1",
            "ALTER TABLE t ADD COLUMN g float8 DEFAULT random()",
        ]
    ):
        pg.execute(f"INSERT INTO t (id, a) VALUES ({300 + i}, 1)")
        pg.execute(ddl)
        pg.execute(f"UPDATE t SET b = 'after' WHERE id % 10 = {i}")
        pipe.drain()
        status = pipe.cli("status").stdout
        assert "rewrote it" in status and "`cdc-assets sync` copies it" in status, status
        synced = pipe.cli("sync")
        assert synced.returncode == 0 and f"copied {TABLE}" in synced.stdout, synced.stdout + synced.stderr
        _assert_exact(pipe, spark, ddl)
        assert "held until" not in pipe.cli("status").stdout


@pytest.mark.slow
def test_an_apply_killed_at_every_step_of_a_migration_loses_and_duplicates_nothing(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    """The real ``apply`` SIGKILLed after each step of moving the mirror's columns (the attnums
    recorded, a column dropped, two swapped through a temporary name, one added and its default
    filled), each time run again until it finishes: the mirror equals the source, and the swapped
    columns kept their values (renamed, never dropped and added again)."""
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, a int, b text, c text, x text, y text);"
        " INSERT INTO t SELECT g, g, 'b' || g, 'c' || g, 'x' || g, 'y' || g FROM generate_series(1, 100) g"
    )
    pipe = Pipeline(pg, tmp_path, [TABLE], spark=COMMANDS_SPARK)
    pipe.setup()
    assert pipe.cli("sync").returncode == 0
    pg.execute("INSERT INTO t (id, a) VALUES (1000, 1)")
    for ddl in (
        "ALTER TABLE t ADD COLUMN e int DEFAULT 7",
        "ALTER TABLE t DROP COLUMN c",
        "ALTER TABLE t RENAME COLUMN x TO tmp",
        "ALTER TABLE t RENAME COLUMN y TO x",
        "ALTER TABLE t RENAME COLUMN tmp TO y",
    ):
        pg.execute(ddl)
    pg.execute("UPDATE t SET a = -a WHERE id % 10 = 0; INSERT INTO t (id, a, e, x) VALUES (1001, 2, 3, 'new')")
    pipe.drain()
    kills = 0
    while (killed := pipe.cli("apply", env={**pipe.environ, FAULT_ENV: "apply-evolve"})).returncode == -9:
        kills += 1
        assert kills < 20, "the apply does not get past its schema changes"
    assert killed.returncode == 0, killed.stderr
    assert kills >= 6, f"killed {kills} times: fewer steps than the migration has"
    for point in ("apply-evolve", "apply-commit"):
        assert pipe.cli("apply", env={**pipe.environ, FAULT_ENV: point}).returncode == 0  # nothing left to do
    _assert_exact(pipe, spark, "the killed applies")
    versions = DeltaTable(pipe.config().target_path(pipe.config().tables[0])).history()
    operations = [v["operation"] for v in versions]
    assert operations.count("RENAME COLUMN") == 3 and operations.count("ADD COLUMNS") == 1, operations


KEYLESS_UPDATE = "UPDATE t SET a = a + 1 WHERE a %% 101 = %s"
"""A write that names no key column (the key is renamed meanwhile): ``%s`` the write's number."""
INSERTS = "UPDATE t SET a = a + 1 WHERE id = %s + 1; INSERT INTO t (id, a) VALUES (%s + 2000000, 0)"
"""Writes of a million-row table: an update of an old key and an insert of a new one."""


@contextmanager
def _writes_meanwhile(dsn: str, statement: str) -> Iterator[None]:
    """Single-statement autocommit writes on another connection while the block runs (``statement``
    with each ``%s`` the write's number); waits until some were made both before and after it."""
    stop, done, errors = threading.Event(), [0], []

    def write() -> None:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                while not stop.is_set():
                    conn.execute(statement.replace("%s", str(done[0])).replace("%%", "%"))
                    done[0] += 1
        except BaseException as error:  # noqa: BLE001 - raised in the test's thread
            errors.append(error)

    thread = threading.Thread(target=write, name="writes-meanwhile")
    thread.start()
    try:
        wait_until(lambda: done[0] >= 20 or errors, 60, "writes before the block")
        yield
        count = done[0]
        wait_until(lambda: done[0] >= count + 20 or errors, 60, "writes after the block")
    finally:
        stop.set()
        thread.join(60)
    assert not errors, errors


@pytest.mark.slow
def test_add_column_default_on_a_million_rows_between_concurrent_writes(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    """``ADD COLUMN … DEFAULT`` of a table of a million rows while another connection writes: the
    mirror reads the default in every old row and each write's own value, with no copy (the table's
    copies stay the initial one)."""
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, a int); INSERT INTO t SELECT g, g FROM generate_series(1, 1000000) g"
    )
    pipe = Pipeline(pg, tmp_path, [TABLE])
    pipe.setup()
    session = spark.newSession()
    with fast_spark(session):
        _applied(pipe, session)
        with _writes_meanwhile(pg.dsn, INSERTS):
            pg.execute("ALTER TABLE t ADD COLUMN e int DEFAULT 7")
        pg.execute("UPDATE t SET e = 8 WHERE id <= 10")
        applied = _applied(pipe, session)
        assert "added e (its default in every row)" in applied.columns, applied.summary()
        assert pipe.checkpoint().tables[TABLE].snapshot_run is None  # no copy was made
        _assert_exact(pipe, session, "ADD COLUMN e int DEFAULT 7")
