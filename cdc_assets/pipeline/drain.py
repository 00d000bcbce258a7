"""One drain: the slot's committed transactions into the change log, exactly once.

:func:`drain` follows ``docs/architecture.md`` ("The drain, step by step"): take the drain lock;
check the slot against the checkpoint (refuse a slot that is ahead); delete what a dead drain
left; start the slot's replication stream at the checkpoint; then assemble what it sends and, batch
by batch, write the batch's files durably, replace the checkpoint and confirm the new position to
the server — until the WAL position the drain started at is reached, or, when following, until the
follow time is up. Change-log retention is a use case of its own (:mod:`cdc_assets.pipeline.retention`),
which the commands and Dagster run after a drain when it is due.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psycopg

from cdc_assets.changelog.batch_demand import BatchDemand
from cdc_assets.changelog.checkpoint import Checkpoint, read_checkpoint
from cdc_assets.changelog.store import LogStore, changelog_store
from cdc_assets.changelog.stream_writer import DrainProgress, DurableBatch, StreamWriter, Written
from cdc_assets.config import Config, SourceConfig
from cdc_assets.errors import DrainLockedError
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.pipeline.server_check import recognise_server
from cdc_assets.pipeline.slot_check import slot_checkpoint
from cdc_assets.source import (
    DrainLock,
    SlotState,
    connect,
    emit_heartbeat,
    ensure_failover,
    read_slot,
    require_replication_role,
    require_usable_slot,
    server_major,
)
from cdc_assets.source.catalog import relation_describer
from cdc_assets.source.connection import one_row
from cdc_assets.source.reconnect import Backoff, connection_lost
from cdc_assets.source.slot_holders import HeldWal, read_held_wal
from cdc_assets.stream.options import pgoutput_options
from cdc_assets.stream.process import POOL as STREAM_CHILDREN
from cdc_assets.stream.reader import GATHER_SECONDS, SlotStream
from cdc_assets.transactions import TransactionAssembler

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DrainResult(Written):
    """What a drain did: what it made durable (counts per table, the new checkpoint), and the slot
    afterwards."""

    start_lsn: int = 0
    reconnects: int = 0
    slot: SlotState | None = None
    held: HeldWal | None = None  # the WAL the slot holds behind restart_lsn, and what pins it
    elapsed_s: float = 0.0

    def lines(self) -> list[str]:
        """What was drained, per table; the slot's lag; a warning about the WAL it holds."""
        out = [
            f"drained {self.transactions:,} transactions, {self.total_changes:,} changes in {self.batches} batches"
            f" ({self.elapsed_s:.1f} s); checkpoint {format_lsn(self.start_lsn)} -> {format_lsn(self.checkpoint_lsn)}"
        ]
        out += [f"  {table}: {count:,} changes" for table, count in sorted(self.changes.items())]
        if self.slot is not None and self.slot.lag_bytes is not None:
            out.append(f"slot {self.slot.name}: lag {self.slot.lag_bytes:,} bytes, WAL status {self.slot.wal_status}")
        if self.held is not None and (warning := self.held.warning()) is not None:
            out.append(warning)
        return out


