"""Streamed transactions (cdc_assets/transactions/streamed.py) through the assembler, on hand-built
rows: blocks interleaved with plain transactions, subtransaction aborts (also after chunks were
converted and spilled), whole aborts, streams a call leaves open, and the errors."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

import pytest

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.messages import (
    StreamAbortMessage,
    StreamCommitMessage,
    StreamStartMessage,
    StreamStopMessage,
    TruncateMessage,
)
from cdc_assets.transactions import TransactionAssembler, spill
from tests.support.assembly import END_OFFSET, T0_US, T_OID, U_OID, RecordingSink, Rows, assemble, insert, message

PATHS = [8192, 3, None]  # block sizes; None: row by row


def stream_commit(rows: Rows, xid: int) -> int:
    """A Stream Commit at the next LSN; returns its end LSN."""
    commit_lsn = rows.lsn
    rows.add(StreamCommitMessage(xid, 0, commit_lsn, commit_lsn + END_OFFSET, T0_US + xid))
    return commit_lsn + END_OFFSET


def start(xid: int, first: bool = True) -> StreamStartMessage:
    return StreamStartMessage(xid, first)


def abort(xid: int, subxid: int) -> StreamAbortMessage:
    return StreamAbortMessage(xid, subxid, None, None)


@pytest.mark.parametrize("block_size", PATHS)
def test_streamed_transaction_follows_the_plain_ones_committed_before(block_size: int | None) -> None:
    rows = Rows().relation()
    rows.add(start(900), insert(1, "s1", xid=900), insert(2, "s2", xid=901), StreamStopMessage())
    rows.transaction(700, insert(10, "p"))
    rows.add(start(900, first=False))
    rows.relation(xid=900)  # sent again inside the block: the same schema
    rows.add(insert(3, "s3", xid=900), StreamStopMessage())
    end = stream_commit(rows, 900)
    rows.transaction(701, insert(11, "q"))
    sink = assemble(rows, block_size=block_size, streaming="on")
    assert sink.changes() == [
        (700, 0, "insert", 10, "p"),
        (900, 0, "insert", 1, "s1"),
        (900, 1, "insert", 2, "s2"),
        (900, 2, "insert", 3, "s3"),
        (701, 0, "insert", 11, "q"),
    ]
    assert [x for x, *_ in sink.transaction_rows()] == [700, 900, 701]
    assert sink.transaction_rows()[1] == (900, end - END_OFFSET, end, T0_US + 900, 3)
    assert {r["_cdc_end_lsn"] for r in sink.records_of() if r["_cdc_xid"] == 900} == {end}


@pytest.mark.parametrize(("chunk_rows", "spill_bytes"), [(spill.CHUNK_ROWS, spill.SPILL_BYTES), (2, 1)])
def test_subtransaction_abort_drops_it_and_every_later_change(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, chunk_rows: int, spill_bytes: int
) -> None:
    """With tiny limits the aborted changes were converted and spilled already when the abort comes."""
    monkeypatch.setattr(spill, "CHUNK_ROWS", chunk_rows)
    monkeypatch.setattr(spill, "SPILL_BYTES", spill_bytes)
    spilled: list[str] = []
    mkstemp = tempfile.mkstemp

    def counting_mkstemp(*args: Any, **kwargs: Any) -> Any:
        handle, path = mkstemp(*args, **kwargs)
        spilled.append(path)
        return handle, path

    monkeypatch.setattr(tempfile, "mkstemp", counting_mkstemp)
    rows = Rows().relation().relation(U_OID, "u")
    rows.add(start(900), insert(1, "keep", xid=900), message(b"kept", xid=900))
    rows.add(insert(2, "sub", xid=901), message(b"dropped", xid=901), insert(3, "nested", xid=902))
    rows.add(TruncateMessage(902, 0, (U_OID,)), insert(4, "later", xid=900), insert(5, "later", xid=900))
    rows.add(StreamStopMessage(), abort(900, 901), abort(900, 999))  # 999 made no change here
    rows.add(start(900, first=False), insert(6, "after", xid=900), StreamStopMessage())
    stream_commit(rows, 900)
    assembler = TransactionAssembler(streaming="on", spill_dir=str(tmp_path))
    sink = assemble(rows, assembler=assembler)
    assert sink.changes() == [(900, 0, "insert", 1, "keep"), (900, 8, "insert", 6, "after")]
    assert sink.records_of("public.u") == []
    [(_, changes, messages)] = sink.committed
    assert changes == 2 and [(m.position, m.message.content) for m in messages] == [(1, b"kept")]
    assert len(spilled) >= (5 if spill_bytes == 1 else 0)
    assert list(tmp_path.iterdir()) == []  # spilled files are deleted once read back


def test_truncate_of_a_subtransaction_is_dropped_with_it() -> None:
    rows = Rows().relation()
    rows.add(start(900), insert(1, "a", xid=900), TruncateMessage(901, 0, (T_OID,)), StreamStopMessage())
    rows.add(abort(900, 901))
    rows.add(start(900, first=False), TruncateMessage(900, 0, (T_OID,)), StreamStopMessage())
    stream_commit(rows, 900)
    sink = assemble(rows, streaming="on")
    assert sink.changes() == [(900, 0, "insert", 1, "a"), (900, 2, "truncate", None, None)]


@pytest.mark.parametrize("block_size", PATHS)
def test_abort_of_the_whole_transaction_drops_it(block_size: int | None) -> None:
    rows = Rows().relation()
    rows.add(start(900), insert(1, "a", xid=900), insert(2, "b", xid=901), StreamStopMessage())
    rows.add(abort(900, 900), abort(950, 950))  # 950 was not streamed in this call
    rows.transaction(700, insert(3, "c"))
    assembler = TransactionAssembler(streaming="on")
    sink = assemble(rows, block_size=block_size, assembler=assembler)
    assert sink.changes() == [(700, 0, "insert", 3, "c")]
    assert assembler.completed == 1 and assembler.open_streams == 0


def test_streams_a_call_leaves_open_are_forgotten() -> None:
    first = Rows().relation()
    first.add(start(900), insert(1, "a", xid=900), StreamStopMessage())
    first.transaction(700, insert(2, "b"))
    assembler = TransactionAssembler(streaming="on")
    sink = RecordingSink()
    assembler.start_session(sink, 0)
    assembler.feed_blocks(first.blocks())
    assert assembler.open_streams == 1
    assembler.end_session()
    assert assembler.open_streams == 0 and sink.changes() == [(700, 0, "insert", 2, "b")]

    again = Rows(start_lsn=first.lsn).relation()  # the next call sends the stream again whole
    again.add(start(900), insert(1, "a", xid=900), StreamStopMessage())
    stream_commit(again, 900)
    assert assemble(again, assembler=assembler).changes() == [(900, 0, "insert", 1, "a")]


def test_checkpoint_drops_a_streamed_transaction_the_log_has() -> None:
    rows = Rows().relation()
    rows.add(start(900), insert(1, "a", xid=900), StreamStopMessage())
    end = stream_commit(rows, 900)
    assembler = TransactionAssembler(streaming="on")
    sink = assemble(rows, checkpoint_lsn=end, assembler=assembler)
    assert sink.committed == [] and sink.batches == []
    assert assembler.completed == 1 and assembler.last_end_lsn == end


def test_stream_errors() -> None:
    continued = Rows().relation().add(start(900, first=False))
    with pytest.raises(DecodeError, match="Stream Start continues transaction 900, whose first segment"):
        assemble(continued, streaming="on")
    unknown = Rows().relation()
    stream_commit(unknown, 900)
    with pytest.raises(DecodeError, match="Stream Commit for transaction 900, which was not streamed") as caught:
        assemble(unknown, streaming="on")
    assert caught.value.lsn == unknown.rows[-1][0]
    outside = Rows().relation().add(start(900), insert(1, "a", oid=99, xid=900))
    with pytest.raises(DecodeError, match="unknown relation OID 99"):
        assemble(outside, streaming="on")


def test_a_stream_left_open_at_a_batch_end_commits_in_a_later_batch_of_the_session() -> None:
    """A following drain ends batches while a streamed transaction is open: its changes stay
    buffered and go, whole, to the batch its Stream Commit arrives in."""
    first = Rows().relation()
    first.add(start(900), insert(1, "a", xid=900), StreamStopMessage())
    first.transaction(700, insert(2, "b"))
    assembler = TransactionAssembler(streaming="on")
    before, after = RecordingSink(), RecordingSink()
    assembler.start_session(before, 0)
    assembler.feed_blocks(first.blocks())
    assert assembler.between_transactions and assembler.open_streams == 1
    assembler.flush()
    assembler.next_batch(after, first.lsn)
    rest = Rows(start_lsn=first.lsn)
    rest.add(start(900, first=False), insert(3, "c", xid=900), StreamStopMessage())
    stream_commit(rest, 900)
    assembler.feed_blocks(rest.blocks())
    assembler.end_session()
    assert before.changes() == [(700, 0, "insert", 2, "b")]
    assert after.changes() == [(900, 0, "insert", 1, "a"), (900, 1, "insert", 3, "c")]


def test_discard_forgets_what_a_lost_session_buffered_with_its_spill_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(spill, "CHUNK_ROWS", 2)
    monkeypatch.setattr(spill, "SPILL_BYTES", 1)
    rows = Rows().relation()
    rows.add(start(900), *[insert(i, "x", xid=900) for i in range(10)], StreamStopMessage())
    assembler = TransactionAssembler(streaming="on", spill_dir=str(tmp_path))
    sink = RecordingSink()
    assembler.start_session(sink, 0)
    assembler.feed_blocks(rows.blocks())
    assert list(tmp_path.iterdir()), "nothing was spilled: the test does not test discard"
    assembler.discard()
    assert assembler.open_streams == 0 and list(tmp_path.iterdir()) == []
    assert sink.changes() == []
