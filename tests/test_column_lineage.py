"""The records carried through schema changes by attnum (docs/architecture.md, "Schema migrations"),
pure: hand-made change records and capture messages, no server."""

from __future__ import annotations

import pyarrow as pa

from cdc_assets.changelog.column_lineage import _array_element, carry_columns
from cdc_assets.changelog.planner import plan_changes
from cdc_assets.changelog.schema_changes import DdlColumn, SchemaChangeMessage, TableDdl, uncertain_column_change
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
