"""The streaming replication protocol's own messages, inside CopyData, one type each.

Server → client: :class:`XLogData` (one pgoutput message and where it is in the WAL) and
:class:`PrimaryKeepalive`; client → server: :class:`StandbyStatusUpdate`. Each layout is written
once, as the ``Struct`` of its fixed part (the type byte first); the server's messages decode from
exactly the bytes they encode to, and the client's encodes. LSNs are ints; the clocks, sent as microseconds since
2000-01-01, are kept as microseconds since the Unix epoch (``*_time_us``), as in
:mod:`cdc_assets.pgoutput.messages`.

This module must stay light: the receiving process (:mod:`cdc_assets.stream.child`) imports it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from struct import Struct
from typing import ClassVar

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.messages import POSTGRES_EPOCH_US

XLOG_DATA = Struct(">cQQq")
"""``'w'``, the WAL position of the data, the server's end of WAL, its clock; the data follows."""
PRIMARY_KEEPALIVE = Struct(">cQqB")
"""``'k'``, the server's end of WAL, its clock, 1 if a reply is wanted now."""
STANDBY_STATUS_UPDATE = Struct(">cQQQqB")
"""``'r'``, positions written, flushed, applied (each the last byte + 1), the client's clock, 1 to
ask for a keepalive at once."""


def now_us() -> int:
    """The wall clock in microseconds since the Unix epoch."""
    return time.time_ns() // 1000


@dataclass(slots=True, frozen=True)
class XLogData:
    """One pgoutput message (``data``) decoded at ``start_lsn``. For a logical slot the server
    sends the same position as ``wal_end``."""

    TYPE: ClassVar[bytes] = b"w"

    start_lsn: int
    wal_end: int
    send_time_us: int
    data: bytes

    def encode(self) -> bytes:
        return (
            XLOG_DATA.pack(self.TYPE, self.start_lsn, self.wal_end, self.send_time_us - POSTGRES_EPOCH_US) + self.data
        )


@dataclass(slots=True, frozen=True)
class PrimaryKeepalive:
    """The server's position: every transaction that committed before ``wal_end`` has been sent
    before this message. ``reply_requested``: answer with a :class:`StandbyStatusUpdate` now, or
    be disconnected at ``wal_sender_timeout``."""

    TYPE: ClassVar[bytes] = b"k"

    wal_end: int
    send_time_us: int
    reply_requested: bool

    def encode(self) -> bytes:
        return PRIMARY_KEEPALIVE.pack(
            self.TYPE, self.wal_end, self.send_time_us - POSTGRES_EPOCH_US, self.reply_requested
        )


@dataclass(slots=True, frozen=True)
class StandbyStatusUpdate:
    """The client's positions. For a logical slot ``flushed`` becomes the slot's
    ``confirmed_flush_lsn``: it must never pass what the change log holds durably (invariant 2)."""

    TYPE: ClassVar[bytes] = b"r"

    written: int
    flushed: int
    applied: int
    send_time_us: int
    reply_requested: bool

    @classmethod
    def durable(cls, lsn: int, *, reply_requested: bool = False) -> StandbyStatusUpdate:
        """The update a client sends when everything up to ``lsn`` is durable, now."""
        return cls(lsn, lsn, lsn, now_us(), reply_requested)

    def encode(self) -> bytes:
        return STANDBY_STATUS_UPDATE.pack(
            self.TYPE,
            self.written,
            self.flushed,
            self.applied,
            self.send_time_us - POSTGRES_EPOCH_US,
            self.reply_requested,
        )


ServerMessage = XLogData | PrimaryKeepalive


def decode_server_message(data: bytes) -> ServerMessage:
    """One CopyData payload from the server, or a :class:`DecodeError` naming the byte."""
    kind = data[:1]
    if kind == XLogData.TYPE:
        _require(data, XLOG_DATA.size, "XLogData", exact=False)
        _, start, end, clock = XLOG_DATA.unpack_from(data)
        return XLogData(start, end, clock + POSTGRES_EPOCH_US, bytes(data[XLOG_DATA.size :]))
    if kind == PrimaryKeepalive.TYPE:
        _require(data, PRIMARY_KEEPALIVE.size, "primary keepalive", exact=True)
        _, end, clock, reply = PRIMARY_KEEPALIVE.unpack_from(data)
        if reply > 1:
            raise DecodeError(f"reply flag {reply} is neither 0 nor 1", message_type="primary keepalive", offset=17)
        return PrimaryKeepalive(end, clock + POSTGRES_EPOCH_US, bool(reply))
    what = "an empty message" if not kind else f"unknown message type {kind!r}"
    raise DecodeError(f"{what} in the replication stream", message_type=None, offset=0)


def _require(data: bytes, size: int, name: str, *, exact: bool) -> None:
    if len(data) < size or (exact and len(data) != size):
        expected = f"{size}" if exact else f"at least {size}"
        raise DecodeError(f"{len(data)} bytes, expected {expected}", message_type=name, offset=min(len(data), size))
