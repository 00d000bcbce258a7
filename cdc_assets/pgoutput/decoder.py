"""Bytes → typed messages for pgoutput protocol versions 1–4.

:class:`PgoutputDecoder` reads one message per :meth:`~PgoutputDecoder.decode` call. Its only state
is what the protocol requires: whether it is between Stream Start and Stream Stop, where change
messages carry a leading xid. Every layout is read with precompiled ``struct`` formats; anything
short, long or unknown raises :class:`~cdc_assets.errors.DecodeError` naming the message type and
byte offset.

One module of ~450 lines on purpose: one small parse function per message type of the protocol,
side by side as PostgreSQL's ``proto.c`` keeps its writers, sharing the tuple and string readers.
"""

from __future__ import annotations

from collections.abc import Callable
from struct import Struct
from struct import error as StructError
from typing import Literal

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput import protocol
from cdc_assets.pgoutput.messages import (
    POSTGRES_EPOCH_US,
    SENT_TIME_RANGE_US,
    BeginMessage,
    BeginPrepareMessage,
    CommitMessage,
    CommitPreparedMessage,
    DeleteMessage,
    InsertMessage,
    LogicalDecodingMessage,
    Message,
    OriginMessage,
    PrepareMessage,
    RelationColumn,
    RelationMessage,
    RollbackPreparedMessage,
    StreamAbortMessage,
    StreamCommitMessage,
    StreamPrepareMessage,
    StreamStartMessage,
    StreamStopMessage,
    TruncateMessage,
    TupleData,
    TypeMessage,
    UpdateMessage,
)
from cdc_assets.pgoutput.protocol import (  # read per message and per column: module globals
    COLUMN_BINARY,
    COLUMN_NULL,
    COLUMN_TEXT,
    COLUMN_UNCHANGED,
    REPLICA_IDENTITIES,
    TUPLE_KEY,
    TUPLE_NEW,
    TUPLE_OLD,
)

Streaming = Literal["off", "on", "parallel"]

_INT16 = Struct(">h")
_INT32 = Struct(">i")
_OID = Struct(">I")
_KIND_LENGTH = Struct(">Bi")  # a TupleData column: kind byte, then Int32 length for t/b
_BEGIN = Struct(">QqI")  # final_lsn, commit_time, xid
_COMMIT = Struct(">BQQq")  # flags, commit_lsn, end_lsn, commit_time
_ORIGIN = Struct(">Q")
_REPLIDENT_NCOLS = Struct(">cH")
_TRUNCATE_HEAD = Struct(">IB")  # nrels, options
_MESSAGE_HEAD = Struct(">BQ")  # flags, lsn
_STREAM_START = Struct(">IB")
_STREAM_COMMIT = Struct(">IBQQq")
_STREAM_ABORT = Struct(">II")
_STREAM_ABORT_PARALLEL = Struct(">IIQq")
_BEGIN_PREPARE = Struct(">QQqI")  # prepare_lsn, end_lsn, prepare_time, xid; then gid
_PREPARE = Struct(">BQQqI")  # flags, prepare_lsn, end_lsn, prepare_time, xid; then gid
_ROLLBACK_PREPARED = Struct(">BQQqqI")


def message_name(type_byte: int) -> str:
    """The protocol's name for a message type byte, or a description of an unknown one."""
    return protocol.MESSAGE_NAMES.get(type_byte) or f"unknown type {chr(type_byte)!r} (0x{type_byte:02x})"


class _Malformed(Exception):
    """Internal: a layout violation found at ``offset``; turned into a DecodeError by decode()."""

    def __init__(self, reason: str, offset: int) -> None:
        self.reason = reason
        self.offset = offset


