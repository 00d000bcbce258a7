"""A :class:`~cdc_assets.changelog.planner.ChangePlan` → one Delta commit.

* **Keyed**: one MERGE on the key (null-safe), bounded by the plan's range of the first key
  column so Delta skips the files outside it. Unresolved TOAST columns are first filled from the
  Delta row under the plan's fill key. With a row filter, the filter is evaluated on each final
  image and PostgreSQL's UPDATE transformation follows from whether the key is in the table
  (a filtered table holds a key exactly when its last image matched):

  ============  ===========  ==============
  key in table  new matches  action
  ============  ===========  ==============
  no            no           nothing
  no            yes          INSERT
  yes           no           DELETE
  yes           yes          UPDATE
  ============  ===========  ==============

* **Multiset** (REPLICA IDENTITY FULL): per distinct row, the copies now in the table plus the
  plan's difference give the final number of copies; one MERGE deletes the old copies and inserts
  the final ones.
* **Append**: an append.
* **Truncate**: an overwrite with the rows that follow the cut — emptying and refilling in one
  commit, so the table never shows a half-applied transaction.

Where the plan's :attr:`~cdc_assets.changelog.planner.ChangePlan.shape` allows, less: a batch that
only inserted is an append (no MERGE: no search for matching rows), and a keyed batch of updates
without key changes (and no row filter) a MERGE without its insert clause, which Delta joins to
the rows of the touched files with an inner join (a right outer join without deletion vectors)
instead of an outer (full) one. A keyed batch of upserts alone (no delete, no row filter, no TOAST
value to fill, no change data feed) is Delta's REPLACE ON its key instead of a MERGE: one pass over
the table.

Each is one Delta statement run by :meth:`DeltaTarget.commit` (a REPLACE ON by
:meth:`DeltaTarget.replace`), so the data and the applied LSN are one commit, and a replay after a
crash is skipped by Delta. A small table's plain batch is the same MERGE or append committed by
delta-rs instead (:mod:`cdc_assets.apply.in_process`).
"""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from cdc_assets.apply.in_process import append_in_process, merge_in_process, writes_in_process
from cdc_assets.apply.spark_literals import backquote, spark_literal
from cdc_assets.apply.spark_types import spark_schema, to_delta_arrow
from cdc_assets.apply.target import DeltaTarget
from cdc_assets.changelog.planner import ChangePlan
from cdc_assets.errors import CdcError
from cdc_assets.faults import fault_point
from cdc_assets.pgoutput.records import DeltaColumn, Op, PlanAction

BROADCAST_SOURCE_BYTES = 32 << 20
"""A keyed MERGE whose change rows take at most this much Arrow memory broadcasts them to the
tasks scanning the table when Delta looks for the files to touch, instead of shuffling the whole
table by key (a batch of 100,000 changes of a 7-column table is already ~10 MB, Spark's own
threshold). Delta's rewrite joins ``source LEFT OUTER JOIN target``, which can only build the
target side: it shuffles both whatever the hint."""


TOO_FEW_COPIES = "cdc-assets: a row of the change log has fewer copies in the Delta table than it deletes"
"""The message a multiset MERGE fails with where the table holds fewer copies of a row than the log deletes."""


class ApplyError(CdcError):
    """A plan cannot be applied to its Delta table (names the table and the reason)."""


@dataclass(slots=True)
class MergeCounts:
    """What one commit did; ``write``: how (``create``, ``overwrite``, ``append``, ``MERGE``,
    ``MERGE (matched only)``, ``REPLACE ON``; empty where nothing was written — the table held the
    LSN already)."""

    inserted: int = 0
    updated: int = 0
    deleted: int = 0
    write: str = ""


