"""A merge's call for a batch: the following drain makes what it has received durable at once
rather than at its next ``drain.commit_seconds``, so a merge about to start takes the newest
changes instead of those of a batch up to ``commit_seconds`` old."""

from __future__ import annotations

import threading

POLL_SECONDS = 0.1
"""How long a following drain waiting for the stream goes at most without looking for a call."""


class BatchDemand:
    """Calls for a batch (:meth:`call`, from a merge's thread) and their answers (:meth:`answer`,
    from the drain's). A call is answered once the drain has ended a batch after it — made it
    durable, or found nothing new to make durable — or the demand is closed. :attr:`received`
    says whether the drain holds changes no batch has made durable yet: without them a call
    would bring nothing."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._calls = 0
        self._answered = 0  # every call up to this one is answered
        self._made = 0  # every call up to this one is answered by a durable batch
        self._closed = False
        self.received = False  # set by the drain: messages received since its last durable batch

    @property
    def calls(self) -> int:
        """The calls so far: the drain reads it before it ends a batch, and answers up to it."""
        return self._calls

    def call(self, timeout: float) -> bool:
        """Call for a batch and wait until it is answered, at most ``timeout`` seconds; whether a
        durable batch answered it."""
        with self._changed:
            if self._closed:
                return False
            self._calls += 1
            call = self._calls
            self._changed.wait_for(lambda: self._answered >= call or self._closed, timeout)
            return self._made >= call

    def answer(self, calls: int, *, made: bool) -> None:
        """A batch ended: the first ``calls`` calls are answered, by a durable batch if ``made``."""
        with self._changed:
            self._answered = max(self._answered, calls)
            if made:
                self._made = max(self._made, calls)
            self._changed.notify_all()

    def close(self) -> None:
        """No batch will answer: a waiting call returns now, and a later one at once."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
