"""Commit columns: the four columns every change record gets when its transaction commits, and
:class:`CommitTable`, the commit values of a batch's plain transactions kept as numpy arrays, so
records spanning thousands of transactions get theirs by one indexing per column."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from cdc_assets.pgoutput.records import RecordColumn
from cdc_assets.transactions.sink import CommitInfo

COMMIT_FIELDS = [
    pa.field(RecordColumn.COMMIT_LSN, pa.int64(), nullable=False),
    pa.field(RecordColumn.END_LSN, pa.int64(), nullable=False),
    pa.field(RecordColumn.XID, pa.int64(), nullable=False),
    pa.field(RecordColumn.COMMIT_TIME, pa.timestamp("us", tz="UTC"), nullable=False),
]


def with_commit_columns(records: pa.RecordBatch, info: CommitInfo) -> pa.RecordBatch:
    """``records`` of one transaction with its commit LSN, end LSN, xid and commit time."""
    values = (info.commit_lsn, info.end_lsn, info.xid, info.commit_time_us)
    return _prepend(records, [np.full(records.num_rows, v, dtype=np.int64) for v in values])


def _prepend(records: pa.RecordBatch, commit_columns: list[np.ndarray]) -> pa.RecordBatch:
    arrays = [pa.array(c, f.type) for c, f in zip(commit_columns, COMMIT_FIELDS)]
    return pa.RecordBatch.from_arrays([*arrays, *records.columns], schema=pa.schema([*COMMIT_FIELDS, *records.schema]))


@dataclass(slots=True)
class CommitColumns:
    """Commit values by transaction tag, as arrays; ``live`` is False for dropped transactions."""

    values: list[np.ndarray]
    live: np.ndarray

    def attach(self, records: pa.RecordBatch, tags: np.ndarray) -> pa.RecordBatch:
        """``records`` (of the transactions ``tags``, row by row) with their commit columns."""
        return _prepend(records, [column[tags] for column in self.values])


class CommitTable:
    """Commit values of the plain transactions of a batch, by tag (their order of Begin), in
    arrays that grow by doubling: commit LSN, end LSN, xid, commit time (µs since 1970). A tag
    also keeps the sequence number of its transaction's first change (see :meth:`locate`)."""

    __slots__ = ("_live", "_size", "_starts", "_values", "pending")

    def __init__(self) -> None:
        self.clear()

    def clear(self) -> None:
        self._size = 0
        self._starts = np.zeros(1024, dtype=np.int64)
        self._values = [np.zeros(1024, dtype=np.int64) for _ in range(4)]
        self._live = np.zeros(1024, dtype=bool)
        self.pending = 0  # transactions committed since the last clear

    def open(self, start: int) -> int:
        """A tag for a transaction that just began with sequence number ``start``; it is dropped
        unless :meth:`commit` is called."""
        tag = self._reserve(1)
        self._starts[tag] = start
        return tag

    def open_many(self, starts: np.ndarray) -> np.ndarray:
        """Tags for transactions that began with sequence numbers ``starts`` (in order)."""
        first = self._reserve(len(starts))
        self._starts[first : self._size] = starts
        return np.arange(first, self._size, dtype=np.int64)

    def commit(self, tag: int, info: CommitInfo) -> None:
        for column, value in zip(self._values, (info.commit_lsn, info.end_lsn, info.xid, info.commit_time_us)):
            column[tag] = value
        self._live[tag] = True
        self.pending += 1

    def commit_many(
        self, tags: np.ndarray, commit_lsns: np.ndarray, end_lsns: np.ndarray, xids: np.ndarray, times: np.ndarray
    ) -> None:
        for column, values in zip(self._values, (commit_lsns, end_lsns, xids, times)):
            column[tags] = values
        self._live[tags] = True
        self.pending += len(tags)

    def locate(self, seqs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Positions within their transactions and tags of the changes numbered ``seqs``."""
        starts = self._starts[: self._size]
        tags = np.searchsorted(starts, seqs, side="right") - 1
        return seqs - starts[tags], tags

    def columns(self) -> CommitColumns:
        return CommitColumns([column[: self._size] for column in self._values], self._live[: self._size])

    def _reserve(self, count: int) -> int:
        """Room for ``count`` more tags; returns the first."""
        first = self._size
        if first + count > len(self._starts):
            capacity = max(first + count, 2 * len(self._starts))
            self._starts = _grown(self._starts, capacity)
            self._values = [_grown(column, capacity) for column in self._values]
            self._live = _grown(self._live, capacity)
        self._size = first + count
        return first


def _grown(array: np.ndarray, capacity: int) -> np.ndarray:
    grown = np.zeros(capacity, dtype=array.dtype)
    grown[: len(array)] = array
    return grown
