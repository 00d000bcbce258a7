"""Fault injection for crash tests: ``CDC_ASSETS_FAULT=<point>[:<n>]`` SIGKILLs the process the
n-th time (default the first) it passes ``<point>``, one of :data:`POINTS` — each is just after a
durable step, where a kill leaves the most to finish or redo.
"""

from __future__ import annotations

import os
import signal

ENV = "CDC_ASSETS_FAULT"

POINTS: dict[str, str] = {
    # the drain
    "mid-batch": "a block of the stream assembled into the open batch",
    "after-segments": "a batch's files durable, its checkpoint not written",
    "after-checkpoint": "the checkpoint written, not yet confirmed to the server",
    "after-advance": "the checkpoint confirmed to the server",
    # change-log retention
    "retention-base": "a compacted base written, the checkpoint not",
    "retention-checkpoint": "the checkpoint names the base, no segment deleted yet",
    "retention-delete": "a folded segment deleted, the others not yet",
    # an online snapshot (`snapshot`, `setup` of a new table, `recover`)
    "copy-chunk": "a chunk of the run written",
    "copy-complete": "the run's checkpoint written, not announced",
    "copy-announced": "the announcement committed",
    # the apply
    "apply-create": "a Delta table created (its first commit)",
    "apply-evolve": "one schema change of a Delta table committed (a column added, dropped, renamed or retyped, a default filled, the source types or attnums recorded)",
    "apply-commit": "a data commit (MERGE, INSERT, INSERT OVERWRITE) recording its applied LSN",
    "apply-register": "a mirror registered in warehouse.catalog",
    "consistent-point": "a consistent point appended to the points table",
    "history-write": "a day of a table's change history written",
    "rebuild-commit": "a table rewritten from the change log",
    # maintenance
    "maintain-optimize": "a table compacted (OPTIMIZE)",
    "maintain-purge": "a table's deletion vectors purged (REORG … APPLY (PURGE))",
    "maintain-vacuum": "a table vacuumed",
    # recover
    "recover-slot": "the new slot created, the gap not recorded",
    "recover-checkpoint": "the gap recorded in the checkpoint, no table copied yet",
}

_passed: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Die here if the environment asks for it (a real SIGKILL: no cleanup, no flushing)."""
    assert name in POINTS, f"unknown fault point {name}"
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, count = wanted.partition(":")
    if point != name:
        return
    _passed[name] = _passed.get(name, 0) + 1
    if _passed[name] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
