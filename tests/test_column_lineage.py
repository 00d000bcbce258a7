"""The records carried through schema changes by attnum (docs/architecture.md, "Schema migrations"),
pure: hand-made change records and capture messages (and a compacted base in a folder), no server."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from cdc_assets.changelog.column_lineage import _array_element, carry_columns
from cdc_assets.changelog.compacted_base import write_base
from cdc_assets.changelog.planner import plan_changes
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.schema_changes import DdlColumn, SchemaChangeMessage, TableDdl, uncertain_column_change
from cdc_assets.changelog.snapshot_runs import run_store
from cdc_assets.changelog.store import LogStore
from tests.support.records import INT4, KEY, TEXT, ChangeLog, relation

NAMES = {1: "id", 2: "a", 3: "b"}


def _column(attnum: int, name: str, type_oid: int, missing: str | None = None) -> DdlColumn:
    return DdlColumn(attnum, name, type_oid, -1, 0, attnum == 1, "", missing is not None, missing)


def _ddl(log: ChangeLog, *columns: DdlColumn, rewrite: int | None = None) -> TableDdl:
    """A capture message placed after the log's records so far, in their last transaction."""
    last = log.rows[-1]
    message = SchemaChangeMessage("s", "p", "ALTER TABLE", 16400, "public", "t", "d", (1,), rewrite, columns)
    return TableDdl(last["_cdc_commit_lsn"], last["_cdc_end_lsn"], last["_cdc_position"], 0, 0, message)


def test_a_rename_keeps_values_a_drop_and_add_of_one_name_does_not_and_old_rows_read_the_default() -> None:
    before = relation("t", ("id", INT4, KEY), ("a", INT4), ("b", TEXT))
    log = ChangeLog(before)
    with log.transaction():
        log.insert({"id": 1, "a": 10, "b": "one"})
        log.update({"id": 2, "a": 20, "b": None}, unchanged=["b"])
    first = _ddl(
        log,
        _column(1, "id", INT4),
        _column(2, "a2", INT4),  # renamed
        _column(4, "b", INT4),  # b dropped, a new b added
        _column(5, "e", INT4, "{7}"),
    )
    after = relation("t", ("id", INT4, KEY), ("a2", INT4), ("b", INT4), ("e", INT4))
    later = log.continued(after)
    later.insert({"id": 3, "a2": 30, "b": 3, "e": 8})
    lineage = carry_columns(NAMES, [log.chunk(), later.chunk()], [first], after)
    assert lineage.recopy is None
    assert [c.name for c in lineage.relation.columns] == ["id", "a2", "b", "e"]
    assert lineage.missing == {"e": pa.scalar(7, pa.int32())}
    plan = plan_changes(lineage.chunks, lineage.relation)
    rows = {r["id"]: r for r in plan.rows.select(["id", "a2", "b", "e"]).to_pylist()}
    assert rows == {
        1: {"id": 1, "a2": 10, "b": None, "e": 7},
        2: {"id": 2, "a2": 20, "b": None, "e": 7},
        3: {"id": 3, "a2": 30, "b": 3, "e": 8},
    }
    assert lineage.chunks[0].records.column("_cdc_unchanged").to_pylist() == [None, None]  # b's old values dropped


def test_a_change_inside_a_transaction_cuts_its_records_there() -> None:
    """``DROP COLUMN b, ADD COLUMN b text`` between two inserts of one transaction leaves the Relation
    message as it was (one chunk): the first row's b is the dropped column's, the second's the new one's."""
    columns = relation("t", ("id", INT4, KEY), ("a", INT4), ("b", TEXT))
    log = ChangeLog(columns)
    with log.transaction():
        log.insert({"id": 1, "a": 1, "b": "dropped"})
        ddl = _ddl(log, _column(1, "id", INT4), _column(2, "a", INT4), _column(4, "b", TEXT))
        log.insert({"id": 2, "a": 2, "b": "new"})
    lineage = carry_columns(NAMES, [log.chunk()], [ddl], columns)
    assert [c.records.num_rows for c in lineage.chunks] == [1, 1]
    plan = plan_changes(lineage.chunks, lineage.relation)
    assert sorted(plan.rows.select(["id", "b"]).to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "b": None},
        {"id": 2, "b": "new"},
    ]


