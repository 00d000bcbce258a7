"""What a log file's Parquet footer says about it: its size, and the largest LSN and commit time it
holds — enough for retention to decide without reading the rows."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import pyarrow.parquet as pq

from cdc_assets.changelog.store import LogStore
from cdc_assets.pgoutput.messages import UNIX_EPOCH
from cdc_assets.pgoutput.records import RecordColumn

_COLUMNS = {"tables": (RecordColumn.END_LSN, RecordColumn.COMMIT_TIME), "transactions": ("end_lsn", "commit_time")}
_MESSAGE_COLUMNS = ("lsn", "commit_time")


@dataclass(slots=True, frozen=True)
class SegmentStats:
    """``max_lsn`` and ``max_commit_time_us`` are None when the file has no such values (an empty
    table's snapshot; non-transactional messages have no commit time)."""

    path: str
    bytes: int
    max_lsn: int | None
    max_commit_time_us: int | None


def segment_stats(store: LogStore, path: str) -> SegmentStats:
    """The footer statistics of the segment ``path`` (a table segment, or a transactions or messages file)."""
    lsn_column, time_column = _COLUMNS.get(path.split("/", 1)[0], _MESSAGE_COLUMNS)
    metadata = pq.ParquetFile(store.path(path), filesystem=store.fs).metadata
    size = store.fs.get_file_info(store.path(path)).size or 0
    return SegmentStats(path, size, column_max(metadata, lsn_column), column_max(metadata, time_column))


def column_max(metadata: pq.FileMetaData, column: str) -> int | None:
    """The largest value of a top-level integer or timestamp column (µs since 1970), from the row
    groups' statistics; None when it has none (no rows, or only nulls)."""
    found: list[int] = []
    for group in range(metadata.num_row_groups):
        row_group = metadata.row_group(group)
        for index in range(row_group.num_columns):
            chunk = row_group.column(index)
            statistics = chunk.statistics
            if chunk.path_in_schema == column and statistics is not None and statistics.has_min_max:
                found.append(_microseconds(statistics.max))
    return max(found, default=None)


def _microseconds(value: datetime | int) -> int:
    if isinstance(value, datetime):
        return (value - UNIX_EPOCH) // timedelta(microseconds=1)
    return int(value)
