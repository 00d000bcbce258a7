"""Which errors say a Spark Connect session was lost: its server went away (it did not answer
through the client's retries) or was started again (it no longer knows the session, and the
client closes it). Either way nothing past the last Delta commit was written, and only a new
session reaches the server. No pyspark import: the CLI reads it for its message."""

from __future__ import annotations

CONNECT_LOST_MARKERS = (
    "StatusCode.UNAVAILABLE",  # no answer through the retries
    "NO_ACTIVE_SESSION",  # the client closed the session its server no longer knows
    "INVALID_HANDLE.SESSION",  # SESSION_CHANGED, SESSION_NOT_FOUND, SESSION_CLOSED
    "incorrect server side session identifier",
)


def connect_lost(error: BaseException) -> bool:
    """Whether ``error``, raised by a Spark Connect call, says the session was lost."""
    text = str(error)
    return any(marker in text for marker in CONNECT_LOST_MARKERS)
