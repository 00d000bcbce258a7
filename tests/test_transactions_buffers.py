"""Change buffers (cdc_assets/transactions/buffers.py): raw messages converted in chunks with their
positions and tags, an older schema's changes converted before a newer one's, a Truncate after
what was buffered, positions dropped from raw and converted changes alike, and a transaction
buffered on its own."""

from __future__ import annotations

import numpy as np
import pytest

from cdc_assets.pgoutput.messages import TruncateMessage
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.transactions import spill
from cdc_assets.transactions.buffers import Buffers, OwnTransaction, RecordBuilders, Segment, combine
from tests.support.assembly import insert, message
from tests.support.pgoutput_writer import encode
from tests.support.records import INT4, TEXT, relation

T = relation("t", ("id", INT4, True), ("v", TEXT))
T2 = relation("t", ("id", INT4, True), ("v", TEXT), ("w", TEXT))  # a later schema of the same table
TRUNCATE = TruncateMessage(None, 0, (T.relation_oid,))


def rows(buffers: Buffers) -> list[tuple[int, str, int | None, int]]:
    """``(position, op, id, tag)`` of every converted record, per table in order (emptying the queues)."""
    out = []
    for queue in buffers.converted.values():
        for _, records, tags in queue.pop_all():
            for row, tag in zip(records.to_pylist(), tags.tolist()):
                out.append((row["_cdc_position"], row["_cdc_op"], (row["new"] or {}).get("id"), tag))
    return out


def test_segments_combine_over_one_buffer() -> None:
    first = Segment.of([b"ab", b"cde"], [0, 1])
    second = Segment.of([b"f"], [5])
    joined = combine([first, second])
    assert [joined.data[s:e] for s, e in zip(joined.starts, joined.ends)] == [b"ab", b"cde", b"f"]
    assert joined.seqs.tolist() == [0, 1, 5]
    assert combine([first]) is first
    picked = joined.select(np.array([False, True, True]))
    assert [picked.data[s:e] for s, e in zip(picked.starts, picked.ends)] == [b"cde", b"f"]


def test_record_builders_make_one_builder_per_schema() -> None:
    builders = RecordBuilders(TypeCatalog())
    assert builders(T) is builders(T) and builders(T2) is not builders(T)


def test_changes_are_converted_in_chunks_with_positions(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(spill, "CHUNK_ROWS", 3)
    buffers = Buffers(RecordBuilders(TypeCatalog()), False, None)
    raw = buffers.buffer(T)
    for i in range(4):
        buffers.add(raw, encode(insert(i, "x")), i)
    assert raw.rows == 1 and buffers.raw_rows == 1  # the first three were converted at the chunk size
    assert rows(buffers) == [(0, "insert", 0, 0), (1, "insert", 1, 0), (2, "insert", 2, 0)]
    buffers.convert_all()
    assert rows(buffers) == [(3, "insert", 3, 0)] and buffers.raw_rows == 0


def test_sequence_numbers_are_located_in_their_transactions() -> None:
    def locate(seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return seqs % 10, seqs // 10  # transaction n numbers its changes 10n, 10n + 1, ...

    buffers = Buffers(RecordBuilders(TypeCatalog()), False, None, locate)
    raw = buffers.buffer(T)
    for seq in (3, 11, 12):
        buffers.add(raw, encode(insert(seq, "x")), seq)
    buffers.convert_all()
    assert rows(buffers) == [(3, "insert", 3, 0), (1, "insert", 11, 1), (2, "insert", 12, 1)]


def test_a_new_schema_converts_the_older_changes_first() -> None:
    buffers = Buffers(RecordBuilders(TypeCatalog()), False, None)
    buffers.add(buffers.buffer(T), encode(insert(1, "x")), 0)
    assert buffers.buffer(T) is buffers.buffer(T)
    newer = buffers.buffer(T2)
    assert buffers.raw_rows == 0 and newer.rows == 0
    [(schema, records, _)] = list(buffers.converted["public.t"].pop_all())
    assert schema == T and records.num_rows == 1


def test_the_buffer_of_a_schema_is_found_again_until_discarded() -> None:
    buffers = Buffers(RecordBuilders(TypeCatalog()), False, None)
    raw = buffers.buffer(T)
    same = relation("t", ("id", INT4, True), ("v", TEXT))  # equal, not identical (sent again by a later call)
    assert buffers.buffer(same) is raw and buffers.buffer(T) is raw
    buffers.add(raw, encode(insert(1, "x")), 0)
    buffers.discard()
    fresh = buffers.buffer(T)
    assert fresh is not raw and buffers.raw == {"public.t": fresh}
    buffers.add(fresh, encode(insert(2, "y")), 0)
    buffers.convert_all()
    assert rows(buffers) == [(0, "insert", 2, 0)]


def test_a_truncate_comes_after_what_was_buffered() -> None:
    buffers = Buffers(RecordBuilders(TypeCatalog()), False, None)
    buffers.add(buffers.buffer(T), encode(insert(1, "x")), 0)
    buffers.add_truncate([T], TRUNCATE, 1, 4)
    buffers.add(buffers.buffer(T), encode(insert(2, "y")), 2)
    buffers.convert_all()
    assert rows(buffers) == [(0, "insert", 1, 0), (1, "truncate", None, 4), (2, "insert", 2, 0)]


@pytest.mark.parametrize("converted_before", [False, True])
def test_drop_positions_from_raw_and_converted_changes(converted_before: bool) -> None:
    buffers = Buffers(RecordBuilders(TypeCatalog()), False, None)
    for position in range(6):
        buffers.add(buffers.buffer(T), encode(insert(position, "x")), position)
        if converted_before and position == 3:
            buffers.convert_all()
    buffers.drop_positions(2, 5)
    assert buffers.raw_rows == (1 if converted_before else 3)
    buffers.convert_all()
    assert [p for p, *_ in rows(buffers)] == [0, 1, 5]


def test_own_transaction_numbers_everything_by_position() -> None:
    txn = OwnTransaction(800, Buffers(RecordBuilders(TypeCatalog()), False, None))
    txn.add_change(T, encode(insert(1, "a")))
    txn.add_message(message(b"m"))
    txn.add_truncate([T], TRUNCATE)
    txn.add_change(T, encode(insert(2, "b")))
    txn.set_origin("node_a", 0xABC)
    chunks = list(txn.chunks())
    assert [(r["_cdc_position"], r["_cdc_op"]) for _, b in chunks for r in b.to_pylist()] == [
        (0, "insert"),
        (2, "truncate"),
        (3, "insert"),
    ]
    assert [m.position for m in txn.messages] == [1] and (txn.origin, txn.origin_lsn) == ("node_a", 0xABC)
    assert list(txn.chunks()) == []  # taken out of the buffers
