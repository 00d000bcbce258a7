"""Schema changes in the change log: the DDL capture's messages (``docs/architecture.md``, "DDL in
the stream"), decoded and placed among a table's changes.

The capture's event trigger (:mod:`cdc_assets.source.ddl_capture`) writes one transactional
message (prefix :data:`~cdc_assets.source.ddl_capture.DDL_PREFIX`) per published table a DDL
command touched: the table's columns and key after the command, and its rewrite. The drain keeps
the message in ``messages/`` with its transaction's commit LSN and end LSN and its position among
the transaction's changes — the same order as the table's change records,
``(commit LSN, position)`` — and notes the table's latest one in the checkpoint
(``TableState.last_ddl_lsn``); :meth:`ChangeLogReader.schema_changes
<cdc_assets.changelog.reader.ChangeLogReader.schema_changes>` reads a table's back as
:class:`TableDdl`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from cdc_assets.errors import CdcError
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.source.ddl_capture import DDL_FORMAT, DDL_PREFIX

REWRITE_REASONS = {1: "persistence", 2: "default value", 4: "column type", 8: "access method"}
"""``pg_event_trigger_table_rewrite_reason()`` bits (``AT_REWRITE_*`` in PostgreSQL's event_trigger.h)."""


@dataclass(slots=True, frozen=True)
class DdlColumn:
    """A column after the command, as ``pg_attribute`` holds it. ``missing`` is ``attmissingval``
    as text (a one-element array literal such as ``{7}``, under the pinned settings) when
    ``has_missing``: the value rows written before an ``ADD COLUMN … DEFAULT`` read."""

    attnum: int
    name: str
    type_oid: int
    typmod: int
    ndims: int
    not_null: bool
    generated: str  # attgenerated: '' (none), 's' (stored), 'v' (virtual, PostgreSQL 18)
    has_missing: bool
    missing: str | None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> DdlColumn:
        missing = data["missing"]
        return cls(
            int(data["attnum"]),
            str(data["name"]),
            int(data["type_oid"]),
            int(data["typmod"]),
            int(data["ndims"]),
            _flag(data["not_null"]),
            str(data["generated"]),
            _flag(data["has_missing"]),
            None if missing is None else str(missing),
        )


@dataclass(slots=True, frozen=True)
class SchemaChangeMessage:
    """One capture message: ``table`` (``relation_oid``) as ``command_tag`` left it, for the
    capture of ``slot`` (publication ``publication``). ``key``: the replica identity's columns by
    attnum (every column under ``REPLICA IDENTITY FULL``, none without a key); ``rewrite_reason``:
    the ``table_rewrite`` reason bits when the command rewrote the table (None: not rewritten);
    ``published``: the names of the columns the publication sends, in attnum order (None: a
    message written before the capture said)."""

    slot: str
    publication: str
    command_tag: str
    relation_oid: int
    schema: str
    table: str
    replica_identity: str
    key: tuple[int, ...]
    rewrite_reason: int | None
    columns: tuple[DdlColumn, ...]
    published: tuple[str, ...] | None = None

    @property
    def qualified_name(self) -> str:
        return f"{self.schema}.{self.table}"

    @property
    def rewritten(self) -> bool:
        return self.rewrite_reason is not None

    def rewrite_reasons(self) -> list[str]:
        """The rewrite's reasons in words (empty when not rewritten)."""
        reason = self.rewrite_reason or 0
        return [word for bit, word in REWRITE_REASONS.items() if reason & bit]

    @classmethod
    def decode(cls, content: bytes, lsn: int, slot: str) -> SchemaChangeMessage:
        """The message at ``lsn`` read by the drain of ``slot``; :class:`CdcError` naming the slot,
        the LSN and (when it can be read) the table for anything but this format."""
        table = "unknown"
        try:
            data = json.loads(content)
            table = f"{data['schema']}.{data['table']}"
            if data["format"] != DDL_FORMAT:
                raise ValueError(f"format {data['format']!r}, expected {DDL_FORMAT}")
            reason = data["rewrite_reason"]
            return cls(
                str(data["slot"]),
                str(data["publication"]),
                str(data["command_tag"]),
                int(data["relation_oid"]),
                str(data["schema"]),
                str(data["table"]),
                str(data["replica_identity"]),
                tuple(int(a) for a in data["key"]),
                None if reason is None else int(reason),
                tuple(DdlColumn.from_json(c) for c in data["columns"]),
                None if data.get("published") is None else tuple(str(n) for n in data["published"]),
            )
        except (ValueError, KeyError, TypeError) as error:
            detail = f"no {error}" if isinstance(error, KeyError) else str(error)
            raise CdcError(
                f"slot {slot}: malformed {DDL_PREFIX} message at LSN {format_lsn(lsn)} (table {table}): {detail}"
            ) from None


@dataclass(slots=True, frozen=True)
class TableDdl:
    """A schema change where the log holds it: in the transaction that committed at
    ``commit_lsn`` and ended at ``end_lsn``, at ``position`` among its changes (the table's change
    records order by ``(commit LSN, position)`` the same way); ``lsn`` is the message's own."""

    commit_lsn: int
    end_lsn: int
    position: int
    lsn: int
    commit_time_us: int
    message: SchemaChangeMessage


def _flag(value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"expected true or false, got {value!r}")
    return value


def uncertain_column_change(old: RelationSchema, new: RelationSchema) -> str | None:
    """What the Relation messages alone cannot tell about a change of a table's columns from
    ``old`` to ``new`` (None: nothing — columns dropped, or a type modifier changed): a new column
    may have a default the rows from before read, a rename and a drop + add look alike, and a
    changed type may hide a ``USING`` expression ("Schema migrations"). A column dropped and added
    again under its name shows only where it was not the last column."""
    before = {c.name: c for c in old.columns}
    after = {c.name: c for c in new.columns}
    added = [name for name in after if name not in before]
    kept = [name for name in before if name in after]
    # columns keep their attnum order: one found after a column that came after it was dropped and added again
    rank = {name: i for i, name in enumerate(kept)}
    order = [name for name in after if name in before]
    moved = [name for i, name in enumerate(order) if any(rank[other] > rank[name] for other in order[:i])]
    retyped = [name for name in kept if after[name].type_oid != before[name].type_oid]
    parts = []
    if added:
        dropped = [name for name in before if name not in after]
        parts.append(f"{', '.join(added)} added" + (f" and {', '.join(dropped)} dropped" if dropped else ""))
    if moved:
        parts.append(f"{', '.join(moved)} dropped and added again")
    if retyped:
        parts.append(f"{', '.join(retyped)} changed type")
    return "; ".join(parts) or None
