"""Interrupts: SIGTERM handled like Ctrl-C, and moments an interrupt must wait for.

A service manager or ``docker stop`` sends SIGTERM; :func:`stop_on_sigterm` makes it unwind the
command like Ctrl-C, so that whatever servers it started are stopped on the way out.
:func:`interrupts_deferred` holds SIGINT and SIGTERM over a step that must not be cut short and
delivers them right after it.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

DEFERRED = (signal.SIGINT, signal.SIGTERM)


def stop_on_sigterm() -> None:
    """From now on SIGTERM raises :class:`KeyboardInterrupt` in the main thread, as SIGINT does."""
    signal.signal(signal.SIGTERM, _raise_interrupt)


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


@contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold SIGINT and SIGTERM until the block ends, then deliver the first one received to the
    handler that was in place. Outside the main thread (where Python runs no signal handler) it
    does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = {number: signal.getsignal(number) for number in DEFERRED}
    for number in DEFERRED:
        signal.signal(number, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            if handler is not None:
                signal.signal(number, handler)
        if received:
            signal.raise_signal(received[0])
