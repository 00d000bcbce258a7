"""A mirror's columns moved by attnum, as its source's schema changes moved them (``docs/architecture.md``,
"Schema migrations").

A mirror records, in the table property :data:`SOURCE_COLUMNS`, its columns' source attnums: their
names as of an LSN, and each one's Delta physical name (column mapping keeps it through a rename).
Given a :class:`~cdc_assets.changelog.column_lineage.Lineage` — the columns after a range's schema
changes — :func:`move_columns` drops the columns whose attnum is gone, renames those whose name
changed (``RENAME COLUMN``: the values stay), adds the new ones and gives the rows the table holds
the value PostgreSQL reads for them (``attmissingval``; NULL without a constant default).

Each step is its own Delta commit, none of them the data's: the property is written first with the
range's start (``before``), so a run killed between steps finds from the physical names what is
done, and carries the same records from the same start again.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa

from cdc_assets.apply.commit_settings import settings_around
from cdc_assets.apply.spark_literals import backquote, spark_literal, sql_string
from cdc_assets.apply.spark_types import delta_arrow_type, spark_schema, spark_type, to_delta_arrow
from cdc_assets.apply.target import DeltaTarget
from cdc_assets.changelog.column_lineage import ColumnNames, Lineage, carry_columns, copy_names
from cdc_assets.changelog.schema_changes import TableDdl
from cdc_assets.faults import fault_point
from cdc_assets.pgoutput.records import ChangeChunk, DeltaColumn
from cdc_assets.pgoutput.schema import RelationSchema

SOURCE_COLUMNS = "cdc_assets.sourceColumns"
"""The mirror's table property that holds its columns' attnums (:class:`SourceColumns`, as JSON)."""
PHYSICAL_NAME = "delta.columnMapping.physicalName"
UPDATE_DELETION_VECTORS = "spark.databricks.delta.update.deletionVectors.persistent"


@dataclass(slots=True, frozen=True)
class SourceColumns:
    """The columns' names by attnum as of ``lsn``; ``before``: as of the start of the range whose
    schema changes are being applied (its LSN and names); ``physical``: each attnum's Delta
    physical name, where known."""

    lsn: int
    names: ColumnNames
    physical: dict[int, str] = field(default_factory=dict)
    before: tuple[int, ColumnNames] | None = None

    def names_at(self, lsn: int) -> ColumnNames | None:
        """The names by attnum as of ``lsn`` (None: not known)."""
        if self.lsn <= lsn:
            return self.names
        if self.before is not None and self.before[0] <= lsn:
            return self.before[1]
        return None

    def to_json(self) -> str:
        return json.dumps(
            {
                "lsn": self.lsn,
                "names": _keyed(self.names),
                "physical": _keyed(self.physical),
                "before": None if self.before is None else {"lsn": self.before[0], "names": _keyed(self.before[1])},
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> SourceColumns:
        data = json.loads(text)
        before = data.get("before")
        return cls(
            int(data["lsn"]),
            _unkeyed(data["names"]),
            _unkeyed(data.get("physical") or {}),
            None if before is None else (int(before["lsn"]), _unkeyed(before["names"])),
        )


@dataclass(slots=True)
class ColumnsMoved:
    """What :func:`move_columns` did to the mirror."""

    renamed: list[tuple[str, str]] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)
    added: list[str] = field(default_factory=list)
    filled: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.renamed or self.dropped or self.added)

    def describe(self) -> str:
        parts = [f"renamed {a} to {b}" for a, b in self.renamed]
        parts += [f"dropped {name}" for name in self.dropped]
        parts += [f"added {name}{' (its default in every row)' if name in self.filled else ''}" for name in self.added]
        return ", ".join(parts)


@dataclass(slots=True)
class CarriedRange:
    """A range of a table's change records in the columns they are applied under (``relation``);
    ``names``: those columns by attnum where known; ``recopy``: why the range cannot be applied
    (the table needs a copy)."""

    chunks: list[ChangeChunk]
    relation: RelationSchema
    moved: ColumnsMoved = field(default_factory=ColumnsMoved)
    names: ColumnNames | None = None
    recopy: str | None = None


def carry_range(
    target: DeltaTarget | None,
    table: str,
    relation: RelationSchema,
    chunks: list[ChangeChunk],
    ddls: list[TableDdl],
    start: ColumnNames | None,
    after: int,
    lsn: int,
) -> CarriedRange:
    """``chunks`` (after ``after``, up to ``lsn``) carried through the table's schema changes
    ``ddls`` from the names ``start`` (None: the range's copy's), and — with a ``target`` — its
    columns checked and moved to theirs. ``relation``: the table's latest Relation-message columns."""
    if not ddls:
        if target is not None:
            target.check_column_types(table, chunks)
        return CarriedRange(chunks, relation, names=copy_names(chunks))
    lineage = carry_columns(start, chunks, ddls, relation)
    if lineage.recopy is not None or lineage.relation is None:
        return CarriedRange([], relation, recopy=lineage.recopy)
    moved = ColumnsMoved()
    if target is not None:
        target.check_column_types(table, lineage.chunks)
        moved = move_columns(target, lineage, after, lsn)
    return CarriedRange(lineage.chunks, lineage.relation, moved, lineage.final)


