"""Setting up a source: publication, slot, and the initial snapshot into the change log.

The slot is created on a replication connection with an exported snapshot; each configured table
is copied inside that snapshot, so the copy holds exactly the transactions that committed before
the slot's consistent point and the slot decodes exactly those after it (nothing lost, nothing
twice). The copy becomes the change log's first batch (``snapshot`` records at the consistent
point) and the first checkpoint.

On a log already set up, setup brings the publication in line with the config — configured
tables it lacks are added (when the source role owns it), and with ``prune`` tables no longer
configured are dropped (and their mirrors' entries in ``warehouse.catalog``, given a Spark session)
— and copies online (:mod:`cdc_assets.pipeline.online_snapshot`) every configured
table the log holds no copy of; the slot is never dropped and no other table is copied again.

Setup is safe to rerun and to kill: ``_setup.json`` marks a setup in progress, so a slot left by a
killed setup (no checkpoint yet) is recognised as ours, dropped and created again; a slot the log
does not know is never dropped.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import psycopg
from pyspark.sql import SparkSession

from cdc_assets.apply.catalog import unregister_mirrors
from cdc_assets.changelog.checkpoint import read_checkpoint, write_checkpoint
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import LogStore, changelog_store
from cdc_assets.config import Config, TableConfig
from cdc_assets.errors import CdcError, SlotMissingError
from cdc_assets.lsn import format_lsn
from cdc_assets.names import TableName
from cdc_assets.pipeline.online_snapshot import CopyProgress, TableCopied, copy_table, tables_without_copy
from cdc_assets.pipeline.server_check import recognise_server
from cdc_assets.pipeline.snapshot_copy import CopiedSnapshot, copy_snapshot
from cdc_assets.source import (
    DdlCapture,
    DrainLock,
    apply_ddl_capture,
    check_source,
    connect,
    copy_again_when_rewritten,
    create_slot_with_snapshot,
    drop_slot,
    ensure_failover,
    ensure_publication,
    prune_publication,
    read_slot,
    require_replication_role,
    require_usable_slot,
)
from cdc_assets.source.server_identity import read_lineage

SETUP_MARKER = "_setup.json"


@dataclass(slots=True)
class SetupResult:
    """What setup did to ``slot``, ``publication`` and the change log at ``changelog``: whether it
    created the publication and slot, the rows of its initial copy, the tables it added to or
    dropped from the publication (and the catalog entries it dropped), the tables it copied online,
    and what it did with DDL capture."""

    slot: str
    publication: str
    changelog: str
    created_publication: bool = False
    created_slot: bool = False
    snapshot_lsn: int | None = None
    rows: dict[str, int] = field(default_factory=dict)
    added: list[str] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    unregistered: list[str] = field(default_factory=list)
    copied: list[TableCopied] = field(default_factory=list)
    ddl_capture: DdlCapture | None = None
    elapsed_s: float = 0.0

    def lines(self) -> list[str]:
        out = [f"created publication {self.publication}"] if self.created_publication else []
        out += [f"added {table} to publication {self.publication}" for table in self.added]
        out += [f"dropped {t} from publication {self.publication} (its Delta table stays)" for t in self.removed]
        out += [f"dropped {entry} from the catalog (its files stay)" for entry in self.unregistered]
        if self.created_slot:
            out.append(f"created slot {self.slot}; snapshot at LSN {format_lsn(self.snapshot_lsn or 0)}")
            out += [f"  {table}: {rows:,} rows" for table, rows in self.rows.items()]
        out += [f"copied online: {copied.summary()}" for copied in self.copied]
        if self.ddl_capture is not None and (line := self.ddl_capture.line()) is not None:
            out.append(line)
        if not (self.created_slot or self.added or self.removed or self.copied):
            return [*out, f"already set up: slot {self.slot} and the change log at {self.changelog} exist"]
        return [*out, f"done in {self.elapsed_s:.1f} s"]


def setup(
    config: Config,
    *,
    prune: bool = False,
    progress: Callable[[str, int], None] | None = None,
    copy_progress: Callable[[CopyProgress], None] | None = None,
    spark: Callable[[], SparkSession] | None = None,
) -> SetupResult:
    """Create what is missing; copy the initial snapshot when the slot is new; on a log already set
    up, add the tables the config gained (``prune``: drop those it lost, and with ``spark`` their
    mirrors' entries in ``warehouse.catalog``) and copy them online.

    ``progress(table, rows_so_far)`` is called while the initial snapshot is copied,
    ``copy_progress`` while tables are copied online.
    """
    source = config.source
    store = changelog_store(config)
    result = SetupResult(source.slot, source.publication, config.changelog.path)
    started = time.monotonic()
    with DrainLock(source, wait=False), connect(source, purpose="setup") as conn:
        check_source(conn, config)
        require_replication_role(conn)
        checkpoint = read_checkpoint(store)
        slot = read_slot(conn, source.slot)
        if checkpoint is not None:
            if slot is None:
                raise SlotMissingError(
                    f"replication slot {source.slot} does not exist, but the change log at {config.changelog.path}"
                    f" was set up for it (checkpoint {format_lsn(checkpoint.lsn)})",
                    "changes since then are lost."
                    " Remedy: run `cdc-assets recover` (a new slot, every table copied again online)",
                )
            ensure_failover(source, require_usable_slot(slot, source))
            recognise_server(source, store, checkpoint)
        publication = ensure_publication(conn, config)
        result.created_publication = publication.created
        result.added = [str(t) for t in publication.added]
        if prune:
            result.removed = [str(t) for t in prune_publication(conn, config)]
        result.ddl_capture = apply_ddl_capture(conn, source)  # before the slot: no DDL after it goes unseen
        if checkpoint is None:
            _create_slot_and_copy(config, conn, store, slot is not None, result, progress)
    if checkpoint is not None:  # the drain goes on while the tables the log has no copy of are copied
        result.copied = [copy_table(config, store, t, copy_progress) for t in tables_without_copy(config, store)]
    if result.removed and config.warehouse.catalog is not None and spark is not None:
        mirrors = [(name, config.target_path(TableConfig(name))) for name in map(TableName.parse, result.removed)]
        result.unregistered = unregister_mirrors(spark(), config.warehouse.catalog, mirrors)
    result.elapsed_s = time.monotonic() - started
    return result


def _create_slot_and_copy(
    config: Config,
    conn: psycopg.Connection[Any],
    store: LogStore,
    slot_exists: bool,
    result: SetupResult,
    progress: Callable[[str, int], None] | None,
) -> None:
    """Create the slot and copy every configured table as of its snapshot (under the drain lock)."""
    source = config.source
    if slot_exists:
        if not store.exists(SETUP_MARKER):
            raise CdcError(
                f"replication slot {source.slot} already exists but the change log at {config.changelog.path} is"
                " empty: it was not created by cdc-assets for this change log. Drop it"
                f" (SELECT pg_drop_replication_slot('{source.slot}')) or set source.slot to a new name"
            )
        drop_slot(conn, source.slot)  # left by a setup that died before its checkpoint
    server = read_lineage(source).identity
    store.replace(SETUP_MARKER, json.dumps({"slot": source.slot}).encode())
    ChangeLogReader(store).remove_stale()

    def attempt() -> CopiedSnapshot:
        with create_slot_with_snapshot(source) as exported:
            result.snapshot_lsn = exported.consistent_point
            return copy_snapshot(
                config, store, exported.snapshot_name, exported.consistent_point, config.tables, progress
            )

    def clean() -> None:  # the slot whose snapshot a truncated table cannot be read in, and its files
        drop_slot(conn, source.slot)
        ChangeLogReader(store).remove_stale()

    copied = copy_again_when_rewritten(attempt, clean)
    result.created_slot = True
    result.rows.update(copied.rows)
    write_checkpoint(store, replace(copied.checkpoint, server=server))
    store.delete(SETUP_MARKER)
