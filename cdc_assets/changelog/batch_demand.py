"""A merge's call for a batch: the following drain makes what it has received durable at once
rather than at its next ``drain.commit_seconds``, so a merge about to start takes the newest
changes instead of those of a batch up to ``commit_seconds`` old."""

from __future__ import annotations

import threading


class BatchDemand:
    """Calls for a batch (:meth:`call`, from a merge's thread) and their answers (:meth:`answer`,
    from the drain's). A call is answered once the drain has ended a batch after it — made it
    durable, or found nothing new to make durable — or the demand is closed."""

    def __init__(self) -> None:
        self._changed = threading.Condition()
        self._calls = 0
        self._answered = 0  # every call up to this one is answered
        self._closed = False

    @property
    def calls(self) -> int:
        """The calls so far: the drain reads it before it ends a batch, and answers up to it."""
        return self._calls

    def call(self, timeout: float) -> bool:
        """Call for a batch and wait until it is answered, at most ``timeout`` seconds; whether it was."""
        with self._changed:
            if self._closed:
                return False
            self._calls += 1
            call = self._calls
            return self._changed.wait_for(lambda: self._answered >= call or self._closed, timeout) and not self._closed

    def answer(self, calls: int) -> None:
        """A batch ended: the first ``calls`` calls are answered."""
        with self._changed:
            if calls > self._answered:
                self._answered = calls
                self._changed.notify_all()

    def close(self) -> None:
        """No batch will answer: a waiting call returns now, and a later one at once."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
