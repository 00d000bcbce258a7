"""``cdc-assets recover``: a new slot after the old one was lost, and every table copied again online.

1. Find out (again under the drain lock, if so) why the slot cannot be drained — missing,
   invalidated, moved past the change log's checkpoint ``K``, or on a server whose history the log
   does not continue (the drain's own checks, whose errors name this command). A slot of the
   wrong kind (plugin, database, two-phase) is someone else's: refused, never dropped.
2. Drop the unusable slot and create a new one; its consistent point ``C`` is past ``K`` (a promoted
   standby whose WAL ends before ``K`` is first made to write past it).
3. Write the checkpoint at ``C``: the gap ``(K, C]`` recorded, every table held until a copy at or
   after ``C`` is announced, the server's identity, no prepared transactions (creating the slot
   waited for every running transaction, prepared ones too, so each of them ended before ``C``).
4. Release the lock — the drain and the other tables' merges go on — and copy every held table
   online; the drain records each run, which releases its table.

Killed anywhere, run it again: before step 3 the old checkpoint stands and the new slot is past it
(refused as a gap, so dropped again); after it, only the tables still held are copied.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg

from cdc_assets.changelog.checkpoint import Checkpoint, Gap, require_checkpoint, write_checkpoint
from cdc_assets.changelog.store import LogStore, changelog_store
from cdc_assets.config import Config
from cdc_assets.faults import fault_point
from cdc_assets.pipeline.online_snapshot import CopyProgress, TableCopied, copy_table, tables_without_copy
from cdc_assets.pipeline.slot_check import lost_slot_error, slot_checkpoint
from cdc_assets.source import (
    DrainLock,
    connect,
    create_slot_with_snapshot,
    drop_slot,
    read_slot,
    require_replication_role,
)
from cdc_assets.source.connection import one_row
from cdc_assets.source.server_identity import read_lineage

PADDING_PREFIX = "cdc_assets.recover_padding"
PADDING_CHUNK = 16 << 20


@dataclass(slots=True)
class RecoverResult:
    """What recover did: the gap it recorded (None: the slot was usable, only held tables were
    copied) and the tables it copied."""

    gap: Gap | None = None
    copied: list[TableCopied] = field(default_factory=list)
    elapsed_s: float = 0.0

    def lines(self) -> list[str]:
        """The copies made, or that there was nothing to do (the gap is reported as it is recorded)."""
        out: list[str] = []
        out.extend(f"recover: copied {c.summary()}" for c in self.copied)
        if not self.gap and not self.copied:
            out.append("recover: nothing to recover: the slot can be drained and no table awaits a copy")
        if self.copied:
            out.append("the next drain records each copy, and the next apply brings its table to the source")
        return out


def recover(
    config: Config,
    *,
    progress: Callable[[CopyProgress], None] | None = None,
    on_gap: Callable[[Gap], None] | None = None,
    on_copied: Callable[[TableCopied], None] | None = None,
) -> RecoverResult:
    """Replace a lost slot and copy every table again online; see the module docstring. ``on_gap``
    is called once the new slot and the gap are recorded, ``on_copied`` after each table's copy."""
    started = time.monotonic()
    store = changelog_store(config)
    result = RecoverResult()
    with connect(config.source, purpose="recover") as conn:
        require_replication_role(conn)
        checkpoint = slot_checkpoint(config, store)
        if lost_slot_error(config.source, read_slot(conn, config.source.slot), checkpoint) is not None:
            with DrainLock(config.source, wait=True):  # a drain of a lost slot fails at once
                checkpoint = slot_checkpoint(config, store)
                lost = lost_slot_error(config.source, read_slot(conn, config.source.slot), checkpoint)
                if lost is not None:
                    result.gap = _new_slot(config, conn, store, checkpoint, lost.reason)
                    if on_gap is not None:
                        on_gap(result.gap)
    held = require_checkpoint(store).tables_awaiting_copy()
    tables = [t for t in config.tables if str(t.name) in held] + tables_without_copy(config, store)
    unique = {str(t.name): t for t in tables}
    for table in unique.values():
        result.copied.append(copy_table(config, store, table, progress))
        if on_copied is not None:
            on_copied(result.copied[-1])
    result.elapsed_s = time.monotonic() - started
    return result


def _new_slot(
    config: Config, conn: psycopg.Connection[Any], store: LogStore, checkpoint: Checkpoint, reason: str
) -> Gap:
    """Drop the slot if there is one, create a new one past the checkpoint and write the checkpoint
    that records the gap and holds every table (call under the drain lock)."""
    source = config.source
    drop_slot(conn, source.slot)
    _write_past(conn, checkpoint.lsn)
    with create_slot_with_snapshot(source) as created:
        point = created.consistent_point
    fault_point("recover-slot")
    gap = Gap(checkpoint.lsn, point, time.time_ns() // 1000, reason)
    tables = {name: replace(state, awaiting_copy=point) for name, state in checkpoint.tables.items()}
    write_checkpoint(
        store,
        replace(
            checkpoint,
            lsn=point,
            tables=tables,
            prepared={},
            server=read_lineage(source).identity,
            gaps=(*checkpoint.gaps, gap),
        ),
    )
    fault_point("recover-checkpoint")
    return gap


def _write_past(conn: psycopg.Connection[Any], lsn: int) -> None:
    """Make the server's WAL reach past ``lsn`` (a server promoted before the log's position):
    non-transactional messages, which no slot created afterwards decodes."""
    while (current := _insert_lsn(conn)) <= lsn:
        size = min(lsn - current + 1, PADDING_CHUNK)
        conn.execute("SELECT pg_logical_emit_message(false, %s, repeat('x', %s))", (PADDING_PREFIX, size))


def _insert_lsn(conn: psycopg.Connection[Any]) -> int:
    (lsn,) = one_row(conn.execute("SELECT (pg_current_wal_insert_lsn() - '0/0')::int8"))
    return int(lsn)
