"""Riding out a source that went away (a restart, a lost connection): which errors say so, and the
pauses between attempts to reach it again."""

from __future__ import annotations

import psycopg

from cdc_assets.errors import SourceUnavailableError

RECONNECT_SECONDS = (1.0, 2.0, 5.0, 10.0)
"""The pauses before the attempts to reach the source again (the last repeats)."""
CONNECTION_LOST_SQLSTATES = frozenset({"57P01", "57P02", "57P03", "08000", "08003", "08006"})
"""Server shut down, crashed or starting up, or the connection broke: worth reconnecting."""


def connection_lost(error: BaseException) -> bool:
    """Whether ``error`` says the source went away (rather than refused something)."""
    if isinstance(error, SourceUnavailableError):
        return True
    return isinstance(error, psycopg.OperationalError) and (
        error.sqlstate is None or error.sqlstate in CONNECTION_LOST_SQLSTATES
    )


class Backoff:
    """The pause before each attempt to reach the source again: :data:`RECONNECT_SECONDS`, the last
    repeating, until :meth:`reset` (the source was reached)."""

    def __init__(self) -> None:
        self._attempts = 0

    def next_pause(self) -> float:
        pause = RECONNECT_SECONDS[min(self._attempts, len(RECONNECT_SECONDS) - 1)]
        self._attempts += 1
        return pause

    def reset(self) -> None:
        self._attempts = 0
