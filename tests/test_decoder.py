"""Unit tests of the message-at-a-time decoder on hand-built bytes (layouts from proto.c)."""

from __future__ import annotations

from datetime import UTC, datetime
from struct import pack

import pytest

from cdc_assets.errors import DecodeError
from cdc_assets.lsn import format_lsn, parse_lsn
from cdc_assets.pgoutput.decoder import PgoutputDecoder
from cdc_assets.pgoutput.messages import (
    POSTGRES_EPOCH_US,
    BeginMessage,
    CommitMessage,
    DeleteMessage,
    InsertMessage,
    LogicalDecodingMessage,
    RelationColumn,
    RelationMessage,
    StreamAbortMessage,
    StreamStartMessage,
    TruncateMessage,
    TupleData,
    TupleDataColumn,
    UpdateMessage,
)
from tests.support.pgoutput_writer import encode, tuple_data

T0 = datetime(2024, 2, 29, 12, 30, 1, 123456, tzinfo=UTC)
T0_UNIX_US = 1_709_209_801_123_456
T0_MICROS = T0_UNIX_US - POSTGRES_EPOCH_US  # as sent: since 2000-01-01


def test_lsn_text_round_trip() -> None:
    assert format_lsn(0x16B374D848) == "16/B374D848"
    assert parse_lsn("16/B374D848") == 0x16B374D848
    assert parse_lsn("0/0") == 0
    assert format_lsn(parse_lsn("FFFFFFFF/FFFFFFFF")) == "FFFFFFFF/FFFFFFFF"
    with pytest.raises(ValueError):
        parse_lsn("16-B374")


def test_begin_and_commit_fields() -> None:
    decoder = PgoutputDecoder()
    begin = decoder.decode(b"B" + pack(">QqI", 0x1234, T0_MICROS, 741))
    assert begin == BeginMessage(final_lsn=0x1234, commit_time_us=T0_UNIX_US, xid=741)
    assert begin.commit_time == T0
    commit = decoder.decode(b"C" + pack(">BQQq", 0, 0x1234, 0x1260, T0_MICROS))
    assert commit == CommitMessage(flags=0, commit_lsn=0x1234, end_lsn=0x1260, commit_time_us=T0_UNIX_US)


def test_relation_columns_and_key_flags() -> None:
    body = pack(">I", 16384) + b"public\0orders\0" + b"d" + pack(">H", 2)
    body += pack(">B", 1) + b"id\0" + pack(">Ii", 23, -1)
    body += pack(">B", 0) + b"amount\0" + pack(">Ii", 1700, (10 << 16 | 2) + 4)
    relation = PgoutputDecoder().decode(b"R" + body)
    assert relation == RelationMessage(
        xid=None,
        relation_oid=16384,
        namespace="public",
        relation_name="orders",
        replica_identity="d",
        columns=(RelationColumn(1, "id", 23, -1), RelationColumn(0, "amount", 1700, 655366)),
    )
    assert [c.is_key for c in relation.columns] == [True, False]
    assert relation.qualified_name == "public.orders"


def test_tuple_kinds_n_u_t_b() -> None:
    data = TupleData("ntub", (None, b"42", None, b"\x00\x01"))
    message = PgoutputDecoder().decode(b"I" + pack(">I", 7) + b"N" + tuple_data(data))
    assert message == InsertMessage(xid=None, relation_oid=7, new_tuple=data)
    assert message.new_tuple.columns[1] == TupleDataColumn("t", b"42")


def test_update_old_key_old_tuple_and_none() -> None:
    new = TupleData("tt", (b"2", b"x"))
    key = TupleData("tn", (b"1", None))
    decoder = PgoutputDecoder()
    for message in (
        UpdateMessage(None, 9, None, None, new),
        UpdateMessage(None, 9, key, None, new),
        UpdateMessage(None, 9, None, TupleData("tt", (b"1", b"y")), new),
    ):
        assert decoder.decode(encode(message)) == message


def test_delete_requires_key_or_old_tuple() -> None:
    with pytest.raises(DecodeError, match=r"Delete message at byte 5: expected 'K' or 'O', got 'N'"):
        PgoutputDecoder().decode(b"D" + pack(">I", 9) + b"N" + tuple_data(TupleData("t", (b"1",))))
    key = DeleteMessage(None, 9, TupleData("t", (b"1",)), None)
    assert PgoutputDecoder().decode(encode(key)) == key


def test_truncate_options() -> None:
    message = PgoutputDecoder().decode(b"T" + pack(">IB3I", 3, 3, 10, 11, 12))
    assert message == TruncateMessage(xid=None, options=3, relation_oids=(10, 11, 12))
    assert message.cascade and message.restart_identity


