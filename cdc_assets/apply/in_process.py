"""A small table's plain batch committed by delta-rs in the apply's own process, not by Spark.

On a warm Spark session a Delta commit that has to know the table's files — any MERGE — costs
several Spark jobs and about a second of the driver's time, however few its rows (BENCHMARKS.md,
"The commit floor"); delta-rs merges the same batch into a table of a few thousand rows in tens
of milliseconds. A table below ``warehouse.small_table_mb`` whose batch is plain — keyed without
unchanged TOAST values to fill, or keyless rows to append, no row filter, no truncate — is
therefore written here when ``warehouse.small_table_writer`` is ``delta-rs`` (the default): one
delta-rs commit with the same idempotency marker and user metadata a Spark commit records
(:meth:`~cdc_assets.apply.target.DeltaTarget.commit_in_process`), the same clauses as
:mod:`cdc_assets.apply.merge`'s MERGE, the same table afterwards. Everything else (row filters,
TOAST fills, multisets, truncates, creation, schema changes) stays Spark's.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, write_deltalake
from deltalake import DeltaTable as RustDeltaTable

from cdc_assets.apply.spark_types import to_delta_arrow
from cdc_assets.apply.target import DeltaTarget
from cdc_assets.changelog.planner import ChangePlan
from cdc_assets.names import quote_identifier as _q  # DataFusion quotes names as PostgreSQL does
from cdc_assets.pgoutput.records import DeltaColumn, PlanAction

WRITER_FEATURES = frozenset({"appendOnly", "invariants", "columnMapping", "deletionVectors"})
"""The Delta writer features of a table delta-rs commits to here: those of the tables cdc-assets
creates by default. A table with any other (change data feed, row tracking, constraints, …, set
through ``warehouse.table_properties`` or by hand) is Spark's to write."""


def writes_in_process(target: DeltaTarget, plan: ChangePlan, row_filter: str | None) -> bool:
    """Whether ``plan`` is committed to ``target`` by delta-rs here (the module's conditions)."""
    plain = plan.mode == "append" or (plan.mode == "keyed" and not plan.has_unresolved)
    return (
        target.small_writes_in_process
        and plain
        and not plan.truncate
        and row_filter is None
        and target.is_small()
        and _writable(target)
    )


def _writable(target: DeltaTarget) -> bool:
    """Whether the table's protocol asks of a writer no more than :data:`WRITER_FEATURES`."""
    table = target.snapshot()
    if table is None:
        return False
    protocol = table.protocol()
    if protocol.writer_features is None:  # a protocol before table features: version 2 is appendOnly and invariants
        return protocol.min_writer_version <= 2
    return set(protocol.writer_features) <= WRITER_FEATURES


def merge_in_process(
    target: DeltaTarget, plan: ChangePlan, columns: list[str], lsn: int, inserts: bool
) -> dict[str, int]:
    """A keyed plan's MERGE on the key (null-safe): a deleted key's row deleted, an upsert's
    final image written over its row, or inserted where the table lacks it (``inserts``); the
    counts under the names of Spark's MERGE result."""
    source = _table_rows(target, plan.rows, columns).append_column(
        DeltaColumn.ACTION, plan.rows.column(DeltaColumn.ACTION)
    )
    # each comparison in parentheses: DataFusion's parser reads ``a IS NOT DISTINCT FROM b AND c`` as ``… FROM (b AND c)``
    condition = " AND ".join(f"(t.{_q(k)} IS NOT DISTINCT FROM s.{_q(k)})" for k in plan.key)
    values = {_q(c): f"s.{_q(c)}" for c in columns}

    def merge(table: RustDeltaTable, properties: CommitProperties) -> dict[str, int]:
        merger = table.merge(
            source, condition, source_alias="s", target_alias="t", streamed_exec=False, commit_properties=properties
        )
        merger = merger.when_matched_delete(f"s.{DeltaColumn.ACTION} = '{PlanAction.DELETE}'").when_matched_update(
            values
        )
        if inserts:
            merger = merger.when_not_matched_insert(values, f"s.{DeltaColumn.ACTION} = '{PlanAction.UPSERT}'")
        metrics = merger.execute()
        return {
            "num_inserted_rows": metrics["num_target_rows_inserted"],
            "num_updated_rows": metrics["num_target_rows_updated"],
            "num_deleted_rows": metrics["num_target_rows_deleted"],
        }

    return target.commit_in_process(merge, lsn)


def append_in_process(target: DeltaTarget, plan: ChangePlan, columns: list[str], lsn: int) -> int:
    """A plan that only adds rows (keyless; keyed whose batch only inserted: its upserts)
    appended; the rows written."""
    rows = plan.rows
    if plan.mode == "keyed":
        rows = rows.filter(pc.equal(rows.column(DeltaColumn.ACTION), PlanAction.UPSERT))
    data = _table_rows(target, rows, columns)

    def append(table: RustDeltaTable, properties: CommitProperties) -> dict[str, int]:
        write_deltalake(table, data, mode="append", commit_properties=properties)
        return {"num_inserted_rows": data.num_rows}

    return target.commit_in_process(append, lsn)["num_inserted_rows"]


def _table_rows(target: DeltaTarget, rows: pa.Table, columns: list[str]) -> pa.Table:
    """``rows``' ``columns`` in the Delta table's own Arrow types (a cast that would lose a value
    fails rather than write it)."""
    table = target.snapshot()
    assert table is not None  # writes_in_process: the table is small, so it exists
    schema = pa.schema(table.schema().to_arrow())
    delta = to_delta_arrow(rows.select(columns))
    return pa.table([delta.column(c).cast(schema.field(c).type) for c in columns], names=columns)