class PgoutputDecoder:
    """Decodes pgoutput messages one at a time.

    ``streaming`` must match the option the slot is read with: it decides whether a Stream Abort
    carries the abort LSN and time (only with ``"parallel"``). The decoder tracks Stream Start /
    Stop itself, since change messages inside a stream block start with an xid.
    """

    __slots__ = ("_parsers", "in_stream", "streaming")

    def __init__(self, streaming: Streaming = "off") -> None:
        if streaming not in ("off", "on", "parallel"):
            raise ValueError(f"streaming must be 'off', 'on' or 'parallel', not {streaming!r}")
        self.streaming: Streaming = streaming
        self.in_stream = False
        self._parsers: dict[int, Callable[[bytes], Message]] = {
            protocol.MSG_BEGIN: self._begin,
            protocol.MSG_COMMIT: self._commit,
            protocol.MSG_ORIGIN: self._origin,
            protocol.MSG_RELATION: self._relation,
            protocol.MSG_TYPE: self._type,
            protocol.MSG_INSERT: self._insert,
            protocol.MSG_UPDATE: self._update,
            protocol.MSG_DELETE: self._delete,
            protocol.MSG_TRUNCATE: self._truncate,
            protocol.MSG_MESSAGE: self._message,
            protocol.MSG_STREAM_START: self._stream_start,
            protocol.MSG_STREAM_STOP: self._stream_stop,
            protocol.MSG_STREAM_COMMIT: self._stream_commit,
            protocol.MSG_STREAM_ABORT: self._stream_abort,
            protocol.MSG_BEGIN_PREPARE: self._begin_prepare,
            protocol.MSG_PREPARE: self._prepare,
            protocol.MSG_COMMIT_PREPARED: self._commit_prepared,
            protocol.MSG_ROLLBACK_PREPARED: self._rollback_prepared,
            protocol.MSG_STREAM_PREPARE: self._stream_prepare,
        }

    def decode(self, data: bytes) -> Message:
        """Decode one message; raise DecodeError if it is not a well-formed pgoutput message."""
        if not data:
            raise DecodeError("empty message", message_type=None, offset=0)
        parser = self._parsers.get(data[0])
        if parser is None:
            raise DecodeError("unknown message type", message_type=message_name(data[0]), offset=0)
        try:
            return parser(data)
        except _Malformed as bad:
            raise DecodeError(bad.reason, message_type=message_name(data[0]), offset=bad.offset) from None
        except (StructError, IndexError):
            # A fixed-size read past the end; parsers check lengths before every variable read,
            # so only the fixed-layout head can land here.
            raise DecodeError(
                f"message is truncated ({len(data)} bytes)", message_type=message_name(data[0]), offset=len(data)
            ) from None

    # -- shared pieces -------------------------------------------------------------------------

    def _xid(self, data: bytes) -> tuple[int | None, int]:
        """The leading xid of a change message inside a stream block, and the offset after it."""
        if self.in_stream:
            if len(data) < 5:
                raise _Malformed("message ends inside its xid", 1)
            return _OID.unpack_from(data, 1)[0], 5
        return None, 1

    # -- transaction control -------------------------------------------------------------------

    def _begin(self, data: bytes) -> BeginMessage:
        if len(data) != 21:
            _exact(data, 1 + _BEGIN.size)
        final_lsn, commit_time, xid = _BEGIN.unpack_from(data, 1)
        return BeginMessage(final_lsn, _timestamp(commit_time, 9), xid)

    def _commit(self, data: bytes) -> CommitMessage:
        if len(data) != 26:
            _exact(data, 1 + _COMMIT.size)
        flags, commit_lsn, end_lsn, commit_time = _COMMIT.unpack_from(data, 1)
        if flags:
            _no_flags(flags, 1)
        return CommitMessage(flags, commit_lsn, end_lsn, _timestamp(commit_time, 18))

    def _origin(self, data: bytes) -> OriginMessage:
        _need(data, 1, 8)
        (commit_lsn,) = _ORIGIN.unpack_from(data, 1)
        name, pos = _string(data, 9)
        _end(data, pos)
        return OriginMessage(commit_lsn, name)

    # -- catalog -------------------------------------------------------------------------------

    def _relation(self, data: bytes) -> RelationMessage:
        xid, pos = self._xid(data)
        _need(data, pos, 4)
        (relation_oid,) = _OID.unpack_from(data, pos)
        namespace, pos = _string(data, pos + 4)
        relation_name, pos = _string(data, pos)
        _need(data, pos, 3)
        replident_byte, ncols = _REPLIDENT_NCOLS.unpack_from(data, pos)
        replica_identity = chr(replident_byte[0])
        if replica_identity not in REPLICA_IDENTITIES:
            raise _Malformed(f"unknown replica identity {replica_identity!r}", pos)
        pos += 3
        columns = []
        for _ in range(ncols):
            _need(data, pos, 1)
            flags = data[pos]
            if flags & ~1:
                raise _Malformed(f"unknown column flags 0x{flags:02x}", pos)
            name, pos = _string(data, pos + 1)
            _need(data, pos, 8)
            type_oid, type_modifier = _OID.unpack_from(data, pos)[0], _INT32.unpack_from(data, pos + 4)[0]
            columns.append(RelationColumn(flags, name, type_oid, type_modifier))
            pos += 8
        _end(data, pos)
        return RelationMessage(xid, relation_oid, namespace, relation_name, replica_identity, tuple(columns))

    def _type(self, data: bytes) -> TypeMessage:
        xid, pos = self._xid(data)
        _need(data, pos, 4)
        (type_oid,) = _OID.unpack_from(data, pos)
        namespace, pos = _string(data, pos + 4)
        name, pos = _string(data, pos)
        _end(data, pos)
        return TypeMessage(xid, type_oid, namespace, name)

    # -- changes -------------------------------------------------------------------------------

    def _insert(self, data: bytes) -> InsertMessage:
        xid, pos = self._xid(data) if self.in_stream else (None, 1)
        _need(data, pos, 5)
        (relation_oid,) = _OID.unpack_from(data, pos)
        if data[pos + 4] != TUPLE_NEW:
            raise _Malformed(f"expected 'N' before the new tuple, got {_show(data[pos + 4])}", pos + 4)
        new_tuple, pos = _tuple_data(data, pos + 5)
        if pos != len(data):
            _end(data, pos)
        return InsertMessage(xid, relation_oid, new_tuple)

    def _update(self, data: bytes) -> UpdateMessage:
        xid, pos = self._xid(data) if self.in_stream else (None, 1)
        _need(data, pos, 5)
        (relation_oid,) = _OID.unpack_from(data, pos)
        pos += 4
        marker = data[pos]
        old_key = old_tuple = None
        if marker == TUPLE_KEY:
            old_key, pos = _tuple_data(data, pos + 1)
        elif marker == TUPLE_OLD:
            old_tuple, pos = _tuple_data(data, pos + 1)
        elif marker != TUPLE_NEW:
            raise _Malformed(f"expected 'K', 'O' or 'N', got {_show(marker)}", pos)
        _need(data, pos, 1)
        if data[pos] != TUPLE_NEW:
            raise _Malformed(f"expected 'N' before the new tuple, got {_show(data[pos])}", pos)
        new_tuple, pos = _tuple_data(data, pos + 1)
        if pos != len(data):
            _end(data, pos)
        return UpdateMessage(xid, relation_oid, old_key, old_tuple, new_tuple)

    def _delete(self, data: bytes) -> DeleteMessage:
        xid, pos = self._xid(data) if self.in_stream else (None, 1)
        _need(data, pos, 5)
        (relation_oid,) = _OID.unpack_from(data, pos)
        pos += 4
        marker = data[pos]
        if marker not in (TUPLE_KEY, TUPLE_OLD):
            raise _Malformed(f"expected 'K' or 'O', got {_show(marker)}", pos)
        old, end = _tuple_data(data, pos + 1)
        _end(data, end)
        if marker == TUPLE_KEY:
            return DeleteMessage(xid, relation_oid, old, None)
        return DeleteMessage(xid, relation_oid, None, old)

    def _truncate(self, data: bytes) -> TruncateMessage:
        xid, pos = self._xid(data)
        _need(data, pos, 5)
        nrels, options = _TRUNCATE_HEAD.unpack_from(data, pos)
        if options & ~3:
            raise _Malformed(f"unknown truncate options 0x{options:02x}", pos + 4)
        pos += 5
        _exact(data, pos + 4 * nrels)
        relation_oids = Struct(f">{nrels}I").unpack_from(data, pos)
        return TruncateMessage(xid, options, relation_oids)

    def _message(self, data: bytes) -> LogicalDecodingMessage:
        xid, pos = self._xid(data)
        _need(data, pos, 9)
        flags, lsn = _MESSAGE_HEAD.unpack_from(data, pos)
        if flags & ~1:
            raise _Malformed(f"unknown message flags 0x{flags:02x}", pos)
        prefix, pos = _string(data, pos + 9)
        _need(data, pos, 4)
        (length,) = _INT32.unpack_from(data, pos)
        if length < 0:
            raise _Malformed(f"negative content length {length}", pos)
        pos += 4
        _exact(data, pos + length)
        return LogicalDecodingMessage(xid, flags, lsn, prefix, data[pos : pos + length])

    # -- streaming (protocol 2+, parallel abort fields with protocol 4) ---------------------

    def _stream_start(self, data: bytes) -> StreamStartMessage:
        _exact(data, 1 + _STREAM_START.size)
        if self.in_stream:
            raise _Malformed("Stream Start inside a stream block", 0)
        xid, first_segment = _STREAM_START.unpack_from(data, 1)
        if first_segment > 1:
            raise _Malformed(f"first_segment must be 0 or 1, got {first_segment}", 5)
        self.in_stream = True
        return StreamStartMessage(xid, bool(first_segment))

    def _stream_stop(self, data: bytes) -> StreamStopMessage:
        _exact(data, 1)
        if not self.in_stream:
            raise _Malformed("Stream Stop outside a stream block", 0)
        self.in_stream = False
        return StreamStopMessage()

    def _stream_commit(self, data: bytes) -> StreamCommitMessage:
        _exact(data, 1 + _STREAM_COMMIT.size)
        xid, flags, commit_lsn, end_lsn, commit_time = _STREAM_COMMIT.unpack_from(data, 1)
        _no_flags(flags, 5)
        return StreamCommitMessage(xid, flags, commit_lsn, end_lsn, _timestamp(commit_time, 22))

    def _stream_abort(self, data: bytes) -> StreamAbortMessage:
        if self.streaming == "parallel":
            _exact(data, 1 + _STREAM_ABORT_PARALLEL.size)
            xid, subxid, abort_lsn, abort_time = _STREAM_ABORT_PARALLEL.unpack_from(data, 1)
            return StreamAbortMessage(xid, subxid, abort_lsn, _timestamp(abort_time, 17))
        _exact(data, 1 + _STREAM_ABORT.size)
        xid, subxid = _STREAM_ABORT.unpack_from(data, 1)
        return StreamAbortMessage(xid, subxid, None, None)

    # -- two-phase (protocol 3+) ---------------------------------------------------------------

    def _begin_prepare(self, data: bytes) -> BeginPrepareMessage:
        _need(data, 1, _BEGIN_PREPARE.size)
        prepare_lsn, end_lsn, prepare_time, xid = _BEGIN_PREPARE.unpack_from(data, 1)
        gid, pos = _string(data, 1 + _BEGIN_PREPARE.size)
        _end(data, pos)
        return BeginPrepareMessage(prepare_lsn, end_lsn, _timestamp(prepare_time, 17), xid, gid)

    def _prepare_fields(self, data: bytes) -> tuple[int, int, int, int, int, str]:
        _need(data, 1, _PREPARE.size)
        flags, prepare_lsn, end_lsn, prepare_time, xid = _PREPARE.unpack_from(data, 1)
        _no_flags(flags, 1)
        gid, pos = _string(data, 1 + _PREPARE.size)
        _end(data, pos)
        return flags, prepare_lsn, end_lsn, _timestamp(prepare_time, 18), xid, gid

    def _prepare(self, data: bytes) -> PrepareMessage:
        return PrepareMessage(*self._prepare_fields(data))

    def _stream_prepare(self, data: bytes) -> StreamPrepareMessage:
        return StreamPrepareMessage(*self._prepare_fields(data))

    def _commit_prepared(self, data: bytes) -> CommitPreparedMessage:
        flags, commit_lsn, end_lsn, commit_time, xid, gid = self._prepare_fields(data)
        return CommitPreparedMessage(flags, commit_lsn, end_lsn, commit_time, xid, gid)

    def _rollback_prepared(self, data: bytes) -> RollbackPreparedMessage:
        _need(data, 1, _ROLLBACK_PREPARED.size)
        flags, prepare_end_lsn, rollback_end_lsn, prepare_time, rollback_time, xid = _ROLLBACK_PREPARED.unpack_from(
            data, 1
        )
        _no_flags(flags, 1)
        gid, pos = _string(data, 1 + _ROLLBACK_PREPARED.size)
        _end(data, pos)
        return RollbackPreparedMessage(
            flags,
            prepare_end_lsn,
            rollback_end_lsn,
            _timestamp(prepare_time, 18),
            _timestamp(rollback_time, 26),
            xid,
            gid,
        )


