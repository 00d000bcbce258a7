"""pgoutput, PostgreSQL's logical replication output plugin: protocol versions 1–4.

``PgoutputDecoder(streaming=...).decode(data)`` turns one message into a typed dataclass (see
:mod:`cdc_assets.pgoutput.messages`); :class:`ChangeRecordBuilder` turns many change messages of a
relation into typed Arrow arrays at once. Errors are :class:`DecodeError`.
"""

from cdc_assets.errors import DecodeError
from cdc_assets.lsn import format_lsn, parse_lsn
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.decoder import PgoutputDecoder
from cdc_assets.pgoutput.messages import (
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
    TupleDataColumn,
    TypeMessage,
    UpdateMessage,
)
from cdc_assets.pgoutput.schema import ColumnSchema, RelationSchema
from cdc_assets.pgoutput.types import PgTypeInfo, TypeCatalog

__all__ = [
    "BeginMessage",
    "BeginPrepareMessage",
    "ChangeRecordBuilder",
    "ColumnSchema",
    "CommitMessage",
    "CommitPreparedMessage",
    "DecodeError",
    "DeleteMessage",
    "InsertMessage",
    "LogicalDecodingMessage",
    "Message",
    "OriginMessage",
    "PgTypeInfo",
    "PgoutputDecoder",
    "PrepareMessage",
    "RelationColumn",
    "RelationMessage",
    "RelationSchema",
    "RollbackPreparedMessage",
    "StreamAbortMessage",
    "StreamCommitMessage",
    "StreamPrepareMessage",
    "StreamStartMessage",
    "StreamStopMessage",
    "TruncateMessage",
    "TupleData",
    "TupleDataColumn",
    "TypeCatalog",
    "TypeMessage",
    "UpdateMessage",
    "format_lsn",
    "parse_lsn",
]
