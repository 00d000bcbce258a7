"""Plain transactions (cdc_assets/transactions/plain.py) through the assembler, on hand-built rows:
the numpy path over whole runs agrees with the message-at-a-time path, records carry their
transaction's commit columns and positions, and what a call cannot take whole is refused exactly."""

from __future__ import annotations

from struct import pack

import numpy as np
import pytest

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.messages import InsertMessage, Message, OriginMessage, TruncateMessage, TupleData
from cdc_assets.transactions import TransactionAssembler, spill
from cdc_assets.transactions.plain import BlockView
from tests.support.assembly import (
    END_OFFSET,
    T0_US,
    T_OID,
    U_OID,
    RecordingSink,
    Rows,
    assemble,
    delete,
    insert,
    message,
    update,
)


def many_transactions(count: int = 50) -> Rows:
    """``count`` transactions of 1 to 4 changes on two tables."""
    rows = Rows().relation().relation(U_OID, "u")
    for i in range(count):
        changes: list[Message] = [
            insert(i, f"v{i}"),
            update(i, None, oid=U_OID),
            delete(i - 1),
            insert(-i, "x", oid=U_OID),
        ]
        rows.transaction(1000 + i, *changes[: 1 + i % 4])
    return rows


def outcome(sink: RecordingSink) -> tuple[object, ...]:
    return sink.changes(), sink.changes("public.u"), sink.transaction_rows(), sink.records_of()


def test_block_path_matches_message_path() -> None:
    rows = many_transactions()
    whole = assemble(rows)
    assert outcome(whole) == outcome(assemble(rows, block_size=None))
    # Transactions cut by block boundaries (the run's open transaction is finished row by row).
    for size in (1, 2, 3, 7, 64):
        assert outcome(assemble(rows, block_size=size)) == outcome(whole), size


def test_runs_of_plain_transactions_are_taken_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    rows = many_transactions()
    one_by_one: list[int] = []
    feed = TransactionAssembler.feed

    def counting_feed(self: TransactionAssembler, lsn: int, data: bytes) -> None:
        one_by_one.append(lsn)
        feed(self, lsn, data)

    monkeypatch.setattr(TransactionAssembler, "feed", counting_feed)
    assemble(rows)
    assert one_by_one == [lsn for lsn, _ in rows.rows[:2]]  # the two Relation messages only
    one_by_one.clear()
    assemble(rows, block_size=10)  # each block's first transaction may start in the block before
    assert 2 < len(one_by_one) < len(rows.rows) // 2


def test_records_carry_commit_columns_and_positions() -> None:
    rows = Rows().relation()
    first_end = rows.transaction(700, insert(1, "a"), update(1, "b"), delete(1))
    second_end = rows.transaction(701, insert(2, None))
    sink = assemble(rows)
    assert sink.changes() == [
        (700, 0, "insert", 1, "a"),
        (700, 1, "update", 1, "b"),
        (700, 2, "delete", 1, None),
        (701, 0, "insert", 2, None),
    ]
    records = sink.records_of()
    assert [(r["_cdc_commit_lsn"], r["_cdc_end_lsn"]) for r in records] == [(first_end - END_OFFSET, first_end)] * 3 + [
        (second_end - END_OFFSET, second_end)
    ]
    assert records[0]["_cdc_commit_time"].timestamp() * 1_000_000 == pytest.approx(T0_US + 700)
    assert sink.transaction_rows() == [
        (700, first_end - END_OFFSET, first_end, T0_US + 700, 3),
        (701, second_end - END_OFFSET, second_end, T0_US + 701, 1),
    ]


def test_checkpoint_drops_transactions_the_log_has() -> None:
    rows = Rows().relation()
    ends = [rows.transaction(700 + i, insert(i, "a")) for i in range(4)]
    for block_size in (8192, None):
        assembler = TransactionAssembler()
        sink = assemble(rows, block_size=block_size, checkpoint_lsn=ends[1], assembler=assembler)
        assert [x for x, *_ in sink.transaction_rows()] == [702, 703]
        assert [c[0] for c in sink.changes()] == [702, 703]
        assert assembler.completed == 4 and assembler.last_end_lsn == ends[3]


