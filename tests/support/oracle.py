"""A test oracle: the change log replayed into plain Python rows, and a diff against the source.

:func:`replay` reads every table of a change log with :class:`ChangeLogReader` (only what the
checkpoint made valid) and applies the change records in ``(_cdc_commit_lsn, _cdc_position)``
order to plain dicts, the way ``docs/architecture.md`` ("Semantics applied downstream") defines them — no
Spark, no Delta, nothing shared with the apply code:

* ``snapshot`` / ``insert``: upsert the ``new`` row by its key;
* ``update``: the old key comes from ``old`` when ``_cdc_old_kind`` is ``K``/``O``, else from
  ``new``; a changed key deletes the old one; the ``new`` row is upserted with the columns listed
  in ``_cdc_unchanged`` (unchanged TOAST) taken from the ``O`` old row, else from the row the
  oracle holds under the old key;
* ``delete``: remove by the key in ``old``;
* ``truncate``: empty the table.

The key is the replica-identity key of the record's own schema version
(``RelationSchema.key_columns``). Tables without one (``REPLICA IDENTITY NOTHING``, ``DEFAULT``
without a primary key) are a multiset of inserted rows; ``REPLICA IDENTITY FULL`` tables (every
column is a "key" column there) are a multiset too, and updates and deletes remove one row equal
to the whole old row.

Schema versions: a record carries only its version's columns. When a table's records move to
another version, the held rows lose the columns that version no longer has (DROP COLUMN) and
columns it adds read ``None`` in rows that were not written since (ADD COLUMN without a default),
which is what ``SELECT *`` shows. Rows are re-keyed when the key columns change. Limitation: a
column dropped and re-added under the same name and type between two records of the table looks
like one unchanged column.

A value the Arrow type cannot hold is null in the record and listed in ``_cdc_special``; the
oracle holds it as :class:`Special` with its exact text.

The replay also checks what the log promises and lists violations in ``Replica.anomalies``:
records out of commit order in the log (invariant 1), two records at the same
``(commit LSN, position)`` (a duplicate, invariant 3), an insert for a key that exists (a snapshot
row also delivered as a change: an inconsistent snapshot), an update or delete of a row the oracle
does not hold, an unchanged-TOAST column whose previous value is unknown.

**Comparing with the source** (:func:`diff_source`, :func:`assert_mirrors`): the replayed rows
against ``SELECT *`` read as the change log's own values (:func:`tests.support.rows.source_values`:
each column's output-function text under the drain's pinned settings, through the same
``column_converter``, special values included), compared as exact multisets
(:func:`tests.support.rows.row_differences`, floats by their bits). So a difference is a
difference in the data the log carried, never in how two libraries render a value. What this
cannot catch is a converter that maps two different texts to the same value; the value
converters have their own server tests.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg

from cdc_assets.changelog.checkpoint import TableState
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.pgoutput.schema import RelationSchema
from tests.support.rows import Row, SourceValues, Special, cut, freeze, row_differences, source_values, to_python

MAX_DIFF_LINES = 25


@dataclass(slots=True)
class TableReplica:
    """One table as the change log says it is: ``columns`` of its latest schema version, and its
    rows — by key (``key`` non-empty), or a multiset (``key`` empty)."""

    name: str
    columns: tuple[str, ...] = ()
    key: tuple[str, ...] = ()
    schema: RelationSchema | None = None
    keyed: dict[tuple[Any, ...], Row] = field(default_factory=dict)
    bag: list[Row] = field(default_factory=list)
    records: int = 0
    schema_versions: list[int] = field(default_factory=list)

    def rows(self) -> list[Row]:
        """Every row, with exactly the latest columns (``None`` where a row predates a column)."""
        held = list(self.keyed.values()) if self.key else list(self.bag)
        return [{c: row.get(c) for c in self.columns} for row in held]

    def __len__(self) -> int:
        return len(self.keyed) if self.key else len(self.bag)


@dataclass(slots=True)
class Replica:
    """Every table of a change log, replayed; ``anomalies`` lists broken promises of the log."""

    tables: dict[str, TableReplica] = field(default_factory=dict)
    anomalies: list[str] = field(default_factory=list)
    checkpoint_lsn: int = 0

    def __getitem__(self, table: str) -> TableReplica:
        return self.tables[table]

    def rows(self, table: str) -> list[Row]:
        return self.tables[table].rows() if table in self.tables else []


# --- replay -------------------------------------------------------------------------------


def replay_key(schema: RelationSchema) -> tuple[str, ...]:
    """The columns rows are keyed by: the replica-identity key, none under FULL (whole-row match)
    or without a key."""
    return () if schema.replica_identity == "f" else schema.key_columns


@dataclass(slots=True)
class _Record:
    commit_lsn: int
    position: int
    op: str
    old_kind: str | None
    unchanged: list[str] | None
    new: Row | None
    old: Row | None
    schema: RelationSchema
    version: int


def replay(
    changelog: str | ChangeLogReader, tables: Iterable[str] | None = None, *, upto: int | None = None
) -> Replica:
    """Replay ``tables`` (default: every table in the log) up to the checkpoint (or ``upto``)."""
    reader = changelog if isinstance(changelog, ChangeLogReader) else ChangeLogReader(changelog)
    checkpoint = reader.checkpoint()
    replica = Replica(checkpoint_lsn=checkpoint.lsn if checkpoint else 0)
    names = list(tables) if tables is not None else reader.tables()
    for name in names:
        replica.tables[name] = _replay_table(reader, name, checkpoint, upto, replica.anomalies)
    return replica


def _records(reader: ChangeLogReader, table: str, state: TableState | None, upto: int | None) -> Iterator[_Record]:
    """The table's records from its latest copy (the initial snapshot, or an online run)."""
    chunks = reader.read_changes(table, upto=upto) if state is None else reader.read_table(table, state, upto=upto)
    for chunk in chunks:
        records = chunk.records
        columns = {name: to_python(records.column(name)) for name in records.column_names}
        for i in range(records.num_rows):
            new, old = columns["new"][i], columns["old"][i]
            for entry, text in columns["_cdc_special"][i] or []:
                image, _, column = entry.partition(".")
                target = new if image == "new" else old
                if target is None:
                    raise AssertionError(f"{table}: _cdc_special names {entry} but the record has no {image} image")
                target[column] = Special(text)
            yield _Record(
                columns["_cdc_commit_lsn"][i],
                columns["_cdc_position"][i],
                columns["_cdc_op"][i],
                columns["_cdc_old_kind"][i],
                columns["_cdc_unchanged"][i],
                new,
                old,
                chunk.relation,
                chunk.schema_version,
            )


