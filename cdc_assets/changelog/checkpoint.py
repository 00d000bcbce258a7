"""The checkpoint: the change log's durable position, replaced atomically after each batch.

Every transaction whose commit end LSN is at or below ``lsn`` is in the log, exactly once; the
slot may be advanced to ``lsn`` and no further (invariant 2). Per table it records the end LSN of
the last transaction that changed it (a sensor compares that with the table's applied LSN by
reading this one small file) and its latest schema version; and the server (system identifier,
timeline) the log was last read from.
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
class TableState:
    """What the log holds for one table: ``snapshot_run`` is its latest copy (an online snapshot
    run or a compacted base); ``folded`` says which of its changes retention removed."""

    last_change_lsn: int
    schema_version: int
    relation: RelationSchema
    snapshot_run: SnapshotRunRef | None = None
    folded: Folded | None = None

    def held_by(self, applied: int | None) -> bool:
        """Whether a Delta table whose applied LSN is ``applied`` holds every change logged for it."""
        return applied is not None and self.last_change_lsn <= applied


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
            "tables": {
                name: {
                    "last_change_lsn": state.last_change_lsn,
                    "schema_version": state.schema_version,
                    "relation": state.relation.to_json(),
                    "snapshot_run": state.snapshot_run.to_json() if state.snapshot_run else None,
                    "folded": state.folded.to_json() if state.folded else None,
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
            tables={
                name: TableState(
                    int(s["last_change_lsn"]),
                    int(s["schema_version"]),
                    RelationSchema.from_json(s["relation"]),
                    SnapshotRunRef.from_json(s["snapshot_run"]) if s.get("snapshot_run") else None,
                    Folded.from_json(s["folded"]) if s.get("folded") else None,
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
