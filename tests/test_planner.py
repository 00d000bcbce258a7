"""``plan_changes`` on change records built by hand in the change log's format (no Spark, no
server): every rule of "Semantics applied downstream" (docs/architecture.md) that the planner owns — last
image wins, key changes, unchanged TOAST, TRUNCATE cuts, snapshots, REPLICA IDENTITY FULL as a
multiset, keyless tables, schema versions — each asserted on the exact rows of the plan."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pyarrow as pa
import pytest

from cdc_assets.changelog.planner import ChangePlan, PlanError, fill_from_history, plan_changes
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.records import ChangeChunk, DeltaColumn, RecordColumn
from cdc_assets.transactions import COMMIT_FIELDS
from tests.support.records import (
    INT4,
    INT4_ARRAY,
    INT8,
    KEY,
    T0,
    TEXT,
    ChangeLog,
    empty_chunk,
    relation,
    schema_of,
)

TOASTY = relation("docs", ("id", INT4, KEY), ("v", TEXT), ("big", TEXT))


def plan_of(log: ChangeLog, **kwargs: Any) -> ChangePlan:
    return plan_changes([log.chunk()], log.relation, **kwargs)


def keyed_rows(plan: ChangePlan) -> list[dict[str, Any]]:
    """The plan's rows without the commit time, sorted by action then key."""
    assert plan.mode == "keyed"
    rows = [{k: v for k, v in r.items() if k != DeltaColumn.COMMIT_TIME} for r in plan.rows.to_pylist()]
    return sorted(rows, key=lambda r: (r[DeltaColumn.ACTION], [r[k] for k in plan.key]))


def upsert(
    image: dict[str, Any], lsn: int, unresolved: list[str] | None = None, fill: dict[str, Any] | None = None
) -> dict[str, Any]:
    return {
        **image,
        DeltaColumn.LSN: lsn,
        DeltaColumn.ACTION: "upsert",
        DeltaColumn.UNRESOLVED: unresolved,
        DeltaColumn.FILL_KEY: fill,
    }


def delete(key: dict[str, Any], columns: list[str], lsn: int) -> dict[str, Any]:
    return {
        **dict.fromkeys(columns),
        **key,
        DeltaColumn.LSN: lsn,
        DeltaColumn.ACTION: "delete",
        DeltaColumn.UNRESOLVED: None,
        DeltaColumn.FILL_KEY: None,
    }


def gone(key: int, lsn: int) -> dict[str, Any]:
    return delete({"id": key}, ["id", "v", "big"], lsn)


# -- the record builder itself ---------------------------------------------------------------------


def test_hand_built_records_have_the_change_log_schema() -> None:
    """The builder's tables have the schema of what the change log's reader yields: the commit
    columns, then ``ChangeRecordBuilder``'s record columns."""
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "x"})
    log.update({"id": 2, "v": "b"}, old={"id": 1}, unchanged=["big"])
    log.delete({"id": 2})
    log.truncate()
    table = log.table()
    assert table.schema.equals(pa.schema([*COMMIT_FIELDS, *ChangeRecordBuilder(TOASTY).schema]))
    assert table.schema.equals(schema_of(TOASTY))
    assert table.column(RecordColumn.OP).to_pylist() == ["insert", "update", "delete", "truncate"]
    assert table.column(RecordColumn.OLD_KIND).to_pylist() == [None, "K", "K", None]
    assert table.column(RecordColumn.UNCHANGED).to_pylist() == [None, ["big"], None, None]
    assert table.column("old").to_pylist()[1] == {"id": 1, "v": None, "big": None}
    assert table.column("new").to_pylist()[1] == {"id": 2, "v": "b", "big": None}
    assert log.end_lsns == sorted(set(log.end_lsns))


# -- keyed: last image wins, inserts and deletes ----------------------------------------------------


def test_last_image_wins_per_key() -> None:
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "x"})
    log.insert({"id": 2, "v": "p", "big": "y"})
    with log.transaction():
        log.update({"id": 1, "v": "b", "big": "x"})
        lsn1 = log.update({"id": 1, "v": "c", "big": "x2"})
    lsn2 = log.update({"id": 2, "v": "q", "big": "y"})
    plan = plan_of(log)
    assert (plan.mode, plan.key, plan.truncate) == ("keyed", ("id",), False)
    assert (plan.records, plan.last_lsn) == (5, lsn2)
    assert keyed_rows(plan) == [
        upsert({"id": 1, "v": "c", "big": "x2"}, lsn1),
        upsert({"id": 2, "v": "q", "big": "y"}, lsn2),
    ]
    assert plan.counts == {"upserts": 2, "deletes": 0}
    assert not plan.has_unresolved
    times = dict(zip(plan.rows.column("id").to_pylist(), plan.rows.column(DeltaColumn.COMMIT_TIME).to_pylist()))
    assert times == {1: T0.replace(second=2), 2: T0.replace(second=3)}  # each row's last commit


