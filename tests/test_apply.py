"""Applying the change log to Delta tables through PySpark, end to end: real PostgreSQL, the
library API (``setup`` → ``drain`` → ``apply_tables``) on the shared Spark session, real Delta
tables. Every Delta table is read with Spark and with delta-rs; both must agree and equal the
source as the change log's own value conversion reads it (``tests/support/mirror_diff.py``).

Covered: PostgreSQL's documented row-filter example and every case of the UPDATE
transformation, on a primary key, a composite key and REPLICA IDENTITY FULL; keyed merges with
key changes and unchanged TOAST values that only the Delta table still has; TRUNCATE applied and
ignored; duplicate rows under REPLICA IDENTITY FULL; USING INDEX; keyless tables; exactly-once
(a second apply is skipped, a replayed plan is skipped by Delta); schema changes between and
inside batches; every common column type; the CLI; the MERGE's key range (files of older keys
are never opened by a batch of recent ones); a transaction committed at the copy's consistent point."""

from __future__ import annotations

import dataclasses
import json
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from decimal import Decimal
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable as RustDeltaTable

from cdc_assets.apply.column_types import ColumnTypeError
from cdc_assets.apply.commit_settings import (
    ADAPTIVE_EXECUTION,
    CODEGEN_FACTORY,
    DELETE_DELETION_VECTORS,
    MATERIALIZE_SOURCE,
    MERGE_DELETION_VECTORS,
    SHUFFLE_PARTITIONS,
    SMALL_BATCH_ROWS,
)
from cdc_assets.apply.merge import ApplyError, MergeCounts, _key_bounds, write_plan
from cdc_assets.apply.resolved_jars import DEFAULT_IVY_HOME, record_jars, recorded_jars
from cdc_assets.apply.session import delta_package, hadoop_aws_package, session_settings
from cdc_assets.apply.table_files import table_files
from cdc_assets.apply.target import APPLIED_KEY, delta_target
from cdc_assets.changelog.planner import plan_changes
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.config import SparkConfig
from cdc_assets.errors import CdcError
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.types import FLOAT8, NUMERIC, TIMESTAMPTZ
from cdc_assets.source.lock import TableWriteLock
from tests.support.commit_at_point import setup_committing_at_point
from tests.support.database import Database
from tests.support.mirror import Mirror
from tests.support.mirror_diff import holds_key, rust_rows
from tests.support.pipeline import wait_until
from tests.support.records import INT8, KEY, T0, TEXT, ChangeLog, numeric_modifier, relation
from tests.support.rows import difference


@pytest.fixture
def mirror_of(pg: Database, spark: Any, tmp_path: Path):  # type: ignore[no-untyped-def]
    def make(tables: dict[str, dict[str, Any]], *ddl: str) -> Mirror:
        mirror = Mirror(pg, tmp_path / "mirror", tables, spark)
        mirror.sql(*ddl)
        return mirror

    return make


# -- row filters: PostgreSQL's documentation example, on the consumer side ---------------------------

DOC_FILTER = "a > 5 AND c = 'NSW'"


