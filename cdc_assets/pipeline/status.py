"""``cdc-assets status``: where the slot, the change log and each table are."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.checkpoint import Gap, awaiting_copy_reason
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.retention import Hold, table_hold
from cdc_assets.changelog.snapshot_runs import SnapshotRunRef
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config
from cdc_assets.errors import SourceError
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.messages import unix_time
from cdc_assets.pipeline.slot_check import lost_slot_error
from cdc_assets.source import (
    HELD_WAL_WARN_BYTES,
    HeldWal,
    PinningTransaction,
    SlotState,
    connect,
    read_held_wal,
    read_slot,
)
from cdc_assets.source.standby_slot import StandbySlot, read_standby_slot


@dataclass(slots=True)
class TableStatus:
    name: str
    last_change_lsn: int | None
    schema_version: int | None
    applied_lsn: int | None = None
    delta_path: str | None = None
    snapshot_run: SnapshotRunRef | None = None  # the table's latest copy: online snapshot run or compacted base
    held: Hold | None = None  # segments past the retention kept because this table still needs them
    awaiting_copy: int | None = (
        None  # held (after a lost slot, or a rewrite) until its copy from this LSN on is drained
    )
    held_for_copy: str | None = None  # why, in words

    @property
    def behind(self) -> bool:
        """The change log holds changes the Delta table does not have yet."""
        return self.last_change_lsn is not None and (
            self.applied_lsn is None or self.applied_lsn < self.last_change_lsn
        )


@dataclass(slots=True)
class Status:
    """A snapshot of the pipeline's positions; ``source_error`` when the source is unreachable."""

    slot_name: str
    slot: SlotState | None
    checkpoint_lsn: int | None
    snapshot_lsn: int | None
    tables: list[TableStatus] = field(default_factory=list)
    source_error: str | None = None
    held_wal: HeldWal | None = None  # the WAL behind the slot's restart_lsn and the transaction pinning it
    standby: StandbySlot | None = None  # with source.standby_dsn: the standby's copy of the slot
    standby_error: str | None = None  # with source.standby_dsn: the standby is unreachable
    slot_problem: str | None = None  # why the drain refuses the slot (lost, or another server): recover
    gaps: tuple[Gap, ...] = ()  # the lost slots' gaps, bridged by re-copies

    def to_json(self) -> dict[str, Any]:
        slot = self.slot
        held = self.held_wal
        return {
            "slot": {
                "name": self.slot_name,
                "exists": slot is not None,
                "confirmed_flush_lsn": _lsn(slot.confirmed_flush_lsn) if slot else None,
                "restart_lsn": _lsn(slot.restart_lsn) if slot else None,
                "current_wal_lsn": _lsn(slot.current_wal_lsn) if slot else None,
                "lag_bytes": slot.lag_bytes if slot else None,
                "wal_status": slot.wal_status if slot else None,
                "safe_wal_size": slot.safe_wal_size if slot else None,
                "two_phase": slot.two_phase if slot else None,
                "active_pid": slot.active_pid if slot else None,
                "problem": self.slot_problem,
            },
            "gaps": [g.to_json() for g in self.gaps],
            "held_wal": (
                {
                    "bytes": held.held_bytes,
                    "restart_lsn": _lsn(held.restart_lsn),
                    "warn_bytes": HELD_WAL_WARN_BYTES,
                    "warning": held.over(),
                    "pinned_by": _pinned_json(held.pinned_by),
                }
                if held
                else None
            ),
            "source_error": self.source_error,
            "standby_slot": _standby_json(self.standby, self.standby_error),
            "checkpoint_lsn": _lsn(self.checkpoint_lsn),
            "snapshot_lsn": _lsn(self.snapshot_lsn),
            "tables": {
                t.name: {
                    "last_change_lsn": _lsn(t.last_change_lsn),
                    "schema_version": t.schema_version,
                    "applied_lsn": _lsn(t.applied_lsn),
                    "behind": t.behind,
                    "awaiting_copy": _lsn(t.awaiting_copy),
                    "held_for_copy": t.held_for_copy,
                    "delta_path": t.delta_path,
                    "held": (
                        {
                            "segments": t.held.segments,
                            "bytes": t.held.bytes,
                            "oldest_commit_time": _time(t.held.oldest_commit_time_us),
                        }
                        if t.held
                        else None
                    ),
                    "snapshot_run": (
                        {
                            "run": t.snapshot_run.run,
                            "consistent_point": _lsn(t.snapshot_run.consistent_point),
                            "announced_lsn": _lsn(t.snapshot_run.position),
                        }
                        if t.snapshot_run
                        else None
                    ),
                }
                for t in self.tables
            },
        }

    def lines(self) -> list[str]:
        slot = self.slot
        out = []
        if self.source_error:
            out.append(f"source: unreachable ({self.source_error})")
        elif slot is None:
            out.append(
                f"slot {self.slot_name}: does not exist"
                + (" (run `cdc-assets setup`)" if self.checkpoint_lsn is None else "")
            )
        else:
            out.append(
                f"slot {slot.name}: confirmed {_lsn(slot.confirmed_flush_lsn)}, server at {_lsn(slot.current_wal_lsn)},"
                f" lag {slot.lag_bytes or 0:,} bytes, WAL status {slot.wal_status}"
                + (f", safe WAL size {slot.safe_wal_size:,} bytes" if slot.safe_wal_size is not None else "")
            )
        if self.slot_problem is not None:
            out.append(f"ERROR: the drain refuses the slot: {self.slot_problem}")
        if self.held_wal is not None:
            out += _held_lines(self.held_wal)
        if self.standby_error is not None:
            out.append(f"standby: unreachable ({self.standby_error})")
        elif self.standby is not None:
            out.append(self.standby.describe())
        if self.checkpoint_lsn is None:
            out.append("change log: not set up")
        else:
            out.append(f"change log: checkpoint {_lsn(self.checkpoint_lsn)} (snapshot at {_lsn(self.snapshot_lsn)})")
        out += [f"change log: gap: {gap.describe()}" for gap in self.gaps]
        for table in self.tables:
            out.append(
                f"  {table.name}: last change {_lsn(table.last_change_lsn)}, schema version {table.schema_version},"
                f" applied to Delta up to {_lsn(table.applied_lsn) or 'nothing yet'}"
                + (" (behind: run `cdc-assets apply`)" if table.behind else "")
                + (
                    f"; online snapshot {table.snapshot_run.run} announced at {_lsn(table.snapshot_run.position)}"
                    if table.snapshot_run
                    else ""
                )
            )
            if table.held_for_copy is not None:
                out.append(f"    {table.held_for_copy}")
            if table.held:
                out.append(
                    f"    holds back the change log: {table.held.segments} segments, {table.held.bytes:,} bytes past"
                    f" the retention (oldest committed {_time(table.held.oldest_commit_time_us)}) until it is applied"
                )
        return out