def write_plan(
    target: DeltaTarget, plan: ChangePlan, lsn: int, *, row_filter: str | None = None, rebuild: bool = False
) -> MergeCounts:
    """Apply ``plan`` to ``target`` in one commit recording ``lsn``.

    ``rebuild``: ``plan`` holds the table's whole history (it starts from the snapshot); the table
    is overwritten even if it already holds ``lsn``.

    Otherwise a plan the table already holds (applied LSN ≥ ``lsn``: a replay after a crash)
    changes nothing. Delta itself would skip the commit; checking first also keeps the steps
    outside that commit from running again — a schema change back to the plan's older columns,
    or the multiset check, which would fail on copies the first run already removed.
    """
    if not rebuild:
        applied = target.applied_lsn()
        if applied is not None and applied >= lsn:
            return MergeCounts()
    columns = _columns_schema(plan)
    batch = plan.rows.num_rows
    table_columns = [f.name for f in columns] + [DeltaColumn.LSN, DeltaColumn.COMMIT_TIME]
    existed = target.exists()
    if existed:
        change = target.schema_change(columns, plan.relation)
        if change:
            target.evolve(change)
    elif not plan.truncate:  # the table is gone but the plan does not start from a copy
        target.create(columns, plan.relation)
    if writes_in_process(target, plan, row_filter):
        return _write_in_process(target, plan, table_columns, lsn)
    source = _source_frame(target.spark, plan)
    if plan.mode == "keyed" and plan.has_unresolved:
        if plan.truncate or not existed:
            raise ApplyError(
                f"{plan.relation.qualified_name}: unchanged TOAST values to fill, but no table to fill from"
            )
        source = _fill_unresolved(source, target.read(), plan, [f.name for f in columns])
    if row_filter:
        source = source.withColumn(DeltaColumn.MATCH, F.coalesce(F.expr(row_filter), F.lit(False)))
    filtered = row_filter is not None
    names = ", ".join(_q(c) for c in table_columns)
    if plan.truncate:
        rows = _rows_to_add(plan, source, filtered)
        if not existed:  # created with its rows: one commit
            inserted = _write_rows(target, None, target.create_statement(plan.relation), rows, names, lsn, batch)
            fault_point("apply-create")
            return MergeCounts(inserted or 0, write="create")
        deleted = target.read().count()
        idempotent = not rebuild or (target.applied_lsn() or -1) < lsn
        into = f"INSERT OVERWRITE {target.sql_name} ({names})"
        inserted = _write_rows(target, target.version(), into, rows, names, lsn, batch, idempotent)
        return MergeCounts() if inserted is None else MergeCounts(inserted, 0, deleted, "overwrite")
    if plan.mode == "append" or plan.shape == "appends":
        rows = _rows_to_add(plan, source, filtered)
        into = f"INSERT INTO {target.sql_name} ({names})"
        inserted = _write_rows(target, target.version(), into, rows, names, lsn, batch)
        return MergeCounts() if inserted is None else MergeCounts(inserted, write="append")
    if plan.mode == "multiset":
        return _merge_multiset(target, plan, source, table_columns, lsn, filtered)
    return _merge_keyed(target, plan, source, table_columns, lsn, filtered)


def _write_in_process(target: DeltaTarget, plan: ChangePlan, columns: list[str], lsn: int) -> MergeCounts:
    """The plan committed by delta-rs (:mod:`cdc_assets.apply.in_process`), written as Spark would
    write it: an append where it only adds rows, else a MERGE (without its insert clause where
    every upsert updates a row)."""
    if plan.mode == "append" or plan.shape == "appends":
        return MergeCounts(append_in_process(target, plan, columns, lsn), write="append")
    inserts = plan.shape != "updates"
    return _counts(
        merge_in_process(target, plan, columns, lsn, inserts), "MERGE" if inserts else "MERGE (matched only)"
    )


def _columns_schema(plan: ChangePlan) -> pa.Schema:
    """The table's own columns, in Delta types."""
    names = [c.name for c in plan.relation.columns]
    return to_delta_arrow(plan.rows.select(names).slice(0, 0)).schema


def _source_frame(spark: SparkSession, plan: ChangePlan) -> DataFrame:
    rows = to_delta_arrow(plan.rows)
    return spark.createDataFrame(rows, schema=spark_schema(rows.schema))


def _rows_to_add(plan: ChangePlan, source: DataFrame, filtered: bool) -> DataFrame:
    """The rows the plan adds: keyed, its upserts; multiset, each row as many times as its copies
    are added; append, every row — only those matching the row filter."""
    if plan.mode == "keyed":
        rows = source.filter(F.col(DeltaColumn.ACTION) == PlanAction.UPSERT)
    elif plan.mode == "multiset":
        rows = source.filter(F.col(DeltaColumn.COPIES) > 0).withColumn(
            DeltaColumn.COPY, F.explode(F.sequence(F.lit(1), F.col(DeltaColumn.COPIES)))
        )
    else:
        rows = source
    return rows.filter(F.col(DeltaColumn.MATCH)) if filtered else rows


def _write_rows(
    target: DeltaTarget,
    before: int | None,
    into: str,
    rows: DataFrame,
    names: str,
    lsn: int,
    batch_rows: int,
    idempotent: bool = True,
) -> int | None:
    """``<into> SELECT <names>`` of ``rows`` (``INSERT INTO``, ``INSERT OVERWRITE``, ``CREATE TABLE
    … AS``) on the table at version ``before`` (None: no table yet); the rows written (None: Delta
    skipped the commit, the table holds ``lsn`` already)."""
    target.commit(
        lambda view: f"{into} SELECT {names} FROM {_q(view)}", rows, lsn, batch_rows=batch_rows, idempotent=idempotent
    )
    version, metrics = target.last_commit()
    return None if version == before else metrics.get("numOutputRows", 0)


