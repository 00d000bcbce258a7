"""The change-record format, which every stage reads or writes: the columns of a change record
(docs/architecture.md, "A change record"), the operations, and :class:`ChangeChunk`, records
written under one schema version. ``arrow.py`` makes the records; the change log adds the
commit columns, stores and reads them; the planner and the merge turn them into Delta rows, whose
metadata columns are named here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

import pyarrow as pa

from cdc_assets.pgoutput.protocol import TUPLE_KEY, TUPLE_OLD
from cdc_assets.pgoutput.schema import RelationSchema


class RecordColumn:
    """The names of the columns every change record carries beside its row images."""

    POSITION: Final = "_cdc_position"  # its message's position in the transaction
    OP: Final = "_cdc_op"  # one of :class:`Op`
    OLD_KIND: Final = "_cdc_old_kind"  # one of :class:`OldKind`
    UNCHANGED: Final = "_cdc_unchanged"  # unchanged-TOAST columns
    SPECIAL: Final = "_cdc_special"  # values the Arrow type cannot hold, as text
    TRUNCATE: Final = "_cdc_truncate"  # a Truncate's relations and options
    # added by the change log, per transaction
    COMMIT_LSN: Final = "_cdc_commit_lsn"
    END_LSN: Final = "_cdc_end_lsn"
    XID: Final = "_cdc_xid"
    COMMIT_TIME: Final = "_cdc_commit_time"


class Op:
    """The values of :attr:`RecordColumn.OP`."""

    INSERT: Final = "insert"
    UPDATE: Final = "update"
    DELETE: Final = "delete"
    TRUNCATE: Final = "truncate"
    SNAPSHOT: Final = "snapshot"  # a row of a copy of the whole table

    ALL: Final = (INSERT, UPDATE, DELETE, TRUNCATE, SNAPSHOT)


class OldKind:
    """The values of :attr:`RecordColumn.OLD_KIND`: the marker the old tuple was sent with."""

    KEY: Final = chr(TUPLE_KEY)  # the replica identity columns
    FULL: Final = chr(TUPLE_OLD)  # the whole row (REPLICA IDENTITY FULL)

    ALL: Final = (KEY, FULL)


class DeltaColumn:
    """The metadata columns of a mirror's rows in Delta, and the working columns of a plan and a
    merge (never stored)."""

    LSN: Final = "_cdc_lsn"  # end LSN of the row's last change's transaction
    COMMIT_TIME: Final = RecordColumn.COMMIT_TIME
    ACTION: Final = "_cdc_action"
    UNRESOLVED: Final = "_cdc_unresolved"
    FILL_KEY: Final = "_cdc_fill_key"
    COPIES: Final = "_cdc_copies"
    MATCH: Final = "_cdc_match"
    KIND: Final = "_cdc_kind"
    COPY: Final = "_cdc_copy"
    FINAL: Final = "_cdc_final"
    RENAMING: Final = "_cdc_renaming_"  # a column's name prefix between two renames (its new name still another's)


class PlanAction:
    """The values of :attr:`DeltaColumn.ACTION` in a keyed plan."""

    UPSERT: Final = "upsert"  # the key's final image
    DELETE: Final = "delete"  # the key is gone


COMMIT_TIME_TYPE = pa.timestamp("us", tz="UTC")

FIRST_COPY_POSITION: Final = -(1 << 62)
"""Where a copy's records (the initial snapshot, an online run, a compacted base) number their
positions from: below every change's (0 on), so a copy sorts before a transaction that commits at
its consistent point, whose commit LSN is the copy's (docs/architecture.md, "A change record")."""


@dataclass(slots=True)
class ChangeChunk:
    """Change records written under one schema version of their table (``relation``; its number,
    ``schema_version``, when read from the change log). ``copy``: they are a copy of the whole
    table (the initial snapshot, an online run, a compacted base) — the table's contents even
    when there are none."""

    relation: RelationSchema
    records: pa.Table
    copy: bool = False
    schema_version: int | None = None