def test_insert_then_delete_in_one_batch_is_a_delete() -> None:
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "x"})
    log.update({"id": 1, "v": "b", "big": "x"})
    lsn = log.delete({"id": 1})
    plan = plan_of(log)
    assert keyed_rows(plan) == [gone(1, lsn)]
    assert plan.counts == {"upserts": 0, "deletes": 1}


def test_delete_then_insert_is_an_upsert() -> None:
    log = ChangeLog(TOASTY)
    log.delete({"id": 1})
    lsn = log.insert({"id": 1, "v": "again", "big": "z"})
    plan = plan_of(log)
    assert keyed_rows(plan) == [upsert({"id": 1, "v": "again", "big": "z"}, lsn)]
    assert plan.counts == {"upserts": 1, "deletes": 0}


def test_composite_key_using_index() -> None:
    """REPLICA IDENTITY USING INDEX: the index columns are the key, planned like a primary key."""
    rel = relation("pairs", ("a", INT4, KEY), ("b", TEXT, KEY), ("v", INT4), identity="i")
    log = ChangeLog(rel)
    log.insert({"a": 1, "b": "x", "v": 1})
    log.insert({"a": 1, "b": "y", "v": 2})
    lsn_y = log.update({"a": 1, "b": "y", "v": 3})
    lsn_x = log.update({"a": 2, "b": "x", "v": 4}, old={"a": 1, "b": "x"})
    plan = plan_of(log)
    assert plan.key == ("a", "b")
    assert keyed_rows(plan) == [
        {
            "a": 1,
            "b": "x",
            "v": None,
            DeltaColumn.LSN: lsn_x,
            DeltaColumn.ACTION: "delete",
            DeltaColumn.UNRESOLVED: None,
            DeltaColumn.FILL_KEY: None,
        },
        upsert({"a": 1, "b": "y", "v": 3}, lsn_y),
        upsert({"a": 2, "b": "x", "v": 4}, lsn_x),
    ]


# -- key changes -----------------------------------------------------------------------------------


def test_key_change_deletes_the_old_key_and_upserts_the_new() -> None:
    log = ChangeLog(TOASTY)
    lsn = log.update({"id": 2, "v": "moved", "big": "x"}, old={"id": 1})
    plan = plan_of(log)
    assert keyed_rows(plan) == [gone(1, lsn), upsert({"id": 2, "v": "moved", "big": "x"}, lsn)]
    assert plan.counts == {"upserts": 1, "deletes": 1}


def test_swap_of_keys_in_one_transaction() -> None:
    """A→C, B→A, C→B (the way PostgreSQL swaps two primary keys): A and B hold each other's rows,
    C (only a waypoint) is deleted."""
    log = ChangeLog(TOASTY)
    with log.transaction() as lsn:
        log.update({"id": 3, "v": "was 1", "big": "x1"}, old={"id": 1})
        log.update({"id": 1, "v": "was 2", "big": "x2"}, old={"id": 2})
        log.update({"id": 2, "v": "was 1", "big": "x1"}, old={"id": 3})
    plan = plan_of(log)
    assert keyed_rows(plan) == [
        gone(3, lsn),
        upsert({"id": 1, "v": "was 2", "big": "x2"}, lsn),
        upsert({"id": 2, "v": "was 1", "big": "x1"}, lsn),
    ]


def test_swap_of_keys_with_unchanged_toast_fills_from_each_old_key() -> None:
    """The same swap with the TOAST column unchanged each time: nothing in the batch has the
    values, so each final row is filled from the Delta row of the key its value came from."""
    log = ChangeLog(TOASTY)
    with log.transaction() as lsn:
        log.update({"id": 3, "v": "was 1"}, old={"id": 1}, unchanged=["big"])
        log.update({"id": 1, "v": "was 2"}, old={"id": 2}, unchanged=["big"])
        log.update({"id": 2, "v": "was 1"}, old={"id": 3}, unchanged=["big"])
    plan = plan_of(log)
    assert keyed_rows(plan) == [
        gone(3, lsn),
        upsert({"id": 1, "v": "was 2", "big": None}, lsn, ["big"], {"id": 2}),
        upsert({"id": 2, "v": "was 1", "big": None}, lsn, ["big"], {"id": 1}),
    ]
    assert plan.has_unresolved


