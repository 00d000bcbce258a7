"""The inverse of the decoder, for tests: typed messages → pgoutput bytes.

Mirrors PostgreSQL's ``logicalrep_write_*`` functions in ``proto.c`` so that property tests can
round-trip arbitrary messages and build streams the server would send.
"""

from __future__ import annotations

from struct import pack

from cdc_assets.pgoutput.messages import (
    POSTGRES_EPOCH_US,
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
from cdc_assets.pgoutput.protocol import COLUMN_BINARY, COLUMN_TEXT, TUPLE_KEY, TUPLE_NEW, TUPLE_OLD

_KEY, _OLD, _NEW = bytes((TUPLE_KEY,)), bytes((TUPLE_OLD,)), bytes((TUPLE_NEW,))


def encode(message: Message) -> bytes:
    """The bytes PostgreSQL would send for ``message`` (xid prefixed when ``message.xid`` is set
    on a change message, abort fields when a Stream Abort carries them)."""
    head = message.type_byte.encode()
    match message:
        case BeginMessage():
            return head + pack(">QqI", message.final_lsn, _micros(message.commit_time_us), message.xid)
        case CommitMessage():
            return head + pack(
                ">BQQq", message.flags, message.commit_lsn, message.end_lsn, _micros(message.commit_time_us)
            )
        case OriginMessage():
            return head + pack(">Q", message.commit_lsn) + _string(message.name)
        case RelationMessage():
            body = _xid(message.xid) + pack(">I", message.relation_oid)
            body += _string(message.namespace) + _string(message.relation_name)
            body += message.replica_identity.encode() + pack(">H", len(message.columns))
            for column in message.columns:
                body += pack(">B", column.flags) + _string(column.name)
                body += pack(">Ii", column.type_oid, column.type_modifier)
            return head + body
        case TypeMessage():
            return (
                head
                + _xid(message.xid)
                + pack(">I", message.type_oid)
                + _string(message.namespace)
                + _string(message.name)
            )
        case InsertMessage():
            return head + _xid(message.xid) + pack(">I", message.relation_oid) + _NEW + tuple_data(message.new_tuple)
        case UpdateMessage():
            body = _xid(message.xid) + pack(">I", message.relation_oid)
            if message.old_key is not None:
                body += _KEY + tuple_data(message.old_key)
            elif message.old_tuple is not None:
                body += _OLD + tuple_data(message.old_tuple)
            return head + body + _NEW + tuple_data(message.new_tuple)
        case DeleteMessage():
            body = _xid(message.xid) + pack(">I", message.relation_oid)
            if message.old_key is not None:
                return head + body + _KEY + tuple_data(message.old_key)
            assert message.old_tuple is not None
            return head + body + _OLD + tuple_data(message.old_tuple)
        case TruncateMessage():
            oids = message.relation_oids
            return head + _xid(message.xid) + pack(f">IB{len(oids)}I", len(oids), message.options, *oids)
        case LogicalDecodingMessage():
            return (
                head
                + _xid(message.xid)
                + pack(">BQ", message.flags, message.lsn)
                + _string(message.prefix)
                + pack(">i", len(message.content))
                + message.content
            )
        case StreamStartMessage():
            return head + pack(">IB", message.xid, message.first_segment)
        case StreamStopMessage():
            return head
        case StreamCommitMessage():
            return head + pack(
                ">IBQQq",
                message.xid,
                message.flags,
                message.commit_lsn,
                message.end_lsn,
                _micros(message.commit_time_us),
            )
        case StreamAbortMessage():
            body = pack(">II", message.xid, message.subtransaction_xid)
            if message.abort_lsn is not None:
                assert message.abort_time is not None
                body += pack(">Qq", message.abort_lsn, _micros(message.abort_time_us))
            return head + body
        case BeginPrepareMessage():
            return (
                head
                + pack(">QQqI", message.prepare_lsn, message.end_lsn, _micros(message.prepare_time_us), message.xid)
                + _string(message.gid)
            )
        case PrepareMessage() | StreamPrepareMessage():
            return (
                head
                + pack(
                    ">BQQqI",
                    message.flags,
                    message.prepare_lsn,
                    message.end_lsn,
                    _micros(message.prepare_time_us),
                    message.xid,
                )
                + _string(message.gid)
            )
        case CommitPreparedMessage():
            return (
                head
                + pack(
                    ">BQQqI",
                    message.flags,
                    message.commit_lsn,
                    message.end_lsn,
                    _micros(message.commit_time_us),
                    message.xid,
                )
                + _string(message.gid)
            )
        case RollbackPreparedMessage():
            return (
                head
                + pack(
                    ">BQQqqI",
                    message.flags,
                    message.prepare_end_lsn,
                    message.rollback_end_lsn,
                    _micros(message.prepare_time_us),
                    _micros(message.rollback_time_us),
                    message.xid,
                )
                + _string(message.gid)
            )
    raise TypeError(f"not a pgoutput message: {message!r}")


def tuple_data(data: TupleData) -> bytes:
    """A TupleData: Int16 count, then per column its kind and, for t/b, Int32 length + bytes."""
    out = bytearray(pack(">h", len(data.kinds)))
    for kind, value in zip(data.kinds, data.values):
        out += kind.encode()
        if ord(kind) in (COLUMN_TEXT, COLUMN_BINARY):
            assert value is not None
            out += pack(">i", len(value)) + value
    return bytes(out)


def _xid(xid: int | None) -> bytes:
    return b"" if xid is None else pack(">I", xid)


def _string(text: str) -> bytes:
    return text.encode() + b"\0"


def _micros(unix_us: int) -> int:
    """A ``*_time_us`` value as sent: microseconds since 2000-01-01."""
    return unix_us - POSTGRES_EPOCH_US
