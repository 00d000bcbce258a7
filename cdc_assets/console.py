"""What the ``cdc-assets`` command shows while it works: a status line rewritten in place, the
initial copy's rates, and each result's own lines as it is done."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

from cdc_assets.pipeline.sync import Described
from cdc_assets.source.copy_rows import SPLIT_IN


class Progress:
    """One status line, rewritten in place on a terminal and printed every few seconds elsewhere."""

    def __init__(self, stream: TextIO = sys.stderr, interval_s: float = 5.0) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.interval_s = interval_s
        self._last = 0.0
        self._shown = False

    def show(self, text: str) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write(f"\r\033[K{text}")
            self._shown = True
        elif now - self._last >= self.interval_s:
            self.stream.write(text + "\n")
            self._last = now
        self.stream.flush()

    def done(self) -> None:
        """End the status line, so that what is printed next starts a line of its own."""
        if self.tty and self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False


class CopyRates:
    """The initial copy's progress line: a table's rows and rows/s since the copy's first block
    (tables are copied at once, so each table's rate is its share of the copy), and the path the
    rows are split on (C or pure Python)."""

    def __init__(self) -> None:
        self._started: float | None = None

    def line(self, table: str, rows: int) -> str:
        now = time.monotonic()
        self._started = self._started or now
        rate = f", {rows / (now - self._started):,.0f} rows/s" if now > self._started else ""
        return f"snapshot {table}: {rows:,} rows{rate} ({SPLIT_IN})"


def printer(progress: Progress | None = None) -> Callable[[Described], None]:
    """Print each result's lines as it is done (after ending ``progress``'s status line)."""

    def report(result: Described) -> None:
        if progress is not None:
            progress.done()
        for line in result.lines():
            print(line, flush=True)

    return report