# -- layout helpers (module level: no attribute lookups on the hot path) -----------------------


def _show(byte: int) -> str:
    return repr(chr(byte)) if 32 <= byte < 127 else f"0x{byte:02x}"


def _need(data: bytes, pos: int, size: int) -> None:
    if pos + size > len(data):
        raise _Malformed(f"needs {size} bytes here but only {max(len(data) - pos, 0)} remain", pos)


def _exact(data: bytes, size: int) -> None:
    if len(data) != size:
        raise _Malformed(f"expected {size} bytes, got {len(data)}", min(size, len(data)))


def _end(data: bytes, pos: int) -> None:
    if pos != len(data):
        raise _Malformed(f"{len(data) - pos} unexpected trailing bytes", pos)


def _no_flags(flags: int, pos: int) -> None:
    if flags:
        raise _Malformed(f"unknown flags 0x{flags:02x} (PostgreSQL sends 0)", pos)


def _timestamp(microseconds: int, pos: int) -> int:
    """A timestamp sent as µs since 2000-01-01, as µs since 1970-01-01 (Arrow's epoch)."""
    if not SENT_TIME_RANGE_US[0] <= microseconds <= SENT_TIME_RANGE_US[1]:
        raise _Malformed(f"timestamp {microseconds} µs after 2000-01-01 is out of range", pos)
    return microseconds + POSTGRES_EPOCH_US


