"""Online snapshots (``cdc-assets snapshot``) under a concurrent random write load: damaged Delta
tables are repaired, the other tables keep being applied meanwhile, and every table ends equal to
its source, read with Spark and with delta-rs (docs/architecture.md, "Online snapshots").

The load is :class:`tests.support.workload.Workload` on its own connection in a thread: inserts,
updates with key changes and swaps, deletes, TRUNCATEs, unchanged TOAST values, prepared and large
transactions, on keyed, REPLICA IDENTITY FULL, keyless and row-filtered tables.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F

from cdc_assets.apply.runner import apply_tables
from cdc_assets.config import Config, load_config
from cdc_assets.drain import drain
from cdc_assets.online_snapshot import CopyProgress, snapshot_tables
from cdc_assets.setup import setup
from tests.conftest import Database
from tests.support.parity import compare_all, fast_spark, report
from tests.support.pipeline import wait_until
from tests.support.workload import Workload, write_workload_config

pytestmark = pytest.mark.slow

DSN_VARIABLE = "CDC_SOURCE_DSN"


@contextmanager
def write_load(workload: Workload) -> Iterator[Callable[[], int]]:
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


def damage(spark: Any, path: str, key: str) -> None:
    """Delete two rows, change one, and add one the source never had (by ``key``)."""
    table = f"delta.`{path}`"
    keys = [row[0] for row in spark.sql(f"SELECT {key} FROM {table} ORDER BY {key} LIMIT 3").collect()]
    assert len(keys) == 3, f"{path} has too few rows to damage"
    spark.sql(f"DELETE FROM {table} WHERE {key} IN ({keys[0]}, {keys[1]})")
    spark.sql(f"UPDATE {table} SET title = 'damaged' WHERE {key} = {keys[2]}")
    stray = spark.read.format("delta").load(path).where(f"{key} = {keys[2]}").withColumn(key, F.lit(-keys[2] - 1))
    stray.write.format("delta").mode("append").save(path)


def pipeline(db: Database, folder: Path, schema: str, workload: Workload, tables: list[str]) -> Config:
    source = {"dsn": "${" + DSN_VARIABLE + "}", "publication": f"{schema}_pub", "slot": schema}
    return load_config(
        write_workload_config(folder, source, [workload.qualified(t) for t in tables]), environ={DSN_VARIABLE: db.dsn}
    )


def test_online_snapshot_repairs_tables_while_the_others_keep_flowing(pg: Database, spark: Any, tmp_path: Path) -> None:
    schema = "online"
    workload = Workload(pg.dsn, schema, seed=1311)
    workload.create()
    workload.populate(60)
    config = pipeline(pg, tmp_path, schema, workload, ["kinds", "docs", "parent", "child", "bag", "events", "orders"])
    session = spark.newSession()
    with fast_spark(session):
        setup(config)
        workload.run(300, allow_pending=False)
        drain(config, wait=True)
        apply_tables(config, session)
        docs, bag = workload.qualified("docs"), workload.qualified("bag")
        damage(session, config.target_path(config.table(docs)), "id")
        assert docs in report(compare_all(config, pg.dsn, None)), "the damage is not visible"
        others = [str(t.name) for t in config.tables if str(t.name) not in (docs, bag)]

        with write_load(workload) as ops:
            copying, others_applied = threading.Event(), threading.Event()
            copied: list[Any] = []

            def hold_the_copy(progress: CopyProgress) -> None:
                """The first chunk is written and the copy's snapshot is open: let the others flow."""
                if not copying.is_set():
                    copying.set()
                    assert others_applied.wait(300), "the other tables were not applied"

            copier = threading.Thread(
                target=lambda: copied.extend(snapshot_tables(config, [docs, bag], progress=hold_the_copy))
            )
            copier.start()
            wait_until(copying.is_set, timeout=120, what="the copy's first chunk")
            applied_before = {r.table: r.applied_lsn for r in apply_tables(config, session, others)}
            ops_then = ops()
            wait_until(lambda: ops() > ops_then + 100, timeout=120, what="more writes during the copy")
            drain(config, wait=True)
            during = apply_tables(config, session, others)
            others_applied.set()
            copier.join(timeout=300)
            assert not copier.is_alive()
            advanced = [r.table for r in during if (r.applied_lsn or 0) > (applied_before[r.table] or 0)]
            assert advanced, [r.summary() for r in during]
            assert len(copied) == 2 and all(c.rows > 0 for c in copied), copied
            wait_until(lambda: ops() > ops_then + 300, timeout=120, what="writes after the copy")
        drain(config, wait=True)
        apply_tables(config, session)
        problems = report(compare_all(config, pg.dsn, session))
        assert not problems, problems
        assert workload.stats.truncates and workload.stats.key_changes, workload.stats.line()
    workload.close()
