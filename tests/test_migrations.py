"""Exact through schema migrations (docs/architecture.md, "Schema migrations"), against real
PostgreSQL, the real drain and real Spark with Delta: each common ``ALTER TABLE`` of a 200-row
table, followed by writes, then a drain and an apply — after each, every column of the Delta table
equals the source by name, read by Spark and by delta-rs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cdc_assets.apply.runner import TableApplied, apply_tables
from tests.support.database import Database
from tests.support.mirror_diff import compare_all, fast_spark, report
from tests.support.pipeline import Pipeline

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
    pipe.drain()
    (applied,) = apply_tables(pipe.config(), spark)
    return applied


def _assert_exact(pipe: Pipeline, spark: Any, what: str) -> None:
    problems = report(compare_all(pipe.config(), pipe.db.dsn, spark))
    assert not problems, f"after {what}:\n{problems}"


def test_each_migration_leaves_the_mirror_equal_to_its_source(pg_any: Database, spark: Any, tmp_path: Path) -> None:
    """The migrations that broke the mirror (a constant, NOT NULL or stable default, a rename, a
    drop and an add of the same name, the key renamed) and those that did not, one after another,
    each between writes: the mirror equals the source by name after each, and renames keep values
    (no column is dropped and added again in Delta)."""
    pg = pg_any
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, a int, b text, c text, d varchar(20));"
        " INSERT INTO t SELECT g, g, 'b' || g, 'c' || g, 'd' FROM generate_series(1, 200) g"
    )
    pipe = Pipeline(pg, tmp_path, [TABLE])
    pipe.setup()
    session = spark.newSession()
    with fast_spark(session):
        assert _applied(pipe, session).skipped is None
        _assert_exact(pipe, session, "the copy")
        for i, (what, ddl) in enumerate(MIGRATIONS):
            n, m = 1000 + 10 * i, i
            pg.execute(WRITES.format(key="id", n=n, m=m))
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


def test_a_rewrite_is_copied_again_by_sync(pg: Database, spark: Any, tmp_path: Path) -> None:
    """``ALTER TYPE … USING`` and a volatile default rewrite the table, whose rows the stream never
    carries: the drain holds the table, ``sync`` copies it again online (no person involved) and the
    mirror equals the source afterwards; ``status`` said why it was held."""
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, a int, b text); INSERT INTO t SELECT g, g, 'b' FROM generate_series(1, 200) g"
    )
    pipe = Pipeline(pg, tmp_path, [TABLE])
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
        assert synced.returncode == 0 and f"copied again {TABLE}" in synced.stdout, synced.stdout + synced.stderr
        _assert_exact(pipe, spark, ddl)
        assert "held until" not in pipe.cli("status").stdout
