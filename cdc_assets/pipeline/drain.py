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
from dataclasses import dataclass
from typing import Any

import psycopg

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.retention import RetentionResult, retain
from cdc_assets.changelog.store import changelog_store
from cdc_assets.changelog.stream_writer import DrainProgress, DurableBatch, StreamWriter, Written
from cdc_assets.config import Config
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
from cdc_assets.source.slot_holders import HeldWal, read_held_wal
from cdc_assets.stream.options import pgoutput_options
from cdc_assets.stream.process import POOL as STREAM_CHILDREN
from cdc_assets.stream.reader import GATHER_SECONDS, SlotStream, StreamLostError
from cdc_assets.transactions import TransactionAssembler

RECONNECT_SECONDS = (1.0, 2.0, 5.0, 10.0)
"""A following drain whose connection was lost reconnects after these pauses (the last repeats)."""

log = logging.getLogger(__name__)


@dataclass(slots=True)
class DrainResult(Written):
    """What a drain did: what it made durable (counts per table, the new checkpoint), and the slot
    afterwards."""

    start_lsn: int = 0
    reconnects: int = 0
    slot: SlotState | None = None
    held: HeldWal | None = None  # the WAL the slot holds behind restart_lsn, and what pins it
    retention: RetentionResult | None = None
    elapsed_s: float = 0.0


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
        checkpoint = slot_checkpoint(config, store)
        require_replication_role(conn)  # before the replication connection that identifies the server
        checkpoint = recognise_server(source, store, checkpoint)
        major = server_major(conn)
        slot = ensure_failover(source, require_usable_slot(read_slot(conn, source.slot), source, checkpoint.lsn))
        if source.heartbeat:
            emit_heartbeat(catalog_conn)
        target = _flush_lsn(conn) if upto_lsn is None else upto_lsn
        catalog = TypeCatalog()
        describe = relation_describer(
            catalog_conn, catalog, {t: state.relation for t, state in checkpoint.tables.items()}
        )

        def new_assembler() -> TransactionAssembler:
            return TransactionAssembler(
                streaming=source.streaming, catalog=catalog, describe=describe, slot=source.slot, spill_dir=spill_dir
            )

        result = DrainResult(checkpoint_lsn=checkpoint.lsn, start_lsn=checkpoint.lsn)
        writer = StreamWriter(config, store, checkpoint, result, new_assembler, started, progress, on_batch)
        deadline = None if upto_lsn is not None or follow <= 0 else started + follow
        while True:
            try:
                options = pgoutput_options(source, major, two_phase=slot.two_phase)
                with SlotStream(
                    conn,
                    source,
                    options,
                    writer.checkpoint.lsn,
                    standby_wait_seconds=config.drain.standby_wait_seconds,
                    gather_seconds=0.0 if deadline is None else GATHER_SECONDS,
                ) as stream:
                    writer.follow(stream, target, upto_lsn, deadline)
                break
            except StreamLostError as error:
                if deadline is None or time.monotonic() >= deadline:
                    raise
                pause = RECONNECT_SECONDS[min(result.reconnects, len(RECONNECT_SECONDS) - 1)]
                log.warning("%s; reconnecting in %.0f s", error, pause)
                result.reconnects += 1
                writer.restart()
                time.sleep(pause)
        applied = {str(t.name): table_applied_lsn(config, t) for t in config.tables}
        result.retention = retain(config, ChangeLogReader(store), writer.checkpoint, applied)
        result.slot = read_slot(conn, source.slot)
        result.held = read_held_wal(conn, source.slot)
    result.elapsed_s = time.monotonic() - started
    return result


def _flush_lsn(conn: psycopg.Connection[Any]) -> int:
    (lsn,) = one_row(conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0')::int8"))
    return int(lsn)