def test_chain_of_key_changes() -> None:
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "x"})
    lsn_b = log.update({"id": 2, "v": "b", "big": "x"}, old={"id": 1})
    lsn_c = log.update({"id": 3, "v": "c", "big": "x"}, old={"id": 2})
    plan = plan_of(log)
    assert keyed_rows(plan) == [gone(1, lsn_b), gone(2, lsn_c), upsert({"id": 3, "v": "c", "big": "x"}, lsn_c)]
    assert plan.counts == {"upserts": 1, "deletes": 2}


def test_key_change_then_new_row_under_the_old_key() -> None:
    log = ChangeLog(TOASTY)
    lsn_move = log.update({"id": 2, "v": "moved", "big": "x"}, old={"id": 1})
    lsn_new = log.insert({"id": 1, "v": "new", "big": "y"})
    plan = plan_of(log)
    assert keyed_rows(plan) == [
        upsert({"id": 1, "v": "new", "big": "y"}, lsn_new),
        upsert({"id": 2, "v": "moved", "big": "x"}, lsn_move),
    ]


# -- unchanged TOAST -------------------------------------------------------------------------------


def test_unchanged_toast_from_an_earlier_image_of_the_same_key() -> None:
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "BIG"})
    lsn = log.update({"id": 1, "v": "b"}, unchanged=["big"])
    plan = plan_of(log)
    assert keyed_rows(plan) == [upsert({"id": 1, "v": "b", "big": "BIG"}, lsn)]
    assert not plan.has_unresolved


def test_unchanged_toast_from_an_earlier_update_that_sent_it() -> None:
    log = ChangeLog(TOASTY)
    log.update({"id": 1, "v": "a", "big": "NEW BIG"})
    lsn = log.update({"id": 1, "v": "b"}, unchanged=["big"])
    assert keyed_rows(plan_of(log)) == [upsert({"id": 1, "v": "b", "big": "NEW BIG"}, lsn)]


def test_unchanged_toast_from_the_image_under_the_old_key() -> None:
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "BIG"})
    lsn = log.update({"id": 2, "v": "b"}, old={"id": 1}, unchanged=["big"])
    plan = plan_of(log)
    assert keyed_rows(plan) == [gone(1, lsn), upsert({"id": 2, "v": "b", "big": "BIG"}, lsn)]
    assert not plan.has_unresolved


def test_unchanged_toast_left_to_the_delta_row_of_the_same_key() -> None:
    log = ChangeLog(TOASTY)
    log.update({"id": 1, "v": "a"}, unchanged=["big"])
    lsn = log.update({"id": 1, "v": "b"}, unchanged=["big"])
    lsn2 = log.update({"id": 2, "v": "z", "big": "sent"})
    plan = plan_of(log)
    assert keyed_rows(plan) == [
        upsert({"id": 1, "v": "b", "big": None}, lsn, ["big"], {"id": 1}),
        upsert({"id": 2, "v": "z", "big": "sent"}, lsn2),
    ]
    assert plan.has_unresolved


def test_unchanged_toast_left_to_the_delta_row_of_the_old_key() -> None:
    log = ChangeLog(TOASTY)
    lsn = log.update({"id": 2, "v": "b"}, old={"id": 1}, unchanged=["big"])
    assert keyed_rows(plan_of(log)) == [gone(1, lsn), upsert({"id": 2, "v": "b", "big": None}, lsn, ["big"], {"id": 1})]


def test_unchanged_toast_through_a_chain_of_key_changes_fills_from_the_first_key() -> None:
    """A→B with 'u', then B→C with 'u': the value is still the one stored under A."""
    log = ChangeLog(TOASTY)
    lsn_b = log.update({"id": 2, "v": "b"}, old={"id": 1}, unchanged=["big"])
    lsn_c = log.update({"id": 3, "v": "c"}, old={"id": 2}, unchanged=["big"])
    plan = plan_of(log)
    assert keyed_rows(plan) == [
        gone(1, lsn_b),
        gone(2, lsn_c),
        upsert({"id": 3, "v": "c", "big": None}, lsn_c, ["big"], {"id": 1}),
    ]