def read_status(config: Config) -> Status:
    reader = ChangeLogReader(changelog_store(config))
    checkpoint = reader.checkpoint()
    status = Status(
        slot_name=config.source.slot,
        slot=None,
        checkpoint_lsn=checkpoint.lsn if checkpoint else None,
        snapshot_lsn=checkpoint.snapshot_lsn if checkpoint else None,
        gaps=checkpoint.gaps if checkpoint else (),
    )
    try:
        with connect(config.source, purpose="status") as conn:
            status.slot = read_slot(conn, config.source.slot)
            status.held_wal = read_held_wal(conn, config.source.slot)
            if checkpoint is not None:
                lost = lost_slot_error(config.source, status.slot, checkpoint)
                status.slot_problem = None if lost is None else str(lost)
    except SourceError as error:
        status.source_error = str(error)
    if config.source.standby_dsn is not None:
        try:
            status.standby = read_standby_slot(config.source, status.slot)
        except SourceError as error:
            status.standby_error = str(error)
    for table in config.tables:
        name = str(table.name)
        state = checkpoint.tables.get(name) if checkpoint else None
        path = config.target_path(table)
        applied = table_applied_lsn(config, table)
        status.tables.append(
            TableStatus(
                name,
                state.last_lsn if state else None,
                state.schema_version if state else None,
                applied,
                path,
                state.snapshot_run if state else None,
                table_hold(config, reader, checkpoint, name, applied) if checkpoint else None,
                state.awaiting_copy if state else None,
                awaiting_copy_reason(state) if state and state.awaiting_copy is not None else None,
            )
        )
    return status


def _held_lines(held: HeldWal) -> list[str]:
    if held.held_bytes is None:
        return []
    pinned = held.pinned_by
    out = [
        f"  held WAL: {held.held_bytes:,} bytes behind restart LSN {_lsn(held.restart_lsn)}; oldest transaction"
        + (f" with an xid: {pinned.describe()}" if pinned else ": none holds an xid")
    ]
    warning = held.warning()
    if warning:
        out.append(f"WARNING: {warning}")
    return out


def _standby_json(standby: StandbySlot | None, error: str | None) -> dict[str, Any] | None:
    if standby is None:
        return None if error is None else {"ready": False, "problem": f"unreachable ({error})"}
    return {
        "ready": standby.problem is None,
        "problem": standby.problem,
        "synced": standby.synced,
        "confirmed_flush_lsn": _lsn(standby.confirmed_flush_lsn),
        "behind_bytes": standby.behind_bytes,
        "invalidation_reason": standby.invalidation_reason,
    }


def _pinned_json(pinned: PinningTransaction | None) -> dict[str, Any] | None:
    if pinned is None:
        return None
    return {
        "pid": pinned.pid,
        "gid": pinned.gid,
        "xid": pinned.xid,
        "xid_age": pinned.xid_age,
        "state": pinned.state,
        "started_at": _timestamp(pinned.started_at),
        "age_seconds": None if pinned.age_seconds is None else round(pinned.age_seconds, 3),
        "query_start": _timestamp(pinned.query_start),
        "query": pinned.query,
        "user": pinned.user,
        "application_name": pinned.application_name,
        "database": pinned.database,
    }


def _timestamp(moment: datetime | None) -> str | None:
    return None if moment is None else moment.astimezone(UTC).isoformat(timespec="seconds")


def _time(microseconds: int) -> str:
    return unix_time(microseconds).isoformat(timespec="seconds")


def _lsn(value: int | None) -> str | None:
    return None if value is None else format_lsn(value)
