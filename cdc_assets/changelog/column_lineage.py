"""A table's change records carried through its schema changes by attnum (``docs/architecture.md``,
"Schema migrations").

Change records name their columns as the Relation message before them did; each captured schema
change (:class:`~cdc_assets.changelog.schema_changes.TableDdl`) says, by attnum, what the columns
are after its command. From the columns' names as of the start of a range (by attnum), the records
are split at every schema change and each piece's columns are carried to the columns after the
last one: a renamed column keeps its values under its new name, a dropped column's values are left
out (a new column of the same name is another attnum), and a column added after a piece's rows
reads, in those rows, what PostgreSQL reads for them — its ``attmissingval`` (the constant default
of ``ADD COLUMN``), else NULL. What this cannot describe — a rewrite, whose rows the stream never
sends, or columns whose attnums are unknown — is a reason to copy the table again instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import pyarrow as pa

from cdc_assets.changelog.schema_changes import DdlColumn, SchemaChangeMessage, TableDdl
from cdc_assets.errors import DecodeError
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.records import ChangeChunk, RecordColumn
from cdc_assets.pgoutput.schema import ColumnSchema, RelationSchema
from cdc_assets.pgoutput.types import FIRST_GENBKI_OID
from cdc_assets.pgoutput.values.converter import column_converter

ColumnNames = dict[int, str]
"""A table's columns' names by attnum."""


@dataclass(slots=True)
class Lineage:
    """The records of a range carried to its last columns. ``relation``: those columns (with their
    attnums); ``start``: the names by attnum the range started with; ``types``: each of those
    columns' Arrow type; ``missing``: per column with a constant default, the value rows from before
    it read (an Arrow scalar of its type); ``recopy``: why the range cannot be carried (then nothing
    else is set)."""

    chunks: list[ChangeChunk] = field(default_factory=list)
    relation: RelationSchema | None = None
    start: ColumnNames = field(default_factory=dict)
    types: dict[str, pa.DataType] = field(default_factory=dict)
    missing: dict[str, pa.Scalar] = field(default_factory=dict)
    recopy: str | None = None

    @property
    def final(self) -> ColumnNames:
        assert self.relation is not None
        return {c.attnum: c.name for c in self.relation.columns if c.attnum is not None}


def copy_names(chunks: Sequence[ChangeChunk]) -> ColumnNames | None:
    """The names by attnum of the first copy among ``chunks`` (read from the catalog), if it has them."""
    for chunk in chunks:
        if chunk.copy:
            return _attnums(chunk.relation)
    return None


def with_attnums(relation: RelationSchema, names: ColumnNames | None) -> RelationSchema:
    """``relation`` (a Relation message's columns) with the attnums of ``names`` by name — for a range
    with no schema change since the copy whose names they are (None: as it is)."""
    if names is None:
        return relation
    by_name = {name: attnum for attnum, name in names.items()}
    return replace(relation, columns=tuple(replace(c, attnum=by_name.get(c.name)) for c in relation.columns))


def carry_columns(
    start: ColumnNames | None, chunks: Sequence[ChangeChunk], ddls: Sequence[TableDdl], relation: RelationSchema
) -> Lineage:
    """Carry ``chunks`` (in log order, after the range's start) through ``ddls`` (the table's schema
    changes in the range, in log order) to the columns after the last one. ``start``: the names by
    attnum at the start (None: unknown); ``relation``: the table's latest Relation-message columns
    (for array dimensions)."""
    if not ddls:
        raise ValueError("no schema change to carry the records through")
    for ddl in ddls:
        if ddl.message.rewritten:
            reasons = ", ".join(ddl.message.rewrite_reasons())
            return Lineage(
                recopy=f"{ddl.message.command_tag} at LSN {format_lsn(ddl.lsn)} rewrote the table ({reasons}):"
                " the stream does not carry the rows it wrote"
            )
    if start is None:
        start = copy_names(chunks)
    if start is None:
        return Lineage(
            recopy=f"the columns' attnums before the schema change at LSN {format_lsn(ddls[0].lsn)} are unknown"
            " (the mirror was written before DDL capture)"
        )
    last = ddls[-1].message
    final = _final_relation(last, relation)
    lineage = Lineage(relation=final, start=dict(start))
    types: dict[int, pa.DataType] = {}
    names, pending, pieces = dict(start), list(ddls), []
    for chunk in chunks:
        if chunk.copy and (copied := _attnums(chunk.relation)) is not None:
            names = copied
        for piece, piece_names in _split(chunk, names, pending):
            pieces.append((piece, piece_names))
            names = piece_names
    for piece, piece_names in pieces:
        by_name = {name: attnum for attnum, name in piece_names.items()}
        for child in piece.records.schema.field("new").type:
            attnum = by_name.get(child.name)
            if attnum is None:
                return Lineage(
                    recopy=f"column {child.name} of its change records is not among the columns of the schema"
                    " change before them"
                )
            types[attnum] = child.type  # the newest piece's: the planner casts older values to it
    for column in last.columns:
        if column.attnum in lineage.final and column.attnum not in types:
            kind = _arrow_type(column)
            if kind is None:
                return Lineage(
                    recopy=f"column {column.name} was added with type OID {column.type_oid}, whose values'"
                    " type is only known from its first change"
                )
            types[column.attnum] = kind
    for column in last.columns:
        if column.attnum in lineage.final and column.has_missing:
            value = _missing_value(column, types[column.attnum])
            if value is None:
                return Lineage(recopy=f"column {column.name}'s default ({column.missing}) cannot be read back")
            lineage.missing[column.name] = value
    by_attnum = {c.attnum: c for c in last.columns}
    lineage.types = {name: types[attnum] for attnum, name in lineage.final.items()}
    lineage.chunks = [
        _carried(piece, piece_names, final, types, lineage.missing, by_attnum) for piece, piece_names in pieces
    ]
    return lineage


def _attnums(relation: RelationSchema) -> ColumnNames | None:
    if any(c.attnum is None for c in relation.columns):
        return None
    return {c.attnum: c.name for c in relation.columns if c.attnum is not None}


def _final_relation(message: SchemaChangeMessage, latest: RelationSchema) -> RelationSchema:
    """The columns the publication sends after ``message``'s command, with their attnums."""
    published = set(message.published) if message.published is not None else None
    dims = {c.name: c.ndims for c in latest.columns}
    key = set(message.key)
    columns = tuple(
        ColumnSchema(
            c.name,
            c.type_oid,
            c.typmod,
            c.attnum in key,
            dims.get(c.name, c.ndims),
            c.attnum,
        )
        for c in message.columns
        if (c.name in published if published is not None else c.generated == "")
    )
    return RelationSchema(message.relation_oid, message.schema, message.table, message.replica_identity, columns)


def _split(chunk: ChangeChunk, names: ColumnNames, pending: list[TableDdl]) -> list[tuple[ChangeChunk, ColumnNames]]:
    """``chunk`` cut at the schema changes of ``pending`` among its records (taken off ``pending``),
    each piece with the names by attnum its records were written under."""
    records = chunk.records
    if not records.num_rows:  # an empty copy: no place among the changes
        return [(chunk, names)]
    commit = records.column(RecordColumn.COMMIT_LSN).to_numpy()
    position = records.column(RecordColumn.POSITION).to_numpy()
    pieces: list[tuple[ChangeChunk, ColumnNames]] = []
    start = 0
    while pending:
        ddl = pending[0]
        after = (commit > ddl.commit_lsn) | ((commit == ddl.commit_lsn) & (position > ddl.position))
        if not after.any():
            break  # the change comes after every record of this chunk
        cut = int(np.argmax(after))
        if cut > start:
            pieces.append((_slice(chunk, start, cut), names))
        start = cut
        names = {c.attnum: c.name for c in ddl.message.columns}
        pending.pop(0)
    pieces.append((_slice(chunk, start, len(commit)), names))
    return pieces


def _slice(chunk: ChangeChunk, start: int, stop: int) -> ChangeChunk:
    if start == 0 and stop == chunk.records.num_rows:
        return chunk
    return ChangeChunk(chunk.relation, chunk.records.slice(start, stop - start), chunk.copy, chunk.schema_version)


def _carried(
    chunk: ChangeChunk,
    names: ColumnNames,
    final: RelationSchema,
    types: dict[int, pa.DataType],
    missing: dict[str, pa.Scalar],
    columns: dict[int, DdlColumn],
) -> ChangeChunk:
    """``chunk``'s records with their images in ``final``'s columns."""
    records = chunk.records
    renamed: dict[str, str] = {}
    for image in ("new", "old"):
        struct = records.column(image).combine_chunks()
        present = {struct.type.field(i).name: i for i in range(struct.type.num_fields)}
        arrays, fields = [], []
        for column in final.columns:
            assert column.attnum is not None
            old_name = names.get(column.attnum)
            if old_name is not None and old_name in present:
                child = struct.field(present[old_name])
                renamed[old_name] = column.name
            else:
                value = missing.get(column.name)
                kind = types[column.attnum]
                child = pa.nulls(len(struct), kind) if value is None else pa.array([value.as_py()] * len(struct), kind)
            arrays.append(child)
            fields.append(pa.field(column.name, child.type))
        carried = pa.StructArray.from_arrays(arrays, fields=fields, mask=struct.is_null())
        records = records.set_column(records.schema.get_field_index(image), image, carried)
    if any(old != new for old, new in renamed.items()):
        unchanged = records.column(RecordColumn.UNCHANGED)
        lists = [None if u is None else [renamed[n] for n in u if n in renamed] or None for u in unchanged.to_pylist()]
        records = records.set_column(
            records.schema.get_field_index(RecordColumn.UNCHANGED),
            RecordColumn.UNCHANGED,
            pa.array(lists, unchanged.type),
        )
    own = {c.name: c for c in chunk.relation.columns}
    relation = replace(
        final,
        columns=tuple(
            _renamed(own[names[c.attnum]], c) if c.attnum in names and names[c.attnum] in own else c
            for c in final.columns
            if c.attnum is not None and c.attnum in columns
        ),
    )
    return ChangeChunk(relation, records, chunk.copy, chunk.schema_version)


def _renamed(column: ColumnSchema, final: ColumnSchema) -> ColumnSchema:
    """``column`` as its records were written (its source type), under its final name and key flag."""
    return replace(column, name=final.name, is_key=final.is_key, attnum=final.attnum)


def _arrow_type(column: DdlColumn) -> pa.DataType | None:
    """The Arrow type values of a built-in type decode to (None: a type of the database's own)."""
    if column.type_oid >= FIRST_GENBKI_OID:
        return None
    return column_converter(column.type_oid, column.typmod, None, max(column.ndims, 1)).arrow_type


def _missing_value(column: DdlColumn, kind: pa.DataType) -> pa.Scalar | None:
    """``attmissingval`` (a one-element array literal of the column's text output) as an Arrow
    scalar of ``kind`` (None: not one scalar value this can read, such as an array's)."""
    text = _array_element(column.missing or "")
    if text is None or column.ndims or pa.types.is_list(kind):
        return None
    try:
        converted = column_converter(column.type_oid, column.typmod, None, 1).convert(
            pa.array([text.encode()], pa.binary()), binary=False
        )
    except DecodeError:
        return None
    if converted.special or converted.array.null_count:
        return None
    value = converted.array[0]
    return value if value.type.equals(kind) else value.cast(kind)


def _array_element(literal: str) -> str | None:
    """The one element of a one-dimensional array literal (``{7}``, ``{"a b"}``); None otherwise."""
    if len(literal) < 2 or literal[0] != "{" or literal[-1] != "}":
        return None
    inner = literal[1:-1]
    if not inner.startswith('"'):
        return None if inner in ("", "NULL") or "," in inner or "{" in inner else inner
    out, escaped = [], False
    for i, char in enumerate(inner[1:], start=1):
        if escaped:
            out.append(char)
            escaped = False
        elif char == "\\":
            escaped = True
        elif char == '"':
            return "".join(out) if i == len(inner) - 1 else None
        else:
            out.append(char)
    return None