def test_unresolved_toast_filled_from_the_whole_history() -> None:
    """Rows a row filter kept out of Delta cannot fill their 'u' columns from it: the plan of the
    whole log (snapshot onward) fills them, through key changes, and leaves resolved rows alone."""
    history = ChangeLog(TOASTY)
    history.snapshot(
        [{"id": 1, "v": "a", "big": "one"}, {"id": 2, "v": "b", "big": "two"}, {"id": 5, "v": "e", "big": "five"}]
    )
    history.update({"id": 3, "v": "c"}, old={"id": 2}, unchanged=["big"])  # applied earlier
    batch = ChangeLog(TOASTY)  # the records after the applied LSN, also at the end of the history
    for log in (history, batch):
        lsn1 = log.update({"id": 1, "v": "a2"}, unchanged=["big"])
        lsn3 = log.update({"id": 4, "v": "d"}, old={"id": 3}, unchanged=["big"])
        lsn5 = log.update({"id": 5, "v": "e2", "big": "FIVE"})
    plan = plan_of(batch)
    assert plan.has_unresolved
    filled = fill_from_history(plan, plan_of(history))
    assert not filled.has_unresolved
    assert keyed_rows(filled) == [
        gone(3, lsn3),
        upsert({"id": 1, "v": "a2", "big": "one"}, lsn1),
        upsert({"id": 4, "v": "d", "big": "two"}, lsn3),
        upsert({"id": 5, "v": "e2", "big": "FIVE"}, lsn5),
    ]
    assert fill_from_history(filled, plan_of(history)) is filled  # nothing left to fill


def test_unchanged_toast_of_two_columns_resolved_separately() -> None:
    """One column resolved from the batch, the other left to Delta; a later update that sends a
    column resolves it."""
    rel = relation("two", ("id", INT4, KEY), ("t1", TEXT), ("t2", TEXT), ("n", INT4))
    log = ChangeLog(rel)
    log.update({"id": 1, "t1": "T1", "n": 1}, unchanged=["t2"])
    lsn = log.update({"id": 1, "n": 2}, unchanged=["t1", "t2"])
    log.update({"id": 2, "n": 1}, unchanged=["t1", "t2"])
    lsn2 = log.update({"id": 2, "t2": "T2", "n": 2}, unchanged=["t1"])
    plan = plan_of(log)
    assert keyed_rows(plan) == [
        upsert({"id": 1, "t1": "T1", "t2": None, "n": 2}, lsn, ["t2"], {"id": 1}),
        upsert({"id": 2, "t1": None, "t2": "T2", "n": 2}, lsn2, ["t1"], {"id": 2}),
    ]


def test_update_keeping_toast_of_a_deleted_key_is_an_error() -> None:
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "x"})
    log.delete({"id": 1})
    log.update({"id": 1, "v": "b"}, unchanged=["big"])
    with pytest.raises(PlanError, match=r"public\.docs.*big.*deleted"):
        plan_of(log)


def test_update_keeping_toast_of_a_key_deleted_before_a_key_change_is_an_error() -> None:
    log = ChangeLog(TOASTY)
    log.delete({"id": 1})
    log.update({"id": 2, "v": "b"}, old={"id": 1}, unchanged=["big"])
    with pytest.raises(PlanError, match="deleted"):
        plan_of(log)


def test_unchanged_toast_after_a_truncate_with_no_earlier_value_is_an_error() -> None:
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "x"})
    log.truncate()
    log.update({"id": 1, "v": "b"}, unchanged=["big"])
    with pytest.raises(PlanError, match="after a TRUNCATE"):
        plan_of(log)


# -- TRUNCATE and snapshots ------------------------------------------------------------------------


def test_truncate_drops_earlier_changes_and_keeps_later_ones() -> None:
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "x"})
    log.insert({"id": 2, "v": "b", "big": "y"})
    with log.transaction():
        log.insert({"id": 3, "v": "c", "big": "z"})
        log.truncate(["public.docs", "public.other"], cascade=True)
        lsn4 = log.insert({"id": 4, "v": "d", "big": "w"})
    log.truncate()  # the last TRUNCATE cuts
    lsn5 = log.insert({"id": 5, "v": "e", "big": "q"})
    lsn6 = log.update({"id": 6, "v": "f"}, old={"id": 5}, unchanged=["big"])
    plan = plan_of(log)
    assert plan.truncate is True
    assert keyed_rows(plan) == [gone(5, lsn6), upsert({"id": 6, "v": "f", "big": "q"}, lsn6)]
    assert (plan.records, plan.last_lsn) == (8, lsn6)
    assert lsn4 < lsn5