def test_truncate_message_and_origin_keep_positions_and_counts() -> None:
    rows = Rows().relation().relation(U_OID, "u")
    rows.begin(700).add(
        OriginMessage(0xABC, "node_a"),
        insert(1, "a"),
        message(b"hello"),
        TruncateMessage(None, 1, (16400, U_OID)),
        insert(2, "b"),
    )
    rows.commit(700)
    for block_size in (8192, None):
        sink = assemble(rows, block_size=block_size)
        assert sink.changes() == [
            (700, 0, "insert", 1, "a"),
            (700, 2, "truncate", None, None),
            (700, 3, "insert", 2, "b"),
        ]
        [truncated] = sink.records_of("public.u")
        assert truncated["_cdc_position"] == 2 and truncated["_cdc_truncate"]["cascade"]
        [(info, changes, messages)] = sink.committed
        assert (info.origin, info.origin_lsn) == ("node_a", 0xABC)
        assert changes == 4  # two inserts, one truncate record per relation; the message is none
        assert [(m.position, m.message.content) for m in messages] == [(1, b"hello")]


def test_standalone_message_is_handed_over_at_its_lsn() -> None:
    rows = Rows().add(message(b"now", transactional=False))
    sink = assemble(rows)
    assert [(lsn, m.content) for lsn, m in sink.standalone] == [(rows.rows[0][0], b"now")]


def test_new_schema_of_a_table_converts_the_older_first() -> None:
    rows = Rows().relation()
    rows.transaction(700, insert(1, "a"))
    rows.relation(extra_column=True)
    rows.transaction(701, InsertMessage(None, T_OID, TupleData("ttt", (b"2", b"b", b"c"))))
    sink = assemble(rows)
    assert [len(r.columns) for r, _ in sink.batches] == [2, 3]
    assert sink.changes() == [(700, 0, "insert", 1, "a"), (701, 0, "insert", 2, "b")]


@pytest.mark.parametrize("block_size", [10, None])
def test_large_batches_are_written_before_the_call_ends(
    monkeypatch: pytest.MonkeyPatch, block_size: int | None
) -> None:
    rows = many_transactions(200)
    expected = outcome(assemble(rows))
    monkeypatch.setattr(spill, "CHUNK_ROWS", 8)
    sink = RecordingSink()
    assembler = TransactionAssembler()
    assembler.start_session(sink, 0)
    if block_size is None:
        for lsn, data in rows.rows:
            assembler.feed(lsn, data)
    else:
        assembler.feed_blocks(rows.blocks(block_size))
    written = len(sink.batches)
    assembler.end_session()
    assert written > 10  # memory stays bounded: written as the call goes, not only at its end
    assert outcome(sink) == expected


@pytest.mark.parametrize("block_size", [8192, None])
def test_errors_name_the_problem_and_the_lsn(block_size: int | None) -> None:
    unknown = Rows().relation()
    unknown.transaction(700, insert(1, "a", oid=99))
    with pytest.raises(DecodeError, match="unknown relation OID 99") as caught:
        assemble(unknown, block_size=block_size)
    assert caught.value.lsn == unknown.rows[2][0]

    outside = Rows().relation().add(insert(1, "a"))
    with pytest.raises(DecodeError, match="outside a transaction"):
        assemble(outside, block_size=block_size)

    nested = Rows().relation().begin(700).begin(701)
    with pytest.raises(DecodeError, match="transaction 701 begins while 700 is still open"):
        assemble(nested, block_size=block_size)

    unfinished = Rows().relation().begin(700).add(insert(1, "a"))
    with pytest.raises(DecodeError, match="ended inside transaction 700"):
        assemble(unfinished, block_size=block_size)


def test_malformed_rows_in_a_run_fall_back_to_exact_errors() -> None:
    rows = Rows().relation().begin(700).add(insert(1, "a"))
    rows.raw(b"C" + pack(">BQQ", 0, rows.lsn, rows.lsn + 8))  # a Commit cut short
    with pytest.raises(DecodeError, match="Commit") as caught:
        assemble(rows)
    assert caught.value.lsn == rows.rows[-1][0]


def test_block_view_reads_big_endian_integers_at_any_offset() -> None:
    view = BlockView(b"\x07" + pack(">Iq", 0xDEADBEEF, -5))
    assert view.u8[0] == 7 and view.u32[1] == 0xDEADBEEF and view.i64[5] == -5
    assert view.i64[np.array([5])].tolist() == [-5]
    assert len(view.u8) >= 13 + 7  # padded: an 8-byte read at the last byte stays in bounds