def _replay_table(
    reader: ChangeLogReader, name: str, checkpoint: Any, upto: int | None, anomalies: list[str]
) -> TableReplica:
    table = TableReplica(name)
    state = checkpoint.tables.get(name) if checkpoint is not None else None
    records = list(_records(reader, name, state, upto))
    order = [(r.commit_lsn, r.position) for r in records]
    if order != sorted(order):
        first = next(i for i in range(1, len(order)) if order[i] < order[i - 1])
        anomalies.append(
            f"{name}: records out of commit order in the log at record {first}: {order[first - 1]} then {order[first]}"
        )
    for (lsn, position), count in Counter(order).items():
        if count > 1:
            anomalies.append(f"{name}: {count} records at commit LSN {lsn:X} position {position} (duplicated)")
    records.sort(key=lambda r: (r.commit_lsn, r.position))
    for record in records:
        if table.schema is None or not table.schema.same_version(record.schema):
            _change_schema(table, record.schema)
        if not table.schema_versions or table.schema_versions[-1] != record.version:
            table.schema_versions.append(record.version)
        _apply(table, record, anomalies)
        table.records += 1
    if state is not None and (table.schema is None or not table.schema.same_version(state.relation)):
        _change_schema(table, state.relation)  # e.g. an empty snapshot: the checkpoint knows the columns
    return table


def _change_schema(table: TableReplica, schema: RelationSchema) -> None:
    """Held rows lose columns ``schema`` no longer has; rows are re-keyed by its key."""
    columns = tuple(c.name for c in schema.columns)
    if table.schema is not None:
        gone = set(table.columns) - set(columns)
        held = list(table.keyed.values()) if table.key else table.bag
        for row in held:
            for column in gone:
                row.pop(column, None)
    else:
        held = []
    key = replay_key(schema)
    if table.schema is None or key != table.key:
        table.keyed, table.bag = {}, []
        for row in held:
            if key:
                table.keyed[tuple(row.get(c) for c in key)] = row
            else:
                table.bag.append(row)
    table.schema, table.columns, table.key = schema, columns, key


