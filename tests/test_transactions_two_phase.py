"""Two-phase transactions (cdc_assets/transactions/two_phase.py) through the assembler, on hand-built
rows: Begin Prepare … Prepare and Stream Prepare hand the sink the whole prepared transaction,
Commit Prepared comes after the plain transactions committed before it, Rollback Prepared is
passed on, the checkpoint drops what the log has, and mismatched ends are refused."""

from __future__ import annotations

import pytest

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.messages import (
    BeginPrepareMessage,
    CommitPreparedMessage,
    OriginMessage,
    PrepareMessage,
    RollbackPreparedMessage,
    StreamAbortMessage,
    StreamPrepareMessage,
    StreamStartMessage,
    StreamStopMessage,
)
from cdc_assets.transactions import CommitInfo, TransactionAssembler
from tests.support.assembly import END_OFFSET, T0_US, U_OID, Rows, assemble, insert, message

PATHS = [8192, 3, None]  # block sizes; None: row by row


def begin_prepare(rows: Rows, xid: int, gid: str) -> Rows:
    return rows.add(BeginPrepareMessage(0, 0, T0_US, xid, gid))


def prepare(rows: Rows, xid: int, gid: str, *, streamed: bool = False) -> int:
    """A Prepare (a Stream Prepare if ``streamed``) at the next LSN; returns its end LSN."""
    kind = StreamPrepareMessage if streamed else PrepareMessage
    lsn = rows.lsn
    rows.add(kind(0, lsn, lsn + END_OFFSET, T0_US + xid, xid, gid))
    return lsn + END_OFFSET


def commit_prepared(rows: Rows, xid: int, gid: str) -> int:
    lsn = rows.lsn
    rows.add(CommitPreparedMessage(0, lsn, lsn + END_OFFSET, T0_US + xid, xid, gid))
    return lsn + END_OFFSET


def rollback_prepared(rows: Rows, xid: int, gid: str) -> int:
    lsn = rows.lsn
    rows.add(RollbackPreparedMessage(0, lsn - 0x100, lsn + END_OFFSET, T0_US, T0_US + xid, xid, gid))
    return lsn + END_OFFSET


@pytest.mark.parametrize("block_size", PATHS)
def test_prepared_transaction_is_handed_over_whole(block_size: int | None) -> None:
    rows = Rows().relation().relation(U_OID, "u")
    rows.transaction(700, insert(1, "plain"))
    begin_prepare(rows, 800, "g1").add(OriginMessage(0xABC, "node_a"))
    rows.add(insert(2, "p1"), insert(3, "p2", oid=U_OID), message(b"hi"), insert(4, "p3"))
    end = prepare(rows, 800, "g1")
    rows.transaction(701, insert(5, "plain"))
    assembler = TransactionAssembler()
    sink = assemble(rows, block_size=block_size, assembler=assembler)
    assert sink.changes() == [(700, 0, "insert", 1, "plain"), (701, 0, "insert", 5, "plain")]
    [prepared] = sink.prepares
    assert (prepared.gid, prepared.xid, prepared.prepare_lsn, prepared.end_lsn, prepared.prepare_time_us) == (
        "g1",
        800,
        end - END_OFFSET,
        end,
        T0_US + 800,
    )
    assert (prepared.origin, prepared.origin_lsn) == ("node_a", 0xABC)
    records = {
        (schema.name, r["_cdc_position"], r["new"]["v"]) for schema, batch in prepared.chunks for r in batch.to_pylist()
    }
    assert records == {("t", 0, "p1"), ("u", 1, "p2"), ("t", 3, "p3")}
    assert [(m.position, m.message.content) for m in prepared.messages] == [(2, b"hi")]
    assert assembler.completed == 3


