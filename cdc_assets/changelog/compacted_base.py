"""A compacted base: a table's whole contents as of an LSN, written from the change log itself.

Retention (:mod:`cdc_assets.changelog.retention`) folds a table's old changes into one: the table's records
from its latest copy up to ``lsn`` are planned (:func:`~cdc_assets.changelog.planner.plan_changes`,
which starts from the copy's ``snapshot`` records) and the plan's image of the table — the upserted
rows of a keyed table, each row's copies of a REPLICA IDENTITY FULL table, the appended rows of a
table without a key — is written as ``snapshot`` records at ``lsn``, in the layout of an online
snapshot run (``docs/architecture.md``, "Change-log retention"). Values the Arrow type cannot hold
(``RecordColumn.SPECIAL``) are not carried: the plan holds typed values only, as Delta does.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from cdc_assets.changelog.checkpoint import Checkpoint, write_checkpoint
from cdc_assets.changelog.layout import COPY_BATCH
from cdc_assets.changelog.planner import ChangePlan, plan_changes
from cdc_assets.changelog.snapshot_runs import new_base_id, run_store
from cdc_assets.changelog.store import LogStore
from cdc_assets.changelog.writer import BatchWriter
from cdc_assets.errors import CdcError
from cdc_assets.pgoutput.arrow import SPECIAL_TYPE, TRUNCATE_TYPE, record_schema
from cdc_assets.pgoutput.records import FIRST_COPY_POSITION, ChangeChunk, DeltaColumn, Op, PlanAction
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.transactions.commit_table import COMMIT_FIELDS


def write_base(
    store: LogStore,
    slot: str,
    table: str,
    chunks: Sequence[ChangeChunk],
    relation: RelationSchema,
    lsn: int,
    commit_time_us: int,
    truncate: Literal["apply", "ignore"],
) -> str:
    """Write ``table`` as of ``lsn`` — ``chunks`` are its records from its latest copy up to ``lsn``,
    in ``relation``'s columns (those as of ``lsn``) — as a complete base beside the log; returns the
    base's name (for a ``SnapshotRunRef``)."""
    plan = plan_changes(chunks, relation, truncate=truncate)
    image = _table_image(plan, table).select([c.name for c in relation.columns])
    row_type = pa.struct(list(image.schema))
    count = image.num_rows
    columns = [
        pa.array(np.full(count, lsn, np.int64)),
        pa.array(np.full(count, lsn, np.int64)),
        pa.array(np.zeros(count, np.int64)),
        pa.array(np.full(count, commit_time_us, np.int64)).cast(COMMIT_FIELDS[3].type),
        pa.array(np.arange(FIRST_COPY_POSITION, FIRST_COPY_POSITION + count, dtype=np.int64)),
        pa.array([Op.SNAPSHOT] * count, pa.string()),
        pa.nulls(count, pa.string()),
        pa.nulls(count, pa.list_(pa.string())),
        pa.nulls(count, SPECIAL_TYPE),
        pa.nulls(count, TRUNCATE_TYPE),
        pa.StructArray.from_arrays([c.combine_chunks() for c in image.columns], fields=list(row_type)),
        pa.nulls(count, row_type),
    ]
    records = pa.RecordBatch.from_arrays(columns, schema=pa.schema([*COMMIT_FIELDS, *record_schema(row_type)]))
    base = new_base_id(lsn)
    copy = run_store(store, table, base)
    writer = BatchWriter(copy, Checkpoint(slot, COPY_BATCH))
    try:
        writer.records(relation, records)
    except BaseException:
        writer.abandon()
        raise
    checkpoint = writer.close(lsn).advanced(lsn, snapshot_lsn=lsn, snapshot_time_us=commit_time_us)
    write_checkpoint(copy, checkpoint)  # the base is complete
    return base


def _table_image(plan: ChangePlan, table: str) -> pa.Table:
    """The rows the table holds after ``plan`` applied to an empty table."""
    rows = plan.rows
    if plan.mode == "append":
        return rows
    if plan.mode == "multiset":
        copies = rows.column(DeltaColumn.COPIES).to_numpy()
        if (copies < 0).any():
            raise CdcError(f"cannot fold the change log of {table}: it removes rows its copy does not hold")
        return rows.take(pa.array(np.repeat(np.arange(rows.num_rows), copies), pa.int64()))
    upserts = rows.filter(pc.equal(rows.column(DeltaColumn.ACTION), PlanAction.UPSERT))
    if upserts.column(DeltaColumn.UNRESOLVED).null_count < upserts.num_rows:
        raise CdcError(f"cannot fold the change log of {table}: an unchanged TOAST value has no earlier value")
    return upserts