@pytest.mark.slow
def test_row_filter_documentation_example(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """The example of https://www.postgresql.org/docs/current/logical-replication-row-filter.html
    (section "Examples", publication ``p1 … WHERE (a > 5 AND c = 'NSW')``), reproduced with the
    filter in the configuration: after every sync the Delta table is exactly
    ``SELECT * FROM t WHERE a > 5 AND c = 'NSW'``. Three tables run the same statements: ``t1``
    keyed on ``a``; ``t2`` keyed on ``(a, c)`` as in the documentation, so moving a row to
    another ``c`` is a key change; ``t3`` REPLICA IDENTITY FULL without a key (a multiset)."""
    tables = ["public.t1", "public.t2", "public.t3"]
    mirror = mirror_of(
        {t: {"row_filter": DOC_FILTER} for t in tables},
        "CREATE TABLE t1 (a int PRIMARY KEY, b int, c text)",
        "CREATE TABLE t2 (a int, b int, c text, PRIMARY KEY (a, c))",
        "CREATE TABLE t3 (a int, b int, c text)",
        "ALTER TABLE t3 REPLICA IDENTITY FULL",
    )
    mirror.setup()

    def each(*statements: str) -> None:
        mirror.sql(*[s.format(t=t) for t in ("t1", "t2", "t3") for s in statements])

    def check_all() -> None:
        for table in tables:
            mirror.check(table, where=DOC_FILTER)

    # The documentation's inserts: only (6, 106, 'NSW') and (9, 109, 'NSW') are replicated.
    for a, b, c in [
        (2, 102, "NSW"),
        (3, 103, "QLD"),
        (4, 104, "VIC"),
        (5, 105, "ACT"),
        (6, 106, "NSW"),
        (7, 107, "NT"),
        (8, 108, "QLD"),
        (9, 109, "NSW"),
    ]:
        each(f"INSERT INTO {{t}} VALUES ({a}, {b}, '{c}')")
    applied = mirror.sync()
    assert {t: applied[t].inserted for t in tables} == dict.fromkeys(tables, 2)
    check_all()
    assert sorted((r["a"], r["b"], r["c"]) for r in mirror.check("public.t1", where=DOC_FILTER)) == [
        (6, 106, "NSW"),
        (9, 109, "NSW"),
    ]

    # The documentation's updates: both match → UPDATE; only the new row matches → INSERT;
    # only the old row matches → DELETE.
    each("UPDATE {t} SET b = 999 WHERE a = 6")
    each("UPDATE {t} SET a = 555 WHERE a = 2")
    each("UPDATE {t} SET c = 'VIC' WHERE a = 9")
    applied = mirror.sync()
    assert [(applied[t].inserted, applied[t].updated, applied[t].deleted) for t in ("public.t1", "public.t2")] == [
        (1, 1, 1),
        (1, 1, 1),
    ]
    check_all()
    assert sorted((r["a"], r["b"], r["c"]) for r in mirror.check("public.t1", where=DOC_FILTER)) == [
        (6, 999, "NSW"),
        (555, 102, "NSW"),
    ]

    # Every case again, with key changes, several changes per row in one batch and in one
    # transaction, rows moving in and out of the filter, and deletes on both sides of it.
    each("UPDATE {t} SET b = 0 WHERE a = 3")  # neither matches: nothing
    each("UPDATE {t} SET a = 12, c = 'NSW' WHERE a = 4")  # key change, only new matches: INSERT
    each("UPDATE {t} SET a = 60 WHERE a = 6")  # key change, both match
    each("UPDATE {t} SET a = 1 WHERE a = 555")  # key change, only old matches: DELETE
    each(
        "UPDATE {t} SET c = 'NSW' WHERE a = 7",  # in, then out again, in one transaction
        "UPDATE {t} SET c = 'NT' WHERE a = 7",
    )
    each("UPDATE {t} SET c = 'NSW' WHERE a = 9")  # out (VIC) → in
    each("UPDATE {t} SET b = b + 1 WHERE a = 9")  # … then updated inside
    each("UPDATE {t} SET c = 'NSW', b = 5 WHERE a = 5")  # a = 5 does not match a > 5
    each("DELETE FROM {t} WHERE a = 8")  # a row that never matched
    each(
        "INSERT INTO {t} VALUES (70, 1, 'NSW'), (71, 1, 'NSW')", "DELETE FROM {t} WHERE a = 70"
    )  # a matching row deleted
    mirror.sync()
    check_all()
    assert sorted((r["a"], r["b"], r["c"]) for r in mirror.check("public.t1", where=DOC_FILTER)) == [
        (9, 110, "NSW"),
        (12, 104, "NSW"),
        (60, 999, "NSW"),
        (71, 1, "NSW"),
    ]


# -- keyed merges end to end -------------------------------------------------------------------------

# ~20 kB of random text, different in every row (g: the row's number in the outer query)
BIG = "g::text || (SELECT string_agg(md5(random()::text || g::text || h::text), '') FROM generate_series(1, 640) h)"


def unchanged_columns(mirror: Mirror, table: str, after: int) -> list[tuple[str, list[str] | None]]:
    """(op, unchanged TOAST columns) of the table's change records after ``after``."""
    return [(r["_cdc_op"], r["_cdc_unchanged"]) for r in mirror.records(table) if r["_cdc_end_lsn"] > after]


def test_a_transaction_committed_at_the_consistent_point_reaches_the_mirror(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """The copy's apply records the consistent point ``C`` as the applied LSN; a transaction that
    commits at ``C`` (its commit the WAL record right after the one that made the slot consistent)
    is not in the copy and ends after ``C``, so the next apply brings it."""
    mirror = mirror_of(
        {"public.acct": {}},
        "CREATE TABLE acct (id int PRIMARY KEY, v int NOT NULL) WITH (autovacuum_enabled = false)",
        "INSERT INTO acct SELECT g, g FROM generate_series(1, 50) g",
    )
    committed = setup_committing_at_point(
        mirror.db, mirror.setup, ["INSERT INTO acct VALUES (5000, 0)", "UPDATE acct SET v = -1 WHERE id = 3"]
    )
    point = committed.setup.snapshot_lsn
    mirror.apply()
    assert mirror.applied("public.acct") == point
    mirror.drain()
    logged = ChangeLogReader(mirror.config().changelog.path)
    assert committed.commit_lsn(logged) == point, "another WAL record came first"
    mirror.apply()
    rows = mirror.check("public.acct")
    assert {"id": 5000, "v": 0} in rows and {"id": 3, "v": -1} in rows


@pytest.mark.slow
def test_keyed_merge_end_to_end(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """Inserts, updates with and without key changes, deletes; unchanged out-of-line TOAST values
    that only the Delta table has (same key, old key of a key change, a chain, a swap); TRUNCATE in
    the middle of a batch, applied and ignored; duplicate rows under REPLICA IDENTITY FULL;
    REPLICA IDENTITY USING INDEX; a table without a key."""
    mirror = mirror_of(
        {
            "public.items": {},
            "public.pairs": {},
            "public.tr": {},
            "public.tr_ign": {"truncate": "ignore"},
            "public.dup": {},
            "public.events": {},
            "public.tk": {},
        },
        "CREATE TABLE items (id int PRIMARY KEY, v text, n int, big text)",
        "ALTER TABLE items ALTER COLUMN big SET STORAGE EXTERNAL",
        f"INSERT INTO items SELECT g, 'v' || g, g, {BIG} FROM generate_series(1, 8) g",
        "CREATE TABLE pairs (id int NOT NULL, code text NOT NULL, v text)",
        "CREATE UNIQUE INDEX pairs_code ON pairs (code)",
        "ALTER TABLE pairs REPLICA IDENTITY USING INDEX pairs_code",
        "INSERT INTO pairs VALUES (1, 'a', 'x'), (2, 'b', 'y'), (3, 'c', 'z')",
        "CREATE TABLE tr (id int PRIMARY KEY, v text)",
        "CREATE TABLE tr_ign (id int PRIMARY KEY, v text)",
        "INSERT INTO tr VALUES (1, 'one'), (2, 'two')",
        "INSERT INTO tr_ign VALUES (1, 'one'), (2, 'two')",
        "CREATE TABLE dup (a int, b text)",
        "ALTER TABLE dup REPLICA IDENTITY FULL",
        "INSERT INTO dup VALUES (1, 'x'), (1, 'x'), (2, 'y')",
        "CREATE TABLE events (at int, what text)",
        "INSERT INTO events VALUES (1, 'a'), (1, 'a')",
        # a key stored out of line (2,496 bytes: above the TOAST threshold, below the index limit)
        "CREATE TABLE tk (k text PRIMARY KEY, v int, big text)",
        "ALTER TABLE tk ALTER COLUMN k SET STORAGE EXTERNAL",
        "ALTER TABLE tk ALTER COLUMN big SET STORAGE EXTERNAL",
        f"INSERT INTO tk SELECT (SELECT string_agg(md5((g * 100 + h)::text), '') FROM generate_series(1, 78) h), g, {BIG}"
        " FROM generate_series(1, 2) g",
    )
    mirror.setup()
    first = mirror.apply()
    assert {t: r.inserted for t, r in first.items()} == {
        "public.items": 8,
        "public.pairs": 3,
        "public.tr": 2,
        "public.tr_ign": 2,
        "public.dup": 3,
        "public.events": 2,
        "public.tk": 2,
    }
    for table in ("public.items", "public.dup"):
        mirror.check(table)
    snapshot_lsn = mirror.checkpoint_lsn()

    # Sync 1: the TOAST column of items is never sent again; every value comes from Delta.
    mirror.sql("UPDATE items SET v = 'one' WHERE id = 1")  # same key
    mirror.sql("UPDATE items SET id = 20 WHERE id = 2")  # key change
    mirror.sql("UPDATE items SET id = 30 WHERE id = 3", "UPDATE items SET id = 31, n = 31 WHERE id = 30")  # chain
    mirror.sql(
        "UPDATE items SET id = 99 WHERE id = 4",
        "UPDATE items SET id = 4 WHERE id = 5",
        "UPDATE items SET id = 5 WHERE id = 99",
    )  # swap 4 ↔ 5
    mirror.sql("DELETE FROM items WHERE id = 6")
    mirror.sql("DELETE FROM items WHERE id = 7", "INSERT INTO items VALUES (7, 'again', 7, 'short')")  # inline now
    mirror.sql("UPDATE items SET n = 70 WHERE id = 7")
    mirror.sql(
        f"INSERT INTO items SELECT 9, 'nine', 9, {BIG} FROM (SELECT 9 AS g) s", "UPDATE items SET n = 90 WHERE id = 9"
    )  # filled from the batch
    mirror.sql("UPDATE items SET big = 'inline now' WHERE id = 8", "UPDATE items SET v = 'eight' WHERE id = 8")

    mirror.sql("UPDATE pairs SET v = 'x2' WHERE code = 'a'")
    mirror.sql("UPDATE pairs SET code = 'bb' WHERE code = 'b'")  # key change of USING INDEX
    mirror.sql("DELETE FROM pairs WHERE code = 'c'", "INSERT INTO pairs VALUES (4, 'c', 'reused key')")
    mirror.sql("UPDATE pairs SET id = 10 WHERE code = 'a'")

    for t in ("tr", "tr_ign"):
        mirror.sql(f"INSERT INTO {t} VALUES (3, 'three')", f"UPDATE {t} SET v = 'one!' WHERE id = 1")
    mirror.sql(
        "INSERT INTO tr VALUES (6, 'six')",
        "INSERT INTO tr_ign VALUES (6, 'six')",
        "TRUNCATE tr, tr_ign",  # one TRUNCATE of both
        "INSERT INTO tr VALUES (4, 'four')",
        "INSERT INTO tr_ign VALUES (4, 'four')",
    )
    for t in ("tr", "tr_ign"):
        mirror.sql(f"UPDATE {t} SET v = 'four!' WHERE id = 4", f"INSERT INTO {t} VALUES (5, 'five')")

    mirror.sql("DELETE FROM dup WHERE ctid = (SELECT min(ctid) FROM dup WHERE a = 1)")  # one of two equal rows
    mirror.sql("UPDATE dup SET b = 'z' WHERE a = 2", "INSERT INTO dup VALUES (3, 'w'), (3, 'w')")
    mirror.sql("INSERT INTO events VALUES (2, 'b'), (1, 'a')")
    mirror.sql("UPDATE tk SET v = v + 10")  # key and big sent as unchanged TOAST
    applied = mirror.sync()

    # The change log really sent 'u' for these updates (so the values came from Delta).
    sent = unchanged_columns(mirror, "public.items", snapshot_lsn)
    assert sent.count(("update", ["big"])) == 8, sent
    assert unchanged_columns(mirror, "public.tk", snapshot_lsn) == [("update", ["k", "big"])] * 2
    for table in ("public.items", "public.pairs", "public.tr", "public.dup", "public.events", "public.tk"):
        mirror.check(table)
    mirror.check(
        "public.tr_ign",
        expected=[
            {"id": 1, "v": "one!"},
            {"id": 2, "v": "two"},
            {"id": 3, "v": "three"},
            {"id": 4, "v": "four!"},
            {"id": 5, "v": "five"},
            {"id": 6, "v": "six"},
        ],
    )
    assert applied["public.tr"].deleted == 2  # emptied: the two rows it held
    assert applied["public.events"].inserted == 2

    # Sync 2: values filled in sync 1 are filled again from Delta; a key change back; the second
    # duplicate goes; the last copy of a row goes.
    before = mirror.checkpoint_lsn()
    mirror.sql("UPDATE items SET n = n + 100 WHERE id IN (1, 4, 5, 7, 9, 31)")
    mirror.sql("UPDATE items SET id = 2 WHERE id = 20")
    mirror.sql("DELETE FROM dup WHERE ctid = (SELECT min(ctid) FROM dup WHERE a = 3)", "DELETE FROM dup WHERE a = 1")
    applied = mirror.sync()
    assert unchanged_columns(mirror, "public.items", before).count(("update", ["big"])) == 6
    assert {t for t, r in applied.items() if r.skipped} == {
        "public.pairs",
        "public.tr",
        "public.tr_ign",
        "public.events",
        "public.tk",
    }
    assert all(r.skipped == "no changes" for t, r in applied.items() if r.skipped)
    mirror.check("public.items")
    assert sorted((r["a"], r["b"]) for r in mirror.check("public.dup")) == [(2, "z"), (3, "w")]


# -- exactly once ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_exactly_once(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """A second apply on the same checkpoint is skipped and writes no Delta version; a plan
    written twice for the same LSN (a crash after the write, before anything else noticed) is
    applied once — for merges, multiset merges, appends and truncating overwrites; and Delta's
    own idempotent-write marker skips any commit at or below the applied LSN."""
    tables = ["public.k", "public.f", "public.a"]
    mirror = mirror_of(
        {t: {} for t in tables},
        "CREATE TABLE k (id int PRIMARY KEY, v text)",
        "CREATE TABLE f (a int, b text)",
        "ALTER TABLE f REPLICA IDENTITY FULL",
        "CREATE TABLE a (at int, what text)",
        "INSERT INTO k VALUES (1, 'a'), (2, 'b')",
        "INSERT INTO f VALUES (1, 'x'), (1, 'x'), (2, 'y')",
        "INSERT INTO a VALUES (1, 'a')",
    )
    mirror.setup()
    mirror.apply()
    mirror.sql("UPDATE k SET v = 'a2' WHERE id = 1", "DELETE FROM k WHERE id = 2", "INSERT INTO k VALUES (3, 'c')")
    mirror.sql("DELETE FROM f WHERE a = 1", "INSERT INTO f VALUES (5, 'q')")  # both copies: -2
    mirror.sql("INSERT INTO a VALUES (2, 'b'), (2, 'b')")
    first = mirror.sync()
    checkpoint = mirror.checkpoint_lsn()
    assert all(r.skipped is None and r.applied_lsn == checkpoint for r in first.values())
    versions = {t: mirror.version(t) for t in tables}

    again = mirror.apply()
    assert {t: r.skipped for t, r in again.items()} == dict.fromkeys(tables, "up to date")
    assert {t: mirror.version(t) for t in tables} == versions
    for table in tables:
        mirror.check(table)

    # A crash between the write of a plan and the next run: the same plan is written again.
    mirror.sql("TRUNCATE k", "INSERT INTO k VALUES (7, 'after the truncate')")
    mirror.sql("DELETE FROM f WHERE a = 5", "INSERT INTO f VALUES (2, 'y')")
    mirror.sql("INSERT INTO a VALUES (3, 'c')")
    mirror.drain()
    for table in tables:
        target, plan, lsn = mirror.pending_plan(table)
        assert plan.mode == {"public.k": "keyed", "public.f": "multiset", "public.a": "append"}[table]
        assert plan.truncate is (table == "public.k")
        counts = write_plan(target, plan, lsn)
        assert (counts.inserted, counts.deleted) != (0, 0)
        version = mirror.version(table)
        assert version == versions[table] + 1 and target.applied_lsn() == lsn
        rows = mirror.check(table)
        replay = write_plan(target, plan, lsn)
        assert (replay.inserted, replay.updated, replay.deleted) == (0, 0, 0)
        assert mirror.version(table) == version and target.applied_lsn() == lsn
        assert not difference(mirror.check(table), rows)
    assert {t: r.skipped for t, r in mirror.apply().items()} == dict.fromkeys(tables, "up to date")

    # Delta's own guard, under the apply code: a commit at the applied LSN or below is skipped.
    target = delta_target(mirror.config(), mirror.config().table("public.a"), mirror.spark)
    version, rows = mirror.version("public.a"), mirror.delta("public.a")
    for lsn in (target.applied_lsn(), 1):
        double = f"INSERT INTO {target.sql_name} SELECT * FROM {{}}"  # would double every row
        target.commit(double.format, target.read(), lsn, batch_rows=0)
    assert mirror.version("public.a") == version
    assert not difference(mirror.delta("public.a"), rows)


# -- file skipping -------------------------------------------------------------------------------------


def data_files(path: str) -> list[Path]:
    """A Delta table's Parquet files (column mapping puts them in random-prefix folders)."""
    return sorted(f for f in Path(path).rglob("*.parquet") if "_delta_log" not in f.parts)


@contextmanager
def damaged(files: dict[Path, bytes]) -> Iterator[None]:
    """``files`` overwritten with junk for the duration (any read of them fails), then restored."""
    for path in files:
        path.write_bytes(b"not parquet" * 100)
    try:
        yield
    finally:
        for path, content in files.items():
            path.write_bytes(content)


@pytest.mark.slow
def test_merge_of_recent_keys_never_opens_the_files_of_older_keys(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """A batch that changes only recent keys of a serial key reads only the files that can hold
    them: the MERGE carries the batch's key range, and Delta skips every file whose statistics lie
    outside it. Shown by damaging the older files (any read of them fails) during the apply. (A
    Spark MERGE's: a table this small is otherwise written by delta-rs, which reads it whole.)"""
    mirror = mirror_of(
        {"public.ev": {}},
        "CREATE TABLE ev (id bigint PRIMARY KEY, note text)",
        "INSERT INTO ev SELECT g, 'old ' || g FROM generate_series(1, 1000) g",
    )
    mirror.warehouse = {"small_table_writer": "spark"}
    mirror.write_config()
    mirror.setup()
    mirror.apply()
    path = mirror.path("public.ev")
    older = {f: f.read_bytes() for f in data_files(path)}
    mirror.sql("INSERT INTO ev SELECT g, 'new ' || g FROM generate_series(1001, 1100) g")
    assert mirror.sync()["public.ev"].inserted == 100
    assert set(data_files(path)) > set(older)

    mirror.sql(
        "UPDATE ev SET note = 'changed' WHERE id BETWEEN 1001 AND 1040",
        "DELETE FROM ev WHERE id BETWEEN 1041 AND 1050",
        "INSERT INTO ev SELECT g, 'newer ' || g FROM generate_series(1101, 1120) g",
    )
    mirror.drain()
    with damaged(older):
        with pytest.raises(Exception, match=r"(?i)parquet"):
            mirror.spark.read.format("delta").load(path).select("note").collect()
        applied = mirror.apply()["public.ev"]
    assert (applied.inserted, applied.updated, applied.deleted) == (20, 40, 10)
    mirror.check("public.ev")

    # A change to an old key needs an older file: the damage is real.
    mirror.sql("UPDATE ev SET note = 'old, changed' WHERE id = 5")
    mirror.drain()
    with damaged(older), pytest.raises(Exception, match=r"(?i)parquet"):
        mirror.apply()
    mirror.apply()
    mirror.check("public.ev")


@pytest.mark.slow
def test_a_batch_of_upserts_replaces_the_rows_under_its_keys(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """A keyed batch of inserts and updates without a delete, on a table Spark writes with deletion
    vectors, is one REPLACE ON (the old rows of its keys deleted, its rows appended as one file) with
    the applied LSN; replayed, Delta skips it; a batch that deletes is a MERGE again; a row-filtered
    table keeps its MERGE (PostgreSQL's UPDATE transformation), and so does a table with Delta's
    change data feed."""
    mirror = mirror_of(
        {"public.up": {}, "public.upf": {"row_filter": "v <> 'hidden'"}},
        "CREATE TABLE up (a int, b text, v text, PRIMARY KEY (a, b))",
        "INSERT INTO up SELECT g, 'k' || g % 3, 'v' || g FROM generate_series(1, 60) g",
        "CREATE TABLE upf (id int PRIMARY KEY, v text)",
        "INSERT INTO upf SELECT g, 'v' || g FROM generate_series(1, 10) g",
    )
    mirror.warehouse = {"small_table_mb": 0}  # Spark's commits, deletion vectors
    mirror.write_config()
    mirror.setup()
    mirror.apply()
    mirror.sql(
        "UPDATE up SET v = 'changed' WHERE a % 7 = 0",
        "INSERT INTO up VALUES (61, 'k1', 'new'), (62, 'k2', NULL)",
        "UPDATE up SET v = 'twice' WHERE a = 61",
        "UPDATE upf SET v = 'hidden' WHERE id = 3",
    )
    mirror.drain()
    target, plan, lsn = mirror.pending_plan("public.up")
    before, files = mirror.version("public.up"), table_files(target.path).files
    counts = write_plan(target, plan, lsn)
    assert counts == MergeCounts(2, 8, 0, "REPLACE ON")
    assert mirror.version("public.up") == before + 1 and target.applied_lsn() == lsn
    after = table_files(target.path)
    assert committed_by(target.path) == "spark" and after.deletion_vectors >= 1
    assert after.files == files + 1  # the batch's rows in one file (the marked files stay)
    rows = mirror.check("public.up")
    empty = mirror.spark.createDataFrame([], target.read().schema)
    target.replace(empty, "t.a = s.a", lsn, batch_rows=0)  # Delta's own skip of a replay
    assert mirror.version("public.up") == before + 1
    assert not difference(mirror.check("public.up"), rows)
    assert mirror.apply()["public.upf"].write == "MERGE"  # the update left the filter: a delete
    mirror.check("public.upf", where="v <> 'hidden'")

    mirror.sql("DELETE FROM up WHERE a = 1", "UPDATE up SET v = 'again' WHERE a = 2")
    assert mirror.sync()["public.up"].write == "MERGE (matched only)"
    mirror.check("public.up")

    # A table with Delta's change data feed keeps the MERGE: its feed shows updates as updates.
    mirror.spark.sql(f"ALTER TABLE delta.`{target.path}` SET TBLPROPERTIES (delta.enableChangeDataFeed = true)")
    mirror.sql("UPDATE up SET v = 'fed' WHERE a = 3")
    assert mirror.sync()["public.up"].write == "MERGE (matched only)"
    mirror.check("public.up")


def test_a_small_table_is_merged_without_deletion_vectors_or_generated_code(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """Below ``warehouse.small_table_mb`` a Spark commit (``small_table_writer: spark``; an UPDATE is
    a REPLACE ON) rewrites the file it changes instead of writing a deletion vector, a small batch runs without generated
    code, and the session's settings are as before afterwards; with the setting at 0 the same kind
    of MERGE writes a deletion vector."""
    mirror = mirror_of(
        {"public.sm": {}},
        "CREATE TABLE sm (id int PRIMARY KEY, v text)",
        "INSERT INTO sm SELECT g, 'v' || g FROM generate_series(1, 100) g",
    )
    mirror.warehouse = {"small_table_writer": "spark"}
    mirror.write_config()
    mirror.setup()
    mirror.apply()
    config = mirror.config()
    target = delta_target(config, config.table("public.sm"), mirror.spark)
    planned = {
        MERGE_DELETION_VECTORS: "false",
        DELETE_DELETION_VECTORS: "false",
        ADAPTIVE_EXECUTION: "false",
        SHUFFLE_PARTITIONS: "1",
    }
    assert target.small_commit_settings(5) == planned | {CODEGEN_FACTORY: "NO_CODEGEN"}
    assert target.small_commit_settings(SMALL_BATCH_ROWS) == planned
    assert target.small_commit_settings(SMALL_BATCH_ROWS, local_source=True) == planned | {MATERIALIZE_SOURCE: "none"}
    partitions = mirror.spark.conf.get(SHUFFLE_PARTITIONS)
    mirror.sql("UPDATE sm SET v = 'changed' WHERE id = 7")
    applied = mirror.sync()["public.sm"]
    assert (applied.inserted, applied.updated, applied.deleted, applied.write) == (0, 1, 0, "REPLACE ON")
    assert committed_by(target.path) == "spark"
    assert table_files(target.path).deletion_vectors == 0
    assert mirror.spark.conf.get(CODEGEN_FACTORY) == "FALLBACK"  # Spark's default: the commit's own setting is gone
    assert mirror.spark.conf.get(SHUFFLE_PARTITIONS) == partitions  # the session's own setting is back

    mirror.warehouse = {"small_table_mb": 0}
    mirror.write_config()
    config = mirror.config()
    assert delta_target(config, config.table("public.sm"), mirror.spark).small_commit_settings(5) == {}
    mirror.sql("UPDATE sm SET v = 'again' WHERE id = 8")
    assert mirror.sync()["public.sm"].updated == 1
    assert table_files(target.path).deletion_vectors == 1
    mirror.check("public.sm")


def committed_by(path: str) -> str:
    """Which engine made the Delta table's latest commit: ``delta-rs`` or ``spark``."""
    commit = RustDeltaTable(path).history(1)[0]
    if str(commit.get("clientVersion", "")).startswith("delta-rs"):
        return "delta-rs"
    assert "Apache-Spark" in str(commit.get("engineInfo")), commit
    return "spark"


@pytest.mark.slow
def test_a_small_tables_plain_batches_are_committed_by_delta_rs_in_the_apply_process(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """Below ``warehouse.small_table_mb`` a keyed batch with no TOAST value to fill and no row
    filter is one delta-rs commit made by the apply itself (no Spark job), with the applied LSN,
    the counts and the table a Spark MERGE gives — a ``NaN`` key (kept as null) matched null-safe;
    a keyless table's rows appended so; a row-filtered table's batch still Spark's, as is one into a
    table with a writer feature delta-rs is not trusted with, and every batch with
    ``small_table_writer: spark``."""
    mirror = mirror_of(
        {"public.nk": {}, "public.lg": {}, "public.fl": {"row_filter": "v <> 'hidden'"}},
        "CREATE TABLE nk (id numeric PRIMARY KEY, v text)",
        "INSERT INTO nk VALUES ('NaN', 'a'), (1.5, 'b'), (2, 'c')",
        "CREATE TABLE lg (at int, note text)",
        "CREATE TABLE fl (id int PRIMARY KEY, v text)",
    )
    mirror.setup()
    mirror.apply()
    path = mirror.path("public.nk")
    jobs = mirror.spark.sparkContext.statusTracker()
    mirror.sql(
        "UPDATE nk SET v = 'changed' WHERE id = 'NaN'",
        "UPDATE nk SET v = 'x' WHERE id = 1.5",
        "INSERT INTO nk VALUES (3, 'd')",
        "INSERT INTO lg VALUES (1, 'one'), (1, 'one')",
        "INSERT INTO fl VALUES (1, 'shown'), (2, 'hidden')",
    )
    mirror.drain()
    before = jobs.getJobIdsForGroup(None)
    applied = {t: mirror.apply([t])[t] for t in ("public.nk", "public.lg")}
    assert set(jobs.getJobIdsForGroup(None)) == set(before)  # no Spark job ran
    assert (applied["public.nk"].inserted, applied["public.nk"].updated, applied["public.nk"].write) == (1, 2, "MERGE")
    assert (applied["public.lg"].inserted, applied["public.lg"].write) == (2, "append")
    assert committed_by(path) == committed_by(mirror.path("public.lg")) == "delta-rs"
    assert applied["public.nk"].applied_lsn == mirror.checkpoint_lsn()
    metadata = json.loads(RustDeltaTable(path).history(1)[0]["userMetadata"])  # as a Spark commit records it
    assert metadata == {APPLIED_KEY: mirror.checkpoint_lsn()}
    assert mirror.apply()["public.fl"].inserted == 1
    assert committed_by(mirror.path("public.fl")) == "spark"
    mirror.sql("DELETE FROM nk WHERE id = 'NaN'", "UPDATE nk SET v = 'y' WHERE id = 2")
    applied["public.nk"] = mirror.sync()["public.nk"]
    assert (applied["public.nk"].updated, applied["public.nk"].deleted) == (1, 1)
    assert committed_by(path) == "delta-rs"
    mirror.check("public.nk")
    mirror.check("public.lg")
    mirror.check("public.fl", where="v <> 'hidden'")

    # A file delta-rs cannot read: an error naming the table's path, no commit; then applied whole.
    mirror.sql("UPDATE nk SET v = 'z' WHERE id = 1.5")
    mirror.drain()
    version = mirror.version("public.nk")
    failure = rf"cannot write the Delta table at {re.escape(path)} with delta-rs: "
    with damaged({f: f.read_bytes() for f in data_files(path)}), pytest.raises(CdcError, match=failure):
        mirror.apply(["public.nk"])
    assert mirror.version("public.nk") == version
    assert mirror.apply(["public.nk"])["public.nk"].updated == 1
    mirror.check("public.nk")

    # A writer feature beyond those of the tables cdc-assets creates: Spark's to write.
    mirror.spark.sql(f"ALTER TABLE delta.`{path}` SET TBLPROPERTIES ('delta.enableChangeDataFeed' = 'true')")
    mirror.sql("UPDATE nk SET v = 'feed' WHERE id = 1.5")
    assert mirror.sync()["public.nk"].updated == 1
    assert committed_by(path) == "spark"
    mirror.check("public.nk")

    mirror.warehouse = {"small_table_writer": "spark"}
    mirror.write_config()
    mirror.sql("UPDATE nk SET v = 'spark' WHERE id = 3")
    assert mirror.sync()["public.nk"].updated == 1
    assert committed_by(path) == "spark"
    mirror.check("public.nk")


def test_a_multiset_table_missing_copies_the_log_deletes_fails_its_merge_and_commits_nothing(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """A REPLICA IDENTITY FULL table whose Delta table lost the copies of a row that the change log
    then deletes: the apply fails with an error naming the table, and the Delta table is as it was
    (the check is part of the MERGE, which fails before its commit)."""
    mirror = mirror_of(
        {"public.bag": {}},
        "CREATE TABLE bag (id int, v text)",
        "ALTER TABLE bag REPLICA IDENTITY FULL",
        "INSERT INTO bag SELECT g % 5, 'v' FROM generate_series(1, 20) g",
    )
    mirror.setup()
    mirror.apply()
    path = mirror.path("public.bag")
    mirror.spark.sql(f"DELETE FROM delta.`{path}` WHERE id = 3").collect()  # the damage: not a change of the log
    version, applied = mirror.version("public.bag"), mirror.applied("public.bag")
    mirror.sql("DELETE FROM bag WHERE id = 3", "INSERT INTO bag VALUES (9, 'new')")
    mirror.drain()
    with pytest.raises(ApplyError, match=r"public\.bag: the change log deletes more copies of a row than the Delta"):
        mirror.apply()
    assert (mirror.version("public.bag"), mirror.applied("public.bag")) == (version, applied)


@pytest.mark.slow
def test_key_range_only_for_keys_ordered_alike_in_arrow_spark_and_delta(spark) -> None:  # type: ignore[no-untyped-def]
    """The range covers every key of the plan, deleted ones included, and exists only where the
    first key column's order is the same in Arrow, Spark and Delta's statistics and no key is
    null (a numeric NaN is kept as null beside its text)."""

    def bounds(type_oid: int, *keys: Any) -> str | None:
        rel = relation("t", ("k", type_oid, KEY), ("v", TEXT))
        if type_oid == NUMERIC:  # numeric(12, 2): decimal128 in the change log (unconstrained: text)
            key = dataclasses.replace(rel.columns[0], type_modifier=numeric_modifier(12, 2))
            rel = dataclasses.replace(rel, columns=(key, *rel.columns[1:]))
        log = ChangeLog(rel)
        for key in keys[:-1]:
            log.insert({"k": key, "v": "x"})
        log.delete({"k": keys[-1]})
        found = _key_bounds(plan_changes([log.chunk()], log.relation))
        return None if found is None else str(found)

    assert bounds(INT8, 7, -3, 40) == "t.`k` >= -3L AND t.`k` <= 40L"
    assert bounds(TEXT, "m", "b", "zz") == "t.`k` >= 'b' AND t.`k` <= 'zz'"
    assert (
        bounds(NUMERIC, Decimal("1.5"), Decimal("-2"), Decimal("3"))
        == "t.`k` >= CAST('-2.00' AS DECIMAL(12, 2)) AND t.`k` <= CAST('3.00' AS DECIMAL(12, 2))"
    )
    # every text key is its own literal, whatever quotes and backslashes it holds
    awkward = ["it's", "back\\slash\\", "\\'", "new\nline", "ünï", "' OR 1=1 --"]
    for text in awkward:
        found = bounds(TEXT, text, text, text)
        assert found is not None
        literal = found.split(" >= ", 1)[1].split(" AND t.", 1)[0]
        assert spark.sql(f"SELECT {literal} AS k").collect()[0]["k"] == text, (text, literal)
    assert bounds(NUMERIC, Decimal("1.5"), None, Decimal("3")) is None
    assert bounds(FLOAT8, 1.0, 2.0, 3.0) is None
    assert bounds(TIMESTAMPTZ, T0, T0, T0) is None


# -- schema changes ----------------------------------------------------------------------------------


def delta_types(mirror: Mirror, table: str) -> dict[str, str]:
    return {
        f.name: f.dataType.simpleString() for f in mirror.spark.read.format("delta").load(mirror.path(table)).schema
    }


@pytest.mark.slow
def test_schema_changes_between_and_inside_batches(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """ADD COLUMN, DROP COLUMN, ALTER COLUMN TYPE int → bigint and varchar(10) → text: between
    syncs (``ev``) and all inside one batch (``ev1``); the Delta schema follows and the data
    equals the source after every sync."""
    mirror = mirror_of(
        {"public.ev": {}, "public.ev1": {}},
        *[
            statement
            for t in ("ev", "ev1")
            for statement in (
                f"CREATE TABLE {t} (id int PRIMARY KEY, n int, s varchar(10), d text)",
                f"INSERT INTO {t} VALUES (1, 1, 'one', 'd1'), (2, 2, 'two', 'd2')",
            )
        ],
    )
    mirror.setup()
    mirror.apply()
    assert delta_types(mirror, "public.ev") == {
        "id": "int",
        "n": "int",
        "s": "string",
        "d": "string",
        "_cdc_lsn": "bigint",
        "_cdc_commit_time": "timestamp",
    }

    # Sync 1: ev gets a column; ev1 goes through every change in one batch, with rows in between.
    mirror.sql("ALTER TABLE ev ADD COLUMN extra text")
    mirror.sql("INSERT INTO ev VALUES (3, 3, 'three', 'd3', 'x3')", "UPDATE ev SET extra = 'x1' WHERE id = 1")
    mirror.sql("UPDATE ev1 SET n = 10 WHERE id = 1")
    mirror.sql("ALTER TABLE ev1 ADD COLUMN extra text")
    mirror.sql("INSERT INTO ev1 VALUES (3, 3, 'three', 'd3', 'x3')")
    mirror.sql("ALTER TABLE ev1 DROP COLUMN d")
    mirror.sql("UPDATE ev1 SET extra = 'x2' WHERE id = 2")
    mirror.sql("ALTER TABLE ev1 ALTER COLUMN n TYPE bigint")
    mirror.sql("UPDATE ev1 SET n = 1099511627776 WHERE id = 3")
    mirror.sql("ALTER TABLE ev1 ALTER COLUMN s TYPE text")
    mirror.sql("INSERT INTO ev1 VALUES (4, -1099511627776, 'longer than ten characters', 'x4')")
    mirror.sync()
    mirror.check("public.ev")
    mirror.check("public.ev1")
    assert delta_types(mirror, "public.ev")["extra"] == "string"
    assert delta_types(mirror, "public.ev1") == {
        "id": "int",
        "n": "bigint",
        "s": "string",
        "extra": "string",
        "_cdc_lsn": "bigint",
        "_cdc_commit_time": "timestamp",
    }

    # Sync 2: a column dropped between syncs.
    mirror.sql("ALTER TABLE ev DROP COLUMN d")
    mirror.sql("UPDATE ev SET n = 20 WHERE id = 2")
    mirror.sync()
    mirror.check("public.ev")
    assert "d" not in delta_types(mirror, "public.ev")

    # Sync 3: types changed between syncs; the old rows keep their values in the new type.
    mirror.sql("ALTER TABLE ev ALTER COLUMN n TYPE bigint")
    mirror.sql("UPDATE ev SET n = 1099511627776 WHERE id = 3")
    mirror.sql("ALTER TABLE ev ALTER COLUMN s TYPE text")
    mirror.sql("INSERT INTO ev VALUES (4, 4, 'longer than ten characters', 'x4')")
    mirror.sync()
    rows = mirror.check("public.ev")
    assert delta_types(mirror, "public.ev") == {
        "id": "int",
        "n": "bigint",
        "s": "string",
        "extra": "string",
        "_cdc_lsn": "bigint",
        "_cdc_commit_time": "timestamp",
    }
    assert sorted((r["id"], r["n"]) for r in rows) == [(1, 1), (2, 20), (3, 1099511627776), (4, 4)]


# -- types -------------------------------------------------------------------------------------------

TYPED_COLUMNS = """
    e mood, a1 int[], a2 text[][], j json, jb jsonb, num numeric(12,3), un numeric,
    tz timestamptz, ts timestamp, d date, t time, ttz timetz, iv interval, by bytea, u uuid,
    b bool, f8 float8, f4 real, i2 smallint, i8 bigint, vc varchar(5)
"""
TYPED_ROWS = [
    # every column set
    (
        "('happy', '{1,2,NULL}', '{{a,b},{\"c d\",NULL}}', '{\"k\": [1, 2.5]}', '{\"b\": 1, \"a\": null}', -123456789.123,"
        " '3.14159265358979323846264338327950288', '2024-02-29 12:34:56.789012+05:30', '1999-12-31 23:59:59.123456',"
        " '2024-02-29', '23:59:59.999999', '12:34:56.5-08', '1 year 2 mons 3 days 04:05:06.5', '\\x00ff10',"
        " 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11', true, 1.5e300, 0.1, -32768, 9223372036854775807, 'ab  ')"
    ),
    # every column NULL
    (
        "(NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL,"
        " NULL, NULL, NULL)"
    ),
    # special floats, empty arrays, negative and odd values
    (
        "('sad', '{}', '{}', '[]', '{}', 0, 'NaN', '1970-01-01 00:00:00+00', '1500-03-01 00:00:00', '1500-03-01',"
        " '00:00:00', '00:00:00+05:53:28', '-1 days +02:03:04.000001', '', '00000000-0000-0000-0000-000000000000',"
        " false, 'NaN', 'Infinity', 0, -1, '')"
    ),
    (
        "('ok', '{-2147483648}', '{{\"\"}}', '\"text\"', '[1, \"two\", {\"3\": null}]', 999999999.999, '-1e-30',"
        " '2262-04-11 23:47:16.854775+00', '0001-01-01 00:00:00', '9999-12-31', '12:00:00', '23:59:59+14',"
        " '-178000000 years', '\\x5c', 'ffffffff-ffff-ffff-ffff-ffffffffffff', NULL, '-Infinity', '-0', 1, 0, 'z')"
    ),
]


@pytest.mark.slow
def test_column_types(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """Every common type, through the snapshot and through changes, keyed (``ty``) and as a
    REPLICA IDENTITY FULL multiset (``tyf``, whose rows are matched on all these columns): the
    values Spark and delta-rs read equal the source's values converted the way the change log
    and the apply convert them."""
    mirror = mirror_of(
        {"public.ty": {}, "public.tyf": {}},
        "CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy')",
        f"CREATE TABLE ty (id int PRIMARY KEY, {TYPED_COLUMNS})",
        f"CREATE TABLE tyf (id int, {TYPED_COLUMNS})",
        "ALTER TABLE tyf REPLICA IDENTITY FULL",
        *[f"INSERT INTO {t} VALUES ({i}, {row[1:]}" for t in ("ty", "tyf") for i, row in enumerate(TYPED_ROWS[:2])],
    )
    mirror.setup()
    mirror.apply()
    for i, row in enumerate(TYPED_ROWS):
        mirror.sql(*[f"INSERT INTO {t} VALUES ({10 + i}, {row[1:]}" for t in ("ty", "tyf")])
    mirror.sql("INSERT INTO tyf SELECT * FROM tyf WHERE id = 12")  # a duplicate row with NaN and infinities
    for t in ("ty", "tyf"):
        mirror.sql(
            f"UPDATE {t} SET (e, a1, a2, j, jb, num, un, tz, ts, d, t, ttz, iv, by, u, b, f8, f4, i2, i8, vc) ="
            f" (SELECT e, a1, a2, j, jb, num, un, tz, ts, d, t, ttz, iv, by, u, b, f8, f4, i2, i8, vc"
            f" FROM {t} WHERE id = 12 LIMIT 1) WHERE id = 0"
        )
        mirror.sql(f"UPDATE {t} SET (e, a1, tz, iv, f8) = ('ok', '{{7}}', now(), '1 day', 2.5) WHERE id = 1")
        mirror.sql(f"DELETE FROM {t} WHERE id = 13")
    mirror.sql("DELETE FROM tyf WHERE ctid = (SELECT min(ctid) FROM tyf WHERE id = 12)")  # one of the two NaN rows
    mirror.sync()
    keyed = mirror.check("public.ty")
    assert len(keyed) == 5
    multiset = mirror.check("public.tyf")
    assert sorted(r["id"] for r in multiset) == [0, 1, 10, 11, 12]
    nan_row = next(r for r in keyed if r["id"] == 12)
    assert nan_row["f8"] != nan_row["f8"] and nan_row["f4"] == float("inf") and nan_row["un"] == "NaN"
    full_row = next(r for r in keyed if r["id"] == 10)
    assert full_row["iv"] == {"months": 14, "days": 3, "microseconds": 14706500000}
    assert full_row["ttz"] == "12:34:56.500000-08:00" and full_row["t"] == "23:59:59.999999"
    assert full_row["a2"] == [["a", "b"], ["c d", None]]


@pytest.mark.slow
def test_a_column_is_retyped_only_when_its_source_type_changes(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """A change-log segment whose ``score`` (a domain over integer) was decoded as text while the
    source type stayed the same — what a drain that lost the domain's base type wrote — is refused:
    the table is stopped with an error naming the column, both types and the LSN, its Delta table
    keeps its type and data, and the other table is applied — by ``apply``, and by a following
    ``sync``, which goes on merging the other table and exits with the error. A copy of the table
    repairs it. A type the source changed (``ALTER COLUMN … TYPE``) still reaches Delta."""
    mirror = mirror_of(
        {"public.acc": {}, "public.other": {}},
        "CREATE DOMAIN posint AS integer CHECK (value > 0)",
        "CREATE TABLE acc (id int PRIMARY KEY, score posint)",
        "CREATE TABLE other (id int PRIMARY KEY, v text)",
        "INSERT INTO acc VALUES (1, 10), (2, 20)",
    )
    mirror.setup()
    mirror.apply()
    mirror.sql("INSERT INTO acc VALUES (3, 30)", "INSERT INTO other VALUES (1, 'one')")
    mirror.drain()
    end_lsn = _retype_newest_segment(mirror, "public.acc", "score", pa.string())
    version = mirror.version("public.acc")
    with pytest.raises(ColumnTypeError) as refused:
        mirror.apply()
    message = str(refused.value)
    assert f"public.acc: column score would change type from int to string at LSN {format_lsn(end_lsn)}" in message
    assert "its source type (type OID" in message and "cdc-assets snapshot public.acc" in message
    assert mirror.version("public.acc") == version and delta_types(mirror, "public.acc")["score"] == "int"
    mirror.check("public.other")
    mirror.sql("INSERT INTO other VALUES (2, 'two')")  # a following sync merges it, acc stays stopped
    rows, applied = rust_rows(mirror.path("public.acc")), mirror.applied("public.acc")
    following = mirror.cli("sync", "--follow", "3")
    assert following.returncode == 1 and "column score would change type from int to string" in following.stderr
    # over Spark Connect the command fences the table first (a commit of no data): rows and LSN stay
    assert rust_rows(mirror.path("public.acc")) == rows and mirror.applied("public.acc") == applied
    mirror.check("public.other")

    copied = mirror.cli("snapshot", "public.acc")
    assert copied.returncode == 0, copied.stderr
    mirror.sync()
    mirror.check("public.acc")
    assert delta_types(mirror, "public.acc")["score"] == "int"
    mirror.sql("ALTER TABLE acc ALTER COLUMN score TYPE bigint", "INSERT INTO acc VALUES (4, 40)")
    mirror.sync()
    mirror.check("public.acc")
    assert delta_types(mirror, "public.acc")["score"] == "bigint"


def _retype_newest_segment(mirror: Mirror, table: str, column: str, kind: pa.DataType) -> int:
    """Rewrite the newest change-log segment of ``table`` with ``column`` of its row images cast to
    ``kind`` (its schema metadata, the source types, kept); the first record's end LSN."""
    newest = max((Path(mirror.config().changelog.path) / "tables" / table).glob("*.parquet"))
    segment = pq.read_table(newest)
    for image in ("new", "old"):
        struct = segment.column(image).combine_chunks()
        fields = [pa.field(f.name, kind if f.name == column else f.type) for f in struct.type]
        children = [struct.field(f.name).cast(f.type) for f in fields]
        cast = pa.StructArray.from_arrays(children, fields=fields, mask=struct.is_null())
        segment = segment.set_column(segment.schema.get_field_index(image), image, cast)
    pq.write_table(segment.replace_schema_metadata(segment.schema.metadata), newest)
    return int(segment.column("_cdc_end_lsn")[0].as_py())


def test_a_table_whose_creation_was_killed_is_created_by_the_next_apply(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """What a kill during a Delta table's creation leaves — ``_delta_log/_staged_commits/``, empty,
    a data file, no commit — is no table: the next apply creates it there (it used to fail with
    TABLE_OR_VIEW_ALREADY_EXISTS at every run)."""
    mirror = mirror_of(
        {"public.items": {}}, "CREATE TABLE items (id int PRIMARY KEY, v text)", "INSERT INTO items VALUES (1, 'a')"
    )
    mirror.setup()
    path = Path(mirror.path("public.items"))
    (path / "_delta_log" / "_staged_commits").mkdir(parents=True)
    (path / "part-00000-left-by-a-kill.snappy.parquet").write_bytes(b"PAR1")
    assert mirror.applied("public.items") is None
    mirror.apply()
    mirror.check("public.items")
    mirror.sql("INSERT INTO items VALUES (2, 'b')")
    mirror.sync()
    mirror.check("public.items")


# -- the command line --------------------------------------------------------------------------------


@pytest.mark.slow
def test_cli_sync_and_apply_one_table(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """``cdc-assets apply --table T`` applies only T; ``cdc-assets sync --maintain`` then drains,
    applies every table and maintains them from one Spark start; each prints a summary per table
    (the real command, in a subprocess)."""
    mirror = mirror_of(
        {"public.ca": {}, "public.cb": {}},
        "CREATE TABLE ca (id int PRIMARY KEY, v text)",
        "CREATE TABLE cb (id int PRIMARY KEY, v text)",
        "INSERT INTO ca VALUES (1, 'a')",
    )
    mirror.setup()
    mirror.sql("INSERT INTO ca VALUES (2, 'b'), (3, 'c')", "INSERT INTO cb VALUES (1, 'x')")
    mirror.drain()
    checkpoint = mirror.checkpoint_lsn()
    done = mirror.cli("apply", "--table", "public.ca")
    assert done.returncode == 0, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("public.")]
    created = "0 updated, 0 deleted by create; applied LSN "  # the first apply creates the table with its copy
    assert lines == [
        f"public.ca: 3 change records → 3 inserted, {created}{format_lsn(checkpoint)},"
        f" Delta version {mirror.version('public.ca')} (" + lines[0].rsplit("(", 1)[-1]
    ], done.stdout
    assert mirror.applied("public.ca") == checkpoint
    assert mirror.applied("public.cb") is None  # cb was left alone: not created
    mirror.check("public.ca")

    # `sync --maintain`: the drain, cb created and ca merged side by side (printed as each is
    # done: in either order), then a maintenance line per table, all from one Spark start.
    mirror.sql("UPDATE ca SET v = 'b2' WHERE id = 2", "DELETE FROM ca WHERE id = 3", "INSERT INTO cb VALUES (2, 'y')")
    done = mirror.cli("sync", "--maintain")
    assert done.returncode == 0, done.stderr
    checkpoint = mirror.checkpoint_lsn()
    lines = sorted(line for line in done.stdout.splitlines() if line.startswith("public."))
    assert len(lines) == 2, done.stdout
    assert lines[0].startswith("public.ca: 2 change records → 0 inserted, 1 updated, 1 deleted by MERGE (matched only)")
    assert lines[1].startswith(f"public.cb: 2 change records → 2 inserted, {created}")
    for line, table in zip(lines, ("public.ca", "public.cb")):
        assert f"applied LSN {format_lsn(checkpoint)}, Delta version " in line, line
        assert mirror.applied(table) == checkpoint
    maintained = [line for line in done.stdout.splitlines() if line.startswith("maintained ")]
    assert [line.split(":")[0] for line in maintained] == ["maintained public.ca", "maintained public.cb"], done.stdout
    assert done.stderr.count("starting Spark") == 1, done.stderr
    mirror.check("public.ca")
    mirror.check("public.cb")


@pytest.mark.slow
def test_cli_sync_follow_merges_after_each_durable_batch_until_stopped(mirror_of) -> None:  # type: ignore[no-untyped-def]
    """``cdc-assets sync --follow``: while the drain follows, each change reaches its Delta table
    (a summary line per merge) before the command ends, and waits while the table's maintenance
    holds its write lock; SIGTERM ends it with exit 130 and the table equal to the source."""
    mirror = mirror_of({"public.fa": {}}, "CREATE TABLE fa (id int PRIMARY KEY, v text)")
    mirror.setup()
    syncing = mirror.popen("sync", "--follow", "600")
    try:
        for i in range(3):
            mirror.sql(f"INSERT INTO fa VALUES ({i}, 'while following')")
            wait_until(
                lambda key=i: holds_key(mirror.path("public.fa"), key),
                timeout=180,
                what=f"row {i} in Delta",
            )
        assert syncing.poll() is None  # merged by the following sync, not after it
        # The table's maintenance holds its write lock: the follower's next merge of it waits.
        with TableWriteLock(mirror.config().source, "public.fa"):
            mirror.sql("INSERT INTO fa VALUES (10, 'while maintained')")
            wait_until(
                lambda: mirror.db.execute("SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"),
                timeout=180,
                what="the follower's merge waiting for the table's write lock",
            )
            assert not holds_key(mirror.path("public.fa"), 10)
        wait_until(lambda: holds_key(mirror.path("public.fa"), 10), timeout=180, what="row 10 in Delta")
    finally:
        syncing.send_signal(signal.SIGTERM)
        out, err = syncing.communicate(timeout=120)
    assert syncing.returncode == 130, err
    merges = [line for line in out.splitlines() if line.startswith("public.fa: 1 change records → 1 inserted")]
    assert len(merges) >= 4, out
    mirror.check("public.fa")


def test_the_driver_gets_a_code_cache_that_a_long_lived_session_does_not_fill() -> None:
    """Each statement's generated classes are compiled by the JIT: the default code cache (240 MB)
    fills in a session that lives for days, and the JVM then evicts and recompiles Spark's and
    Delta's own code at every statement; a user's own size and options are kept."""
    cluster = "spark://h:7077"
    settings = session_settings(SparkConfig(master=cluster))
    assert settings["spark.driver.extraJavaOptions"] == "-XX:ReservedCodeCacheSize=1g"
    assert settings["spark.executor.extraJavaOptions"] == "-XX:ReservedCodeCacheSize=1g"
    theirs = SparkConfig(master=cluster, conf={"spark.driver.extraJavaOptions": "-Dx=1"})
    assert session_settings(theirs)["spark.driver.extraJavaOptions"] == "-XX:ReservedCodeCacheSize=1g -Dx=1"
    sized = SparkConfig(master=cluster, conf={"spark.driver.extraJavaOptions": "-XX:ReservedCodeCacheSize=2g -Dx=1"})
    assert session_settings(sized)["spark.driver.extraJavaOptions"] == "-XX:ReservedCodeCacheSize=2g -Dx=1"


def test_a_local_driver_allocates_no_page_or_broadcast_block_that_g1_calls_humongous(spark: Any) -> None:
    """Tungsten's pages (up to 64 MB) and broadcast blocks (4 MB) were half a G1 region or more:
    each was allocated outside the young generation and could start a concurrent marking cycle,
    dozens per MERGE. The test session's JVM runs with the settings that prevent it, and a user's
    own choices are kept; a cluster's executors keep Spark's defaults."""
    jvm = spark.sparkContext._jvm
    diagnostic = jvm.java.lang.management.ManagementFactory.getPlatformMXBean(
        jvm.java.lang.Class.forName("com.sun.management.HotSpotDiagnosticMXBean")
    )
    region = int(diagnostic.getVMOption("G1HeapRegionSize").getValue())
    page = spark.sparkContext._jsc.sc().env().memoryManager().pageSizeBytes()
    block = spark.sparkContext.getConf().get("spark.broadcast.blockSize")
    assert (region, page, block) == (4 << 20, 1 << 20, "1m")
    assert page < region // 2  # G1 allocates an object of half a region or more as humongous
    settings = session_settings(SparkConfig(master="local[2]"))
    assert settings["spark.driver.extraJavaOptions"] == "-XX:ReservedCodeCacheSize=1g -XX:G1HeapRegionSize=4m"
    assert settings["spark.executor.extraJavaOptions"] == "-XX:ReservedCodeCacheSize=1g"
    theirs = SparkConfig(
        master="local[2]",
        conf={"spark.driver.extraJavaOptions": "-XX:G1HeapRegionSize=8m", "spark.buffer.pageSize": "2m"},
    )
    chosen = session_settings(theirs)
    assert chosen["spark.driver.extraJavaOptions"] == "-XX:ReservedCodeCacheSize=1g -XX:G1HeapRegionSize=8m"
    assert chosen["spark.buffer.pageSize"] == "2m"
    cluster = session_settings(SparkConfig(master="spark://h:7077"))
    assert "spark.buffer.pageSize" not in cluster and "spark.broadcast.blockSize" not in cluster


def test_delta_jars_are_those_of_the_installed_delta_spark_for_the_installed_spark_minor() -> None:
    """The jars requested follow the installed pyspark and delta-spark (any pair the version ranges
    of pyproject.toml allow); a release with no jars on Maven Central (4.4.1) runs with those of
    the release it repackages."""
    assert delta_package() == delta_package(version("pyspark"), version("delta-spark"))
    assert delta_package("4.0.1", "4.4.0") == "io.delta:delta-spark_4.0_2.13:4.4.0"
    assert delta_package("4.2.0", "4.4.1") == "io.delta:delta-spark_4.2_2.13:4.4.0"


def test_a_start_passes_the_jars_an_earlier_start_resolved_and_resolves_again_when_one_is_gone(
    spark: Any, tmp_path: Path
) -> None:
    """Ivy resolves Delta's package at every start (~3 s even with every jar cached): the jars a
    start resolved are recorded beside Ivy's cache, and a later start passes them as ``spark.jars``
    while every one of them is still there."""
    jars = spark.sparkContext.getConf().get("spark.jars")  # resolved by Ivy, or passed from the record
    assert "delta-spark" in jars
    assert recorded_jars(f"{delta_package()},{hadoop_aws_package()}", DEFAULT_IVY_HOME) == jars.split(",")
    config = SparkConfig(conf={"spark.jars.ivy": str(tmp_path)})
    first = session_settings(config)
    assert first["spark.jars.packages"] == delta_package() and "spark.jars" not in first
    jar = tmp_path / "jars" / "io.delta_delta-spark.jar"
    jar.parent.mkdir()
    jar.write_bytes(b"")
    record_jars(delta_package(), tmp_path, f"file://{jar}")
    again = session_settings(config)
    assert again["spark.jars"] == f"file://{jar}" and "spark.jars.packages" not in again
    jar.unlink()  # a cleaned cache: resolve again
    assert session_settings(config)["spark.jars.packages"] == delta_package()


@pytest.mark.slow
def test_local_sessions_rebuild_delta_state_with_few_tasks() -> None:
    """Delta's default of 50 tasks to rebuild a table's state made every read and MERGE of a
    small table take tens of seconds on two local cores; Spark's 10,000 file-listing tasks did the
    same to each VACUUM."""
    settings = session_settings(SparkConfig(master="local[2]"))
    assert settings["spark.databricks.delta.snapshotPartitions"] == "2"
    assert settings["spark.sql.sources.parallelPartitionDiscovery.parallelism"] == "2"  # VACUUM's listing
    assert session_settings(SparkConfig(master="local"))["spark.databricks.delta.snapshotPartitions"] == "1"
    assert "spark.databricks.delta.snapshotPartitions" not in session_settings(SparkConfig(master="spark://h:7077"))
    chosen = SparkConfig(master="local[2]", conf={"spark.databricks.delta.snapshotPartitions": "8"})
    assert session_settings(chosen)["spark.databricks.delta.snapshotPartitions"] == "8"
