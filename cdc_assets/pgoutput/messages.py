"""One slotted dataclass per pgoutput message, protocol versions 1–4.

Field names follow "Logical Replication Message Formats" in PostgreSQL's documentation, in
snake_case. LSNs are ints (see :func:`cdc_assets.lsn.format_lsn`). Timestamps, sent as
microseconds since the PostgreSQL epoch (2000-01-01), are stored converted to microseconds since
the Unix epoch in ``*_time_us`` fields (what an Arrow ``timestamp('us', 'UTC')`` holds) and read as
timezone-aware ``datetime`` through the matching ``*_time`` properties. ``xid`` on a change
message is the transaction id the protocol sends only between Stream Start and Stream Stop;
outside a stream block it is ``None``.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import ClassVar, TypeAlias

from cdc_assets.pgoutput import protocol

POSTGRES_EPOCH_US = 946_684_800_000_000
"""2000-01-01 in microseconds since 1970-01-01: PostgreSQL's clocks (pgoutput's and the replication
protocol's timestamps) count from it."""
SENT_TIME_RANGE_US = (-62_135_596_800_000_000 - POSTGRES_EPOCH_US, 253_402_300_799_999_999 - POSTGRES_EPOCH_US)
"""The timestamps the messages' datetime properties can represent (years 1 to 9999), as sent
(µs since 2000-01-01)."""

UNIX_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def unix_time(microseconds: int) -> datetime:
    """A ``*_time_us`` value as a UTC datetime."""
    return UNIX_EPOCH + timedelta(0, 0, microseconds)


@dataclass(slots=True)
class TupleDataColumn:
    """One column of a TupleData: its kind (``n``, ``u``, ``t``, ``b``) and bytes for ``t``/``b``."""

    kind: str
    data: bytes | None


@dataclass(slots=True)
class TupleData:
    """A row image: ``kinds[i]`` is column i's kind, ``values[i]`` its bytes (``None`` for n/u).

    In an old key tuple (``'K'``) non-key columns are ``'n'``, meaning "not sent", not NULL.
    """

    kinds: str
    values: tuple[bytes | None, ...]

    @property
    def columns(self) -> tuple[TupleDataColumn, ...]:
        return tuple(TupleDataColumn(k, v) for k, v in zip(self.kinds, self.values))


@dataclass(slots=True)
class BeginMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_BEGIN)
    final_lsn: int
    commit_time_us: int
    xid: int

    @property
    def commit_time(self) -> datetime:
        return unix_time(self.commit_time_us)


@dataclass(slots=True)
class CommitMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_COMMIT)
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int

    @property
    def commit_time(self) -> datetime:
        return unix_time(self.commit_time_us)


@dataclass(slots=True)
class OriginMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_ORIGIN)
    commit_lsn: int
    name: str


@dataclass(slots=True)
class RelationColumn:
    """A column of a Relation message. ``flags`` bit 1 marks a replica identity (key) column."""

    flags: int
    name: str
    type_oid: int
    type_modifier: int

    @property
    def is_key(self) -> bool:
        return bool(self.flags & 1)


@dataclass(slots=True)
class RelationMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_RELATION)
    xid: int | None
    relation_oid: int
    namespace: str
    relation_name: str
    replica_identity: str
    columns: tuple[RelationColumn, ...]

    @property
    def qualified_name(self) -> str:
        """``schema.table``; pgoutput sends ``""`` for pg_catalog."""
        return f"{self.namespace or 'pg_catalog'}.{self.relation_name}"


@dataclass(slots=True)
class TypeMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_TYPE)
    xid: int | None
    type_oid: int
    namespace: str
    name: str


@dataclass(slots=True)
class InsertMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_INSERT)
    xid: int | None
    relation_oid: int
    new_tuple: TupleData


@dataclass(slots=True)
class UpdateMessage:
    """``old_key`` is sent (``'K'``) when a replica identity column changed; ``old_tuple``
    (``'O'``) under REPLICA IDENTITY FULL; at most one of them is set."""

    type_byte: ClassVar[str] = chr(protocol.MSG_UPDATE)
    xid: int | None
    relation_oid: int
    old_key: TupleData | None
    old_tuple: TupleData | None
    new_tuple: TupleData