def _values(columns: list[str]) -> tuple[str, str, str]:
    """``SET`` assignments, ``INSERT`` names and ``VALUES`` of a MERGE writing ``columns`` from ``s``."""
    return (
        ", ".join(f"{_q(c)} = s.{_q(c)}" for c in columns),
        ", ".join(_q(c) for c in columns),
        ", ".join(f"s.{_q(c)}" for c in columns),
    )


def _null_safe(left: str, right: str, names: list[str]) -> str:
    return " AND ".join(f"{left}.{_q(n)} <=> {right}.{_q(n)}" for n in names)


_q = backquote


def _fill_unresolved(source: DataFrame, table: DataFrame, plan: ChangePlan, names: list[str]) -> DataFrame:
    """Unchanged TOAST columns from the Delta row under each upsert's fill key."""
    s, t = source.alias("s"), table.alias("t")
    condition: Column = F.col(f"s.{DeltaColumn.FILL_KEY}").isNotNull()
    for key in plan.key:
        condition = condition & F.col(f"s.{DeltaColumn.FILL_KEY}.{_q(key)}").eqNullSafe(F.col(f"t.{_q(key)}"))
    joined = s.join(t, condition, "left")
    filled = [
        F.when(F.array_contains(F.col(f"s.{DeltaColumn.UNRESOLVED}"), name), F.col(f"t.{_q(name)}"))
        .otherwise(F.col(f"s.{_q(name)}"))
        .alias(name)
        for name in names
    ]
    rest = [F.col(f"s.{_q(c)}") for c in source.columns if c not in names]
    return joined.select(*filled, *rest)


def _merge_keyed(
    target: DeltaTarget, plan: ChangePlan, source: DataFrame, columns: list[str], lsn: int, filtered: bool
) -> MergeCounts:
    condition = _key_condition(plan)
    # Not where the table feeds its changes: its feed would show the updates as deletes and inserts.
    if not filtered and not plan.has_unresolved and not plan.counts.get("deletes") and not target.feeds_changes():
        return _replace_keyed(target, plan, source.select(*[_q(c) for c in columns]), condition, lsn)
    if plan.rows.nbytes <= BROADCAST_SOURCE_BYTES:
        source = F.broadcast(source)
    update, names, values = _values(columns)
    delete = f"s.{DeltaColumn.ACTION} = '{PlanAction.DELETE}'" + (f" OR NOT s.{DeltaColumn.MATCH}" if filtered else "")
    insert = f"s.{DeltaColumn.ACTION} = '{PlanAction.UPSERT}'" + (f" AND s.{DeltaColumn.MATCH}" if filtered else "")
    # Every upsert updates a row the table holds: no insert clause (Delta's matched-only MERGE).
    # Not with a row filter: an UPDATE moving a row into the filter inserts it (PostgreSQL's
    # UPDATE transformation).
    inserts = plan.shape != "updates" or filtered

    def merge(view: str) -> str:
        return (
            f"MERGE INTO {target.sql_name} AS t USING {_q(view)} AS s ON {condition}"
            f" WHEN MATCHED AND ({delete}) THEN DELETE"
            f" WHEN MATCHED THEN UPDATE SET {update}"
            + (f" WHEN NOT MATCHED AND ({insert}) THEN INSERT ({names}) VALUES ({values})" if inserts else "")
        )

    write = "MERGE" if inserts else "MERGE (matched only)"
    local = not plan.has_unresolved  # the plan's rows alone, not joined to the table's
    return _counts(target.commit(merge, source, lsn, batch_rows=plan.rows.num_rows, local_source=local), write)


def _replace_keyed(target: DeltaTarget, plan: ChangePlan, rows: DataFrame, condition: str, lsn: int) -> MergeCounts:
    """A batch of upserts alone, as Delta's ``REPLACE ON`` the key: the rows under its keys
    deleted and its rows appended, finding the rows once where a MERGE reads the table three
    times (to find the files it touches, to join the changes to them, to mark the old rows)."""
    before = target.version()
    target.replace(rows, condition, lsn, batch_rows=plan.rows.num_rows)
    version, metrics = target.last_commit()
    if version == before:
        return MergeCounts()
    updated = metrics.get("numDeletedRows", 0)
    return MergeCounts(plan.rows.num_rows - updated, updated, write="REPLACE ON")


