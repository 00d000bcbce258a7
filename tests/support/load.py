"""A :class:`~tests.support.workload.Workload` running in a thread while a test drains, copies
and merges, and the configuration that mirrors its tables."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cdc_assets.config import Config, load_config
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.workload import Workload, tables_section


@contextmanager
def running_load(workload: Workload) -> Iterator[Callable[[], int]]:
    """``workload`` runs in a thread until the context ends; yields the operations count so far."""
    stop = threading.Event()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            while not stop.is_set():
                workload.run(20, allow_pending=False)
        except BaseException as error:  # noqa: BLE001 — re-raised in the test's thread
            errors.append(error)

    thread = threading.Thread(target=run, name="write-load")
    thread.start()
    try:
        yield lambda: workload.stats.ops
    finally:
        stop.set()
        thread.join(timeout=120)
    assert not thread.is_alive(), "the write load did not stop"
    if errors:
        raise errors[0]
    workload.finish()


def workload_config(
    dsn: str, folder: Path, schema: str, workload: Workload, tables: list[str], **source: Any
) -> Config:
    """A configuration mirroring ``tables`` of ``workload`` through publication ``<schema>_pub`` and
    slot ``<schema>`` (``source``: more source settings)."""
    settings = {"publication": f"{schema}_pub", "slot": schema, **source}
    path = write_config(folder, tables_section([workload.qualified(t) for t in tables]), source=settings)
    return load_config(path, environ={DSN_VARIABLE: dsn})