def _string(data: bytes, pos: int) -> tuple[str, int]:
    end = data.find(0, pos)
    if end < 0:
        raise _Malformed("string has no terminating NUL", pos)
    try:
        return data[pos:end].decode(), end + 1
    except UnicodeDecodeError:
        raise _Malformed("string is not valid UTF-8", pos) from None


def _tuple_data(data: bytes, pos: int) -> tuple[TupleData, int]:
    """Read a TupleData starting at ``pos``; return it and the offset after it."""
    size = len(data)
    if pos + 2 > size:
        raise _Malformed("tuple column count runs past the end", pos)
    (ncols,) = _INT16.unpack_from(data, pos)
    if ncols < 0:
        raise _Malformed(f"negative column count {ncols}", pos)
    pos += 2
    kinds = bytearray()
    values: list[bytes | None] = []
    add_value = values.append
    kind_and_length = _KIND_LENGTH.unpack_from
    for i in range(ncols):
        if pos + 5 <= size:
            kind, length = kind_and_length(data, pos)
        elif pos < size:
            kind, length = data[pos], -1
        else:
            raise _Malformed(f"tuple ends after {i} of {ncols} columns", pos)
        if kind == COLUMN_TEXT or kind == COLUMN_BINARY:  # noqa: SIM109 - once per column: two compares beat building a tuple
            start = pos + 5
            pos = start + length
            if length < 0 or pos > size:
                raise _Malformed(f"column {i} has length {length} but {size - start} bytes remain", start - 4)
            add_value(data[start:pos])
        elif kind == COLUMN_NULL or kind == COLUMN_UNCHANGED:  # noqa: SIM109 - as above
            pos += 1
            add_value(None)
        else:
            raise _Malformed(f"unknown column kind {_show(kind)} in column {i}", pos)
        kinds.append(kind)
    return TupleData(kinds.decode("ascii"), tuple(values)), pos