def _key_condition(plan: ChangePlan) -> str:
    """The key, null-safe, of the table (``t``) and the plan's rows (``s``), and the plan's range of
    its first column on the table's side."""
    condition = _null_safe("t", "s", list(plan.key))
    bounds = _key_bounds(plan)
    return condition if bounds is None else f"{condition} AND {bounds}"


def _key_bounds(plan: ChangePlan) -> str | None:
    """``t.<first key column>`` between the smallest and the largest value the plan holds of it.

    A condition on the target alone: Delta skips every file whose statistics put that column
    outside the range, so a batch of changes to recent keys (a serial or time-ordered key) reads
    the newest files only, not the whole table. None where the column's type has no such order
    shared by Arrow, Spark and Delta's statistics (floats, timestamps, binary, nested) or holds a
    null (a numeric NaN key is kept as null beside its text).
    """
    name = plan.key[0]
    column = plan.rows.column(name)
    ordered = (
        pa.types.is_integer,
        pa.types.is_string,
        pa.types.is_large_string,
        pa.types.is_date32,
        pa.types.is_decimal,
    )
    if not any(test(column.type) for test in ordered) or column.null_count or not len(column):
        return None
    bounds = pc.min_max(column)
    low, high = (spark_literal(bounds[end].as_py(), column.type) for end in ("min", "max"))
    return f"t.{_q(name)} >= {low} AND t.{_q(name)} <= {high}"


def _merge_multiset(
    target: DeltaTarget, plan: ChangePlan, source: DataFrame, columns: list[str], lsn: int, filtered: bool
) -> MergeCounts:
    """Delete every copy of each changed row and insert its final number of copies."""
    names = list(plan.key)
    if filtered:
        # The row is its own key: one that does not match the filter was never in the table
        # (and never will be), so its copies are neither counted nor written.
        source = source.filter(F.col(DeltaColumn.MATCH))
    table = target.read()
    existing = (
        table.alias("t")
        .join(source.select(*names).alias("s"), F.expr(_null_safe("t", "s", names)), "left_semi")
        .groupBy(*names)
        .count()
    )
    final = source.alias("s").join(existing.alias("e"), F.expr(_null_safe("s", "e", names)), "left")
    final = final.select(
        *[F.col(f"s.{_q(c)}").alias(c) for c in source.columns],
        (F.coalesce(F.col("e.count"), F.lit(0)) + F.col(f"s.{DeltaColumn.COPIES}")).alias(DeltaColumn.FINAL),
    )
    # A row left with fewer than no copies fails the MERGE itself before it commits (no job of its
    # own to look first): every row of ``final`` passes this filter on its way into the source.
    final = final.filter(F.when(F.col(DeltaColumn.FINAL) < 0, F.raise_error(F.lit(TOO_FEW_COPIES))).otherwise(True))
    keep = F.col(DeltaColumn.FINAL) > 0
    deletes = final.select(*names, *[F.lit(None).alias(c) for c in columns if c not in names]).withColumn(
        DeltaColumn.KIND, F.lit(Op.DELETE)
    )
    inserts = (
        final.filter(keep)
        .withColumn(DeltaColumn.COPY, F.explode(F.sequence(F.lit(1), F.col(DeltaColumn.FINAL))))
        .select(*columns)
        .withColumn(DeltaColumn.KIND, F.lit(Op.INSERT))
    )
    merge_source = deletes.select(*columns, DeltaColumn.KIND).unionByName(inserts.select(*columns, DeltaColumn.KIND))
    _, inserted, values = _values(columns)

    def merge(view: str) -> str:
        return (
            f"MERGE INTO {target.sql_name} AS t USING {_q(view)} AS s"
            f" ON ({_null_safe('t', 's', names)}) AND s.{DeltaColumn.KIND} = '{Op.DELETE}'"
            f" WHEN MATCHED THEN DELETE"
            f" WHEN NOT MATCHED AND s.{DeltaColumn.KIND} = '{Op.INSERT}' THEN INSERT ({inserted}) VALUES ({values})"
        )

    try:
        commit = target.commit(merge, merge_source, lsn, batch_rows=plan.rows.num_rows)
    except Exception as error:
        if TOO_FEW_COPIES not in str(error):
            raise
        raise ApplyError(
            f"{plan.relation.qualified_name}: the change log deletes more copies of a row than the Delta table holds;"
            " the table is out of step with the log (rebuild it)"
        ) from None
    return _counts(commit, "MERGE")


def _counts(row: dict[str, int], write: str) -> MergeCounts:
    """A MERGE's counts (none where Delta skipped the commit: this LSN was applied before)."""
    if not row:
        return MergeCounts()
    return MergeCounts(row["num_inserted_rows"], row["num_updated_rows"], row["num_deleted_rows"], write)
