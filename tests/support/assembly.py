"""Hand-built peek calls for unit tests of the transaction assembler (no server): pgoutput rows
with LSNs (:class:`Rows`), cut into :class:`MessageBlock` s, fed to a :class:`TransactionAssembler`
whose sink records everything it is given (:class:`RecordingSink`).

Usage::

    rows = Rows().relation()
    rows.transaction(700, insert(1, "a"), update(1, "b"))
    sink = assemble(rows)                    # feed_blocks, blocks of 8,192 rows
    sink.changes()                           # [(700, 0, "insert", 1, "a"), (700, 1, "update", 1, "b")]
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pyarrow as pa

from cdc_assets.pgoutput.decoder import Streaming
from cdc_assets.pgoutput.messages import (
    BeginMessage,
    CommitMessage,
    DeleteMessage,
    InsertMessage,
    LogicalDecodingMessage,
    Message,
    RelationColumn,
    RelationMessage,
    TupleData,
    UpdateMessage,
)
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pgoutput.types import INT4, TEXT
from cdc_assets.stream.blocks import MessageBlock
from cdc_assets.transactions import CommitInfo, PreparedTransaction, TransactionalMessage, TransactionAssembler
from tests.support.pgoutput_writer import encode

T_OID = 16400  # table public.t (id int4 key, v text)
U_OID = 16401  # table public.u, same columns
T0_US = 1_767_225_600_000_000  # 2026-01-01, µs since 1970
LSN_STEP = 0x10
END_OFFSET = 0x8  # a commit's end LSN − its commit LSN


def insert(key: int, value: str | None, *, oid: int = T_OID, xid: int | None = None) -> InsertMessage:
    return InsertMessage(xid, oid, _tuple(key, value))


def update(key: int, value: str | None, *, oid: int = T_OID, xid: int | None = None) -> UpdateMessage:
    return UpdateMessage(xid, oid, None, None, _tuple(key, value))


def delete(key: int, *, oid: int = T_OID, xid: int | None = None) -> DeleteMessage:
    return DeleteMessage(xid, oid, TupleData("tn", (str(key).encode(), None)), None)


def message(content: bytes, *, xid: int | None = None, transactional: bool = True) -> LogicalDecodingMessage:
    return LogicalDecodingMessage(xid, int(transactional), 0, "test", content)


def _tuple(key: int, value: str | None) -> TupleData:
    return TupleData("tn" if value is None else "tt", (str(key).encode(), None if value is None else value.encode()))


class Rows:
    """The rows of one peek call, each message at the next LSN (:data:`LSN_STEP` apart)."""

    def __init__(self, start_lsn: int = 0x100000) -> None:
        self.rows: list[tuple[int, bytes]] = []
        self.lsn = start_lsn

    def add(self, *messages: Message) -> Rows:
        for item in messages:
            self.rows.append((self.lsn, encode(item)))
            self.lsn += LSN_STEP
        return self

    def raw(self, data: bytes) -> Rows:
        """A row of arbitrary bytes (malformed input)."""
        self.rows.append((self.lsn, data))
        self.lsn += LSN_STEP
        return self

    def relation(
        self, oid: int = T_OID, name: str = "t", *, extra_column: bool = False, xid: int | None = None
    ) -> Rows:
        columns = [RelationColumn(1, "id", INT4, -1), RelationColumn(0, "v", TEXT, -1)]
        if extra_column:
            columns.append(RelationColumn(0, "w", TEXT, -1))
        return self.add(RelationMessage(xid, oid, "public", name, "d", tuple(columns)))

    def begin(self, xid: int) -> Rows:
        return self.add(BeginMessage(final_lsn=0, commit_time_us=T0_US + xid, xid=xid))

    def commit(self, xid: int) -> int:
        """A Commit at the next LSN; returns its end LSN."""
        commit_lsn = self.lsn
        self.add(CommitMessage(0, commit_lsn, commit_lsn + END_OFFSET, T0_US + xid))
        return commit_lsn + END_OFFSET

    def transaction(self, xid: int, *messages: Message) -> int:
        """Begin, ``messages``, Commit; returns the end LSN."""
        self.begin(xid).add(*messages)
        return self.commit(xid)

    def blocks(self, size: int = 8192) -> list[MessageBlock]:
        blocks = []
        for first in range(0, len(self.rows), size):
            part = self.rows[first : first + size]
            ends = np.cumsum([len(data) for _, data in part], dtype=np.int64)
            lsns = np.array([lsn for lsn, _ in part], dtype=np.int64)
            blocks.append(MessageBlock(lsns, ends, b"".join(data for _, data in part)))
        return blocks


@dataclass
class RecordingSink:
    """A ChangeSink that keeps everything, and the order of the calls in ``events``."""

    batches: list[tuple[RelationSchema, pa.RecordBatch]] = field(default_factory=list)
    committed: list[tuple[CommitInfo, int, list[TransactionalMessage]]] = field(default_factory=list)
    standalone: list[tuple[int, LogicalDecodingMessage]] = field(default_factory=list)
    prepares: list[PreparedTransaction] = field(default_factory=list)
    commit_prepares: list[tuple[str, CommitInfo]] = field(default_factory=list)
    rollbacks: list[tuple[str, int]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    def records(self, relation: RelationSchema, records: pa.RecordBatch) -> None:
        self.batches.append((relation, records))
        self.events.append(f"records {relation.qualified_name}")

    def transaction(self, info: CommitInfo, changes: int, messages: list[TransactionalMessage]) -> None:
        self.committed.append((info, changes, list(messages)))
        self.events.append(f"transaction {info.xid}")

    def transactions(
        self, commit_lsns: np.ndarray, end_lsns: np.ndarray, xids: np.ndarray, times_us: np.ndarray, changes: np.ndarray
    ) -> None:
        for commit_lsn, end_lsn, xid, time_us, count in zip(
            commit_lsns.tolist(), end_lsns.tolist(), xids.tolist(), times_us.tolist(), changes.tolist()
        ):
            self.committed.append((CommitInfo(xid, commit_lsn, end_lsn, time_us), count, []))
            self.events.append(f"transaction {xid}")

    def standalone_message(self, lsn: int, message: LogicalDecodingMessage) -> None:
        self.standalone.append((lsn, message))

    def prepared(self, transaction: PreparedTransaction) -> None:
        self.prepares.append(transaction)
        self.events.append(f"prepared {transaction.gid}")

    def commit_prepared(self, gid: str, info: CommitInfo) -> None:
        self.commit_prepares.append((gid, info))
        self.events.append(f"commit prepared {gid}")

    def rollback_prepared(self, gid: str, end_lsn: int) -> None:
        self.rollbacks.append((gid, end_lsn))
        self.events.append(f"rollback prepared {gid}")

    def records_of(self, table: str = "public.t") -> list[dict[str, Any]]:
        """Every record written for ``table``, in order, with commit columns."""
        return [
            row for relation, batch in self.batches if relation.qualified_name == table for row in batch.to_pylist()
        ]

    def changes(self, table: str = "public.t") -> list[tuple[Any, ...]]:
        """``(xid, position, op, id, v)`` of each record of ``table`` (id, v: of the new image, else the old)."""
        out = []
        for row in self.records_of(table):
            image = row["new"] or row["old"] or {}
            out.append((row["_cdc_xid"], row["_cdc_position"], row["_cdc_op"], image.get("id"), image.get("v")))
        return out

    def transaction_rows(self) -> list[tuple[int, int, int, int, int]]:
        """``(xid, commit LSN, end LSN, commit time, changes)`` of each committed transaction, in order."""
        return [(i.xid, i.commit_lsn, i.end_lsn, i.commit_time_us, n) for i, n, _ in self.committed]


def assemble(
    rows: Rows,
    *,
    block_size: int | None = 8192,
    streaming: Streaming = "off",
    checkpoint_lsn: int = 0,
    assembler: TransactionAssembler | None = None,
) -> RecordingSink:
    """One peek call of ``rows``: by :meth:`~TransactionAssembler.feed_blocks` in blocks of
    ``block_size`` rows, or row by row through :meth:`~TransactionAssembler.feed` if None."""
    sink = RecordingSink()
    assembler = assembler or TransactionAssembler(streaming=streaming)
    assembler.start_session(sink, checkpoint_lsn)
    if block_size is None:
        for lsn, data in rows.rows:
            assembler.feed(lsn, data)
    else:
        assembler.feed_blocks(rows.blocks(block_size))
    assembler.end_session()
    return sink