def record_copy_columns(target: DeltaTarget, carried: CarriedRange, lsn: int) -> None:
    """Record the attnums of the columns of a table written from a copy, as of ``lsn`` (nothing when
    the copy does not know them: a compacted base of a mirror set up before they were kept).

    Called before the copy's data commit as well as after it, so that a run killed between the two
    leaves them recorded: a table still to be created records them as it is created; an existing
    one with its names as of its applied LSN (``before``), and physical names only once every
    column has one (a partial map would make a column whose name is missing look added)."""
    if carried.names is None:
        return
    names = carried.names
    if not target.exists():
        target.creation_properties[SOURCE_COLUMNS] = SourceColumns(lsn, names).to_json()
        return
    by_name = _fields(target)
    physical = {a: by_name[n] for a, n in names.items() if n in by_name}
    recorded = recorded_columns(target)
    applied = target.applied_lsn()
    before = None
    if recorded is not None and applied is not None and applied < lsn:
        held = recorded.names_at(applied)
        before = None if held is None else (applied, held)
    _record(target, recorded, SourceColumns(lsn, names, physical if len(physical) == len(names) else {}, before))


def recorded_columns(target: DeltaTarget) -> SourceColumns | None:
    """What ``target`` records of its columns' attnums (None: nothing, or no table)."""
    table = target.snapshot()
    value = None if table is None else table.metadata().configuration.get(SOURCE_COLUMNS)
    return SourceColumns.from_json(value) if value else None


def start_names(target: DeltaTarget, after: int) -> ColumnNames | None:
    """The names by attnum of ``target``'s columns as of its applied LSN ``after`` (None: unknown)."""
    recorded = recorded_columns(target)
    return None if recorded is None else recorded.names_at(after)


def move_columns(target: DeltaTarget, lineage: Lineage, after: int, lsn: int) -> ColumnsMoved:
    """Give ``target`` (its applied LSN ``after``) the columns of ``lineage``, the range up to
    ``lsn``; the data commit that follows records ``lsn``."""
    moved = ColumnsMoved()
    if not target.exists():
        return moved
    final = lineage.final
    recorded = recorded_columns(target)
    physical = dict(recorded.physical) if recorded is not None and recorded.physical else {}
    if not physical:
        by_name = _fields(target)
        physical = {a: by_name[n] for a, n in lineage.start.items() if n in by_name}
    _record(target, recorded, SourceColumns(lsn, final, physical, (after, lineage.start)))
    names = _fields_by_physical(target)
    for attnum, phys in physical.items():
        if attnum not in final and phys in names:
            target.execute(f"ALTER TABLE {target.sql_name} DROP COLUMN {backquote(names[phys])}")
            moved.dropped.append(names.pop(phys))
            fault_point("apply-evolve")
    pending = {a: final[a] for a, p in physical.items() if a in final and p in names and names[p] != final[a]}
    while pending:  # each to its new name once that name is free; a cycle through a temporary name
        held = set(names.values())
        ready = [a for a, new in pending.items() if new not in held]
        if not ready:
            attnum = next(a for a in pending if names[physical[a]] != f"{DeltaColumn.RENAMING}{a}")
            _rename(target, names[physical[attnum]], f"{DeltaColumn.RENAMING}{attnum}")
            names[physical[attnum]] = f"{DeltaColumn.RENAMING}{attnum}"
            continue
        for attnum in ready:
            _rename(target, names[physical[attnum]], pending[attnum])
            names[physical[attnum]] = pending.pop(attnum)
            moved.renamed.append((lineage.start.get(attnum, final[attnum]), final[attnum]))
    order = [c.name for c in lineage.relation.columns] if lineage.relation else []
    for attnum, name in final.items():
        if attnum in physical:
            continue
        if name not in names.values():  # else added by a run killed before it recorded the column
            previous = order[order.index(name) - 1] if order.index(name) else None
            position = " FIRST" if previous is None else f" AFTER {backquote(previous)}"
            kind = spark_type(delta_arrow_type(lineage.types[name]))
            target.execute(
                f"ALTER TABLE {target.sql_name} ADD COLUMNS ({backquote(name)} {kind.simpleString()}{position})"
            )
            fault_point("apply-evolve")
        moved.added.append(name)
        if name in lineage.missing:
            _fill(target, name, lineage.missing[name])
            moved.filled.append(name)
        physical[attnum] = _fields(target)[name]  # recorded: done, its default filled
        _record(target, recorded_columns(target), SourceColumns(lsn, final, dict(physical), (after, lineage.start)))
    return moved