def drain(
    config: Config,
    *,
    wait: bool = False,
    progress: Callable[[DrainProgress], None] | None = None,
    spill_dir: str | None = None,
    upto_lsn: int | None = None,
    follow_seconds: float | None = None,
    on_batch: Callable[[DurableBatch], None] | None = None,
    demand: BatchDemand | None = None,
) -> DrainResult:
    """Drain the configured slot into the change log until it holds every transaction that ended
    by ``upto_lsn`` (default: the WAL position when the drain started); then, for
    ``follow_seconds`` (default ``drain.follow_seconds``), go on following the stream, making it
    durable every ``drain.commit_seconds``. An interrupt (Ctrl-C, SIGTERM) ends the drain with a
    last durable batch, confirmed to the server, when no transaction is half received.

    ``wait``: wait for another drain of the slot instead of failing; ``on_batch`` is called after
    each durable batch; ``demand``: a following drain's merges call for a batch through it."""
    source = config.source
    store = changelog_store(config)
    started = time.monotonic()
    follow = config.drain.follow_seconds if follow_seconds is None else follow_seconds
    STREAM_CHILDREN.prestart()
    with DrainLock(source, wait) as lock, _Connections(source) as connections:
        checkpoint, slot = _check_source(connections.conn, source, store, slot_checkpoint(config, store))
        major = server_major(connections.conn)
        if source.heartbeat:
            emit_heartbeat(connections.catalog)
        target = _flush_lsn(connections.conn) if upto_lsn is None else upto_lsn
        catalog = TypeCatalog()
        known = {t: state.relation for t, state in checkpoint.tables.items()}

        def new_assembler() -> TransactionAssembler:
            describe = relation_describer(connections.catalog, catalog, known)  # the connection of the moment
            return TransactionAssembler(
                streaming=source.streaming, catalog=catalog, describe=describe, slot=source.slot, spill_dir=spill_dir
            )

        result = DrainResult(checkpoint_lsn=checkpoint.lsn, start_lsn=checkpoint.lsn)
        writer = StreamWriter(config, store, checkpoint, result, new_assembler, started, progress, on_batch, demand)
        deadline = None if upto_lsn is not None or follow <= 0 else started + follow
        backoff, lost = Backoff(), False
        while True:
            try:
                if lost:
                    slot = _resume(lock, connections, source, writer)
                options = pgoutput_options(source, major, two_phase=slot.two_phase)
                with SlotStream(
                    connections.conn,
                    source,
                    options,
                    writer.checkpoint.lsn,
                    standby_wait_seconds=config.drain.standby_wait_seconds,
                    gather_seconds=0.0 if deadline is None else GATHER_SECONDS,
                ) as stream:
                    backoff.reset()
                    writer.follow(stream, target, upto_lsn, deadline)
                break
            except Exception as error:
                if deadline is None or time.monotonic() >= deadline or not connection_lost(error):
                    raise
                pause = backoff.next_pause()
                log.warning("%s; reconnecting in %.0f s", error, pause)
                result.reconnects += 1
                time.sleep(pause)
                lost = True
        result.slot = read_slot(connections.conn, source.slot)
        result.held = read_held_wal(connections.conn, source.slot)
    result.elapsed_s = time.monotonic() - started
    return result


class _Connections:
    """The drain's SQL connections to the source: ``conn`` for checks, ``catalog`` for catalog
    look-ups; :meth:`reopen` after the source went away."""

    def __init__(self, source: SourceConfig) -> None:
        self._source = source
        self.conn, self.catalog = self._open()

    def __enter__(self) -> _Connections:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def reopen(self) -> None:
        self.close()
        self.conn, self.catalog = self._open()

    def close(self) -> None:
        self.conn.close()
        self.catalog.close()

    def _open(self) -> tuple[psycopg.Connection[Any], psycopg.Connection[Any]]:
        conn = connect(self._source, purpose="drain")
        try:
            return conn, connect(self._source, purpose="catalog")
        except BaseException:
            conn.close()
            raise


def _check_source(
    conn: psycopg.Connection[Any], source: SourceConfig, store: LogStore, checkpoint: Checkpoint
) -> tuple[Checkpoint, SlotState]:
    """Before a session: the role, the server recognised (the checkpoint recording it), and the
    slot usable from the checkpoint (made a failover slot when configured)."""
    require_replication_role(conn)  # before the replication connection that identifies the server
    checkpoint = recognise_server(source, store, checkpoint)
    slot = ensure_failover(source, require_usable_slot(read_slot(conn, source.slot), source, checkpoint.lsn))
    return checkpoint, slot


def _resume(lock: DrainLock, connections: _Connections, source: SourceConfig, writer: StreamWriter) -> SlotState:
    """After the source went away: the drain lock held again, the change log still at this drain's
    checkpoint, the connections reopened and the source checked as at the start; then the lost
    session's leftovers are cleared."""
    lock.retake()
    stored = read_checkpoint(writer.store)
    if stored is None or stored.to_json() != writer.checkpoint.to_json():
        moved = "gone" if stored is None else f"at {format_lsn(stored.lsn)}"
        raise DrainLockedError(
            f"the change log's checkpoint is {moved}, not at {format_lsn(writer.checkpoint.lsn)} where this drain"
            f" left it: another process drained slot {source.slot} while this one had lost the source; this one stops"
        )
    connections.reopen()
    writer.checkpoint, slot = _check_source(connections.conn, source, writer.store, writer.checkpoint)
    writer.restart()
    return slot


def _flush_lsn(conn: psycopg.Connection[Any]) -> int:
    (lsn,) = one_row(conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0')::int8"))
    return int(lsn)
