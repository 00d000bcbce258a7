"""Planning: a table's change records → its net change (pure: no I/O, no Spark).

The records after a Delta table's applied LSN, in commit order, become one :class:`ChangePlan`:

* **TRUNCATE cuts.** With ``truncate: apply`` the last TRUNCATE of the batch drops every earlier
  change and marks the table to be emptied, row filters notwithstanding; later changes apply to
  the empty table. A copy does the same from its start (it *is* the table's contents, even empty).
* **Last image wins** per key. A key-changing UPDATE (an old key ``K`` or old row ``O`` that
  differs from the new key) deletes the old key and upserts the new one.
* **Unchanged TOAST** columns (``'u'``) are filled, in order, from the ``O`` old row of the same
  record; from the latest earlier image of the same key in the batch — for a key change, the
  image under the *old* key; otherwise they stay *unresolved* and the merge takes them from the
  row already in the Delta table under its fill key (``DeltaColumn.FILL_KEY``) (the key the value was last stored under).
* **Keyed tables** (a replica identity key: primary key or ``USING INDEX``) get one upsert or
  delete per key. **REPLICA IDENTITY FULL** tables, whose key is every column, are planned as a
  multiset — per distinct row, how many copies to add or remove — exact even with duplicate
  rows. **Tables without a key** are append-only.

Keys touched only by inserts, deletes and plain updates are resolved vectorized (the last record
of each key wins); only keys involved in key changes or unresolved TOAST values go through an
ordered fold in Python, so planning stays cheap for large batches.

The consumer-side row filter is evaluated by the merge on the final images, where the Delta
table itself says whether the old image matched (see :mod:`cdc_assets.apply.merge`).

One module of ~570 lines on purpose: the three plans share one event table (:class:`_Events`)
and its helpers, and the keyed plan's vectorized path and its fold are two halves of one rule
(last image wins, TOAST filled in order); apart, each would need the other's private details.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_assets.errors import CdcError
from cdc_assets.pgoutput.protocol import REPLICA_IDENTITY_FULL
from cdc_assets.pgoutput.records import (
    COMMIT_TIME_TYPE,
    ChangeChunk,
    DeltaColumn,
    OldKind,
    Op,
    PlanAction,
    RecordColumn,
)
from cdc_assets.pgoutput.schema import RelationSchema

PlanMode = Literal["keyed", "multiset", "append"]
PlanShape = Literal["appends", "updates", "any"]


class PlanError(CdcError):
    """The change records contradict themselves (e.g. an update keeps a value of a deleted key)."""


@dataclass(slots=True)
class ChangePlan:
    """The net change of one table against its latest schema ``relation``.

    ``mode`` says how ``rows`` apply:

    * ``keyed``: one row per key; ``DeltaColumn.ACTION`` is ``PlanAction.UPSERT`` (the final image,
      where the columns in ``DeltaColumn.UNRESOLVED`` are to be taken from the Delta row under
      ``DeltaColumn.FILL_KEY``) or ``PlanAction.DELETE`` (key columns only);
    * ``multiset``: one row per distinct full row, ``DeltaColumn.COPIES`` copies to add (> 0) or
      remove (< 0);
    * ``append``: rows to append.

    ``truncate`` empties the table before ``rows`` apply. Every row carries ``DeltaColumn.LSN`` (end
    LSN of its last change's transaction) and ``DeltaColumn.COMMIT_TIME``.

    ``shape`` says what work the merge may skip (:mod:`cdc_assets.apply.merge`): ``appends`` —
    appending the upserts is the whole change (keyed: the batch only inserted, and a key
    PostgreSQL inserts is in neither the source nor its mirror just before — except in a table
    whose TRUNCATEs are ignored, which may still hold it; multiset: the batch only adds copies);
    ``updates`` — each upsert replaces a row the table holds under the same key (no inserts, no
    key changes); else ``any``.
    """

    relation: RelationSchema
    mode: PlanMode
    key: tuple[str, ...]
    truncate: bool
    rows: pa.Table
    records: int
    last_lsn: int
    counts: dict[str, int] = field(default_factory=dict)
    shape: PlanShape = "any"

    @property
    def has_unresolved(self) -> bool:
        return self.mode == "keyed" and self.rows.column(DeltaColumn.UNRESOLVED).null_count < self.rows.num_rows


def plan_changes(
    chunks: Sequence[ChangeChunk], relation: RelationSchema, *, truncate: Literal["apply", "ignore"] = "apply"
) -> ChangePlan:
    """Plan ``chunks`` (in log order, at least one) for a table whose latest schema is ``relation``."""
    if not chunks:
        raise ValueError("nothing to plan: no change records")
    events = _Events.build(chunks, relation, truncate)
    if not relation.key_columns:
        return _append_plan(events)
    mirrored = truncate == "apply"  # the table holds exactly the source's rows as of its applied LSN
    if relation.replica_identity == REPLICA_IDENTITY_FULL:
        return _multiset_plan(events)
    return _keyed_plan(events, relation.key_columns, mirrored)


def fill_from_history(plan: ChangePlan, history: ChangePlan) -> ChangePlan:
    """``plan`` with its unresolved columns taken from ``history``, the plan of the table's whole
    change log up to the same LSN (which starts from the snapshot, so it resolves every value).

    The Delta table cannot fill an unresolved column of a row it does not hold: with a row filter,
    an UPDATE that moves a row into the filter without touching its TOASTed columns carries them
    as ``'u'`` while the row was never written. ``history``'s final image of the same key has them.
    """
    if not plan.has_unresolved:
        return plan
    if history.mode != "keyed" or history.key != plan.key:
        raise ValueError("history must be the keyed plan of the same table")
    rows = plan.rows
    names = [c.name for c in plan.relation.columns]
    unresolved = rows.column(DeltaColumn.UNRESOLVED).combine_chunks()
    known = history.rows.filter(pc.equal(history.rows.column(DeltaColumn.ACTION), PlanAction.UPSERT))
    lookup = known.select(list(plan.key)).append_column(
        "__history_row", pa.array(np.arange(known.num_rows), pa.int64())
    )
    position = rows.select(list(plan.key)).append_column("__plan_row", pa.array(np.arange(rows.num_rows), pa.int64()))
    joined = _groupable(position).join(_groupable(lookup), list(plan.key), join_type="inner", use_threads=False)
    at = np.full(rows.num_rows, -1, dtype=np.int64)
    at[joined.column("__plan_row").to_numpy()] = joined.column("__history_row").to_numpy()
    found = at >= 0
    from_history = known.take(pa.array(np.where(found, at, 0), pa.int64())) if known.num_rows else None
    parents = pc.list_parent_indices(unresolved).to_numpy()
    listed = pc.list_flatten(unresolved)
    left: list[list[str] | None] = unresolved.to_pylist()
    for name in names:
        mask = np.zeros(rows.num_rows, dtype=bool)
        mask[parents[pc.equal(listed, name).to_numpy(zero_copy_only=False)]] = True
        mask &= found
        if not mask.any() or from_history is None:
            continue
        index = rows.column_names.index(name)
        earlier = from_history.column(name).cast(rows.schema.field(name).type)
        filled = pc.if_else(pa.array(mask), earlier, rows.column(name))
        rows = rows.set_column(index, rows.field(index), filled)
        for i in np.flatnonzero(mask):
            left[i] = [c for c in left[i] or () if c != name] or None
    rows = rows.set_column(
        rows.column_names.index(DeltaColumn.UNRESOLVED),
        rows.schema.field(DeltaColumn.UNRESOLVED),
        pa.array(left, pa.list_(pa.string())),
    )
    fill_key = pc.if_else(
        pa.array([u is None for u in left]),
        pa.nulls(rows.num_rows, rows.schema.field(DeltaColumn.FILL_KEY).type),
        rows.column(DeltaColumn.FILL_KEY),
    )
    rows = rows.set_column(
        rows.column_names.index(DeltaColumn.FILL_KEY), rows.schema.field(DeltaColumn.FILL_KEY), fill_key
    )
    return replace(plan, rows=rows)


# -- the records, flattened to the latest schema ---------------------------------------------------


@dataclass(slots=True)
class _Events:
    """The records after the cut, with ``new`` and ``old`` images as tables of the latest columns."""

    relation: RelationSchema
    truncate: bool
    ops: np.ndarray
    new: pa.Table
    old: pa.Table
    old_kind: np.ndarray
    unchanged: list[list[str] | None]
    lsn: np.ndarray
    commit_time: pa.Array
    record_count: int
    last_lsn: int

    @classmethod
    def build(cls, chunks: Sequence[ChangeChunk], relation: RelationSchema, truncate_mode: str) -> _Events:
        ops = np.concatenate([c.records.column(RecordColumn.OP).to_numpy(zero_copy_only=False) for c in chunks])
        lsn = np.concatenate([c.records.column(RecordColumn.END_LSN).to_numpy() for c in chunks])
        offsets = np.cumsum([0] + [c.records.num_rows for c in chunks])
        copy_at = next((int(offsets[i]) for i, c in enumerate(chunks) if c.copy), None)
        truncate, start = _cut(ops, truncate_mode, copy_at)
        keep = np.flatnonzero((np.arange(len(ops)) >= start) & (ops != Op.TRUNCATE))
        index = pa.array(keep, pa.int64())
        new = latest_images(chunks, relation, "new").take(index)
        old = latest_images(chunks, relation, "old").take(index)
        kinds = np.concatenate([c.records.column(RecordColumn.OLD_KIND).to_numpy(zero_copy_only=False) for c in chunks])
        unchanged = [u for c in chunks for u in c.records.column(RecordColumn.UNCHANGED).to_pylist()]
        times = pa.chunked_array(
            [
                chunk
                for c in chunks
                for chunk in c.records.column(RecordColumn.COMMIT_TIME).cast(COMMIT_TIME_TYPE).chunks
            ],
            COMMIT_TIME_TYPE,
        ).combine_chunks()
        new, kept_unchanged = _unchanged_keys_from_old(
            new, old, kinds[keep], [unchanged[i] for i in keep], relation.key_columns
        )
        return cls(
            relation=relation,
            truncate=truncate,
            ops=ops[keep],
            new=new,
            old=old,
            old_kind=kinds[keep],
            unchanged=kept_unchanged,
            lsn=lsn[keep],
            commit_time=times.take(index),
            record_count=len(ops),
            last_lsn=int(lsn.max()) if len(lsn) else 0,
        )

    def take_times(self, rows: np.ndarray) -> pa.Array:
        return self.commit_time.take(pa.array(rows, pa.int64()))


def _unchanged_keys_from_old(
    new: pa.Table, old: pa.Table, old_kind: np.ndarray, unchanged: list[list[str] | None], key: tuple[str, ...]
) -> tuple[pa.Table, list[list[str] | None]]:
    """Key columns sent as unchanged TOAST, taken from the old key or row.

    A key value stored out of line (between ~2 kB and the index's ~2.7 kB limit, or under
    ``SET STORAGE EXTERNAL``) is sent as ``'u'`` in the new tuple when it did not change; the
    server then always sends the old key (``K``) or row (``O``), which holds it."""
    from_old = [
        {c for c in names if c in key} if names and old_kind[i] in OldKind.ALL else set()
        for i, names in enumerate(unchanged)
    ]
    if not any(from_old):
        return new, unchanged
    for name in key:
        mask = np.array([name in columns for columns in from_old], dtype=bool)
        if mask.any():
            position = new.column_names.index(name)
            filled = pc.if_else(pa.array(mask), old.column(name), new.column(name))
            new = new.set_column(position, new.field(position), filled)
    rest = [
        [c for c in names if c not in taken] or None if names else names for names, taken in zip(unchanged, from_old)
    ]
    return new, rest


def latest_images(chunks: Sequence[ChangeChunk], relation: RelationSchema, image: str = "new") -> pa.Table:
    """The ``new`` (or ``old``) images of ``chunks`` as one table of ``relation``'s columns."""
    names = [c.name for c in relation.columns]
    types = _latest_types(chunks, relation)
    return pa.concat_tables([_flatten(c.records.column(image), names, types) for c in chunks])


def _cut(ops: np.ndarray, truncate_mode: str, copy_at: int | None) -> tuple[bool, int]:
    """Whether the table is emptied first, and the index of the first record applied after that.

    The later of the last TRUNCATE (with ``truncate: apply``) and the start of the copy wins: the
    first chunk marked ``copy`` (at index ``copy_at``, rows or none) or the first snapshot record.
    """
    starts = []
    if truncate_mode == "apply":
        truncates = np.flatnonzero(ops == Op.TRUNCATE)
        if len(truncates):
            starts.append(int(truncates[-1]) + 1)
    copies = [int(i) for i in np.flatnonzero(ops == Op.SNAPSHOT)[:1]] + ([] if copy_at is None else [copy_at])
    if copies:
        starts.append(min(copies))
    return (True, max(starts)) if starts else (False, 0)


def _latest_types(chunks: Sequence[ChangeChunk], relation: RelationSchema) -> dict[str, pa.DataType]:
    """Each column's Arrow type in the newest chunk that has it (older values are cast to it)."""
    types: dict[str, pa.DataType] = {}
    for chunk in reversed(chunks):
        for child in chunk.records.schema.field("new").type:
            types.setdefault(child.name, child.type)
    return {c.name: types.get(c.name, pa.null()) for c in relation.columns}


def _flatten(column: pa.ChunkedArray, names: list[str], types: dict[str, pa.DataType]) -> pa.Table:
    """A struct column as a table of the latest columns: missing ones null, older types cast."""
    struct = column.combine_chunks()
    present = {struct.type.field(i).name for i in range(struct.type.num_fields)}
    absent = struct.is_null()
    arrays = []
    for name in names:
        if name not in present:
            arrays.append(pa.nulls(len(struct), types[name]))
            continue
        child = struct.field(name)
        if not child.type.equals(types[name]):
            try:
                child = child.cast(types[name])
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as error:
                raise PlanError(
                    f"column {name}: cannot convert {child.type} values to {types[name]}: {error}"
                ) from None
        if struct.null_count:
            child = pc.if_else(absent, pa.nulls(len(child), child.type), child)
        arrays.append(child)
    return pa.table(arrays, names=names)


def _with_metadata(table: pa.Table, lsn: np.ndarray, commit_time: pa.Array) -> pa.Table:
    return table.append_column(DeltaColumn.LSN, pa.array(lsn, pa.int64())).append_column(
        DeltaColumn.COMMIT_TIME, commit_time
    )


# -- append-only ------------------------------------------------------------------------------------


def _append_plan(events: _Events) -> ChangePlan:
    rows = np.flatnonzero(np.isin(events.ops, [Op.INSERT, Op.SNAPSHOT]))
    table = _with_metadata(events.new.take(pa.array(rows, pa.int64())), events.lsn[rows], events.take_times(rows))
    return ChangePlan(
        events.relation,
        "append",
        (),
        events.truncate,
        table,
        events.record_count,
        events.last_lsn,
        {"inserts": len(rows)},
    )


# -- keyed ------------------------------------------------------------------------------------------


def _keyed_plan(events: _Events, key: tuple[str, ...], mirrored: bool) -> ChangePlan:
    is_update = events.ops == Op.UPDATE
    is_delete = events.ops == Op.DELETE
    has_old = np.isin(events.old_kind, OldKind.ALL)
    old_keys = pa.table(
        [pc.if_else(pa.array(has_old), events.old.column(k), events.new.column(k)) for k in key], names=list(key)
    )
    new_id, old_id, keys = _key_ids(events.new.select(list(key)), old_keys)
    key_changed = is_update & has_old & (new_id != old_id)
    toasted = np.array([bool(u) for u in events.unchanged], dtype=bool)
    complex_records = key_changed | (toasted & (events.old_kind != OldKind.FULL))
    complex_ids = np.union1d(new_id[complex_records], old_id[complex_records])
    in_fold = np.isin(new_id, complex_ids) | np.isin(old_id, complex_ids)
    simple = np.flatnonzero(~in_fold)
    # The other records have one key each and no key change: the last record of each key wins.
    simple_ids = np.where(is_delete[simple], old_id[simple], new_id[simple])
    _, last_in_reverse = np.unique(simple_ids[::-1], return_index=True)
    winners = np.sort(simple[::-1][last_in_reverse])
    schema = _keyed_schema(events, key)
    parts = [
        _upserts(events, winners[~is_delete[winners]], schema),
        _deletes(events, winners[is_delete[winners]], old_keys, schema),
        *_fold(events, np.flatnonzero(in_fold), new_id, old_id, key_changed, keys, schema),
    ]
    rows = pa.concat_tables(parts)
    actions = rows.column(DeltaColumn.ACTION)
    upserts = int(pc.sum(pc.equal(actions, PlanAction.UPSERT)).as_py() or 0)
    counts = {"upserts": upserts, "deletes": rows.num_rows - upserts}
    shape: PlanShape = "any"
    if not events.truncate and mirrored and _only_inserts(events):
        shape = "appends"
    elif not events.truncate and not np.isin(events.ops, [Op.INSERT, Op.SNAPSHOT]).any() and not key_changed.any():
        shape = "updates"
    return ChangePlan(
        events.relation, "keyed", key, events.truncate, rows, events.record_count, events.last_lsn, counts, shape
    )


def _only_inserts(events: _Events) -> bool:
    return len(events.ops) > 0 and bool(np.all(events.ops == Op.INSERT))


def _keyed_schema(events: _Events, key: tuple[str, ...]) -> pa.Schema:
    image = events.new.schema
    return pa.schema(
        [
            *image,
            pa.field(DeltaColumn.LSN, pa.int64()),
            pa.field(DeltaColumn.COMMIT_TIME, COMMIT_TIME_TYPE),
            pa.field(DeltaColumn.ACTION, pa.string()),
            pa.field(DeltaColumn.UNRESOLVED, pa.list_(pa.string())),
            pa.field(DeltaColumn.FILL_KEY, pa.struct([image.field(k) for k in key])),
        ]
    )


def _key_ids(new_keys: pa.Table, old_keys: pa.Table) -> tuple[np.ndarray, np.ndarray, list[dict[str, Any]]]:
    """Integer ids of keys (equal keys, nulls included, share an id) and the key of each id."""
    count = new_keys.num_rows
    both = _groupable(pa.concat_tables([new_keys, old_keys]))
    both = both.append_column("__row", pa.array(np.arange(2 * count), pa.int64()))
    groups = both.group_by(new_keys.column_names, use_threads=False).aggregate([("__row", "list")])
    lists = groups.column("__row_list").combine_chunks()
    ids = np.empty(2 * count, dtype=np.int64)
    ids[lists.flatten().to_numpy()] = np.repeat(np.arange(len(lists)), pc.list_value_length(lists).to_numpy())
    first_rows = pc.list_element(lists, 0).to_numpy()
    original = pa.concat_tables([new_keys, old_keys]).take(pa.array(first_rows, pa.int64())).to_pylist()
    return ids[:count], ids[count:], original


def _groupable(table: pa.Table) -> pa.Table:
    """``table`` with nested columns (lists, structs) replaced by their text, so it can be grouped."""
    columns = []
    for column in table.columns:
        nested = pa.types.is_nested(column.type) or pa.types.is_interval(column.type)
        columns.append(pa.array([repr(v) for v in column.to_pylist()], pa.string()) if nested else column)
    return pa.table(columns, names=table.column_names)


def _upserts(events: _Events, rows: np.ndarray, schema: pa.Schema) -> pa.Table:
    image = _images_with_old_toast(events, rows)
    table = _with_metadata(image, events.lsn[rows], events.take_times(rows))
    table = table.append_column(DeltaColumn.ACTION, pa.array([PlanAction.UPSERT] * len(rows), pa.string()))
    return _conform(table, schema)


def _deletes(events: _Events, rows: np.ndarray, old_keys: pa.Table, schema: pa.Schema) -> pa.Table:
    table = _with_metadata(old_keys.take(pa.array(rows, pa.int64())), events.lsn[rows], events.take_times(rows))
    table = table.append_column(DeltaColumn.ACTION, pa.array([PlanAction.DELETE] * len(rows), pa.string()))
    return _conform(table, schema)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """``table`` with ``schema``'s columns in order; missing ones null."""
    return pa.table(
        [table.column(f.name) if f.name in table.column_names else pa.nulls(table.num_rows, f.type) for f in schema],
        schema=schema,
    )


def _images_with_old_toast(events: _Events, rows: np.ndarray) -> pa.Table:
    """New images of ``rows``, unchanged TOAST columns taken from the ``O`` old row where sent."""
    index = pa.array(rows, pa.int64())
    image = events.new.take(index)
    names_by_row = [events.unchanged[r] or () if events.old_kind[r] == OldKind.FULL else () for r in rows]
    if not any(names_by_row):
        return image
    old = events.old.take(index)
    columns = []
    for name in image.column_names:
        mask = np.array([name in names for names in names_by_row], dtype=bool)
        columns.append(
            pc.if_else(pa.array(mask), old.column(name), image.column(name)) if mask.any() else image.column(name)
        )
    return pa.table(columns, names=image.column_names)


@dataclass(slots=True)
class _Final:
    """The folded state of one key: its last image (None when deleted) and what is unresolved."""

    image: dict[str, Any] | None
    unresolved: set[str]
    fill_id: int | None
    lsn: int
    commit_time: Any


def _fold(
    events: _Events,
    records: np.ndarray,
    new_id: np.ndarray,
    old_id: np.ndarray,
    key_changed: np.ndarray,
    keys: list[dict[str, Any]],
    schema: pa.Schema,
) -> list[pa.Table]:
    """Apply, in order, the records touching keys with key changes or unresolved TOAST values."""
    if not len(records):
        return []
    index = pa.array(records, pa.int64())
    new_rows = events.new.take(index).to_pylist()
    old_rows = events.old.take(index).to_pylist()
    times = events.commit_time.take(index).to_pylist()
    name = events.relation.qualified_name
    state: dict[int, _Final] = {}
    for i, record in enumerate(records):
        lsn = int(events.lsn[record])
        if events.ops[record] == Op.DELETE:
            state[int(old_id[record])] = _Final(None, set(), None, lsn, times[i])
            continue
        image = new_rows[i]
        unresolved: set[str] = set()
        fill_id: int | None = None
        source_id = int(old_id[record] if key_changed[record] else new_id[record])
        for column in events.unchanged[record] or ():
            earlier = state.get(source_id)
            if events.old_kind[record] == OldKind.FULL:
                image[column] = old_rows[i][column]
            elif earlier is None:
                if events.truncate:
                    raise PlanError(
                        f"{name}: column {column} was sent as unchanged TOAST (LSN {lsn}) after a TRUNCATE, with no"
                        " earlier value in the batch"
                    )
                unresolved.add(column)
                fill_id = source_id
            elif earlier.image is None:
                raise PlanError(f"{name}: an update (LSN {lsn}) keeps column {column} of a row the batch deleted")
            elif column in earlier.unresolved:
                unresolved.add(column)
                fill_id = earlier.fill_id
            else:
                image[column] = earlier.image[column]
        if key_changed[record]:
            state[int(old_id[record])] = _Final(None, set(), None, lsn, times[i])
        state[int(new_id[record])] = _Final(image, unresolved, fill_id, lsn, times[i])
    names = [c.name for c in events.relation.columns]
    rows = []
    for key_id, final in state.items():
        row: dict[str, Any] = dict(final.image) if final.image is not None else dict(keys[key_id])
        row[DeltaColumn.LSN], row[DeltaColumn.COMMIT_TIME] = final.lsn, final.commit_time
        row[DeltaColumn.ACTION] = PlanAction.UPSERT if final.image is not None else PlanAction.DELETE
        row[DeltaColumn.UNRESOLVED] = sorted(final.unresolved) or None
        row[DeltaColumn.FILL_KEY] = keys[final.fill_id] if final.fill_id is not None else None
        rows.append(
            {
                n: row.get(n)
                for n in [
                    *names,
                    DeltaColumn.LSN,
                    DeltaColumn.COMMIT_TIME,
                    DeltaColumn.ACTION,
                    DeltaColumn.UNRESOLVED,
                    DeltaColumn.FILL_KEY,
                ]
            }
        )
    return [pa.Table.from_pylist(rows, schema=schema)]


# -- multiset ---------------------------------------------------------------------------------------


def _multiset_plan(events: _Events) -> ChangePlan:
    """REPLICA IDENTITY FULL: +1 per new row image, -1 per old row image, summed per distinct row."""
    names = [c.name for c in events.relation.columns]
    adds = np.flatnonzero(np.isin(events.ops, [Op.INSERT, Op.SNAPSHOT, Op.UPDATE]))
    removes = np.flatnonzero(np.isin(events.ops, [Op.UPDATE, Op.DELETE]))
    images = pa.concat_tables([_images_with_old_toast(events, adds), events.old.take(pa.array(removes, pa.int64()))])
    signs = np.concatenate([np.ones(len(adds), np.int64), -np.ones(len(removes), np.int64)])
    lsns = np.concatenate([events.lsn[adds], events.lsn[removes]])
    rows = np.concatenate([adds, removes])
    # In record order, so that the last image of a group (``__i`` max) is its latest change.
    order = np.argsort(rows, kind="stable")
    images, signs, lsns, rows = images.take(pa.array(order, pa.int64())), signs[order], lsns[order], rows[order]
    grouping = _groupable(images).append_column("__i", pa.array(np.arange(len(rows)), pa.int64()))
    grouping = grouping.append_column(DeltaColumn.COPIES, pa.array(signs)).append_column(
        DeltaColumn.LSN, pa.array(lsns, pa.int64())
    )
    groups = grouping.group_by(names, use_threads=False).aggregate(
        [(DeltaColumn.COPIES, "sum"), (DeltaColumn.LSN, "max"), ("__i", "max")]
    )
    copies = groups.column(f"{DeltaColumn.COPIES}_sum").to_numpy()
    changed = np.flatnonzero(copies != 0)
    last = groups.column("__i_max").to_numpy()[changed]
    table = images.take(pa.array(last, pa.int64()))
    table = table.append_column(DeltaColumn.COPIES, pa.array(copies[changed], pa.int64()))
    table = _with_metadata(table, lsns[last], events.take_times(rows[last]))
    counts = {"inserts": int(copies[copies > 0].sum()), "deletes": int(-copies[copies < 0].sum())}
    return ChangePlan(
        events.relation,
        "multiset",
        tuple(names),
        events.truncate,
        table,
        events.record_count,
        events.last_lsn,
        counts,
        "appends" if not events.truncate and _only_inserts(events) else "any",
    )
