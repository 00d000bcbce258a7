"""What the assembler hands over, and to whom: the :class:`ChangeSink` protocol, the values it is
given, and :class:`Output`, the current batch's sink with how far its transactions got."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import pyarrow as pa

from cdc_assets.pgoutput.messages import LogicalDecodingMessage
from cdc_assets.pgoutput.schema import RelationSchema


@dataclass(slots=True)
class CommitInfo:
    """Where and when a transaction committed. ``origin`` is set when it was replayed from
    another node (an Origin message); ``gid`` for a transaction committed with COMMIT PREPARED."""

    xid: int
    commit_lsn: int
    end_lsn: int
    commit_time_us: int
    origin: str | None = None
    origin_lsn: int | None = None
    gid: str | None = None


@dataclass(slots=True, frozen=True)
class TransactionalMessage:
    """A transactional logical decoding message, at ``position`` among its transaction's changes."""

    position: int
    message: LogicalDecodingMessage


@dataclass(slots=True)
class PreparedTransaction:
    """A two-phase transaction at PREPARE: to be kept until COMMIT or ROLLBACK PREPARED."""

    gid: str
    xid: int
    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    origin: str | None
    origin_lsn: int | None
    chunks: list[tuple[RelationSchema, pa.RecordBatch]]
    messages: list[TransactionalMessage]


class ChangeSink(Protocol):
    """Where the assembler puts what it assembles (the change log's batch writer)."""

    def records(self, relation: RelationSchema, records: pa.RecordBatch) -> None:
        """Change records of committed transactions, with commit columns, in commit order."""

    def transaction(self, info: CommitInfo, changes: int, messages: list[TransactionalMessage]) -> None:
        """A committed transaction, after all its records were given to :meth:`records`."""

    def transactions(
        self, commit_lsns: np.ndarray, end_lsns: np.ndarray, xids: np.ndarray, times_us: np.ndarray, changes: np.ndarray
    ) -> None:
        """Committed plain transactions (no origin, no messages), in commit order, as columns."""

    def standalone_message(self, lsn: int, message: LogicalDecodingMessage) -> None:
        """A non-transactional logical decoding message."""

    def prepared(self, transaction: PreparedTransaction) -> None:
        """A prepared transaction (two-phase slots only)."""

    def commit_prepared(self, gid: str, info: CommitInfo) -> None:
        """COMMIT PREPARED: write the prepared transaction ``gid`` as committed with ``info``."""

    def rollback_prepared(self, gid: str, end_lsn: int) -> None:
        """ROLLBACK PREPARED: forget the prepared transaction ``gid``."""


class Output:
    """The sink of the current batch, shared by the assembler's parts, and how far the batch's
    transactions got: the highest end LSN seen, and how many transactions ended (committed,
    prepared or rolled back). Transactions ending at or below ``checkpoint_lsn`` are in the change
    log already (a rewound slot sends them again): they are counted, not written (invariant 3)."""

    __slots__ = ("checkpoint_lsn", "completed", "last_end_lsn", "sink")

    sink: ChangeSink  # set by :meth:`start`; nothing is written before

    def __init__(self) -> None:
        self.checkpoint_lsn = 0
        self.last_end_lsn = 0
        self.completed = 0

    def start(self, sink: ChangeSink, checkpoint_lsn: int) -> None:
        self.sink = sink
        self.checkpoint_lsn = checkpoint_lsn
        self.last_end_lsn = max(self.last_end_lsn, checkpoint_lsn)
        self.completed = 0

    def ended(self, end_lsn: int) -> bool:
        """Count a transaction that ended at ``end_lsn``; whether it is to be written."""
        self.completed += 1
        if end_lsn > self.last_end_lsn:
            self.last_end_lsn = end_lsn
        return end_lsn > self.checkpoint_lsn

    def ended_many(self, end_lsns: np.ndarray) -> np.ndarray:
        """:meth:`ended` for transactions ending at ``end_lsns``: the mask of those to be written."""
        self.completed += len(end_lsns)
        if len(end_lsns):
            self.last_end_lsn = max(self.last_end_lsn, int(end_lsns.max()))
        return end_lsns > self.checkpoint_lsn
