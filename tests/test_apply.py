"""Applying the change log to Delta tables through PySpark, end to end: real PostgreSQL, the
library API (``setup`` → ``drain`` → ``apply_tables``) on the shared Spark session, real Delta
tables. Every Delta table is read with Spark and with delta-rs; both must agree and equal the
source as the change log's own value conversion reads it (``tests/support/delta_read.py``).

Covered: PostgreSQL's documented row-filter example and every case of the UPDATE
transformation, on a primary key, a composite key and REPLICA IDENTITY FULL; keyed merges with
key changes and unchanged TOAST values that only the Delta table still has; TRUNCATE applied and
ignored; duplicate rows under REPLICA IDENTITY FULL; USING INDEX; keyless tables; exactly-once
(a second apply is skipped, a replayed plan is skipped by Delta); schema changes between and
inside batches; every common column type; the CLI."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cdc_assets.apply.merge import write_plan
from cdc_assets.apply.planner import RecordChunk, plan_changes
from cdc_assets.apply.runner import delta_target
from cdc_assets.changelog.reader import ChangeLogReader
from tests.conftest import Database
from tests.support.mirror import Mirror

RANDOM_20K = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 640))"


@pytest.fixture
def mirror_of(pg: Database, spark: Any, tmp_path: Path):  # type: ignore[no-untyped-def]
    def make(tables: dict[str, dict[str, Any]], *ddl: str) -> Mirror:
        mirror = Mirror(pg, tmp_path / "mirror", tables, spark)
        mirror.sql(*ddl)
        return mirror

    return make


# -- row filters: PostgreSQL's documentation example, on the consumer side ---------------------------

DOC_FILTER = "a > 5 AND c = 'NSW'"


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
    for a, b, c in [(2, 102, "NSW"), (3, 103, "QLD"), (4, 104, "VIC"), (5, 105, "ACT"), (6, 106, "NSW"), (7, 107, "NT"),
                    (8, 108, "QLD"), (9, 109, "NSW")]:
        each(f"INSERT INTO {{t}} VALUES ({a}, {b}, '{c}')")
    applied = mirror.sync()
    assert {t: applied[t].inserted for t in tables} == {t: 2 for t in tables}
    check_all()
    assert sorted((r["a"], r["b"], r["c"]) for r in mirror.check("public.t1", where=DOC_FILTER)) == [
        (6, 106, "NSW"), (9, 109, "NSW")]

    # The documentation's updates: both match → UPDATE; only the new row matches → INSERT;
    # only the old row matches → DELETE.
    each("UPDATE {t} SET b = 999 WHERE a = 6")
    each("UPDATE {t} SET a = 555 WHERE a = 2")
    each("UPDATE {t} SET c = 'VIC' WHERE a = 9")
    applied = mirror.sync()
    assert [(applied[t].inserted, applied[t].updated, applied[t].deleted) for t in ("public.t1", "public.t2")] == [
        (1, 1, 1), (1, 1, 1)]
    check_all()
    assert sorted((r["a"], r["b"], r["c"]) for r in mirror.check("public.t1", where=DOC_FILTER)) == [
        (6, 999, "NSW"), (555, 102, "NSW")]

    # Every case again, with key changes, several changes per row in one batch and in one
    # transaction, rows moving in and out of the filter, and deletes on both sides of it.
    each("UPDATE {t} SET b = 0 WHERE a = 3")                      # neither matches: nothing
    each("UPDATE {t} SET a = 12, c = 'NSW' WHERE a = 4")          # key change, only new matches: INSERT
    each("UPDATE {t} SET a = 60 WHERE a = 6")                     # key change, both match
    each("UPDATE {t} SET a = 1 WHERE a = 555")                    # key change, only old matches: DELETE
    each("UPDATE {t} SET c = 'NSW' WHERE a = 7",                  # in, then out again, in one transaction
         "UPDATE {t} SET c = 'NT' WHERE a = 7")
    each("UPDATE {t} SET c = 'NSW' WHERE a = 9")                  # out (VIC) → in
    each("UPDATE {t} SET b = b + 1 WHERE a = 9")                  # … then updated inside
    each("UPDATE {t} SET c = 'NSW', b = 5 WHERE a = 5")           # a = 5 does not match a > 5
    each("DELETE FROM {t} WHERE a = 8")                           # a row that never matched
    each("INSERT INTO {t} VALUES (70, 1, 'NSW'), (71, 1, 'NSW')",
         "DELETE FROM {t} WHERE a = 70")                          # a matching row deleted
    mirror.sync()
    check_all()
    assert sorted((r["a"], r["b"], r["c"]) for r in mirror.check("public.t1", where=DOC_FILTER)) == [
        (9, 110, "NSW"), (12, 104, "NSW"), (60, 999, "NSW"), (71, 1, "NSW")]


# -- keyed merges end to end -------------------------------------------------------------------------

BIG = "g::text || (SELECT string_agg(md5(random()::text || g::text), '') FROM generate_series(1, 640))"  # ~20 kB, per row


def unchanged_columns(mirror: Mirror, table: str, after: int) -> list[tuple[str, list[str] | None]]:
    """(op, unchanged TOAST columns) of the table's change records after ``after``."""
    return [(r["_cdc_op"], r["_cdc_unchanged"]) for r in mirror.records(table) if r["_cdc_end_lsn"] > after]


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
    )
    mirror.setup()
    first = mirror.apply()
    assert {t: r.inserted for t, r in first.items()} == {
        "public.items": 8, "public.pairs": 3, "public.tr": 2, "public.tr_ign": 2, "public.dup": 3, "public.events": 2}
    for table in ("public.items", "public.dup"):
        mirror.check(table)
    snapshot_lsn = mirror.checkpoint_lsn()

    # Sync 1: the TOAST column of items is never sent again; every value comes from Delta.
    mirror.sql("UPDATE items SET v = 'one' WHERE id = 1")                       # same key
    mirror.sql("UPDATE items SET id = 20 WHERE id = 2")                         # key change
    mirror.sql("UPDATE items SET id = 30 WHERE id = 3", "UPDATE items SET id = 31, n = 31 WHERE id = 30")  # chain
    mirror.sql("UPDATE items SET id = 99 WHERE id = 4", "UPDATE items SET id = 4 WHERE id = 5",
               "UPDATE items SET id = 5 WHERE id = 99")                         # swap 4 ↔ 5
    mirror.sql("DELETE FROM items WHERE id = 6")
    mirror.sql("DELETE FROM items WHERE id = 7", "INSERT INTO items VALUES (7, 'again', 7, 'short')")  # inline now
    mirror.sql("UPDATE items SET n = 70 WHERE id = 7")
    mirror.sql(f"INSERT INTO items SELECT 9, 'nine', 9, {BIG} FROM (SELECT 9 AS g) s",
               "UPDATE items SET n = 90 WHERE id = 9")                           # filled from the batch
    mirror.sql("UPDATE items SET big = 'inline now' WHERE id = 8", "UPDATE items SET v = 'eight' WHERE id = 8")

    mirror.sql("UPDATE pairs SET v = 'x2' WHERE code = 'a'")
    mirror.sql("UPDATE pairs SET code = 'bb' WHERE code = 'b'")                # key change of USING INDEX
    mirror.sql("DELETE FROM pairs WHERE code = 'c'", "INSERT INTO pairs VALUES (4, 'c', 'reused key')")
    mirror.sql("UPDATE pairs SET id = 10 WHERE code = 'a'")

    for t in ("tr", "tr_ign"):
        mirror.sql(f"INSERT INTO {t} VALUES (3, 'three')", f"UPDATE {t} SET v = 'one!' WHERE id = 1")
    mirror.sql("INSERT INTO tr VALUES (6, 'six')", "INSERT INTO tr_ign VALUES (6, 'six')",
               "TRUNCATE tr, tr_ign",                                            # one TRUNCATE of both
               "INSERT INTO tr VALUES (4, 'four')", "INSERT INTO tr_ign VALUES (4, 'four')")
    for t in ("tr", "tr_ign"):
        mirror.sql(f"UPDATE {t} SET v = 'four!' WHERE id = 4", f"INSERT INTO {t} VALUES (5, 'five')")

    mirror.sql("DELETE FROM dup WHERE ctid = (SELECT min(ctid) FROM dup WHERE a = 1)")  # one of two equal rows
    mirror.sql("UPDATE dup SET b = 'z' WHERE a = 2", "INSERT INTO dup VALUES (3, 'w'), (3, 'w')")
    mirror.sql("INSERT INTO events VALUES (2, 'b'), (1, 'a')")
    applied = mirror.sync()

    # The change log really sent 'u' for these updates (so the values came from Delta).
    sent = unchanged_columns(mirror, "public.items", snapshot_lsn)
    assert sent.count(("update", ["big"])) == 8, sent
    for table in ("public.items", "public.pairs", "public.tr", "public.dup", "public.events"):
        mirror.check(table)
    mirror.check("public.tr_ign", expected=[
        {"id": 1, "v": "one!"}, {"id": 2, "v": "two"}, {"id": 3, "v": "three"}, {"id": 4, "v": "four!"},
        {"id": 5, "v": "five"}, {"id": 6, "v": "six"}])
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
    assert {t for t, r in applied.items() if r.skipped} == {"public.pairs", "public.tr", "public.tr_ign", "public.events"}
    assert all(r.skipped == "no changes" for t, r in applied.items() if r.skipped)
    mirror.check("public.items")
    assert sorted((r["a"], r["b"]) for r in mirror.check("public.dup")) == [(2, "z"), (3, "w")]
