"""Unit tests of the streaming replication protocol's framing messages (XLogData, primary keepalive,
standby status update) on hand-written bytes, with layouts from PostgreSQL's "Streaming Replication
Protocol" documentation; hypothesis round-trips random messages and fuzzes the decoders."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from struct import pack

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cdc_assets.errors import DecodeError
from cdc_assets.stream.protocol import (
    POSTGRES_EPOCH_US,
    PRIMARY_KEEPALIVE,
    STANDBY_STATUS_UPDATE,
    XLOG_DATA,
    PrimaryKeepalive,
    StandbyStatusUpdate,
    XLogData,
    decode_server_message,
)

LSN = 0x16B374D848  # 16/B374D848
LSN_BYTES = bytes.fromhex("00 00 00 16 b3 74 d8 48")
END = 0x16B374D8A0  # 16/B374D8A0
END_BYTES = bytes.fromhex("00 00 00 16 b3 74 d8 a0")
T0 = datetime(2024, 2, 29, 12, 30, 1, 123456, tzinfo=UTC)
T0_UNIX_US = 1_709_209_801_123_456
T0_CLOCK = 762_525_001_123_456  # as sent: µs since 2000-01-01
T0_CLOCK_BYTES = bytes.fromhex("00 02 b5 83 2f d3 06 80")

_lsns = st.integers(0, 2**64 - 1)
_times = st.integers(-(2**63) + POSTGRES_EPOCH_US, 2**63 - 1 + POSTGRES_EPOCH_US)  # the clock fits an int64


def _keepalive_bytes() -> bytes:
    """A valid keepalive, written by hand: 'k', end of WAL, clock, reply requested."""
    return b"k" + END_BYTES + T0_CLOCK_BYTES + b"\x01"


def _decode_error(data: bytes) -> DecodeError:
    with pytest.raises(DecodeError) as caught:
        decode_server_message(data)
    return caught.value


# -- the clocks ----------------------------------------------------------------------------------


def test_postgres_epoch_is_2000_01_01_utc() -> None:
    unix = datetime(1970, 1, 1, tzinfo=UTC)
    assert POSTGRES_EPOCH_US == 946_684_800_000_000
    assert (datetime(2000, 1, 1, tzinfo=UTC) - unix) // timedelta(microseconds=1) == POSTGRES_EPOCH_US
    assert (T0 - unix) // timedelta(microseconds=1) == T0_UNIX_US
    assert T0_CLOCK == T0_UNIX_US - POSTGRES_EPOCH_US
    assert int.from_bytes(T0_CLOCK_BYTES, "big") == T0_CLOCK


def test_clock_zero_is_the_postgres_epoch() -> None:
    message = decode_server_message(b"k" + bytes(8) + bytes(8) + b"\x00")
    assert message == PrimaryKeepalive(wal_end=0, send_time_us=946_684_800_000_000, reply_requested=False)
    assert PrimaryKeepalive(0, 946_684_800_000_000, False).encode() == b"k" + bytes(17)


def test_clock_before_2000_is_negative() -> None:
    """The clock is signed: one microsecond before 2000-01-01 is all ones."""
    message = decode_server_message(b"k" + bytes(8) + b"\xff" * 8 + b"\x00")
    assert isinstance(message, PrimaryKeepalive)
    assert message.send_time_us == POSTGRES_EPOCH_US - 1


# -- exact layouts -------------------------------------------------------------------------------


def test_struct_sizes_match_the_documented_layouts() -> None:
    assert XLOG_DATA.size == 1 + 8 + 8 + 8
    assert PRIMARY_KEEPALIVE.size == 1 + 8 + 8 + 1
    assert STANDBY_STATUS_UPDATE.size == 1 + 8 + 8 + 8 + 8 + 1


def test_keepalive_from_hand_written_bytes() -> None:
    data = _keepalive_bytes()
    assert len(data) == 18
    message = decode_server_message(data)
    assert message == PrimaryKeepalive(wal_end=END, send_time_us=T0_UNIX_US, reply_requested=True)
    assert message.encode() == data
    no_reply = b"k" + END_BYTES + T0_CLOCK_BYTES + b"\x00"
    assert decode_server_message(no_reply) == PrimaryKeepalive(END, T0_UNIX_US, False)
    assert PrimaryKeepalive(END, T0_UNIX_US, False).encode() == no_reply


def test_keepalive_from_struct_pack() -> None:
    data = pack(">cQqB", b"k", 2**64 - 1, -(2**63), 1)
    assert decode_server_message(data) == PrimaryKeepalive(2**64 - 1, -(2**63) + POSTGRES_EPOCH_US, True)


def test_xlog_data_from_hand_written_bytes() -> None:
    payload = b"B" + bytes(20)  # a pgoutput message: opaque here
    data = b"w" + LSN_BYTES + END_BYTES + T0_CLOCK_BYTES + payload
    message = decode_server_message(data)
    assert message == XLogData(start_lsn=LSN, wal_end=END, send_time_us=T0_UNIX_US, data=payload)
    assert type(message.data) is bytes
    assert message.encode() == data


def test_xlog_data_with_no_data() -> None:
    """The header alone is a whole XLogData: its data is empty."""
    data = b"w" + LSN_BYTES + END_BYTES + T0_CLOCK_BYTES
    assert decode_server_message(data) == XLogData(LSN, END, T0_UNIX_US, b"")
    assert XLogData(LSN, END, T0_UNIX_US, b"").encode() == data


def test_xlog_data_whose_data_looks_like_a_keepalive() -> None:
    """The data is everything after the 25-byte header, whatever it holds."""
    inner = _keepalive_bytes()
    message = decode_server_message(b"w" + LSN_BYTES + END_BYTES + T0_CLOCK_BYTES + inner)
    assert isinstance(message, XLogData)
    assert message.data == inner


def test_status_update_hand_written_bytes() -> None:
    update = StandbyStatusUpdate(written=LSN, flushed=END, applied=1, send_time_us=T0_UNIX_US, reply_requested=True)
    expected = b"r" + LSN_BYTES + END_BYTES + bytes(7) + b"\x01" + T0_CLOCK_BYTES + b"\x01"
    assert update.encode() == expected
    assert len(expected) == 34
    assert StandbyStatusUpdate(0, 0, 0, POSTGRES_EPOCH_US, False).encode() == b"r" + bytes(33)


# -- round trips ---------------------------------------------------------------------------------


@given(_lsns, _lsns, _times, st.binary(max_size=200))
def test_xlog_data_round_trips(start: int, end: int, send_time_us: int, data: bytes) -> None:
    message = XLogData(start, end, send_time_us, data)
    encoded = message.encode()
    assert len(encoded) == 25 + len(data)
    assert decode_server_message(encoded) == message


@given(_lsns, _times, st.booleans())
def test_keepalive_round_trips(end: int, send_time_us: int, reply: bool) -> None:
    message = PrimaryKeepalive(end, send_time_us, reply)
    encoded = message.encode()
    assert encoded[0:1] == b"k" and encoded[17] == reply
    assert decode_server_message(encoded) == message


@given(_lsns, _lsns, _lsns, _times, st.booleans())
def test_status_update_encodes_the_documented_layout(
    written: int, flushed: int, applied: int, send_time_us: int, reply: bool
) -> None:
    """'r', three positions, the clock in µs since 2000-01-01, the reply flag (the server only reads it)."""
    encoded = StandbyStatusUpdate(written, flushed, applied, send_time_us, reply).encode()
    assert encoded == b"r" + pack(">QQQqB", written, flushed, applied, send_time_us - POSTGRES_EPOCH_US, reply)


def test_clock_range_ends_round_trip() -> None:
    for send_time_us in (-(2**63) + POSTGRES_EPOCH_US, 2**63 - 1 + POSTGRES_EPOCH_US):
        message = PrimaryKeepalive(0, send_time_us, False)
        assert decode_server_message(message.encode()) == message


# -- malformed input -----------------------------------------------------------------------------


def test_empty_message() -> None:
    error = _decode_error(b"")
    assert str(error) == "cannot decode message at byte 0: an empty message in the replication stream"
    assert (error.message_type, error.offset) == (None, 0)


@pytest.mark.parametrize("kind", [b"r", b"x", b"\x00", b"W", b"K", b"d"])
def test_unknown_type_byte(kind: bytes) -> None:
    error = _decode_error(kind + bytes(17))
    assert str(error) == f"cannot decode message at byte 0: unknown message type {kind!r} in the replication stream"
    assert error.offset == 0


def test_unknown_type_byte_exact_text() -> None:
    assert (
        str(_decode_error(b"x"))
        == "cannot decode message at byte 0: unknown message type b'x' in the replication stream"
    )


def test_every_truncated_keepalive_is_rejected() -> None:
    data = _keepalive_bytes()
    for cut in range(1, len(data)):
        error = _decode_error(data[:cut])
        assert (error.message_type, error.offset) == ("primary keepalive", cut)
        assert str(error) == f"cannot decode primary keepalive message at byte {cut}: {cut} bytes, expected 18"


def test_every_truncated_xlog_data_header_is_rejected() -> None:
    data = b"w" + LSN_BYTES + END_BYTES + T0_CLOCK_BYTES
    for cut in range(1, len(data)):
        error = _decode_error(data[:cut])
        assert (error.message_type, error.offset) == ("XLogData", cut)
        assert str(error) == f"cannot decode XLogData message at byte {cut}: {cut} bytes, expected at least 25"
    assert str(_decode_error(data[:24])) == "cannot decode XLogData message at byte 24: 24 bytes, expected at least 25"


@pytest.mark.parametrize("extra", [b"\x00", b"k", bytes(100)])
def test_keepalive_with_trailing_bytes(extra: bytes) -> None:
    data = _keepalive_bytes() + extra
    error = _decode_error(data)
    assert (error.message_type, error.offset) == ("primary keepalive", 18)
    assert str(error) == f"cannot decode primary keepalive message at byte 18: {len(data)} bytes, expected 18"


@pytest.mark.parametrize("flag", [2, 0x80, 0xFF])
def test_keepalive_reply_flag_neither_0_nor_1(flag: int) -> None:
    error = _decode_error(b"k" + END_BYTES + T0_CLOCK_BYTES + bytes([flag]))
    assert (error.message_type, error.offset) == ("primary keepalive", 17)
    assert str(error) == f"cannot decode primary keepalive message at byte 17: reply flag {flag} is neither 0 nor 1"


def test_keepalive_reply_flag_2_exact_text() -> None:
    error = _decode_error(b"k" + bytes(16) + b"\x02")
    assert str(error) == "cannot decode primary keepalive message at byte 17: reply flag 2 is neither 0 nor 1"


# -- fuzz ----------------------------------------------------------------------------------------

_FUZZ = settings(max_examples=1000, deadline=None)
_framed = st.one_of(
    st.binary(max_size=60),
    st.tuples(st.sampled_from([b"w", b"k", b"r"]), st.binary(max_size=40)).map(lambda t: t[0] + t[1]),
    st.tuples(st.just(b"k"), st.binary(min_size=17, max_size=17)).map(lambda t: t[0] + t[1]),
    st.tuples(st.just(b"r"), st.binary(min_size=33, max_size=33)).map(lambda t: t[0] + t[1]),
)


@_FUZZ
@given(_framed)
def test_random_bytes_decode_or_raise_decode_error(data: bytes) -> None:
    """Whatever the bytes: a message that encodes back to exactly them, or a DecodeError."""
    try:
        message = decode_server_message(data)
    except DecodeError as error:
        assert error.offset is not None and 0 <= error.offset <= len(data)
        return
    assert message.encode() == data


# -- durable -------------------------------------------------------------------------------------


def test_durable_reports_the_lsn_everywhere_now() -> None:
    before = time.time_ns() // 1000
    update = StandbyStatusUpdate.durable(LSN)
    after = time.time_ns() // 1000
    assert (update.written, update.flushed, update.applied) == (LSN, LSN, LSN)
    assert before <= update.send_time_us <= after
    assert update.reply_requested is False
    assert StandbyStatusUpdate.durable(LSN, reply_requested=True).reply_requested is True
    encoded = update.encode()
    assert encoded[1:9] == encoded[9:17] == encoded[17:25] == LSN_BYTES
    assert encoded[25:33] == pack(">q", update.send_time_us - POSTGRES_EPOCH_US) and encoded[33] == 0