def test_truncate_as_the_last_record() -> None:
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "x"})
    lsn = log.truncate()
    plan = plan_of(log)
    assert plan.truncate is True
    assert plan.rows.num_rows == 0
    assert (plan.records, plan.last_lsn, plan.counts) == (2, lsn, {"upserts": 0, "deletes": 0})


def test_truncate_ignored() -> None:
    log = ChangeLog(TOASTY)
    lsn1 = log.insert({"id": 1, "v": "a", "big": "x"})
    log.truncate()
    lsn2 = log.insert({"id": 2, "v": "b", "big": "y"})
    plan = plan_of(log, truncate="ignore")
    assert plan.truncate is False
    assert keyed_rows(plan) == [
        upsert({"id": 1, "v": "a", "big": "x"}, lsn1),
        upsert({"id": 2, "v": "b", "big": "y"}, lsn2),
    ]
    assert plan.records == 3


def test_snapshot_batch_replaces_the_table() -> None:
    """A snapshot is the table's contents: what precedes it is dropped and the table emptied;
    changes after it apply on top."""
    log = ChangeLog(TOASTY)
    log.insert({"id": 9, "v": "before the snapshot", "big": "x"})
    snap = log.snapshot(
        [{"id": 1, "v": "a", "big": "x"}, {"id": 2, "v": "b", "big": "y"}, {"id": 3, "v": "c", "big": "z"}]
    )
    lsn4 = log.insert({"id": 4, "v": "d", "big": "w"})
    lsn2 = log.delete({"id": 2})
    lsn3 = log.update({"id": 3, "v": "c2"}, unchanged=["big"])
    plan = plan_of(log, truncate="ignore")  # a snapshot cuts whatever the truncate setting
    assert plan.truncate is True
    assert keyed_rows(plan) == [
        gone(2, lsn2),
        upsert({"id": 1, "v": "a", "big": "x"}, snap),
        upsert({"id": 3, "v": "c2", "big": "z"}, lsn3),
        upsert({"id": 4, "v": "d", "big": "w"}, lsn4),
    ]
    assert plan.records == 7


# -- REPLICA IDENTITY FULL: a multiset ---------------------------------------------------------------


FULL = relation("bag", ("a", INT4), ("b", TEXT), ("big", TEXT), identity="f")


def multiset_rows(plan: ChangePlan) -> list[dict[str, Any]]:
    assert plan.mode == "multiset"
    rows = [{k: v for k, v in r.items() if k != DeltaColumn.COMMIT_TIME} for r in plan.rows.to_pylist()]
    return sorted(rows, key=lambda r: (r["a"], r["b"] or ""))


def test_full_identity_counts_copies_of_duplicate_rows() -> None:
    log = ChangeLog(FULL)
    log.insert({"a": 1, "b": "x", "big": "B"})
    lsn = log.insert({"a": 1, "b": "x", "big": "B"})
    lsn2 = log.insert({"a": 2, "b": "y", "big": "C"})
    plan = plan_of(log)
    assert plan.key == ("a", "b", "big")
    assert multiset_rows(plan) == [
        {"a": 1, "b": "x", "big": "B", DeltaColumn.COPIES: 2, DeltaColumn.LSN: lsn},
        {"a": 2, "b": "y", "big": "C", DeltaColumn.COPIES: 1, DeltaColumn.LSN: lsn2},
    ]
    assert plan.counts == {"inserts": 3, "deletes": 0}

    later = log.continued(FULL)
    lsn3 = later.delete({"a": 1, "b": "x", "big": "B"})  # one of the two identical rows
    lsn4 = later.update({"a": 2, "b": "z"}, old={"a": 2, "b": "y", "big": "C"}, unchanged=["big"])
    plan = plan_of(later)
    assert multiset_rows(plan) == [
        {"a": 1, "b": "x", "big": "B", DeltaColumn.COPIES: -1, DeltaColumn.LSN: lsn3},
        {"a": 2, "b": "y", "big": "C", DeltaColumn.COPIES: -1, DeltaColumn.LSN: lsn4},
        {"a": 2, "b": "z", "big": "C", DeltaColumn.COPIES: 1, DeltaColumn.LSN: lsn4},  # 'u' filled from the O old row
    ]
    assert plan.counts == {"inserts": 1, "deletes": 2}


