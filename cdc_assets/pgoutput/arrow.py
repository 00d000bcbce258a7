"""Change messages of one relation → Arrow change records, column-wise.

A :class:`ChangeRecordBuilder` is made per schema version of a relation. It turns a list of
Insert/Update/Delete messages (or snapshot rows, or a Truncate) into a record batch whose columns
are described in ``docs/architecture.md`` ("A change record"): the operation, the old-tuple kind,
unchanged-TOAST columns, values the Arrow type cannot hold, and the ``new`` / ``old`` row images
as typed structs. Commit-level columns (LSNs, xid, commit time) are added by the change log.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput import protocol
from cdc_assets.pgoutput.columnar import ChangeColumns, TupleColumns, extract_changes, extract_from_buffer
from cdc_assets.pgoutput.records import OldKind, Op, RecordColumn
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.pgoutput.values import ColumnConverter, ConvertedColumn, column_converter

SNAPSHOT = Op.SNAPSHOT
TRUNCATE = Op.TRUNCATE

TRUNCATE_TYPE = pa.struct(
    [
        pa.field("relations", pa.list_(pa.string())),
        pa.field("cascade", pa.bool_()),
        pa.field("restart_identity", pa.bool_()),
    ]
)
SPECIAL_TYPE = pa.map_(pa.string(), pa.string())

_OP_DICTIONARY = pa.array([Op.INSERT, Op.UPDATE, Op.DELETE, TRUNCATE, SNAPSHOT])
_OP_INDEX = np.zeros(256, dtype=np.int8)
_OP_INDEX[[protocol.MSG_INSERT, protocol.MSG_UPDATE, protocol.MSG_DELETE]] = [0, 1, 2]
_OLD_KINDS = pa.array(list(OldKind.ALL))


class ChangeRecordBuilder:
    """Builds change-record batches for one schema version of one relation."""

    __slots__ = ("_names", "converters", "relation", "row_type", "schema")

    def __init__(self, relation: RelationSchema, catalog: TypeCatalog | None = None) -> None:
        self.relation = relation
        self.converters: list[ColumnConverter] = [
            column_converter(c.type_oid, c.type_modifier, catalog, max(c.ndims, 1)) for c in relation.columns
        ]
        self.row_type = pa.struct(
            [pa.field(c.name, conv.arrow_type) for c, conv in zip(relation.columns, self.converters)]
        )
        self._names = pa.array([c.name for c in relation.columns], pa.string())
        self.schema = record_schema(self.row_type)

    @property
    def binary_supported(self) -> tuple[bool, ...]:
        """Per column, whether its values convert from binary format (else send them as text)."""
        return tuple(converter.binary_supported for converter in self.converters)

    def changes(
        self, messages: Sequence[bytes], positions: np.ndarray, *, xid_prefixed: bool = False
    ) -> pa.RecordBatch:
        """Records for Insert/Update/Delete ``messages`` (all of this relation), at ``positions``."""
        return self._records(extract_changes(messages, len(self.converters), xid_prefixed=xid_prefixed), positions)

    def changes_in(
        self, data: bytes, starts: np.ndarray, ends: np.ndarray, positions: np.ndarray, *, xid_prefixed: bool = False
    ) -> pa.RecordBatch:
        """Like :meth:`changes`, for messages at ``data[starts[i]:ends[i]]``."""
        columns = extract_from_buffer(data, starts, ends, len(self.converters), xid_prefixed=xid_prefixed)
        return self._records(columns, positions)

    def _records(self, columns: ChangeColumns, positions: np.ndarray) -> pa.RecordBatch:
        count = len(columns.ops)
        new, new_special = self._image(columns.new)
        old, old_special = self._image(columns.old)
        old_kind = np.select(
            [columns.old_markers == protocol.TUPLE_KEY, columns.old_markers == protocol.TUPLE_OLD], [0, 1], -1
        )
        return pa.RecordBatch.from_arrays(
            [
                pa.array(np.asarray(positions, dtype=np.int64)),
                _ops(_OP_INDEX[columns.ops]),
                _optional_choice(old_kind, _OLD_KINDS),
                self._unchanged(columns.new.kinds),
                _special(count, [("new", new_special), ("old", old_special)]),
                pa.nulls(count, TRUNCATE_TYPE),
                new,
                old,
            ],
            schema=self.schema,
        )

    def snapshot(self, raw: Sequence[pa.Array], positions: np.ndarray, binary: Sequence[bool]) -> pa.RecordBatch:
        """Records for snapshot rows, one raw array per column whose values are all binary-format
        (``binary[i]``) or all text-format."""
        count = len(positions)
        converted = [self._convert(j, column, as_binary) for j, (column, as_binary) in enumerate(zip(raw, binary))]
        new = pa.StructArray.from_arrays([c.array for c in converted], fields=list(self.row_type))
        return pa.RecordBatch.from_arrays(
            [
                pa.array(np.asarray(positions, dtype=np.int64)),
                _ops(np.full(count, 4, dtype=np.int8)),
                pa.nulls(count, pa.string()),
                pa.nulls(count, pa.list_(pa.string())),
                _special(count, [("new", [(c.name, conv) for c, conv in zip(self.relation.columns, converted)])]),
                pa.nulls(count, TRUNCATE_TYPE),
                new,
                pa.nulls(count, self.row_type),
            ],
            schema=self.schema,
        )

    def truncate(
        self, position: int, relations: Sequence[str], cascade: bool, restart_identity: bool
    ) -> pa.RecordBatch:
        """The record of a TRUNCATE that lists this relation among ``relations``."""
        return pa.RecordBatch.from_arrays(
            [
                pa.array([position], pa.int64()),
                _ops(np.array([3], dtype=np.int8)),
                pa.nulls(1, pa.string()),
                pa.nulls(1, pa.list_(pa.string())),
                pa.nulls(1, SPECIAL_TYPE),
                pa.array(
                    [{"relations": list(relations), "cascade": cascade, "restart_identity": restart_identity}],
                    TRUNCATE_TYPE,
                ),
                pa.nulls(1, self.row_type),
                pa.nulls(1, self.row_type),
            ],
            schema=self.schema,
        )

    def _image(self, part: TupleColumns) -> tuple[pa.StructArray, list[tuple[str, ConvertedColumn]]]:
        """One row image (new or old) as a typed struct, null where the message has none."""
        converted = [self._convert(j, raw, part.kinds[:, j]) for j, raw in enumerate(part.raw)]
        present = part.present
        mask = None if present.all() else pa.array(~present)
        image = pa.StructArray.from_arrays([c.array for c in converted], fields=list(self.row_type), mask=mask)
        return image, [(c.name, conv) for c, conv in zip(self.relation.columns, converted)]

    def _convert(self, index: int, raw: pa.Array, kinds: np.ndarray | bool) -> ConvertedColumn:
        """Column ``index``'s values, their format given per value (``kinds``) or for all (a bool);
        errors name the column."""
        converter = self.converters[index]
        try:
            if isinstance(kinds, bool):
                return converter.convert(raw, binary=kinds)
            return _convert(converter, raw, kinds)
        except DecodeError as error:
            raise error.within(f"column {self.relation.qualified_name}.{self.relation.columns[index].name}") from None

    def _unchanged(self, kinds: np.ndarray) -> pa.Array:
        """Per row, the names of the columns sent as unchanged TOAST (null when none)."""
        unchanged = kinds == protocol.COLUMN_UNCHANGED
        count = len(kinds)
        if not unchanged.any():
            return pa.nulls(count, pa.list_(pa.string()))
        rows, cols = np.nonzero(unchanged)
        per_row = np.bincount(rows, minlength=count)
        offsets = np.zeros(count + 1, dtype=np.int32)
        np.cumsum(per_row, out=offsets[1:])
        has_any = per_row > 0
        return pa.ListArray.from_arrays(pa.array(offsets), self._names.take(pa.array(cols)), mask=pa.array(~has_any))


def record_schema(row_type: pa.StructType) -> pa.Schema:
    """The schema of change records for rows of ``row_type`` (commit columns excluded)."""
    return pa.schema(
        [
            pa.field(RecordColumn.POSITION, pa.int64(), nullable=False),
            pa.field(RecordColumn.OP, pa.string(), nullable=False),
            pa.field(RecordColumn.OLD_KIND, pa.string()),
            pa.field(RecordColumn.UNCHANGED, pa.list_(pa.string())),
            pa.field(RecordColumn.SPECIAL, SPECIAL_TYPE),
            pa.field(RecordColumn.TRUNCATE, TRUNCATE_TYPE),
            pa.field("new", row_type),
            pa.field("old", row_type),
        ]
    )


def _convert(converter: ColumnConverter, raw: pa.BinaryArray, kinds: np.ndarray) -> ConvertedColumn:
    """Convert one column whose values may mix text and binary kinds (binary mode sends text for
    types without a send function)."""
    binary = kinds == protocol.COLUMN_BINARY
    if not binary.any():
        return converter.convert(raw, binary=False)
    text = kinds == protocol.COLUMN_TEXT
    if not text.any():
        return converter.convert(raw, binary=True)
    as_text = converter.convert(raw.filter(pa.array(text)), binary=False)
    as_binary = converter.convert(raw.filter(pa.array(binary)), binary=True)
    order = np.concatenate([np.flatnonzero(text), np.flatnonzero(binary)])
    rest = np.flatnonzero(~text & ~binary)
    merged = pa.concat_arrays([as_text.array, as_binary.array, pa.nulls(len(rest), as_text.array.type)])
    inverse = np.empty(len(kinds), dtype=np.int64)
    inverse[np.concatenate([order, rest])] = np.arange(len(kinds))
    special = {int(order[i]): v for i, v in as_text.special.items()}
    special.update({int(order[len(as_text.array) + i]): v for i, v in as_binary.special.items()})
    return ConvertedColumn(merged.take(pa.array(inverse)), special)


def _ops(indices: np.ndarray) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(indices, pa.int8()), _OP_DICTIONARY).dictionary_decode()


def _optional_choice(indices: np.ndarray, choices: pa.Array) -> pa.Array:
    """``choices[indices[i]]``, null where the index is -1."""
    valid = indices >= 0
    if not valid.any():
        return pa.nulls(len(indices), choices.type)
    taken = pa.array(np.where(valid, indices, 0), pa.int64(), mask=~valid)
    return choices.take(taken)


def _special(count: int, images: list[tuple[str, list[tuple[str, ConvertedColumn]]]]) -> pa.Array:
    """Per row, ``image.column`` → exact text for values the typed columns could not hold."""
    entries: dict[int, list[tuple[str, str]]] = {}
    for image, columns in images:
        for name, converted in columns:
            for row, text in converted.special.items():
                entries.setdefault(row, []).append((f"{image}.{name}", text))
    if not entries:
        return pa.nulls(count, SPECIAL_TYPE)
    return pa.array([entries.get(row) for row in range(count)], SPECIAL_TYPE)
