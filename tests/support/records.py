"""Change records built by hand, exactly in the change log's format (``docs/architecture.md``, "A
change record"), for unit tests of the planner.

The record columns are those of :func:`cdc_assets.pgoutput.arrow.record_schema` (the schema
``ChangeRecordBuilder`` produces) behind :data:`cdc_assets.transactions.COMMIT_FIELDS`, the
commit columns the change log prepends — so a table made here has the schema of a table read back
with ``ChangeLogReader.read_changes``. Conventions of pgoutput that the records keep:

* an unchanged TOAST column (``'u'``) is null in ``new`` and listed in ``_cdc_unchanged``;
* a ``K`` old image holds the key columns only (the others are null); an ``O`` image is the row;
* a delete has no ``new`` image; a truncate has neither image and fills ``_cdc_truncate``.

Usage::

    log = ChangeLog(relation("t", ("id", INT4, KEY), ("v", TEXT)))
    log.insert({"id": 1, "v": "a"})                  # one transaction per change, or
    with log.transaction():                          # several changes in one transaction
        log.update({"id": 2, "v": None}, old={"id": 1}, unchanged=["v"])
        log.delete({"id": 2})
    plan_changes([log.chunk()], log.relation)
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa

from cdc_assets.pgoutput.arrow import ChangeRecordBuilder, record_schema
from cdc_assets.pgoutput.records import FIRST_COPY_POSITION, ChangeChunk, RecordColumn
from cdc_assets.pgoutput.schema import ColumnSchema, RelationSchema
from cdc_assets.transactions import COMMIT_FIELDS

# Type OIDs of the columns the tests use, and their change-log Arrow types.
BOOL, INT4, INT8, TEXT, VARCHAR, INT4_ARRAY = 16, 23, 20, 25, 1043, 1007
KEY = True

T0 = datetime(2026, 1, 1, tzinfo=UTC)
LSN_STEP = 0x1000  # between transactions
END_OFFSET = 0x28  # commit end LSN − commit LSN


def numeric_modifier(precision: int, scale: int) -> int:
    """The type modifier of ``numeric(precision, scale)`` (scale an 11-bit field, as PostgreSQL 15+ packs it)."""
    return ((precision << 16) | (scale & 0x7FF)) + 4


def relation(
    name: str, *columns: tuple[Any, ...], identity: str = "d", oid: int = 16400, namespace: str = "public"
) -> RelationSchema:
    """A relation of ``(name, type_oid[, is_key[, ndims]])`` columns; ``identity`` as in pgoutput
    (``d`` default, ``f`` full, ``i`` index, ``n`` nothing). For ``f`` every column is a key
    column, as pgoutput flags them."""
    made = []
    for column in columns:
        col_name, type_oid, *rest = column
        is_key = bool(rest[0]) if rest else False
        ndims = int(rest[1]) if len(rest) > 1 else (1 if type_oid == INT4_ARRAY else 0)
        made.append(ColumnSchema(col_name, type_oid, -1, is_key or identity == "f", ndims))
    return RelationSchema(oid, namespace, name, identity, tuple(made))


def schema_of(rel: RelationSchema) -> pa.Schema:
    """The schema of a change-log table of ``rel``: commit columns, then the record columns."""
    return pa.schema([*COMMIT_FIELDS, *ChangeRecordBuilder(rel).schema])


class ChangeLog:
    """Change records of one relation (one schema version), in commit order.

    Each change outside :meth:`transaction` is a transaction of its own. Transactions get commit
    LSNs ``start, start + LSN_STEP, …``; their end LSN is ``commit + END_OFFSET``."""

    def __init__(self, rel: RelationSchema, *, start: int = 0x10000, xid: int = 700) -> None:
        self.relation = rel
        self.row_type = ChangeRecordBuilder(rel).row_type
        self.schema = pa.schema([*COMMIT_FIELDS, *record_schema(self.row_type)])
        self.rows: list[dict[str, Any]] = []
        self.next_commit = start
        self.next_xid = xid
        self._open: dict[str, Any] | None = None
        self.end_lsns: list[int] = []

    # -- transactions ------------------------------------------------------------------------

    @contextmanager
    def transaction(self) -> Iterator[int]:
        """Changes inside are one transaction; yields its end LSN."""
        assert self._open is None, "transactions do not nest"
        self._open = self._begin()
        try:
            yield self._open[RecordColumn.END_LSN]
        finally:
            self._open = None

    def _begin(self) -> dict[str, Any]:
        commit = self.next_commit
        self.next_commit += LSN_STEP
        self.next_xid += 1
        info = {
            RecordColumn.COMMIT_LSN: commit,
            RecordColumn.END_LSN: commit + END_OFFSET,
            RecordColumn.XID: self.next_xid,
            RecordColumn.COMMIT_TIME: T0 + timedelta(seconds=len(self.end_lsns)),
            "position": 0,
        }
        self.end_lsns.append(commit + END_OFFSET)
        return info

    @property
    def last_lsn(self) -> int:
        return self.end_lsns[-1]

    def _add(self, **record: Any) -> int:
        tx = self._open if self._open is not None else self._begin()
        row = {k: v for k, v in tx.items() if k != "position"}
        row.update(record)
        row[RecordColumn.POSITION] = tx["position"]
        tx["position"] += 1
        row.setdefault(RecordColumn.OLD_KIND, None)
        row.setdefault(RecordColumn.UNCHANGED, None)
        row.setdefault(RecordColumn.SPECIAL, None)
        row.setdefault(RecordColumn.TRUNCATE, None)
        row.setdefault("new", None)
        row.setdefault("old", None)
        self.rows.append(row)
        return row[RecordColumn.END_LSN]

    # -- changes -----------------------------------------------------------------------------

    def insert(self, new: dict[str, Any]) -> int:
        return self._add(_cdc_op="insert", new=self._image(new))

    def snapshot(self, rows: Sequence[dict[str, Any]]) -> int:
        """Snapshot rows: one "transaction" at the slot's consistent point, xid 0."""
        tx = self._begin()
        tx[RecordColumn.XID] = 0
        tx["position"] = FIRST_COPY_POSITION
        self._open = tx
        try:
            for row in rows:
                self._add(_cdc_op="snapshot", new=self._image(row))
        finally:
            self._open = None
        return tx[RecordColumn.END_LSN]

    def update(
        self,
        new: dict[str, Any],
        *,
        old: dict[str, Any] | None = None,
        kind: str | None = None,
        unchanged: Sequence[str] = (),
    ) -> int:
        """``old`` with ``kind`` ``K`` (default when ``old`` is given and the identity is not
        full) or ``O``; ``unchanged`` columns are sent as ``'u'`` (null in ``new``)."""
        if old is not None and kind is None:
            kind = "O" if self.relation.replica_identity == "f" else "K"
        image = self._image({**new, **dict.fromkeys(unchanged)})
        return self._add(
            _cdc_op="update",
            _cdc_old_kind=kind,
            _cdc_unchanged=list(unchanged) or None,
            new=image,
            old=self._old(old, kind),
        )

    def delete(self, old: dict[str, Any], *, kind: str | None = None) -> int:
        kind = kind or ("O" if self.relation.replica_identity == "f" else "K")
        return self._add(_cdc_op="delete", _cdc_old_kind=kind, old=self._old(old, kind))

    def truncate(self, relations: Sequence[str] | None = None, *, cascade: bool = False) -> int:
        names = list(relations) if relations is not None else [self.relation.qualified_name]
        return self._add(
            _cdc_op="truncate",
            _cdc_truncate={"relations": names, "cascade": cascade, "restart_identity": False},
        )

    def _image(self, values: dict[str, Any]) -> dict[str, Any]:
        unknown = set(values) - {c.name for c in self.relation.columns}
        assert not unknown, f"not columns of {self.relation.name}: {unknown}"
        return {c.name: values.get(c.name) for c in self.relation.columns}

    def _old(self, old: dict[str, Any] | None, kind: str | None) -> dict[str, Any] | None:
        if old is None:
            return None
        if kind == "K":
            keys = set(self.relation.key_columns)
            assert set(old) <= keys, f"a K image holds key columns only, got {sorted(old)}"
        return self._image(old)

    # -- output ------------------------------------------------------------------------------

    def table(self) -> pa.Table:
        """The records as the change log's reader returns them."""
        columns = {f.name: [row.get(f.name) for row in self.rows] for f in self.schema}
        for f in self.schema:
            assert f.nullable or None not in columns[f.name], f"{f.name} is not nullable"
        return pa.Table.from_pydict(columns, schema=self.schema)

    def chunk(self) -> ChangeChunk:
        return ChangeChunk(self.relation, self.table())

    def continued(self, rel: RelationSchema) -> ChangeLog:
        """A log of the next schema version ``rel``, continuing this one's LSNs."""
        follower = ChangeLog(rel, start=self.next_commit, xid=self.next_xid)
        return follower


def empty_chunk(rel: RelationSchema) -> ChangeChunk:
    """No records (a table whose segment holds only its schema)."""
    return ChangeChunk(rel, schema_of(rel).empty_table())
