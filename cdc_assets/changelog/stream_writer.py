"""The stream into the change log: what a slot's replication stream sends, assembled into
transactions and made durable batch by batch — segments, checkpoint, then the confirmed position
(docs/architecture.md, "The drain, step by step"). :func:`cdc_assets.pipeline.drain.drain` opens
the sessions around it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cdc_assets.changelog.batch_demand import POLL_SECONDS, BatchDemand
from cdc_assets.changelog.checkpoint import Checkpoint, write_checkpoint
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import LogStore
from cdc_assets.changelog.writer import BatchWriter
from cdc_assets.config import Config
from cdc_assets.faults import fault_point
from cdc_assets.interrupts import interrupts_deferred
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.protocol import MSG_COMMIT, MSG_PREPARE
from cdc_assets.stream.blocks import MessageBlock, StreamPosition
from cdc_assets.stream.reader import SlotStream
from cdc_assets.stream.upto import UptoCut
from cdc_assets.transactions import TransactionAssembler

TRANSACTION_ENDS = bytes((MSG_COMMIT, MSG_PREPARE))
"""Commit and Prepare: the messages after which no transaction is open, so a batch may end."""
PING_SECONDS = 0.2
"""How often a drain that is catching up asks the server how far it has sent."""


@dataclass(slots=True)
class DrainProgress:
    """Where a running drain is, after each durable batch (for progress displays and Dagster logs)."""

    batches: int
    transactions: int
    changes: int
    checkpoint_lsn: int
    target_lsn: int
    elapsed_s: float

    def line(self) -> str:
        rate = self.changes / self.elapsed_s if self.elapsed_s > 0 else 0.0
        return (
            f"batch {self.batches}: {self.transactions:,} transactions, {self.changes:,} changes ({rate:,.0f}/s),"
            f" checkpoint {format_lsn(self.checkpoint_lsn)} of {format_lsn(self.target_lsn)}"
        )


@dataclass(slots=True)
class Written:
    """What a :class:`StreamWriter` has made durable so far."""

    batches: int = 0
    transactions: int = 0
    messages: int = 0
    changes: dict[str, int] = field(default_factory=dict)
    checkpoint_lsn: int = 0

    @property
    def total_changes(self) -> int:
        return sum(self.changes.values())


@dataclass(slots=True, frozen=True)
class DurableBatch:
    """One batch made durable: its checkpoint, and the changes per table it added."""

    checkpoint_lsn: int
    transactions: int
    changes: dict[str, int]
    commit_time_us: int | None


class StreamWriter:
    """Writes what a slot's replication stream sends into the change log, batch by batch durably,
    across the drain's replication sessions: the assembler, the open batch, the checkpoint, and
    what was made durable so far (:attr:`written`). It is made under the slot's drain lock: it
    starts by removing what an interrupted drain left unfinished."""

    def __init__(
        self,
        config: Config,
        store: LogStore,
        checkpoint: Checkpoint,
        written: Written,
        new_assembler: Callable[[], TransactionAssembler],
        started: float,
        progress: Callable[[DrainProgress], None] | None,
        on_batch: Callable[[DurableBatch], None] | None,
        demand: BatchDemand | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.checkpoint = checkpoint
        self.new_assembler = new_assembler
        self.assembler = new_assembler()
        self.written = written  # counted up from here
        self.started = started
        self.progress = progress
        self.on_batch = on_batch
        self.demand = demand
        ChangeLogReader(store).remove_stale()  # what an interrupted drain left unfinished
        self.writer = BatchWriter(store, checkpoint)
        self.target = 0

    def follow(self, stream: SlotStream, target: int, upto: int | None, deadline: float | None) -> None:
        """One replication session: assemble what ``stream`` sends, and make it durable batch by
        batch, until caught up with ``target`` (and ``deadline`` is past) or ``upto`` is reached. A
        batch ends every ``drain.commit_seconds``, at ``source.batch_changes``, and at the first
        transaction's end after a merge's call (:class:`BatchDemand`)."""
        self.target = target
        assembler = self.assembler
        assembler.start_session(self.writer, self.checkpoint.lsn)
        commit_seconds = self.config.drain.commit_seconds
        batch_changes = self.config.source.batch_changes
        cut = UptoCut(upto) if upto is not None else None
        position = self.checkpoint.lsn  # every transaction that committed before it has been received
        caught_up = reached = False
        fed = 0  # messages in the open batch
        backlog: MessageBlock | None = None  # the rest of a block split at a batch's end
        asked = last_batch = time.monotonic()
        demand = self.demand
        answered = calls = 0  # merges' calls for a batch: how many are answered, how many were seen
        stream.ping()
        try:
            while True:
                now = time.monotonic()
                due = last_batch + commit_seconds
                if demand is not None and (calls := demand.calls) > answered:
                    due = now
                wake = due if caught_up else min(due, asked + PING_SECONDS)
                if deadline is not None:
                    wake = min(wake, deadline)
                if demand is not None:
                    wake = min(wake, now + POLL_SECONDS)
                frame = backlog or stream.next(timeout=max(0.0, wake - now))
                backlog = None
                if isinstance(frame, MessageBlock) and not reached:
                    if cut is not None:
                        frame, reached = cut.head(frame)
                    if fed + len(frame) >= batch_changes or now >= due:  # end the batch at the next Commit
                        at = 0 if now >= due else batch_changes - fed - 1
                        frame, backlog = frame.split_after(TRANSACTION_ENDS, at)
                    fed += assembler.feed_blocks([frame])
                    if demand is not None:
                        demand.received = fed > 0
                    fault_point("mid-batch")
                elif isinstance(frame, StreamPosition):
                    if assembler.between_transactions:
                        position = max(position, frame.lsn)
                    caught_up = caught_up or position >= target
                now = time.monotonic()
                if not caught_up and now - asked >= PING_SECONDS:
                    stream.ping()
                    asked = now
                finished = reached or (caught_up and (deadline is None or now >= deadline))
                if assembler.between_transactions and (finished or now >= due or fed >= batch_changes):
                    with interrupts_deferred():  # an interrupt lands after the batch, not inside it
                        made = self._durable(stream, position if upto is None else min(position, upto))
                    if demand is not None:
                        demand.received = False
                        if calls > answered:
                            demand.answer(calls, made=made)
                            answered = calls
                    if finished:
                        break
                    stream.ping()  # a fresh position for the next batch
                    last_batch = asked = time.monotonic()
                    fed = 0
        except BaseException as interrupt:  # Ctrl-C, SIGTERM, a Dagster run's termination
            if isinstance(interrupt, Exception) or not assembler.between_transactions:
                raise
            self._durable(stream, position if upto is None else min(position, upto))  # keep what was received
            stream.stop()
            raise
        assembler.end_session()

    def restart(self) -> None:
        """After a lost session: what it left is not valid — its open batch, its assembly."""
        self.writer.abandon()
        ChangeLogReader(self.store).remove_stale()
        self.writer = BatchWriter(self.store, self.checkpoint)
        self.assembler.discard()
        self.assembler = self.new_assembler()

    def _durable(self, stream: SlotStream, position: int) -> bool:
        """Make the batch durable — segments, checkpoint, then the confirmed position — and start
        the next one; False if there was nothing to make durable. Its checkpoint is the end of its
        last transaction, or the server's position if that is later (nothing before it is left to
        receive)."""
        assembler = self.assembler
        assembler.flush()
        lsn = max(assembler.last_end_lsn, position)
        if lsn <= self.checkpoint.lsn:
            return False
        writer = self.writer
        checkpoint = writer.close(lsn)
        fault_point("after-segments")
        write_checkpoint(self.store, checkpoint)
        fault_point("after-checkpoint")
        stream.confirm(checkpoint.lsn)
        fault_point("after-advance")
        writer.after_checkpoint()
        self.checkpoint = checkpoint
        self._count(writer)
        self.writer = BatchWriter(self.store, checkpoint, carried=writer.carried)
        assembler.next_batch(self.writer, checkpoint.lsn)
        summary = writer.summary
        if self.on_batch is not None:
            self.on_batch(
                DurableBatch(checkpoint.lsn, summary.transactions, dict(summary.changes), writer.last_commit_time_us)
            )
        if self.progress is not None:
            written = self.written
            self.progress(
                DrainProgress(
                    written.batches,
                    written.transactions,
                    written.total_changes,
                    checkpoint.lsn,
                    self.target,
                    time.monotonic() - self.started,
                )
            )
        return True

    def _count(self, writer: BatchWriter) -> None:
        written, summary = self.written, writer.summary
        written.checkpoint_lsn = self.checkpoint.lsn
        written.batches += 1
        written.transactions += summary.transactions
        written.messages += summary.messages
        for table, count in summary.changes.items():
            written.changes[table] = written.changes.get(table, 0) + count
