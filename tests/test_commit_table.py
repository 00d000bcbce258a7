"""Commit columns (cdc_assets/transactions/commit_table.py): the commit table maps sequence numbers
to transactions and positions, keeps commit values by tag as it grows, marks uncommitted tags
dead, and the commit columns are prepended with the change log's names and types."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from cdc_assets.transactions import COMMIT_FIELDS, CommitInfo, with_commit_columns
from cdc_assets.transactions.commit_table import CommitTable

RECORDS = pa.record_batch([pa.array([5, 6], pa.int64()), pa.array(["a", "b"])], names=["_cdc_position", "v"])


def info(xid: int) -> CommitInfo:
    return CommitInfo(xid, commit_lsn=xid * 0x100, end_lsn=xid * 0x100 + 8, commit_time_us=xid * 1_000_000)


def test_locate_maps_sequence_numbers_to_positions_and_tags() -> None:
    table = CommitTable()
    assert [table.open(0), table.open(3), table.open(3), table.open(5)] == [0, 1, 2, 3]  # tag 1 had no change
    positions, tags = table.locate(np.array([0, 1, 2, 3, 4, 5, 9]))
    assert positions.tolist() == [0, 1, 2, 0, 1, 0, 4]
    assert tags.tolist() == [0, 0, 0, 2, 2, 3, 3]


def test_commit_values_by_tag_and_dropped_tags() -> None:
    table = CommitTable()
    for start in (0, 2, 4):
        table.open(start)
    table.commit(0, info(70))
    table.commit_many(np.array([2]), np.array([0x7100]), np.array([0x7108]), np.array([71]), np.array([71_000_000]))
    assert table.pending == 2
    columns = table.columns()
    assert columns.live.tolist() == [True, False, True]  # tag 1 never committed
    assert [c.tolist() for c in columns.values] == [
        [0x4600, 0, 0x7100],
        [0x4608, 0, 0x7108],
        [70, 0, 71],
        [70_000_000, 0, 71_000_000],
    ]
    attached = columns.attach(RECORDS, np.array([2, 0]))
    assert attached.column("_cdc_xid").to_pylist() == [71, 70]
    assert attached.column("_cdc_end_lsn").to_pylist() == [0x7108, 0x4608]
    assert attached.column("v").to_pylist() == ["a", "b"]
    table.clear()
    assert table.pending == 0 and len(table.columns().live) == 0 and table.open(0) == 0


def test_the_table_grows_and_keeps_its_values() -> None:
    table = CommitTable()
    first = table.open_many(np.arange(0, 3000, 2))
    second = table.open_many(np.arange(3000, 6000, 2))
    assert first.tolist() == list(range(1500)) and second.tolist() == list(range(1500, 3000))
    everything = np.arange(3000)
    table.commit_many(everything, everything * 16, everything * 16 + 8, everything + 500, everything)
    columns = table.columns()
    assert columns.live.all() and columns.values[2].tolist() == (everything + 500).tolist()
    positions, tags = table.locate(np.array([0, 1, 2999, 5999]))
    assert tags.tolist() == [0, 0, 1499, 2999] and positions.tolist() == [0, 1, 1, 1]


def test_with_commit_columns_prepends_the_change_log_columns() -> None:
    records = with_commit_columns(RECORDS, info(70))
    assert records.schema.names == [f.name for f in COMMIT_FIELDS] + ["_cdc_position", "v"]
    assert list(records.schema)[:4] == COMMIT_FIELDS
    assert records.column("_cdc_commit_lsn").to_pylist() == [0x4600, 0x4600]
    assert records.column("_cdc_commit_time").type == pa.timestamp("us", tz="UTC")
    assert records.column("_cdc_commit_time").cast(pa.int64()).to_pylist() == [70_000_000] * 2
