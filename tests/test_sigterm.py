"""``cdc-assets sync`` stopped by SIGTERM (as a service manager stops it) takes down what it
started: the drain's stream-receiving process and the Spark JVM. (The demo's servers: tests/test_demo.py.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.support.database import Database
from tests.support.mirror import Mirror
from tests.support.pipeline import wait_until
from tests.support.processes import Command, process_name, sigterm_and_check

pytestmark = pytest.mark.slow


def test_sigterm_stops_sync_with_its_stream_process_and_spark(pg: Database, tmp_path: Path) -> None:
    mirror = Mirror(pg, tmp_path / "sync", {"public.t": {}}, None)
    mirror.sql(
        "CREATE TABLE t (id int PRIMARY KEY, v text)", "INSERT INTO t SELECT g, 'v' FROM generate_series(1, 100) g"
    )
    mirror.setup()
    mirror.sql("UPDATE t SET v = 'w' WHERE id <= 50")
    command = Command("sync", "-c", str(mirror.config_path), cwd=tmp_path, env={"CDC_SOURCE_DSN": pg.dsn})
    try:

        def spark_runs() -> bool:
            command.printed("drained")  # raises if the command ended
            return any("java" in process_name(p) for p in psutil.Process(command.process.pid).children(recursive=True))

        wait_until(spark_runs, 300, "the sync's Spark JVM")
        started: list[Any] = psutil.Process(command.process.pid).children(recursive=True)
        assert any("cdc_assets.stream.child" in process_name(p) for p in started), [
            process_name(p)[:120] for p in started
        ]
        sigterm_and_check(command, started, exit_code=130)
    finally:
        command.kill_group()
