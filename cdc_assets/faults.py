"""Fault injection for crash tests: ``CDC_ASSETS_FAULT=<point>[:<n>]`` SIGKILLs the process the
n-th time (default the first) it passes ``<point>``. Points: ``after-segments`` (batch files
durable, checkpoint not written), ``after-checkpoint`` (checkpoint written, not yet confirmed to the server),
``after-advance`` (confirmed to the server), ``mid-batch`` (a block of the stream assembled into the open batch);
for ``cdc-assets snapshot``: ``copy-chunk`` (a chunk of the run written), ``copy-complete`` (the
run's checkpoint written, not announced), ``copy-announced`` (the announcement committed); for
change-log retention: ``retention-base`` (a compacted base written, the checkpoint not),
``retention-checkpoint`` (the checkpoint names it, no segment deleted yet), ``retention-delete``
(a folded segment deleted, the others not yet).
"""

from __future__ import annotations

import os
import signal

ENV = "CDC_ASSETS_FAULT"
_passed: dict[str, int] = {}


def fault_point(name: str) -> None:
    """Die here if the environment asks for it (a real SIGKILL: no cleanup, no flushing)."""
    wanted = os.environ.get(ENV)
    if not wanted:
        return
    point, _, count = wanted.partition(":")
    if point != name:
        return
    _passed[name] = _passed.get(name, 0) + 1
    if _passed[name] == int(count or 1):
        os.kill(os.getpid(), signal.SIGKILL)
