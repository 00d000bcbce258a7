"""One drain: the slot's committed transactions into the change log, exactly once.

:func:`drain` follows ``docs/architecture.md`` ("The drain, step by step"): take the drain lock;
reconcile the checkpoint with the slot (advance a slot left behind, refuse a slot that is ahead);
delete what a dead drain left; then batch by batch peek, assemble, write the batch's files durably,
replace the checkpoint, advance the slot — until the WAL position the drain started at is reached
or the slot has nothing more; last, still under the lock, change-log retention
(:mod:`cdc_assets.retention`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg

from cdc_assets.changelog.checkpoint import (
    Checkpoint,
    require_checkpoint,
    write_checkpoint,
)
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.writer import BatchWriter
from cdc_assets.config import Config
from cdc_assets.errors import CdcError, SlotGapError
from cdc_assets.faults import fault_point
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.messages import RelationMessage
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.retention import RetentionResult, retain
from cdc_assets.source import (
    DrainLock,
    SlotReader,
    SlotState,
    column_ndims,
    connect,
    emit_heartbeat,
    load_type_catalog,
    read_slot,
    require_usable_slot,
    server_major,
)
from cdc_assets.source.connection import one_row
from cdc_assets.source.receiver import POOL as PEEK_CHILDREN
from cdc_assets.transactions import TransactionAssembler

FIRST_USER_OID = 10000


@dataclass(slots=True)
class DrainProgress:
    """Where a running drain is, after each batch (for progress displays and Dagster logs)."""

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
    slot: SlotState | None = None
    retention: RetentionResult | None = None
    elapsed_s: float = 0.0

    @property
    def total_changes(self) -> int:
        return sum(self.changes.values())


def drain(
    config: Config,
    *,
    wait: bool = False,
    progress: Callable[[DrainProgress], None] | None = None,
    spill_dir: str | None = None,
    upto_lsn: int | None = None,
) -> DrainResult:
    """Drain the configured slot into the change log until it holds every transaction that ended
    by ``upto_lsn`` (default: the WAL position when the drain started).

    ``wait``: wait for another drain of the slot instead of failing."""
    source = config.source
    store = config.changelog_store()
    started = time.monotonic()
    PEEK_CHILDREN.prestart()
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
        with SlotReader(conn, source, major, two_phase=slot.two_phase) as reader:
            _reconcile(reader, slot, checkpoint)
            ChangeLogReader(store).remove_stale()
            if source.heartbeat:
                emit_heartbeat(catalog_conn)
            target = _flush_lsn(conn) if upto_lsn is None else upto_lsn
            result = DrainResult(start_lsn=checkpoint.lsn, checkpoint_lsn=checkpoint.lsn)
            catalog = TypeCatalog()
            assembler = TransactionAssembler(
                streaming=source.streaming,
                catalog=catalog,
                describe=_describer(
                    catalog_conn, catalog, {t: state.relation for t, state in checkpoint.tables.items()}
                ),
                slot=source.slot,
                spill_dir=spill_dir,
            )
            limit = source.batch_changes
            while True:
                writer = BatchWriter(store, checkpoint)
                assembler.start_call(writer, checkpoint.lsn)
                try:
                    with reader.peek(limit, upto_lsn=target) as blocks:
                        fault_point("mid-batch")
                        count = assembler.feed_blocks(blocks)
                    assembler.finish_call()
                except BaseException:
                    writer.abandon()
                    raise
                if assembler.last_end_lsn > checkpoint.lsn:
                    checkpoint = writer.close(assembler.last_end_lsn)
                    fault_point("after-segments")
                    write_checkpoint(store, checkpoint)
                    fault_point("after-checkpoint")
                    reader.advance(checkpoint.lsn)
                    fault_point("after-advance")
                    writer.after_checkpoint()
                    _add(result, writer)
                else:
                    writer.abandon()
                    if assembler.completed:
                        # Every transaction it completed is already in the log: the slot re-sent them
                        # (it is behind the checkpoint). Move it up, or the next call repeats this one.
                        reader.advance(checkpoint.lsn)
                result.checkpoint_lsn = checkpoint.lsn
                if progress is not None:
                    progress(
                        DrainProgress(
                            result.batches,
                            result.transactions,
                            result.total_changes,
                            checkpoint.lsn,
                            target,
                            time.monotonic() - started,
                        )
                    )
                if count < limit or checkpoint.lsn >= target:
                    break
                # A call that completed nothing holds one transaction larger than the limit: ask for more.
                limit = limit * 2 if assembler.completed == 0 else source.batch_changes
            result.slot = read_slot(conn, source.slot)
            result.retention = retain(config, ChangeLogReader(store), checkpoint)
    result.elapsed_s = time.monotonic() - started
    return result


def _reconcile(reader: SlotReader, slot: SlotState, checkpoint: Checkpoint) -> None:
    """Bring the slot to the checkpoint, or refuse if it went past it (data loss)."""
    confirmed = slot.confirmed_flush_lsn or 0
    if confirmed < checkpoint.lsn:
        reader.advance(checkpoint.lsn)  # the advance after the last checkpoint was lost
    elif confirmed > checkpoint.lsn:
        raise SlotGapError(
            f"replication slot {slot.name} has confirmed LSN {format_lsn(confirmed)}, past the change log's"
            f" checkpoint {format_lsn(checkpoint.lsn)}: transactions between the two were consumed by something"
            " else and are not in the log. Nothing was advanced. Remedy: drop the slot and run `cdc-assets setup`"
            " again, which takes a new initial snapshot"
        )


def _flush_lsn(conn: psycopg.Connection[Any]) -> int:
    (lsn,) = one_row(conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0')::int8"))
    return int(lsn)


def _describer(
    conn: psycopg.Connection[Any], catalog: TypeCatalog, known: dict[str, RelationSchema]
) -> Callable[[RelationMessage], RelationSchema]:
    """Relation messages → schemas with array dimensions, loading user types into ``catalog``.

    pgoutput does not send array dimensions, and the catalog only knows today's columns: a column
    dropped since the change was made has none there. So a column the relation's last known schema
    version (``known``: the checkpoint's, then each one described here) has with the same name, type
    and typmod keeps its dimensions; only new or changed columns are looked up in the catalog.
    Look-ups are cached: the server re-sends every Relation message in every call.
    """
    cache: dict[tuple[object, ...], RelationSchema] = {}

    def describe(message: RelationMessage) -> RelationSchema:
        key = (
            message.relation_oid,
            message.namespace,
            message.relation_name,
            message.replica_identity,
            tuple((c.flags, c.name, c.type_oid, c.type_modifier) for c in message.columns),
        )
        schema = cache.get(key)
        if schema is None:
            user_types = [c.type_oid for c in message.columns if c.type_oid >= FIRST_USER_OID]
            missing = [
                oid for oid in user_types if (known_type := catalog.get(oid)) is None or known_type.category == "u"
            ]
            if missing:
                for info in load_type_catalog(conn, missing):
                    catalog.add(info)
            ndims = column_ndims(conn, message.relation_oid)
            schema = RelationSchema.from_message(message, ndims)
            previous = known.get(schema.qualified_name)
            if previous is not None and previous.relation_oid == schema.relation_oid:
                before = {(c.name, c.type_oid, c.type_modifier): c.ndims for c in previous.columns}
                for c in schema.columns:
                    ndims[c.name] = before.get((c.name, c.type_oid, c.type_modifier), ndims.get(c.name, 0))
                schema = RelationSchema.from_message(message, ndims)
            cache[key] = known[schema.qualified_name] = schema
        return schema

    return describe


def _add(result: DrainResult, writer: BatchWriter) -> None:
    summary = writer.summary
    result.batches += 1
    result.transactions += summary.transactions
    result.messages += summary.messages
    for table, count in summary.changes.items():
        result.changes[table] = result.changes.get(table, 0) + count