def test_logical_message_content_and_flags() -> None:
    message = LogicalDecodingMessage(None, 1, 0xABC, "audit", b"\x00payload\xff")
    decoded = PgoutputDecoder().decode(encode(message))
    assert decoded == message and decoded.transactional


def test_stream_block_prefixes_xid_on_changes() -> None:
    decoder = PgoutputDecoder(streaming="on")
    assert decoder.decode(b"S" + pack(">IB", 900, 1)) == StreamStartMessage(900, True)
    assert decoder.in_stream
    insert = decoder.decode(b"I" + pack(">II", 901, 7) + b"N" + tuple_data(TupleData("t", (b"1",))))
    assert insert == InsertMessage(xid=901, relation_oid=7, new_tuple=TupleData("t", (b"1",)))
    decoder.decode(b"E")
    assert not decoder.in_stream
    outside = decoder.decode(b"I" + pack(">I", 7) + b"N" + tuple_data(TupleData("t", (b"1",))))
    assert outside.xid is None


def test_stream_abort_fields_depend_on_parallel_streaming() -> None:
    plain = PgoutputDecoder(streaming="on").decode(b"A" + pack(">II", 900, 903))
    assert plain == StreamAbortMessage(900, 903, None, None)
    body = b"A" + pack(">IIQq", 900, 903, 0x5000, T0_MICROS)
    parallel = PgoutputDecoder(streaming="parallel").decode(body)
    assert parallel == StreamAbortMessage(900, 903, 0x5000, T0_UNIX_US) and parallel.abort_time == T0
    with pytest.raises(DecodeError, match="expected 9 bytes, got 25"):
        PgoutputDecoder(streaming="on").decode(body)


@pytest.mark.parametrize(
    ("data", "pattern"),
    [
        (b"", r"empty message"),
        (b"Z\x00", r"unknown type 'Z' \(0x5a\) message at byte 0: unknown message type"),
        (b"B" + bytes(19), r"Begin message at byte 20: expected 21 bytes, got 20"),
        (b"C" + bytes(26), r"Commit message at byte 26: expected 26 bytes, got 27"),
        (b"C\x02" + bytes(24), r"Commit message at byte 1: unknown flags 0x02"),
        (b"R" + pack(">I", 1) + b"public", r"Relation message at byte 5: string has no terminating NUL"),
        (
            b"I" + pack(">I", 7) + b"N" + pack(">h", 1) + b"t" + pack(">i", 5) + b"ab",
            r"Insert message at byte 9: column 0 has length 5 but 2 bytes remain",
        ),
        (
            b"I" + pack(">I", 7) + b"N" + pack(">h", 2) + b"n",
            r"Insert message at byte 9: tuple ends after 1 of 2 columns",
        ),
        (
            b"I" + pack(">I", 7) + b"N" + pack(">h", 1) + b"x",
            r"Insert message at byte 8: unknown column kind 'x' in column 0",
        ),
        (
            b"I" + pack(">I", 7) + b"N" + pack(">h", 1) + b"n!!",
            r"Insert message at byte 9: 2 unexpected trailing bytes",
        ),
        (b"I" + pack(">I", 7) + b"X", r"Insert message at byte 5: expected 'N' before the new tuple, got 'X'"),
        (b"U" + pack(">I", 7), r"Update message at byte 1: needs 5 bytes here but only 4 remain"),
        (b"T" + pack(">IB", 2, 0) + pack(">I", 1), r"Truncate message at byte 10: expected 14 bytes, got 10"),
        (
            b"M" + pack(">BQ", 1, 5) + b"p\0" + pack(">i", -1),
            r"Logical Decoding message at byte 12: negative content length",
        ),
        (b"E", r"Stream Stop message at byte 0: Stream Stop outside a stream block"),
        (b"B" + pack(">QqI", 1, 2**63 - 1, 3), r"Begin message at byte 9: timestamp .* out of range"),
        (b"C" + pack(">BQQq", 0, 1, 2, -(2**62)), r"Commit message at byte 18: timestamp .* out of range"),
    ],
)
def test_malformed_input_names_type_and_offset(data: bytes, pattern: str) -> None:
    with pytest.raises(DecodeError, match=pattern):
        PgoutputDecoder().decode(data)


def test_decode_error_carries_caller_position() -> None:
    with pytest.raises(DecodeError) as caught:
        PgoutputDecoder().decode(b"Q")
    located = caught.value.at(lsn=0x16B374D848, slot="cdc_slot")
    assert str(located).endswith("(slot cdc_slot, LSN 16/B374D848)")
    assert located.message_type == caught.value.message_type and located.offset == 0


def test_streaming_mode_is_validated() -> None:
    with pytest.raises(ValueError, match="streaming must be"):
        PgoutputDecoder(streaming="true")  # type: ignore[arg-type]
