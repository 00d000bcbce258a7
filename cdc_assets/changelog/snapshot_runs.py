"""Online snapshot runs: a table's copy as of a consistent point, stored beside the change log.

A run of ``cdc-assets snapshot`` (see ``docs/architecture.md``, "Online snapshots") copies one table
as of the exported snapshot of a temporary slot, whose consistent point ``C`` splits the stream
exactly: the copy holds every transaction with end LSN ≤ ``C``, the log every one after. A run is
a small change log of its own under ``snapshots/<table>/<run>/`` — the table's ``snapshot``
records at ``C`` and a checkpoint, written last, that makes the run complete.

Once complete, the run is announced in the stream itself: a transactional logical decoding message
(prefix :data:`SNAPSHOT_RUN_PREFIX`) commits at a position ``K`` > ``C``. The drain records it in
the table's :class:`~cdc_assets.changelog.checkpoint.TableState`, so every reader of the log sees
the run at ``K``, in log order: a Delta table that has not applied ``K`` starts again from the run
(the run's records, then the log's after ``C``), and a rebuild starts from the latest run.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from cdc_assets.changelog.layout import table_folder
from cdc_assets.changelog.store import LogStore
from cdc_assets.errors import CdcError
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.schema import RelationSchema

SNAPSHOT_RUN_PREFIX = "cdc_assets.snapshot_run"
SNAPSHOTS = "snapshots"
BASE_MARK = "-base-"  # in the name of a compacted base written by retention


@dataclass(slots=True, frozen=True)
class SnapshotRunRef:
    """A complete run as the log knows it: ``run`` holds the table as of ``consistent_point``; the
    stream announced it at ``position`` (the end LSN of the announcing transaction); ``reason``: why
    the table was held for it, when it was (a rewrite, a column change the stream cannot tell)."""

    run: str
    consistent_point: int
    position: int
    reason: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "consistent_point": self.consistent_point,
            "position": self.position,
            "reason": self.reason,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SnapshotRunRef:
        return cls(str(data["run"]), int(data["consistent_point"]), int(data["position"]), data.get("reason"))

    def describe(self) -> str:
        """The copy in words, for a mirror's history and metadata."""
        why = f" after {self.reason}" if self.reason else ""
        return f"copied again as of LSN {format_lsn(self.consistent_point)} (run {self.run}){why}"


@dataclass(slots=True, frozen=True)
class SnapshotRunAnnouncement:
    """The content of the announcing message: which table, which run, and the table's columns as of
    the consistent point (the log may hold no change of the table yet)."""

    table: str
    run: str
    consistent_point: int
    relation: RelationSchema

    def encode(self) -> bytes:
        return json.dumps(
            {
                "table": self.table,
                "run": self.run,
                "consistent_point": self.consistent_point,
                "relation": self.relation.to_json(),
            }
        ).encode()

    @classmethod
    def decode(cls, content: bytes, lsn: int) -> SnapshotRunAnnouncement:
        try:
            data = json.loads(content)
            return cls(
                str(data["table"]),
                str(data["run"]),
                int(data["consistent_point"]),
                RelationSchema.from_json(data["relation"]),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise CdcError(f"malformed {SNAPSHOT_RUN_PREFIX} message at LSN {lsn:X}: {error}") from None


def runs_folder(table: str) -> str:
    """The folder of a table's runs, relative to the change log's root."""
    return f"{SNAPSHOTS}/{table_folder(table).split('/', 1)[1]}"


def new_run_id(consistent_point: int) -> str:
    """A run's name: its consistent point first, so names sort in stream order."""
    return f"{consistent_point:016X}-{secrets.token_hex(4)}"


def new_base_id(lsn: int) -> str:
    """A compacted base's name (retention's, never announced): its LSN first, like a run's."""
    return f"{lsn:016X}{BASE_MARK}{secrets.token_hex(4)}"


def is_base(run: str) -> bool:
    return BASE_MARK in run


def run_consistent_point(run: str) -> int:
    return int(run.split("-", 1)[0], 16)


def run_store(store: LogStore, table: str, run: str) -> LogStore:
    """The run's own little change log."""
    return store.sub(f"{runs_folder(table)}/{run}")