def _rename(target: DeltaTarget, old: str, new: str) -> None:
    target.execute(f"ALTER TABLE {target.sql_name} RENAME COLUMN {backquote(old)} TO {backquote(new)}")
    fault_point("apply-evolve")


def _fill(target: DeltaTarget, name: str, value: pa.Scalar) -> None:
    """Every row the table holds gets ``value`` in column ``name``, just added (one commit, not the
    data's). Only NULLs are set — every row's, as the table still holds the rows from before the
    column: a run killed after the fill finds none left and commits nothing. An ``UPDATE`` with the
    value as a literal; a value of a type without one, from a one-row view through a ``MERGE``."""
    column = backquote(name)
    literal = spark_literal(value.as_py(), value.type)
    if literal is not None:  # every row changes: rewriting the files beats marking each row deleted
        with settings_around(target.spark, {UPDATE_DELETION_VECTORS: "false"}):
            (result,) = target.execute(f"UPDATE {target.sql_name} SET {column} = {literal} WHERE {column} IS NULL")
    else:
        rows = to_delta_arrow(pa.table({"v": pa.array([value.as_py()], value.type)}))
        view = f"cdc_default_{uuid.uuid4().hex}"
        target.spark.createDataFrame(rows, schema=spark_schema(rows.schema)).createTempView(view)
        try:
            (result,) = target.execute(
                f"MERGE INTO {target.sql_name} t USING {backquote(view)} s ON true"
                f" WHEN MATCHED AND t.{column} IS NULL THEN UPDATE SET t.{column} = s.v"
            )
        finally:
            target.spark.catalog.dropTempView(view)
    if result["num_affected_rows"]:
        fault_point("apply-evolve")


def _record(target: DeltaTarget, recorded: SourceColumns | None, columns: SourceColumns) -> None:
    if recorded == columns:
        return
    target.execute(
        f"ALTER TABLE {target.sql_name} SET TBLPROPERTIES ({sql_string(SOURCE_COLUMNS)} = {sql_string(columns.to_json())})"
    )
    fault_point("apply-evolve")


def _fields(target: DeltaTarget) -> dict[str, str]:
    """The table's columns' names → their physical names (the name itself without column mapping)."""
    table = target.snapshot()
    assert table is not None
    fields: list[dict[str, Any]] = json.loads(table.schema().to_json())["fields"]
    return {f["name"]: (f.get("metadata") or {}).get(PHYSICAL_NAME, f["name"]) for f in fields}


def _fields_by_physical(target: DeltaTarget) -> dict[str, str]:
    return {phys: name for name, phys in _fields(target).items()}


def _keyed(names: dict[int, str]) -> dict[str, str]:
    return {str(a): n for a, n in sorted(names.items())}


def _unkeyed(data: dict[str, str]) -> dict[int, str]:
    return {int(a): str(n) for a, n in data.items()}