def _apply(table: TableReplica, record: _Record, anomalies: list[str]) -> None:
    where = f"{table.name} at commit LSN {record.commit_lsn:X} position {record.position} ({record.op})"
    match record.op:
        case "truncate":
            table.keyed.clear()
            table.bag.clear()
        case "snapshot" | "insert":
            row = dict(_required(record.new, where))
            if table.key:
                key = _key(row, table.key)
                if key in table.keyed:
                    anomalies.append(f"{where}: insert of key {key}, which the table already holds")
                table.keyed[key] = row
            else:
                table.bag.append(row)
        case "update":
            new = dict(_required(record.new, where))
            if table.key:
                old_key = _key(record.old, table.key) if record.old_kind in ("K", "O") else _key(new, table.key)
                previous = table.keyed.pop(old_key, None)
                if previous is None:
                    anomalies.append(f"{where}: update of key {old_key}, which the table does not hold")
                source = record.old if record.old_kind == "O" else previous
            else:
                if record.old_kind != "O":
                    anomalies.append(f"{where}: update without an old row in a table without replica identity key")
                    return
                previous = _take_equal(table.bag, record.old)
                if previous is None:
                    anomalies.append(f"{where}: update of a row the table does not hold: {record.old}")
                source = record.old
            for column in record.unchanged or []:
                if source is None or column not in source:
                    anomalies.append(f"{where}: unchanged TOAST column {column} has no previous value")
                    new[column] = None
                else:
                    new[column] = source[column]
            if table.key:
                new_key = _key(new, table.key)
                if new_key != old_key and new_key in table.keyed:
                    anomalies.append(f"{where}: key change {old_key} -> {new_key} onto an existing key")
                table.keyed[new_key] = new
            else:
                table.bag.append(new)
        case "delete":
            old = _required(record.old, where)
            if table.key:
                if table.keyed.pop(_key(old, table.key), None) is None:
                    anomalies.append(f"{where}: delete of key {_key(old, table.key)}, which the table does not hold")
            elif _take_equal(table.bag, old) is None:
                anomalies.append(f"{where}: delete of a row the table does not hold: {old}")
        case other:
            anomalies.append(f"{where}: unknown operation {other!r}")


def _required(image: Row | None, where: str) -> Row:
    if image is None:
        raise AssertionError(f"{where}: the record has no row image")
    return image


def _key(row: Row | None, columns: Sequence[str]) -> tuple[Any, ...]:
    assert row is not None
    return tuple(freeze(row.get(c)) for c in columns)


def _take_equal(bag: list[Row], old: Row | None) -> Row | None:
    """Remove and return one row equal to ``old`` on ``old``'s columns."""
    assert old is not None
    wanted = {c: freeze(v) for c, v in old.items()}
    for i, row in enumerate(bag):
        if all(freeze(row.get(c)) == v for c, v in wanted.items()):
            return bag.pop(i)
    return None


# --- the change log against the source ----------------------------------------------------------


def diff_table(replica: TableReplica, source: SourceValues) -> list[str]:
    """Differences between the replayed table and the source rows, one line each."""
    lines: list[str] = []
    if tuple(replica.columns) != tuple(source.columns):
        lines.append(f"columns differ: change log {list(replica.columns)}, source {list(source.columns)}")
    return lines + row_differences(replica.rows(), source.rows, ("the change log", "the source"), replica.key)


def diff_source(replica: Replica, conn: psycopg.Connection[Any] | str, tables: Iterable[str]) -> str:
    """A readable report of every difference between the replica and ``SELECT *`` of each table
    in the source; empty when they are equal."""
    own = isinstance(conn, str)
    connection = psycopg.connect(conn, autocommit=True) if isinstance(conn, str) else conn
    try:
        out: list[str] = []
        for table in tables:
            if table not in replica.tables:
                out.append(f"{table}: not in the change log")
                continue
            lines = diff_table(replica.tables[table], source_values(connection, table))
            if lines:
                out.append(f"{table}: {len(lines)} difference(s)")
                out.append(cut(lines, MAX_DIFF_LINES, indent="  "))
        return "\n".join(out)
    finally:
        if own:
            connection.close()


def assert_mirrors(changelog: str, conn: psycopg.Connection[Any] | str, tables: Iterable[str]) -> Replica:
    """Replay the log; fail with a readable report on an anomaly or a difference from the source."""
    tables = list(tables)
    replica = replay(changelog, tables)
    problems = "\n".join(replica.anomalies)
    difference = diff_source(replica, conn, tables)
    assert not problems and not difference, f"change log anomalies:\n{problems}\ndifferences:\n{difference}"
    return replica