def test_full_identity_changes_that_cancel_out_leave_nothing() -> None:
    log = ChangeLog(FULL)
    log.insert({"a": 1, "b": "x", "big": "B"})
    log.update({"a": 1, "b": "y", "big": "B"}, old={"a": 1, "b": "x", "big": "B"})
    log.update({"a": 1, "b": "x", "big": "B"}, old={"a": 1, "b": "y", "big": "B"})
    log.delete({"a": 1, "b": "x", "big": "B"})
    plan = plan_of(log)
    assert plan.rows.num_rows == 0
    assert plan.counts == {"inserts": 0, "deletes": 0}


def test_full_identity_row_gets_the_lsn_of_its_last_change() -> None:
    """A row deleted and inserted again carries the LSN and commit time of the insert."""
    log = ChangeLog(FULL)
    log.delete({"a": 1, "b": "x", "big": "B"})
    log.insert({"a": 1, "b": "x", "big": "B"})
    log.insert({"a": 1, "b": "x", "big": "B"})
    lsn = log.update({"a": 1, "b": "x", "big": "B"}, old={"a": 5, "b": "q", "big": "B"})
    plan = plan_of(log)
    rows = plan.rows.to_pylist()
    assert {(r["a"], r[DeltaColumn.COPIES], r[DeltaColumn.LSN]) for r in rows} == {(1, 2, lsn), (5, -1, lsn)}
    assert {r[DeltaColumn.COMMIT_TIME] for r in rows} == {T0.replace(second=3)}


def test_full_identity_with_arrays_and_nulls() -> None:
    rel = relation("arr", ("a", INT4), ("xs", INT4_ARRAY), identity="f")
    log = ChangeLog(rel)
    log.insert({"a": 1, "xs": [1, 2]})
    log.insert({"a": 1, "xs": [1, 2]})
    log.insert({"a": None, "xs": None})
    log.delete({"a": 1, "xs": [1, 2]})
    log.delete({"a": None, "xs": None})
    plan = plan_of(log)
    assert [(r["a"], r["xs"], r[DeltaColumn.COPIES]) for r in plan.rows.to_pylist()] == [(1, [1, 2], 1)]


def test_full_identity_truncate_cut() -> None:
    log = ChangeLog(FULL)
    log.insert({"a": 1, "b": "x", "big": "B"})
    log.truncate()
    log.insert({"a": 2, "b": "y", "big": "C"})
    plan = plan_of(log)
    assert plan.truncate is True
    assert [(r["a"], r[DeltaColumn.COPIES]) for r in plan.rows.to_pylist()] == [(2, 1)]


# -- tables without a key: append-only ---------------------------------------------------------------


def test_keyless_table_is_append_only() -> None:
    rel = relation("events", ("at", INT4), ("what", TEXT))
    log = ChangeLog(rel)
    lsn1 = log.insert({"at": 1, "what": "a"})
    with log.transaction() as lsn2:
        log.insert({"at": 2, "what": "b"})
        log.insert({"at": 2, "what": "b"})  # duplicates are kept
    plan = plan_of(log)
    assert (plan.mode, plan.key, plan.truncate) == ("append", (), False)
    assert [{k: v for k, v in r.items() if k != DeltaColumn.COMMIT_TIME} for r in plan.rows.to_pylist()] == [
        {"at": 1, "what": "a", DeltaColumn.LSN: lsn1},
        {"at": 2, "what": "b", DeltaColumn.LSN: lsn2},
        {"at": 2, "what": "b", DeltaColumn.LSN: lsn2},
    ]
    assert plan.counts == {"inserts": 3}


def test_keyless_table_truncate_and_snapshot() -> None:
    rel = relation("events", ("at", INT4), ("what", TEXT), identity="n")
    log = ChangeLog(rel)
    log.snapshot([{"at": 0, "what": "old"}])
    log.insert({"at": 1, "what": "a"})
    log.truncate()
    log.insert({"at": 2, "what": "b"})
    plan = plan_of(log)
    assert plan.truncate is True
    assert plan.rows.select(["at", "what"]).to_pylist() == [{"at": 2, "what": "b"}]
    ignored = plan_of(log, truncate="ignore")
    assert ignored.truncate is True  # the snapshot still cuts
    assert ignored.rows.column("at").to_pylist() == [0, 1, 2]


# -- schema versions ---------------------------------------------------------------------------------


