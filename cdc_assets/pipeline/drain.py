"""One drain: the slot's committed transactions into the change log, exactly once.

:func:`drain` follows ``docs/architecture.md`` ("The drain, step by step"): take the drain lock;
check the slot against the checkpoint (refuse a slot that is ahead); delete what a dead drain
left; start the slot's replication stream at the checkpoint; then assemble what it sends and, batch
by batch, write the batch's files durably, replace the checkpoint and confirm the new position to
the server — until the WAL position the drain started at is reached, or, when following, until the
follow time is up; last, still under the lock, change-log retention (:mod:`cdc_assets.changelog.retention`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.checkpoint import (
    Checkpoint,
    require_checkpoint,
    write_checkpoint,
)
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.retention import RetentionResult, retain
from cdc_assets.changelog.store import LogStore, changelog_store
from cdc_assets.changelog.writer import BatchWriter
from cdc_assets.config import Config
from cdc_assets.errors import CdcError, SlotGapError
from cdc_assets.faults import fault_point
from cdc_assets.interrupts import interrupts_deferred
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.source import (
    DrainLock,
    SlotState,
    connect,
    emit_heartbeat,
    read_slot,
    require_usable_slot,
    server_major,
)
from cdc_assets.source.catalog import relation_describer
from cdc_assets.source.connection import one_row
from cdc_assets.source.slot_holders import HeldWal, read_held_wal
from cdc_assets.stream.blocks import MessageBlock, StreamPosition
from cdc_assets.stream.options import pgoutput_options
from cdc_assets.stream.process import POOL as STREAM_CHILDREN
from cdc_assets.stream.reader import SlotStream, StreamLostError
from cdc_assets.stream.upto import UptoCut
from cdc_assets.transactions import TransactionAssembler

RECONNECT_SECONDS = (1.0, 2.0, 5.0, 10.0)
"""A following drain whose connection was lost reconnects after these pauses (the last repeats)."""
TRANSACTION_ENDS = b"CP"
"""Commit and Prepare: the messages after which no transaction is open, so a batch may end."""
PING_SECONDS = 0.2
"""How often a drain that is catching up asks the server how far it has sent."""

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DrainProgress:
    """Where a running drain is, after each durable batch (for progress displays and Dagster logs)."""

    batches: int
    transactions: int
    changes: int
    checkpoint_lsn: int
    target_lsn: int
    elapsed_s: float


@dataclass(slots=True)
class DrainResult:
    """What a drain did: counts per table, the new checkpoint, and the slot afterwards."""

    batches: int = 0
    transactions: int = 0
    changes: dict[str, int] = field(default_factory=dict)
    messages: int = 0
    checkpoint_lsn: int = 0
    start_lsn: int = 0
    reconnects: int = 0
    slot: SlotState | None = None
    held: HeldWal | None = None  # the WAL the slot holds behind restart_lsn, and what pins it
    retention: RetentionResult | None = None
    elapsed_s: float = 0.0

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


def drain(
    config: Config,
    *,
    wait: bool = False,
    progress: Callable[[DrainProgress], None] | None = None,
    spill_dir: str | None = None,
    upto_lsn: int | None = None,
    follow_seconds: float | None = None,
    on_batch: Callable[[DurableBatch], None] | None = None,
) -> DrainResult:
    """Drain the configured slot into the change log until it holds every transaction that ended
    by ``upto_lsn`` (default: the WAL position when the drain started); then, for
    ``follow_seconds`` (default ``drain.follow_seconds``), go on following the stream, making it
    durable every ``drain.commit_seconds``. An interrupt (Ctrl-C, SIGTERM) ends the drain with a
    last durable batch, confirmed to the server, when no transaction is half received.

    ``wait``: wait for another drain of the slot instead of failing; ``on_batch`` is called after
    each durable batch."""
    source = config.source
    store = changelog_store(config)
    started = time.monotonic()
    follow = config.drain.follow_seconds if follow_seconds is None else follow_seconds
    STREAM_CHILDREN.prestart()
    with (
        DrainLock(source, wait),
        connect(source, purpose="drain") as conn,
        connect(source, purpose="catalog") as catalog_conn,
    ):
        checkpoint = require_checkpoint(store)
        if checkpoint.slot != source.slot:
            raise CdcError(
                f"the change log at {config.changelog_path} belongs to slot {checkpoint.slot}, not {source.slot}"
            )
        major = server_major(conn)
        slot = require_usable_slot(read_slot(conn, source.slot), source)
        _refuse_gap(slot, checkpoint)
        ChangeLogReader(store).remove_stale()
        if source.heartbeat:
            emit_heartbeat(catalog_conn)
        target = _flush_lsn(conn) if upto_lsn is None else upto_lsn
        options = pgoutput_options(source, major, two_phase=slot.two_phase)
        catalog = TypeCatalog()
        describe = relation_describer(
            catalog_conn, catalog, {t: state.relation for t, state in checkpoint.tables.items()}
        )

        def new_assembler() -> TransactionAssembler:
            return TransactionAssembler(
                streaming=source.streaming, catalog=catalog, describe=describe, slot=source.slot, spill_dir=spill_dir
            )

        run = _StreamRun(
            config, store, checkpoint, new_assembler, DrainResult(start_lsn=checkpoint.lsn), started, progress, on_batch
        )
        deadline = None if upto_lsn is not None or follow <= 0 else started + follow
        while True:
            try:
                with SlotStream(conn, source, options, run.checkpoint.lsn) as stream:
                    run.follow(stream, target, upto_lsn, deadline)
                break
            except StreamLostError as error:
                if deadline is None or time.monotonic() >= deadline:
                    raise
                pause = RECONNECT_SECONDS[min(run.result.reconnects, len(RECONNECT_SECONDS) - 1)]
                log.warning("%s; reconnecting in %.0f s", error, pause)
                run.result.reconnects += 1
                time.sleep(pause)
        result = run.result
        result.slot = read_slot(conn, source.slot)
        result.held = read_held_wal(conn, source.slot)
        applied = {str(t.name): table_applied_lsn(config, t) for t in config.tables}
        result.retention = retain(config, ChangeLogReader(store), run.checkpoint, applied)
    result.elapsed_s = time.monotonic() - started
    return result


class _StreamRun:
    """The drain's state across its replication sessions: the assembler, the open batch, the
    checkpoint, and what the drain did so far."""

    def __init__(
        self,
        config: Config,
        store: LogStore,
        checkpoint: Checkpoint,
        new_assembler: Callable[[], TransactionAssembler],
        result: DrainResult,
        started: float,
        progress: Callable[[DrainProgress], None] | None,
        on_batch: Callable[[DurableBatch], None] | None,
    ) -> None:
        self.config = config
        self.store = store
        self.checkpoint = checkpoint
        self.new_assembler = new_assembler
        self.assembler = new_assembler()
        self.result = result
        self.result.checkpoint_lsn = checkpoint.lsn
        self.started = started
        self.progress = progress
        self.on_batch = on_batch
        self.writer = BatchWriter(store, checkpoint)
        self.target = 0

    def follow(self, stream: SlotStream, target: int, upto: int | None, deadline: float | None) -> None:
        """One replication session: assemble what ``stream`` sends, and make it durable batch by
        batch, until caught up with ``target`` (and ``deadline`` is past) or ``upto`` is reached."""
        self.target = target
        if self.result.reconnects:  # what the lost session left is not valid: its batch, its assembly
            self.writer.abandon()
            ChangeLogReader(self.store).remove_stale()
            self.writer = BatchWriter(self.store, self.checkpoint)
            self.assembler.discard()
            self.assembler = self.new_assembler()
        assembler = self.assembler
        assembler.start_session(self.writer, self.checkpoint.lsn)
        commit_seconds = self.config.drain.commit_seconds
        batch_changes = self.config.source.batch_changes
        cut = UptoCut(self.config.source.streaming, upto) if upto is not None else None
        position = self.checkpoint.lsn  # every transaction that committed before it has been received
        caught_up = reached = False
        fed = 0  # messages in the open batch
        backlog: MessageBlock | None = None  # the rest of a block split at a batch's end
        asked = last_batch = time.monotonic()
        stream.ping()
        try:
            while True:
                now = time.monotonic()
                due = last_batch + commit_seconds
                wake = due if caught_up else min(due, asked + PING_SECONDS)
                frame = backlog or stream.next(timeout=max(0.0, wake - now))
                backlog = None
                if isinstance(frame, MessageBlock) and not reached:
                    if cut is not None:
                        frame, reached = cut.head(frame)
                    if fed + len(frame) >= batch_changes or now >= due:  # end the batch at the next Commit
                        at = 0 if now >= due else batch_changes - fed - 1
                        frame, backlog = frame.split_after(TRANSACTION_ENDS, at)
                    fed += assembler.feed_blocks([frame])
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
                        self._durable(stream, position if upto is None else min(position, upto))
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

    def _durable(self, stream: SlotStream, position: int) -> None:
        """Make the batch durable — segments, checkpoint, then the confirmed position — and start
        the next one. Its checkpoint is the end of its last transaction, or the server's position if
        that is later (nothing before it is left to receive)."""
        assembler = self.assembler
        assembler.flush()
        lsn = max(assembler.last_end_lsn, position)
        if lsn <= self.checkpoint.lsn:
            return
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
            result = self.result
            self.progress(
                DrainProgress(
                    result.batches,
                    result.transactions,
                    result.total_changes,
                    checkpoint.lsn,
                    self.target,
                    time.monotonic() - self.started,
                )
            )

    def _count(self, writer: BatchWriter) -> None:
        result, summary = self.result, writer.summary
        result.checkpoint_lsn = self.checkpoint.lsn
        result.batches += 1
        result.transactions += summary.transactions
        result.messages += summary.messages
        for table, count in summary.changes.items():
            result.changes[table] = result.changes.get(table, 0) + count


def _refuse_gap(slot: SlotState, checkpoint: Checkpoint) -> None:
    """Refuse a slot that went past the checkpoint (data loss). A slot behind it is fine: the
    stream starts at the checkpoint and confirms it at once."""
    confirmed = slot.confirmed_flush_lsn or 0
    if confirmed > checkpoint.lsn:
        raise SlotGapError(
            f"replication slot {slot.name} has confirmed LSN {format_lsn(confirmed)}, past the change log's"
            f" checkpoint {format_lsn(checkpoint.lsn)}: transactions between the two were consumed by something"
            " else and are not in the log. Nothing was advanced. Remedy: drop the slot and run `cdc-assets setup`"
            " again, which takes a new initial snapshot"
        )


def _flush_lsn(conn: psycopg.Connection[Any]) -> int:
    (lsn,) = one_row(conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0')::int8"))
    return int(lsn)