def test_commit_prepared_comes_after_earlier_commits() -> None:
    rows = Rows().relation()
    rows.transaction(700, insert(1, "a"))
    end = commit_prepared(rows, 800, "g1")
    rows.transaction(701, insert(2, "b"))
    sink = assemble(rows)
    assert sink.commit_prepares == [("g1", CommitInfo(800, end - END_OFFSET, end, T0_US + 800, gid="g1"))]
    assert sink.events.index("records public.t") < sink.events.index("commit prepared g1")
    assert sink.changes() == [(700, 0, "insert", 1, "a"), (701, 0, "insert", 2, "b")]


def test_rollback_prepared_is_passed_on() -> None:
    rows = Rows()
    end = rollback_prepared(rows, 800, "g1")
    assembler = TransactionAssembler()
    sink = assemble(rows, assembler=assembler)
    assert sink.rollbacks == [("g1", end)]
    assert assembler.completed == 1 and assembler.last_end_lsn == end


def test_checkpoint_drops_what_the_log_has() -> None:
    rows = Rows().relation()
    begin_prepare(rows, 800, "g1").add(insert(1, "a"))
    prepare(rows, 800, "g1")
    commit_prepared(rows, 800, "g1")
    end = rollback_prepared(rows, 801, "g2")
    assembler = TransactionAssembler()
    sink = assemble(rows, checkpoint_lsn=end, assembler=assembler)
    assert sink.prepares == [] and sink.commit_prepares == [] and sink.rollbacks == []
    assert assembler.completed == 3


def test_stream_prepare_hands_over_the_streamed_transaction() -> None:
    rows = Rows().relation()
    rows.add(StreamStartMessage(900, True), insert(1, "a", xid=900), insert(2, "b", xid=901), StreamStopMessage())
    rows.add(StreamAbortMessage(900, 901, None, None))
    rows.add(StreamStartMessage(900, False), insert(3, "c", xid=900), StreamStopMessage())
    end = prepare(rows, 900, "g9", streamed=True)
    assembler = TransactionAssembler(streaming="on")
    sink = assemble(rows, assembler=assembler)
    [prepared] = sink.prepares
    assert (prepared.gid, prepared.xid, prepared.end_lsn) == ("g9", 900, end)
    assert [(r["_cdc_position"], r["new"]["v"]) for _, b in prepared.chunks for r in b.to_pylist()] == [
        (0, "a"),
        (2, "c"),
    ]
    assert sink.committed == [] and assembler.open_streams == 0


@pytest.mark.parametrize("block_size", [8192, None])
def test_mismatched_ends_are_refused(block_size: int | None) -> None:
    commit_after_begin_prepare = begin_prepare(Rows().relation(), 800, "g1").add(insert(1, "a"))
    commit_after_begin_prepare.commit(800)
    with pytest.raises(DecodeError, match="Commit ends transaction 800, which began with Begin Prepare"):
        assemble(commit_after_begin_prepare, block_size=block_size)

    prepare_after_begin = Rows().relation().begin(700).add(insert(1, "a"))
    prepare(prepare_after_begin, 700, "g1")
    with pytest.raises(DecodeError, match=r"Prepare ends transaction 700, which began with Begin(?! Prepare)"):
        assemble(prepare_after_begin, block_size=block_size)

    lone_prepare = Rows()
    prepare(lone_prepare, 700, "g1")
    with pytest.raises(DecodeError, match="outside a transaction"):
        assemble(lone_prepare, block_size=block_size)

    begin_inside = begin_prepare(Rows().relation(), 800, "g1").begin(801)
    with pytest.raises(DecodeError, match="transaction 801 begins while 800 is still open"):
        assemble(begin_inside, block_size=block_size)

    unfinished = begin_prepare(Rows().relation(), 800, "g1").add(insert(1, "a"))
    with pytest.raises(DecodeError, match="ended inside transaction 800"):
        assemble(unfinished, block_size=block_size)

    unknown_stream = Rows()
    prepare(unknown_stream, 900, "g9", streamed=True)
    with pytest.raises(DecodeError, match="Stream Prepare for transaction 900, which was not streamed"):
        assemble(unknown_stream, block_size=block_size, streaming="on")