def test_records_of_older_schema_versions_are_flattened_to_the_latest() -> None:
    """Version 1 (id, n int4, gone text) → version 2 (id, n int8, added text): the dropped column
    disappears, the added one is null in older images, int4 values are widened to int8."""
    v1 = relation("evolving", ("id", INT4, KEY), ("n", INT4), ("gone", TEXT))
    v2 = relation("evolving", ("id", INT4, KEY), ("n", INT8), ("added", TEXT))
    old = ChangeLog(v1)
    lsn1 = old.insert({"id": 1, "n": 5, "gone": "x"})
    old.insert({"id": 2, "n": -7, "gone": "y"})
    lsn3 = old.insert({"id": 3, "n": 2_000_000_000, "gone": "z"})
    new = old.continued(v2)
    lsn2 = new.update({"id": 2, "n": 2**40, "added": "new"})
    lsn4 = new.insert({"id": 4, "n": None, "added": "four"})
    plan = plan_changes([old.chunk(), new.chunk()], v2)
    assert plan.rows.schema.field("n").type == pa.int64()
    assert plan.rows.column_names[:3] == ["id", "n", "added"]
    assert keyed_rows(plan) == [
        upsert({"id": 1, "n": 5, "added": None}, lsn1),
        upsert({"id": 2, "n": 2**40, "added": "new"}, lsn2),
        upsert({"id": 3, "n": 2_000_000_000, "added": None}, lsn3),
        upsert({"id": 4, "n": None, "added": "four"}, lsn4),
    ]
    assert (plan.records, plan.last_lsn) == (5, lsn4)


def test_schema_versions_with_key_changes_and_toast_across_them() -> None:
    v1 = relation("evolving", ("id", INT4, KEY), ("big", TEXT))
    v2 = relation("evolving", ("id", INT8, KEY), ("big", TEXT), ("extra", INT4))
    old = ChangeLog(v1)
    old.insert({"id": 1, "big": "BIG"})
    new = old.continued(v2)
    lsn = new.update({"id": 2**33, "extra": 1}, old={"id": 1}, unchanged=["big"])
    plan = plan_changes([old.chunk(), new.chunk()], v2)
    assert keyed_rows(plan) == [
        {
            "id": 1,
            "big": None,
            "extra": None,
            DeltaColumn.LSN: lsn,
            DeltaColumn.ACTION: "delete",
            DeltaColumn.UNRESOLVED: None,
            DeltaColumn.FILL_KEY: None,
        },
        upsert({"id": 2**33, "big": "BIG", "extra": 1}, lsn),
    ]


def test_empty_chunks_between_versions_are_harmless() -> None:
    v1 = relation("evolving", ("id", INT4, KEY), ("v", TEXT))
    v2 = relation("evolving", ("id", INT4, KEY), ("v", TEXT), ("w", TEXT))
    log = ChangeLog(v1)
    lsn = log.insert({"id": 1, "v": "a"})
    plan = plan_changes([empty_chunk(v1), log.chunk(), empty_chunk(v2)], v2)
    assert keyed_rows(plan) == [upsert({"id": 1, "v": "a", "w": None}, lsn)]


# -- empty input --------------------------------------------------------------------------------------


@pytest.mark.parametrize("rel", [TOASTY, FULL, relation("events", ("at", INT4))], ids=["keyed", "multiset", "append"])
def test_empty_record_tables(rel: Any) -> None:
    plan = plan_changes([empty_chunk(rel), empty_chunk(rel)], rel)
    assert plan.rows.num_rows == 0
    assert (plan.truncate, plan.records, plan.last_lsn) == (False, 0, 0)
    assert set(plan.counts.values()) <= {0}
    assert [c.name for c in rel.columns] == plan.rows.column_names[: len(rel.columns)]
    assert not plan.has_unresolved


@pytest.mark.parametrize("rel", [TOASTY, FULL, relation("events", ("at", INT4))], ids=["keyed", "multiset", "append"])
def test_an_empty_copy_empties_the_table(rel: Any) -> None:
    """A copy chunk without rows is an empty table's copy: it cuts like a snapshot record, so the
    changes before it are dropped and the table emptied; the changes after it apply."""
    log = ChangeLog(rel)
    row = {c.name: None for c in rel.columns} | {rel.columns[0].name: 1}
    log.insert(row)
    after = ChangeLog(rel, start=log.next_commit, xid=log.next_xid)
    lsn = after.insert(row | {rel.columns[0].name: 2})
    copy = replace(empty_chunk(rel), copy=True)
    plan = plan_changes([log.chunk(), copy, after.chunk()], rel)
    assert (plan.truncate, plan.rows.num_rows, plan.last_lsn) == (True, 1, lsn)
    assert plan.rows.column(rel.columns[0].name).to_pylist() == [2]
    alone = plan_changes([log.chunk(), copy], rel, truncate="ignore")  # a copy cuts whatever the setting
    assert (alone.truncate, alone.rows.num_rows) == (True, 0)


