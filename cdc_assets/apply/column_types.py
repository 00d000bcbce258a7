"""A Delta column changes type only when its source column did (docs/architecture.md, "Metadata
and schema").

Every chunk of change records says, per column, the source type its values were decoded under
(type OID, typmod, array dimensions: :class:`SourceType`) and the Arrow type they were decoded
to. A mirror records the source type of each of its columns in the table property
:data:`SOURCE_TYPES`. Before a plan is written, the chunks are walked in log order from what the
table holds: a column whose Delta type would change while its source type stays the same means
the values were decoded wrongly, and the table is stopped with a :class:`ColumnTypeError` instead
of being rewritten. A copy of the table (a chunk marked ``copy``) starts the walk afresh: it is
read from the source's catalog and replaces the table's contents.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import NamedTuple

from pyspark.sql import types as T

from cdc_assets.apply.spark_types import delta_arrow_type, spark_type
from cdc_assets.errors import CdcError
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.records import ChangeChunk, RecordColumn
from cdc_assets.pgoutput.schema import RelationSchema

SOURCE_TYPES = "cdc_assets.sourceTypes"
"""The mirror's table property that holds each column's source type, as a JSON object."""


class SourceType(NamedTuple):
    """What a column's values were decoded under."""

    type_oid: int
    type_modifier: int
    ndims: int

    def describe(self) -> str:
        dims = f", {self.ndims} array dimension{'s' if self.ndims > 1 else ''}" if self.ndims else ""
        return f"type OID {self.type_oid}, typmod {self.type_modifier}{dims}"


class ColumnTypeError(CdcError):
    """A column's decoded type changed while its source type did not: the table is stopped."""


def source_types(relation: RelationSchema) -> dict[str, SourceType]:
    """Each column's source type in ``relation``."""
    return {c.name: SourceType(c.type_oid, c.type_modifier, c.ndims) for c in relation.columns}


def source_types_property(relation: RelationSchema) -> str:
    """The value of :data:`SOURCE_TYPES` for a table of ``relation``'s columns."""
    return json.dumps({name: list(kind) for name, kind in source_types(relation).items()}, separators=(",", ":"))


def recorded_source_types(configuration: Mapping[str, str | None]) -> dict[str, SourceType] | None:
    """The source types a table's properties record (None: a table written before they were)."""
    value = configuration.get(SOURCE_TYPES)
    if not value:
        return None
    return {name: SourceType(*kind) for name, kind in json.loads(value).items()}


def check_column_types(
    table: str,
    delta_types: Mapping[str, T.DataType],
    recorded: Mapping[str, SourceType] | None,
    chunks: Sequence[ChangeChunk],
) -> None:
    """Raise :class:`ColumnTypeError` where ``chunks`` (in log order) would change a column's Delta
    type without a change of its source type: against the table's columns (``delta_types``, with
    the source types ``recorded`` in it; None: unknown, any change allowed) and between chunks."""
    held: dict[str, tuple[T.DataType, SourceType | None]] = {
        name: (kind, None if recorded is None else recorded.get(name)) for name, kind in delta_types.items()
    }
    for chunk in chunks:
        if chunk.copy:
            held = {}
        sources = source_types(chunk.relation)
        for field in chunk.records.schema.field("new").type:
            kind, source = spark_type(delta_arrow_type(field.type)), sources.get(field.name)
            before = held.get(field.name)
            if before is not None and before[0] != kind and source is not None and before[1] == source:
                lsns = chunk.records.column(RecordColumn.END_LSN)
                at = f" at LSN {format_lsn(lsns[0].as_py())}" if len(lsns) else ""
                raise ColumnTypeError(
                    f"{table}: column {field.name} would change type from {before[0].simpleString()} to"
                    f" {kind.simpleString()}{at}, but its source type ({source.describe()}) did not change;"
                    f" the table is not written (the other tables go on): copy it again with"
                    f" `cdc-assets snapshot {table}`"
                )
            held[field.name] = (kind, source)
