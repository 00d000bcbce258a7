"""The checkpoint: the change log's durable position, replaced atomically after each batch.

Every transaction whose commit end LSN is at or below ``lsn`` is in the log, exactly once; the
slot may be advanced to ``lsn`` and no further (invariant 2). Per table it records the end LSN of
the last transaction that changed it (a sensor compares that with the table's applied LSN by
reading this one small file) and its latest schema version; the server (system identifier,
timeline) the log was last read from; and the gaps ``cdc-assets recover`` bridged with re-copies.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any

from cdc_assets.changelog.layout import CHECKPOINT
from cdc_assets.changelog.snapshot_runs import SnapshotRunRef
from cdc_assets.changelog.store import LogStore
from cdc_assets.errors import CdcError, NotSetUpError, StorageError
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.source.server_identity import ServerIdentity

FORMAT = 1


@dataclass(slots=True, frozen=True)
class Folded:
    """How far retention has folded a table's changes into its latest copy: the log holds its
    changes with end LSN after ``lsn`` only; the last folded one committed at ``commit_time_us``."""

    lsn: int
    commit_time_us: int

    def to_json(self) -> dict[str, int]:
        return {"lsn": self.lsn, "commit_time_us": self.commit_time_us}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Folded:
        return cls(int(data["lsn"]), int(data["commit_time_us"]))


@dataclass(slots=True, frozen=True)
class Gap:
    """Changes the log can never hold: a slot lost after the log's position ``lost_after``, replaced
    by a new slot whose consistent point is ``slot_point``; the transactions that ended in between
    reach each table through its re-copy (``cdc-assets recover``, at ``time_us``), not as changes."""

    lost_after: int
    slot_point: int
    time_us: int
    reason: str

    def overlaps(self, low: int, high: int) -> bool:
        """Whether some transaction ending in ``(low, high]`` may have ended inside the gap."""
        return low < self.slot_point and self.lost_after < high

    def lines(self) -> list[str]:
        return [f"recover: {self.describe()}"]

    def describe(self) -> str:
        """One line: what was lost, and where the new slot starts."""
        return (
            f"{self.reason}; a new slot starts at LSN {format_lsn(self.slot_point)}: the transactions that ended in"
            f" ({format_lsn(self.lost_after)}, {format_lsn(self.slot_point)}] reach the tables through their copies"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "lost_after": self.lost_after,
            "lost_after_text": format_lsn(self.lost_after),
            "slot_point": self.slot_point,
            "slot_point_text": format_lsn(self.slot_point),
            "time_us": self.time_us,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Gap:
        return cls(int(data["lost_after"]), int(data["slot_point"]), int(data["time_us"]), str(data["reason"]))


@dataclass(slots=True, frozen=True)
class TableState:
    """What the log holds for one table: ``snapshot_run`` is its latest copy (an online snapshot
    run or a compacted base); ``folded`` says which of its changes retention removed;
    ``awaiting_copy`` (a recovery's slot point, or the end of a transaction that rewrote the table:
    ``copy_reason`` says which) holds the table until a copy at or after it is announced: its
    Delta table lacks the changes of the gap, or the rows of the rewrite. ``last_ddl_lsn``: the end LSN of the
    last transaction with a captured schema change of the table ("DDL in the stream"); schema
    changes alone do not move ``last_change_lsn``."""

    last_change_lsn: int
    schema_version: int
    relation: RelationSchema
    snapshot_run: SnapshotRunRef | None = None
    folded: Folded | None = None
    awaiting_copy: int | None = None
    last_ddl_lsn: int | None = None
    copy_reason: str | None = None  # why it awaits a copy, when not a lost slot (a rewrite of the table)

    @property
    def last_lsn(self) -> int:
        """The end LSN of the last transaction a mirror of the table must apply: its last change or
        its last captured schema change."""
        return max(self.last_change_lsn, self.last_ddl_lsn or -1)

    def held_by(self, applied: int | None) -> bool:
        """Whether a Delta table whose applied LSN is ``applied`` holds every change and schema
        change logged for it."""
        return applied is not None and self.last_lsn <= applied


def awaiting_copy_reason(state: TableState) -> str:
    """Why a table held until a copy is not merged."""
    if state.copy_reason is not None:
        return (
            f"held until a copy after LSN {format_lsn(state.awaiting_copy or 0)} is drained: {state.copy_reason};"
            " `cdc-assets sync` copies it (or `cdc-assets snapshot`)"
        )
    return (
        f"held until its copy after the lost slot (new slot at LSN {format_lsn(state.awaiting_copy or 0)}) is"
        " drained: `cdc-assets recover` copies it"
    )


@dataclass(slots=True, frozen=True)
class PreparedEntry:
    """A prepared (two-phase) transaction stored in ``folder``, waiting for its outcome."""

    gid: str
    xid: int
    prepare_lsn: int
    end_lsn: int
    prepare_time_us: int
    folder: str
    origin: str | None = None
    origin_lsn: int | None = None


@dataclass(slots=True, frozen=True)
class Checkpoint:
    slot: str
    lsn: int
    tables: dict[str, TableState] = field(default_factory=dict)
    prepared: dict[str, PreparedEntry] = field(default_factory=dict)
    snapshot_lsn: int | None = None
    snapshot_time_us: int | None = None  # when the initial snapshot was taken (µs since 1970, UTC)
    server: ServerIdentity | None = None  # the server the log was last read from (None: not recorded yet)
    gaps: tuple[Gap, ...] = ()  # oldest first
    retained_at_us: int | None = None  # when change-log retention last ran (µs since 1970; None: never)

    def gap_between(self, low: int, high: int) -> Gap | None:
        """The latest gap a transaction ending in ``(low, high]`` may have ended in, if any."""
        return next((g for g in reversed(self.gaps) if g.overlaps(low, high)), None)

    def tables_awaiting_copy(self) -> list[str]:
        """The tables held until their re-copy after the latest gap."""
        return sorted(name for name, state in self.tables.items() if state.awaiting_copy is not None)

    def advanced(self, lsn: int, **changes: Any) -> Checkpoint:
        return replace(self, lsn=lsn, **changes)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "slot": self.slot,
            "lsn": self.lsn,
            "lsn_text": format_lsn(self.lsn),
            "snapshot_lsn": self.snapshot_lsn,
            "snapshot_time_us": self.snapshot_time_us,
            "server": self.server.to_json() if self.server else None,
            "gaps": [g.to_json() for g in self.gaps],
            "retained_at_us": self.retained_at_us,
            "tables": {
                name: {
                    "last_change_lsn": state.last_change_lsn,
                    "schema_version": state.schema_version,
                    "relation": state.relation.to_json(),
                    "snapshot_run": state.snapshot_run.to_json() if state.snapshot_run else None,
                    "folded": state.folded.to_json() if state.folded else None,
                    "awaiting_copy": state.awaiting_copy,
                    "last_ddl_lsn": state.last_ddl_lsn,
                    "copy_reason": state.copy_reason,
                }
                for name, state in sorted(self.tables.items())
            },
            "prepared": {
                gid: {
                    "xid": p.xid,
                    "prepare_lsn": p.prepare_lsn,
                    "end_lsn": p.end_lsn,
                    "prepare_time_us": p.prepare_time_us,
                    "folder": p.folder,
                    "origin": p.origin,
                    "origin_lsn": p.origin_lsn,
                }
                for gid, p in sorted(self.prepared.items())
            },
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Checkpoint:
        if data.get("format") != FORMAT:
            raise CdcError(f"checkpoint format {data.get('format')!r} is not supported (expected {FORMAT})")
        return cls(
            slot=str(data["slot"]),
            lsn=int(data["lsn"]),
            snapshot_lsn=data.get("snapshot_lsn"),
            snapshot_time_us=data.get("snapshot_time_us"),
            server=ServerIdentity.from_json(data["server"]) if data.get("server") else None,
            gaps=tuple(Gap.from_json(g) for g in data.get("gaps", [])),
            retained_at_us=data.get("retained_at_us"),
            tables={
                name: TableState(
                    int(s["last_change_lsn"]),
                    int(s["schema_version"]),
                    RelationSchema.from_json(s["relation"]),
                    SnapshotRunRef.from_json(s["snapshot_run"]) if s.get("snapshot_run") else None,
                    Folded.from_json(s["folded"]) if s.get("folded") else None,
                    s.get("awaiting_copy"),
                    s.get("last_ddl_lsn"),
                    s.get("copy_reason"),
                )
                for name, s in data.get("tables", {}).items()
            },
            prepared={
                gid: PreparedEntry(
                    gid,
                    int(p["xid"]),
                    int(p["prepare_lsn"]),
                    int(p["end_lsn"]),
                    int(p["prepare_time_us"]),
                    str(p["folder"]),
                    p.get("origin"),
                    p.get("origin_lsn"),
                )
                for gid, p in data.get("prepared", {}).items()
            },
        )


def read_checkpoint(store: LogStore) -> Checkpoint | None:
    """The current checkpoint, or None for a log that was never set up."""
    raw = store.read_bytes(CHECKPOINT)
    if raw is None:
        return None
    try:
        return Checkpoint.from_json(json.loads(raw))
    except (ValueError, KeyError, TypeError) as error:
        raise CdcError(f"checkpoint {store.path(CHECKPOINT)} is unreadable: {error}") from None


def require_checkpoint(store: LogStore) -> Checkpoint:
    """The current checkpoint; :class:`NotSetUpError` for a log that was never set up."""
    checkpoint = read_checkpoint(store)
    if checkpoint is None:
        bucket = store.missing_bucket()
        if bucket is not None:
            raise StorageError(f"the change log at {store.root}: bucket {bucket} does not exist (check changelog.path)")
        raise NotSetUpError(f"the change log at {store.root} has no checkpoint: run `cdc-assets setup` first")
    return checkpoint


def write_checkpoint(store: LogStore, checkpoint: Checkpoint) -> None:
    """Replace the checkpoint atomically (call only once the batch's files are durable)."""
    store.replace(CHECKPOINT, json.dumps(checkpoint.to_json(), indent=1).encode())
