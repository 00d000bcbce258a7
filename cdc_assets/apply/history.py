"""Change history: every change of a table as an append-only Delta table, partitioned by commit day.

One row per change (snapshot rows are not changes): the operation, LSNs, position, xid, commit
time, the ``before`` image (the old key or old row when PostgreSQL sent one) and the ``after``
image, and the columns sent as unchanged TOAST. A lost slot's gap is one ``gap`` row on the day of
its recovery: the changes in its LSN range are not in the history. A day is written with
``replaceWhere`` on its partition, so writing a day again — a backfill, a retry — gives the same
partition.
"""

from __future__ import annotations

from datetime import UTC, date, datetime, time, timedelta

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from cdc_assets.apply.spark_types import spark_schema, to_delta_arrow
from cdc_assets.apply.target import delta_table_exists
from cdc_assets.changelog.checkpoint import Gap, TableState
from cdc_assets.changelog.planner import latest_images
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.errors import CdcError
from cdc_assets.faults import fault_point
from cdc_assets.pgoutput.messages import UNIX_EPOCH, unix_time
from cdc_assets.pgoutput.records import COMMIT_TIME_TYPE, ChangeChunk, Op, RecordColumn
from cdc_assets.pgoutput.schema import RelationSchema

DAY = "commit_day"
GAP_OP = "gap"
"""The operation of a history row that marks a lost slot's gap (``cdc-assets recover``)."""
_CHANGE_SCHEMA = pa.schema(
    [
        pa.field(RecordColumn.OP, pa.string(), nullable=False),
        pa.field(RecordColumn.COMMIT_LSN, pa.int64(), nullable=False),
        pa.field(RecordColumn.END_LSN, pa.int64(), nullable=False),
        pa.field(RecordColumn.POSITION, pa.int64(), nullable=False),
        pa.field(RecordColumn.XID, pa.int64(), nullable=False),
        pa.field(RecordColumn.COMMIT_TIME, COMMIT_TIME_TYPE, nullable=False),
        pa.field(RecordColumn.OLD_KIND, pa.string()),
        pa.field(RecordColumn.UNCHANGED, pa.list_(pa.string())),
    ]
)
"""The columns of a history row before its images (a change record's, and a gap row's)."""


class HistoryGoneError(CdcError):
    """The day's changes are no longer (all) in the change log: retention folded them."""


def history_rows(reader: ChangeLogReader, table: str, state: TableState, day: date) -> pa.Table:
    """The changes of ``table`` committed on ``day`` (UTC), in commit order; a day retention has
    folded (some of) is refused with :class:`HistoryGoneError`."""
    start = datetime.combine(day, time(), tzinfo=UTC)
    end = start + timedelta(days=1)
    if state.folded is not None and start <= unix_time(state.folded.commit_time_us):
        kept = unix_time(state.folded.commit_time_us)
        raise HistoryGoneError(
            f"the history of {table} for {day.isoformat()} is gone: change-log retention removed its changes"
            f" committed up to {kept.isoformat()} (changelog.retention_hours); the days after that one are complete"
        )
    relation = state.relation
    chunks = []
    since = (start - UNIX_EPOCH) // timedelta(microseconds=1)
    for chunk in reader.read_changes(table, committed_since_us=since):  # the segments of earlier days are skipped
        records = chunk.records
        when = records.column(RecordColumn.COMMIT_TIME)
        keep = pc.and_(
            pc.and_(pc.greater_equal(when, pa.scalar(start, when.type)), pc.less(when, pa.scalar(end, when.type))),
            pc.not_equal(records.column(RecordColumn.OP), Op.SNAPSHOT),
        )
        records = records.filter(keep)
        if records.num_rows:
            chunks.append(ChangeChunk(chunk.relation, records))
    checkpoint = reader.checkpoint()
    gaps = _gap_rows([g for g in checkpoint.gaps if start <= unix_time(g.time_us) < end] if checkpoint else [])
    if not chunks:
        return _with_day(gaps, day) if gaps.num_rows else pa.table({})
    before = _image(chunks, relation, "old")
    after = _image(chunks, relation, "new")
    changes = pa.concat_tables([c.records.select(_CHANGE_SCHEMA.names) for c in chunks]).cast(_CHANGE_SCHEMA)
    changes = changes.append_column("before", before).append_column("after", after)
    if gaps.num_rows:
        changes = pa.concat_tables([changes, gaps], promote_options="default").sort_by(
            [(RecordColumn.END_LSN, "ascending"), (RecordColumn.POSITION, "ascending")]
        )
    return _with_day(changes, day)


def _with_day(rows: pa.Table, day: date) -> pa.Table:
    return rows.append_column(DAY, pa.array([day] * rows.num_rows, pa.date32()))


def _gap_rows(gaps: list[Gap]) -> pa.Table:
    """One ``gap`` row per lost slot's gap: the transactions that ended in ``(commit LSN, end LSN]``
    are not in the history (the table was copied again after it), recorded at the recovery's time."""
    return pa.Table.from_pylist(
        [
            {
                RecordColumn.OP: GAP_OP,
                RecordColumn.COMMIT_LSN: g.lost_after,
                RecordColumn.END_LSN: g.slot_point,
                RecordColumn.POSITION: 0,
                RecordColumn.XID: 0,
                RecordColumn.COMMIT_TIME: unix_time(g.time_us),
            }
            for g in gaps
        ],
        schema=_CHANGE_SCHEMA,
    )


def write_history(
    spark: SparkSession,
    path: str,
    rows: pa.Table,
    day: date,
    table_properties: dict[str, str],
    storage_options: dict[str, str] | None = None,
) -> int:
    """Replace the ``day`` partition of the history table at ``path`` with ``rows``; returns the row count."""
    if rows.num_rows:
        converted = to_delta_arrow(rows)
        frame = spark.createDataFrame(converted, schema=spark_schema(converted.schema))
    elif delta_table_exists(path, storage_options):
        frame = spark.read.format("delta").load(path).limit(0)  # clears the day
    else:
        return 0  # nothing to write and no table to clear
    writer = (
        frame.write.format("delta")
        .mode("overwrite")
        .partitionBy(DAY)
        .option("replaceWhere", f"{DAY} = DATE'{day.isoformat()}'")
        .option("mergeSchema", "true")
    )
    for key, value in table_properties.items():
        writer = writer.option(key, value)
    writer.save(path)
    fault_point("history-write")
    return int(rows.num_rows)


def _image(chunks: list[ChangeChunk], relation: RelationSchema, image: str) -> pa.StructArray:
    """The ``image`` struct of every record, in the latest columns, null where the record has none."""
    flat = latest_images(chunks, relation, image)
    absent = pa.concat_arrays([c.records.column(image).combine_chunks().is_null() for c in chunks])
    return pa.StructArray.from_arrays(
        [flat.column(name).combine_chunks() for name in flat.column_names], names=flat.column_names, mask=absent
    )