def test_no_chunks_at_all_is_refused() -> None:
    with pytest.raises(ValueError, match="nothing to plan"):
        plan_changes([], TOASTY)


def test_chunks_may_hold_any_record_table() -> None:
    """A ChangeChunk is a relation and a table; planning does not depend on chunk boundaries."""
    log = ChangeLog(TOASTY)
    log.insert({"id": 1, "v": "a", "big": "BIG"})
    lsn = log.update({"id": 2, "v": "b"}, old={"id": 1}, unchanged=["big"])
    table = log.table()
    split = [ChangeChunk(TOASTY, table.slice(0, 1)), ChangeChunk(TOASTY, table.slice(1))]
    assert (
        keyed_rows(plan_changes(split, TOASTY))
        == keyed_rows(plan_of(log))
        == [
            gone(1, lsn),
            upsert({"id": 2, "v": "b", "big": "BIG"}, lsn),
        ]
    )


def test_unchanged_toast_key_column_comes_from_the_old_key() -> None:
    """A key value stored out of line is sent as 'u' when unchanged; the old key (always sent
    then) holds it. Not a key change: the row is updated in place."""
    rel = relation("tk", ("k", TEXT, KEY), ("v", INT4), ("big", TEXT))
    log = ChangeLog(rel)
    lsn = log.update({"v": 2}, old={"k": "long key"}, unchanged=["k", "big"])
    lsn2 = log.update({"k": "other", "v": 3, "big": "b"}, old={"k": "other"})
    plan = plan_of(log)
    assert keyed_rows(plan) == [
        upsert({"k": "long key", "v": 2, "big": None}, lsn, ["big"], {"k": "long key"}),
        upsert({"k": "other", "v": 3, "big": "b"}, lsn2),
    ]
    full = relation("tkf", ("k", TEXT), ("v", INT4), identity="f")
    log = ChangeLog(full)
    log.update({"v": 2}, old={"k": "long key", "v": 1}, unchanged=["k"])
    assert sorted((r["k"], r["v"], r[DeltaColumn.COPIES]) for r in plan_of(log).rows.to_pylist()) == [
        ("long key", 1, -1),
        ("long key", 2, 1),
    ]


# -- what the merge may skip -----------------------------------------------------------------------


def shape(*changes: Any, identity: Any = TOASTY, **kwargs: Any) -> str:
    """The shape of the plan of ``changes``: (method, args, kwargs) called on a fresh change log."""
    log = ChangeLog(identity)
    for method, args, options in changes:
        getattr(log, method)(*args, **options)
    return plan_of(log, **kwargs).shape


def test_a_batch_that_only_inserts_is_an_append_unless_truncates_are_ignored() -> None:
    inserts = [("insert", ({"id": k, "v": "a", "big": "x"},), {}) for k in (1, 2, 3)]
    assert shape(*inserts) == "appends"
    # the table may still hold a key the source truncated away and inserts again
    assert shape(*inserts, truncate="ignore") == "any"
    # the table is emptied first: an overwrite, whatever its rows
    assert shape(inserts[0], ("truncate", (), {}), inserts[1]) == "any"
    # a delete then an insert of the same key: the key was in the table
    assert shape(("delete", ({"id": 1},), {}), inserts[0]) == "any"


def test_a_batch_of_updates_and_deletes_under_unchanged_keys_updates_rows_the_table_holds() -> None:
    update = ("update", ({"id": 1, "v": "b", "big": "x"},), {})
    assert shape(update, ("delete", ({"id": 2},), {})) == "updates"
    assert shape(update, truncate="ignore") == "updates"
    assert shape(update, ("update", ({"id": 5, "v": "moved", "big": "x"},), {"old": {"id": 3}})) == "any"
    assert shape(update, ("insert", ({"id": 9, "v": "a", "big": "x"},), {})) == "any"


def test_a_full_identity_batch_that_only_inserts_adds_copies() -> None:
    row = {"a": 1, "b": "x", "big": "B"}
    assert shape(("insert", (row,), {}), ("insert", (row,), {}), identity=FULL) == "appends"
    assert shape(("insert", (row,), {}), ("insert", (row,), {}), identity=FULL, truncate="ignore") == "appends"
    assert shape(("insert", (row,), {}), ("delete", (row,), {}), identity=FULL) == "any"
