"""Which Delta version of a mirrored table holds the source's table as of a change-log position.

A version whose applied LSN is ``a`` holds every change of the table that ended by ``a`` and no
other. So it holds the table exactly as of an LSN ``L`` (every transaction that ended by ``L``,
none after) when the log has no change of the table with end LSN between the two — in ``(a, L]``
when ``a < L`` (none is missing), in ``(L, a]`` when ``a > L`` (none is extra) — and no copy of the
table (an online snapshot run) was announced there. The log's checkpoint must have reached ``L``:
before that, a change up to ``L`` may not be in the log yet.

A version's applied LSN comes from its commit's user metadata (every data commit of cdc-assets
records the LSN it applied; a maintenance or schema commit keeps the one before); the oldest
version looked at is read from its own snapshot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from cdc_assets.apply.target import APPLIED_KEY, applied_lsn, open_table
from cdc_assets.changelog.checkpoint import Checkpoint
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.lsn import format_lsn

VERSIONS_SEARCHED = 50
"""How many of a table's latest Delta versions are looked through for the state at an LSN."""


@dataclass(slots=True, frozen=True)
class AppliedVersion:
    """One Delta version of a mirrored table and the change-log position it holds."""

    version: int
    applied_lsn: int | None  # None: before the first data commit


def applied_versions(
    path: str, app: str, storage_options: dict[str, str] | None = None, limit: int = VERSIONS_SEARCHED
) -> list[AppliedVersion]:
    """The table's latest ``limit`` versions, newest first (empty: no table)."""
    table = open_table(path, storage_options)
    if table is None:
        return []
    commits = sorted(table.history(limit), key=lambda c: int(c["version"]))
    applied = applied_lsn(path, app, storage_options, int(commits[0]["version"]))
    versions = []
    for commit in commits:
        recorded = _recorded_lsn(commit.get("userMetadata"))
        applied = applied if recorded is None else recorded
        versions.append(AppliedVersion(int(commit["version"]), applied))
    return versions[::-1]


def _recorded_lsn(metadata: object) -> int | None:
    if not isinstance(metadata, str):
        return None
    try:
        value = json.loads(metadata).get(APPLIED_KEY)
    except (ValueError, AttributeError):
        return None  # someone else's commit metadata
    return value if isinstance(value, int) else None


def quiet_between(reader: ChangeLogReader, checkpoint: Checkpoint, table: str, low: int, high: int) -> bool:
    """Whether the log has no change of ``table`` with end LSN in ``(low, high]`` and announced no
    copy of it there (``checkpoint``: the log's, read after the versions looked at). Where
    retention folded the changes away, or a lost slot's gap lies in between, nobody can tell: not
    quiet."""
    state = checkpoint.tables.get(table)
    if state is None or low >= high:
        return True
    if checkpoint.gap_between(low, high) is not None:
        return False
    if (state.folded is not None and low < state.folded.lsn) or reader.due_snapshot_run(state, low, high):
        return False
    return state.last_change_lsn <= low or not any(c.records.num_rows for c in reader.read_changes(table, low, high))


def version_holding(
    reader: ChangeLogReader,
    checkpoint: Checkpoint,
    table: str,
    versions: list[AppliedVersion],
    lsn: int,
) -> AppliedVersion | str | None:
    """The newest of ``versions`` (newest first) that holds ``table`` exactly as of ``lsn``; None
    when there is no table and none is due (it has no change up to ``lsn``); else why there is
    none. The caller has checked that the log's checkpoint has reached ``lsn``."""
    at = format_lsn(lsn)
    if not versions or versions[0].applied_lsn is None:  # no data commit yet
        if quiet_between(reader, checkpoint, table, -1, lsn):
            return None
        return f"{table} has no Delta table with its changes up to {at}"
    for candidate in versions:
        applied = candidate.applied_lsn
        if applied is None:
            break
        if applied <= lsn:
            if quiet_between(reader, checkpoint, table, applied, lsn):
                return candidate
            return f"{table}'s merge has not brought its changes up to {at} (applied {format_lsn(applied)})"
        if quiet_between(reader, checkpoint, table, lsn, applied):
            return candidate
    return f"none of {table}'s latest {len(versions)} Delta versions holds its state at {at}"