@dataclass(slots=True)
class DeleteMessage:
    """Exactly one of ``old_key`` (``'K'``) and ``old_tuple`` (``'O'``) is set."""

    type_byte: ClassVar[str] = chr(protocol.MSG_DELETE)
    xid: int | None
    relation_oid: int
    old_key: TupleData | None
    old_tuple: TupleData | None


@dataclass(slots=True)
class TruncateMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_TRUNCATE)
    xid: int | None
    options: int
    relation_oids: tuple[int, ...]

    @property
    def cascade(self) -> bool:
        return bool(self.options & 1)

    @property
    def restart_identity(self) -> bool:
        return bool(self.options & 2)


@dataclass(slots=True)
class LogicalDecodingMessage:
    """A ``pg_logical_emit_message`` payload (sent only with ``messages 'true'``)."""

    type_byte: ClassVar[str] = chr(protocol.MSG_MESSAGE)
    xid: int | None
    flags: int
    lsn: int
    prefix: str
    content: bytes

    @property
    def transactional(self) -> bool:
        return bool(self.flags & 1)


@dataclass(slots=True)
class StreamStartMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_STREAM_START)
    xid: int
    first_segment: bool


@dataclass(slots=True)
class StreamStopMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_STREAM_STOP)


@dataclass(slots=True)
class StreamCommitMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_STREAM_COMMIT)
    xid: int
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int

    @property
    def commit_time(self) -> datetime:
        return unix_time(self.commit_time_us)


@dataclass(slots=True)
class StreamAbortMessage:
    """``abort_lsn`` and ``abort_time`` are sent only with ``streaming 'parallel'``."""

    type_byte: ClassVar[str] = chr(protocol.MSG_STREAM_ABORT)
    xid: int
    subtransaction_xid: int
    abort_lsn: int | None
    abort_time_us: int | None

    @property
    def abort_time(self) -> datetime | None:
        return None if self.abort_time_us is None else unix_time(self.abort_time_us)


@dataclass(slots=True)
class BeginPrepareMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_BEGIN_PREPARE)
    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    xid: int
    gid: str

    @property
    def prepare_time(self) -> datetime:
        return unix_time(self.prepare_time_us)


@dataclass(slots=True)
class PrepareMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_PREPARE)
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    xid: int
    gid: str

    @property
    def prepare_time(self) -> datetime:
        return unix_time(self.prepare_time_us)


@dataclass(slots=True)
class CommitPreparedMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_COMMIT_PREPARED)
    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int
    xid: int
    gid: str

    @property
    def commit_time(self) -> datetime:
        return unix_time(self.commit_time_us)


@dataclass(slots=True)
class RollbackPreparedMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_ROLLBACK_PREPARED)
    flags: int
    prepare_end_lsn: int
    rollback_end_lsn: int
    prepare_time_us: int
    rollback_time_us: int
    xid: int
    gid: str

    @property
    def prepare_time(self) -> datetime:
        return unix_time(self.prepare_time_us)

    @property
    def rollback_time(self) -> datetime:
        return unix_time(self.rollback_time_us)


@dataclass(slots=True)
class StreamPrepareMessage:
    type_byte: ClassVar[str] = chr(protocol.MSG_STREAM_PREPARE)
    flags: int
    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    xid: int
    gid: str

    @property
    def prepare_time(self) -> datetime:
        return unix_time(self.prepare_time_us)


Message: TypeAlias = (
    BeginMessage
    | CommitMessage
    | OriginMessage
    | RelationMessage
    | TypeMessage
    | InsertMessage
    | UpdateMessage
    | DeleteMessage
    | TruncateMessage
    | LogicalDecodingMessage
    | StreamStartMessage
    | StreamStopMessage
    | StreamCommitMessage
    | StreamAbortMessage
    | BeginPrepareMessage
    | PrepareMessage
    | CommitPreparedMessage
    | RollbackPreparedMessage
    | StreamPrepareMessage
)
