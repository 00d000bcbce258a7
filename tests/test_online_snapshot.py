"""Online snapshots (``cdc-assets snapshot``, and ``setup`` adding a table) under a concurrent random
write load: damaged Delta tables are repaired, a table added mid-stream is copied in, the other
tables keep being applied meanwhile, and every table ends equal to its source, read with Spark and
with delta-rs — also when ``snapshot`` is SIGKILLed at random points and run again
(docs/architecture.md, "Online snapshots").

The load is :class:`tests.support.workload.Workload` on its own connection in a thread: inserts,
updates with key changes and swaps, deletes, TRUNCATEs, unchanged TOAST values, prepared and large
transactions, on keyed, REPLICA IDENTITY FULL, keyless and row-filtered tables.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import functions as F

from cdc_assets.apply.runner import apply_tables
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.faults import ENV as FAULT
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.online_snapshot import CopyProgress, snapshot_tables
from cdc_assets.pipeline.setup import setup
from tests.support.config_file import DSN_VARIABLE
from tests.support.database import Database
from tests.support.load import running_load, workload_config
from tests.support.mirror_diff import compare_all, fast_spark, report
from tests.support.oracle import assert_mirrors
from tests.support.pipeline import wait_until
from tests.support.workload import Workload

pytestmark = pytest.mark.slow


def damage(spark: Any, path: str, key: str) -> None:
    """Delete rows, change one, and add one the source never had (by ``key``; the table has rows)."""
    table = f"delta.`{path}`"
    keys = [row[0] for row in spark.sql(f"SELECT {key} FROM {table} ORDER BY {key} LIMIT 3").collect()]
    assert keys, f"{path} has no rows to damage"
    kept = keys[-1]
    if len(keys) > 1:
        spark.sql(f"DELETE FROM {table} WHERE {key} IN ({', '.join(map(str, keys[:-1]))})")
    spark.sql(f"UPDATE {table} SET title = 'damaged' WHERE {key} = {kept}")
    frame = spark.read.format("delta").load(path)
    stray = frame.where(f"{key} = {kept}").withColumn(key, F.lit(-kept - 1).cast(frame.schema[key].dataType))
    stray.write.format("delta").mode("append").save(path)


def test_online_snapshot_repairs_tables_while_the_others_keep_flowing(pg: Database, spark: Any, tmp_path: Path) -> None:
    schema = "online"
    workload = Workload(pg.dsn, schema, seed=1311)
    workload.create()
    workload.populate(60)
    tables = ["kinds", "docs", "parent", "child", "bag", "events", "orders"]
    config = workload_config(pg.dsn, tmp_path, schema, workload, tables)
    session = spark.newSession()
    with fast_spark(session):
        setup(config)
        workload.run(300, allow_pending=False)
        workload.touch_all()  # every table holds rows, whatever the load truncated
        drain(config, wait=True)
        apply_tables(config, session)
        docs, bag, orders = workload.qualified("docs"), workload.qualified("bag"), workload.qualified("orders")
        damage(session, config.target_path(config.table(docs)), "id")
        assert docs in report(compare_all(config, pg.dsn, None)), "the damage is not visible"
        others = [str(t.name) for t in config.tables if str(t.name) not in (docs, bag, orders)]

        with running_load(workload) as ops:
            copying, others_applied = threading.Event(), threading.Event()
            copied: list[Any] = []

            def hold_the_copy(progress: CopyProgress) -> None:
                """The first table is read, its run not announced yet: the others flow meanwhile.
                (While a table is read, its copy holds ACCESS SHARE on it: a TRUNCATE of the table
                waits, and the load's connection with it.)"""
                if progress.read and not copying.is_set():
                    copying.set()
                    assert others_applied.wait(300), "the other tables were not applied"

            wider = workload_config(pg.dsn, tmp_path, schema, workload, [*tables, "coded"])  # a table added mid-stream

            def copy() -> None:
                try:
                    copied.extend(snapshot_tables(config, [docs, bag, orders], progress=hold_the_copy))
                    copied.extend(setup(wider).copied)
                except BaseException as error:  # noqa: BLE001 — shown by the assertion below
                    copied.append(error)

            copier = threading.Thread(target=copy)
            copier.start()
            wait_until(copying.is_set, timeout=300, what="the first table read")
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
            assert [c.table for c in copied] == [docs, bag, orders, workload.qualified("coded")], copied
            # A table the load truncated just before its snapshot is copied empty, rightly (a TRUNCATE
            # after the snapshot restarts the copy from a snapshot after it); not all of them are.
            assert sum(c.rows for c in copied) > 0, copied
            wait_until(lambda: ops() > ops_then + 300, timeout=120, what="writes after the copy")
        drain(wider, wait=True)
        apply_tables(wider, session)
        problems = report(compare_all(wider, pg.dsn, session))
        assert not problems, problems
        assert workload.stats.truncates and workload.stats.key_changes, workload.stats.line()
    workload.close()


KILLS = int(os.environ.get("CDC_SNAPSHOT_KILLS", "4"))  # the large variant: 10 or more


def test_snapshot_killed_at_random_points_then_rerun(pg: Database, spark: Any, tmp_path: Path) -> None:
    """``cdc-assets snapshot`` SIGKILLed ``CDC_SNAPSHOT_KILLS`` times (default 4) at random points — at a fault point (a chunk
    written, the run complete but not announced, the announcement committed) or after a random
    delay — while the load runs; after each kill the log is drained and, replayed from each table's
    latest copy, equals the source (a killed run counts whole or not at all), and now and then the
    Delta tables are merged and compared too; a final rerun repairs a damaged table; no temporary
    slot is left, and no more runs than the next run deletes."""
    schema = "killed"
    rng = random.Random(20261125)
    workload = Workload(pg.dsn, schema, seed=77)
    workload.create()
    workload.populate(40)
    workload.conn.execute(f"INSERT INTO {schema}.bag SELECT g, 'bulk', g, NULL, NULL FROM generate_series(1, 120000) g")
    config = workload_config(pg.dsn, tmp_path, schema, workload, ["kinds", "docs", "bag", "orders"])
    docs, bag = workload.qualified("docs"), workload.qualified("bag")
    environ = {**os.environ, DSN_VARIABLE: pg.dsn}
    command = [sys.executable, "-m", "cdc_assets", "snapshot", docs, bag, "-c", str(config.path)]
    points = ["copy-chunk:1", "copy-chunk:2", "copy-chunk:3", "copy-complete:1", "copy-complete:2", "copy-announced:1"]
    session = spark.newSession()
    kills: list[str] = []
    with fast_spark(session):
        setup(config)
        drain(config, wait=True)
        apply_tables(config, session)
        while len(kills) < KILLS or len(set(kills)) < 3:  # at least three kinds of kill point
            with running_load(workload):
                if rng.random() < 0.5:
                    point = rng.choice(points)
                    done = subprocess.run(command, env={**environ, FAULT: point}, capture_output=True, timeout=300)
                    returncode = done.returncode
                else:
                    point = "a random moment"
                    process = subprocess.Popen(command, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                    try:
                        process.wait(timeout=rng.uniform(0.5, 6.0))  # fault injection at a random moment
                    except subprocess.TimeoutExpired:
                        process.kill()
                    returncode = process.wait()
            if returncode == -signal.SIGKILL:
                kills.append(point)
            else:
                assert returncode == 0, f"snapshot exited {returncode}"
            drain(config, wait=True)
            assert_mirrors(config.changelog.path, pg.dsn, [str(t.name) for t in config.tables])  # the log replayed
            if len(kills) % 4 == 1:  # and now and then merged, whatever the kills left
                applied = apply_tables(config, session)
                problems = report(compare_all(config, pg.dsn, None))
                checkpoint = ChangeLogReader(changelog_store(config)).require_checkpoint()
                assert not problems, (
                    f"after kills at {kills}: applied {[r.summary() for r in applied]}; checkpoint"
                    f" {checkpoint.lsn:X}, {bag}: {checkpoint.tables.get(bag)}\n{problems}"
                )
        workload.touch_all()
        drain(config, wait=True)
        apply_tables(config, session)
        damage(session, config.target_path(config.table(docs)), "id")
        with running_load(workload):
            done = subprocess.run(command, env=environ, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        drain(config, wait=True)
        apply_tables(config, session)
        problems = report(compare_all(config, pg.dsn, session))
        assert not problems, problems
    print(f"killed at: {kills}")
    assert len(kills) >= KILLS and len(set(kills)) >= 3, kills
    wait_until(
        lambda: pg.execute("SELECT slot_name::text FROM pg_replication_slots") == [(schema,)],
        timeout=60,
        what="the killed copies' temporary slots gone",
    )
    for table in (
        docs,
        bag,
    ):  # the last run and those the next run deletes: the one applied before, one never announced
        runs = list((Path(config.changelog.path) / "snapshots" / table).iterdir())
        assert 1 <= len(runs) <= 3, runs
    workload.close()
