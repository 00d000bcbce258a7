"""The bytes that name things in pgoutput's messages, each spelled here and nowhere else.

As PostgreSQL's ``logicalproto.h`` (``LogicalRepMsgType``, ``LOGICAL_REP_COLUMN_*``) serves both
the writers and the readers of ``proto.c``, this module serves the message classes, the decoder,
the columnar extraction and the transaction assembly. Wire bytes are ints, as indexing ``bytes``
and numpy's ``uint8`` arrays gives them; replica identities are one-character strings, as
:attr:`~cdc_assets.pgoutput.messages.RelationMessage.replica_identity` holds them.
"""

from __future__ import annotations

from typing import Final

# Message types: the first byte of every message.
MSG_BEGIN: Final = ord("B")
MSG_COMMIT: Final = ord("C")
MSG_ORIGIN: Final = ord("O")
MSG_RELATION: Final = ord("R")
MSG_TYPE: Final = ord("Y")
MSG_INSERT: Final = ord("I")
MSG_UPDATE: Final = ord("U")
MSG_DELETE: Final = ord("D")
MSG_TRUNCATE: Final = ord("T")
MSG_MESSAGE: Final = ord("M")
MSG_STREAM_START: Final = ord("S")
MSG_STREAM_STOP: Final = ord("E")
MSG_STREAM_COMMIT: Final = ord("c")
MSG_STREAM_ABORT: Final = ord("A")
MSG_BEGIN_PREPARE: Final = ord("b")
MSG_PREPARE: Final = ord("P")
MSG_COMMIT_PREPARED: Final = ord("K")
MSG_ROLLBACK_PREPARED: Final = ord("r")
MSG_STREAM_PREPARE: Final = ord("p")

MESSAGE_NAMES: Final[dict[int, str]] = {
    MSG_BEGIN: "Begin",
    MSG_COMMIT: "Commit",
    MSG_ORIGIN: "Origin",
    MSG_RELATION: "Relation",
    MSG_TYPE: "Type",
    MSG_INSERT: "Insert",
    MSG_UPDATE: "Update",
    MSG_DELETE: "Delete",
    MSG_TRUNCATE: "Truncate",
    MSG_MESSAGE: "Logical Decoding",
    MSG_STREAM_START: "Stream Start",
    MSG_STREAM_STOP: "Stream Stop",
    MSG_STREAM_COMMIT: "Stream Commit",
    MSG_STREAM_ABORT: "Stream Abort",
    MSG_BEGIN_PREPARE: "Begin Prepare",
    MSG_PREPARE: "Prepare",
    MSG_COMMIT_PREPARED: "Commit Prepared",
    MSG_ROLLBACK_PREPARED: "Rollback Prepared",
    MSG_STREAM_PREPARE: "Stream Prepare",
}
"""The protocol documentation's name of each message type."""

# TupleData: the marker before a tuple of an Insert, Update or Delete ...
TUPLE_KEY: Final = ord("K")  # the old replica identity columns
TUPLE_OLD: Final = ord("O")  # the whole old row (REPLICA IDENTITY FULL)
TUPLE_NEW: Final = ord("N")
# ... and the kind byte of each of its columns.
COLUMN_NULL: Final = ord("n")  # in a 'K' tuple also "not sent"
COLUMN_UNCHANGED: Final = ord("u")  # unchanged TOAST value, not sent
COLUMN_TEXT: Final = ord("t")
COLUMN_BINARY: Final = ord("b")

# Relation: the table's replica identity (pg_class.relreplident).
REPLICA_IDENTITY_DEFAULT: Final = "d"
REPLICA_IDENTITY_NOTHING: Final = "n"
REPLICA_IDENTITY_FULL: Final = "f"
REPLICA_IDENTITY_INDEX: Final = "i"
REPLICA_IDENTITIES: Final = frozenset(
    (REPLICA_IDENTITY_DEFAULT, REPLICA_IDENTITY_NOTHING, REPLICA_IDENTITY_FULL, REPLICA_IDENTITY_INDEX)
)