def test_a_change_committed_at_a_copys_lsn_comes_after_the_whole_copy(tmp_path: Path) -> None:
    """A compacted base is written at ``B``, the end LSN of the last change it folds, where the
    next transaction's commit record may start: that transaction commits at the base's commit LSN.
    Its ``DROP COLUMN b, ADD COLUMN b text`` cuts its own records, after the whole base: the row it
    inserted before the change reads the new b as NULL."""
    columns = relation("t", ("id", INT4, KEY), ("a", INT4), ("b", TEXT))
    folded = ChangeLog(columns)
    for key in range(1, 5):
        folded.insert({"id": key, "a": key, "b": "old"})
    store = LogStore(str(tmp_path))
    base = write_base(store, "s", "public.t", [folded.chunk()], columns, folded.last_lsn, 0, "apply")
    (copy,) = ChangeLogReader(run_store(store, "public.t", base)).read_changes("public.t")
    at_base = ChangeLog(columns, start=folded.last_lsn)
    with at_base.transaction():
        at_base.insert({"id": 100, "a": 100, "b": "before"})
        ddl = _ddl(at_base, _column(1, "id", INT4), _column(2, "a", INT4), _column(4, "b", TEXT))
        at_base.update({"id": 1, "a": 1, "b": "after"})
    assert copy.copy and ddl.commit_lsn == folded.last_lsn
    lineage = carry_columns(NAMES, [copy, at_base.chunk()], [ddl], columns)
    plan = plan_changes(lineage.chunks, lineage.relation)
    assert {r["id"]: r["b"] for r in plan.rows.select(["id", "b"]).to_pylist()} == {
        1: "after",
        2: None,
        3: None,
        4: None,
        100: None,
    }


def test_what_cannot_be_carried_is_a_reason_to_copy() -> None:
    columns = relation("t", ("id", INT4, KEY), ("a", INT4))
    log = ChangeLog(columns)
    log.insert({"id": 1, "a": 1})
    rewrite = _ddl(log, _column(1, "id", INT4), _column(2, "a", 20), rewrite=4)
    assert "rewrote the table (column type)" in (carry_columns(NAMES, [log.chunk()], [rewrite], columns).recopy or "")
    plain = _ddl(log, _column(1, "id", INT4), _column(2, "a", INT4))
    assert "unknown" in (carry_columns(None, [log.chunk()], [plain], columns).recopy or "")


def test_attmissingval_literals() -> None:
    assert _array_element("{7}") == "7"
    assert _array_element('{"a b"}') == "a b"
    assert _array_element('{"say \\"hi\\""}') == 'say "hi"'
    assert _array_element("{NULL}") is None
    assert _array_element("{1,2}") is None
    assert _array_element("7") is None


def test_what_the_relation_messages_alone_cannot_tell() -> None:
    before = relation("t", ("id", INT4, KEY), ("a", INT4), ("b", TEXT), ("c", TEXT))
    assert uncertain_column_change(before, relation("t", ("id", INT4, KEY), ("a", INT4), ("c", TEXT))) is None
    assert uncertain_column_change(
        before, relation("t", ("id", INT4, KEY), ("a", INT4), ("b2", TEXT), ("c", TEXT))
    ) == ("b2 added and b dropped")
    assert uncertain_column_change(before, relation("t", ("id", INT4, KEY), ("a", INT4), ("c", TEXT), ("b", TEXT))) == (
        "b dropped and added again"
    )
    assert uncertain_column_change(before, relation("t", ("id", INT4, KEY), ("a", 20), ("b", TEXT), ("c", TEXT))) == (
        "a changed type"
    )
