"""The distributed path: ``cdc-assets sync`` applying on a real Spark standalone cluster.

A master and a worker are started from pip's pyspark (``spark-class …deploy.master.Master`` /
``…deploy.worker.Worker``, ``SPARK_HOME`` = the pyspark package) on free loopback ports. The
worker has no Delta jars of its own: the CLI's driver resolves ``spark.jars.packages`` and ships
the jars to the executor, which is what happens on any cluster that was not built with Delta.
The CLI runs as a subprocess with ``spark.master: spark://127.0.0.1:PORT`` (so it starts its own
driver; the shared local ``spark`` fixture is not used), twice: the first sync writes the Delta
tables from the snapshot and a round of changes, the second merges a round with updates, deletes
and a primary-key change into the existing tables. After each, the Delta tables (read with
delta-rs) equal the source, one of them through a consumer-side row filter. The master's and the
worker's JSON status and the executor's own log prove that the tasks ran on the worker.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyspark
import pytest

from cdc_assets.apply.session import delta_package
from cdc_assets.config import load_config
from cdc_sandbox.pgcluster import free_port
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.database import Database
from tests.support.mirror_diff import assert_delta_equals_source
from tests.support.rows import split_metadata

pytestmark = pytest.mark.slow  # not in the quick tier

SPARK_HOME = Path(pyspark.__file__).resolve().parent
TABLES = {"public.customers": None, "public.orders": "status <> 'draft'"}  # table -> row filter
APP_NAME = "cdc-assets"  # the CLI's Spark application name (session.spark_session's default)


def _get_json(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=5) as response:
        return json.loads(response.read().decode())


def _wait_for(what: str, probe: Callable[[], Any], timeout_s: float, on_timeout: Callable[[], str]) -> Any:
    """Poll ``probe`` until it returns something truthy (connection errors count as not yet)."""
    deadline = time.monotonic() + timeout_s
    last_error: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = probe()
            if value:
                return value
        except (OSError, urllib.error.URLError, ValueError) as error:
            last_error = error
        time.sleep(0.25)
    raise AssertionError(
        f"timed out after {timeout_s:.0f} s waiting for {what} (last error: {last_error})\n{on_timeout()}"
    )


def _tail(path: Path, lines: int = 40) -> str:
    if not path.exists():
        return f"({path} does not exist)"
    return f"--- {path} ---\n" + "\n".join(path.read_text(errors="replace").splitlines()[-lines:])


@dataclass
class StandaloneCluster:
    """A Spark standalone master and one worker, each in its own process group."""

    folder: Path
    master_port: int = field(default_factory=free_port)
    master_ui_port: int = field(default_factory=free_port)
    worker_port: int = field(default_factory=free_port)
    worker_ui_port: int = field(default_factory=free_port)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"spark://127.0.0.1:{self.master_port}"

    @property
    def work_dir(self) -> Path:
        return self.folder / "worker-work"

    def master_status(self) -> Any:
        return _get_json(f"http://127.0.0.1:{self.master_ui_port}/json/")

    def worker_status(self) -> Any:
        return _get_json(f"http://127.0.0.1:{self.worker_ui_port}/json/")

    def logs(self) -> str:
        return "\n".join(_tail(self.folder / f"{name}.log") for name in ("master", "worker"))

    def environment(self) -> dict[str, str]:
        env = {**os.environ, "SPARK_HOME": str(SPARK_HOME), "SPARK_LOCAL_IP": "127.0.0.1"}
        # No REST submission server (it would take the fixed port 6066); daemons keep to loopback.
        env["SPARK_MASTER_OPTS"] = "-Dspark.master.rest.enabled=false"
        env["SPARK_WORKER_OPTS"] = "-Dspark.worker.cleanup.enabled=false"
        env["PYSPARK_PYTHON"] = sys.executable
        return env

    def _spawn(self, name: str, *args: str) -> None:
        log = (self.folder / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [str(SPARK_HOME / "bin" / "spark-class"), *args],
            env=self.environment(),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # its own process group, ended as a whole
        )
        log.close()
        self.processes.append(process)

    def start(self) -> None:
        self.work_dir.mkdir(parents=True)
        self._spawn(
            "master",
            "org.apache.spark.deploy.master.Master",
            "--host", "127.0.0.1",
            "--port", str(self.master_port),
            "--webui-port", str(self.master_ui_port),
        )  # fmt: skip
        self._spawn(
            "worker",
            "org.apache.spark.deploy.worker.Worker",
            "--host", "127.0.0.1",
            "--port", str(self.worker_port),
            "--webui-port", str(self.worker_ui_port),
            "--cores", "2",
            "--memory", "2g",
            "--work-dir", str(self.work_dir),
            self.url,
        )  # fmt: skip

        def registered() -> bool:
            for process in self.processes:
                if process.poll() is not None:
                    raise AssertionError(f"a Spark daemon exited with {process.returncode}\n{self.logs()}")
            status = self.master_status()
            return status.get("status") == "ALIVE" and any(w["state"] == "ALIVE" for w in status["workers"])

        _wait_for("the worker to register with the master", registered, 120, self.logs)

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGTERM)
                except ProcessLookupError:
                    continue
        for process in self.processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[StandaloneCluster]:
    spark = StandaloneCluster(tmp_path / "spark")
    spark.folder.mkdir()
    try:
        spark.start()
        yield spark
    finally:
        spark.stop()
    assert all(p.poll() is not None for p in spark.processes), "a Spark daemon outlived the test"


def _cli(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    script = Path(sys.executable).parent / "cdc-assets"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "cdc_assets"]
    started = time.monotonic()
    result = subprocess.run([*command, *args], env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    print(f"cdc-assets {' '.join(args)}: {time.monotonic() - started:.1f} s\n{result.stdout}{result.stderr[-3000:]}")
    assert result.returncode == 0, (
        f"cdc-assets {' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr[-6000:]}"
    )
    return result


def _assert_delta_equals_source(db: Database, config: Path) -> dict[str, int]:
    """Every Delta table equals its source (after its row filter), every row with its LSN;
    returns the row counts."""
    counts = {}
    with db.connect() as conn:
        read = assert_delta_equals_source(conn, load_config(config, environ={DSN_VARIABLE: db.dsn}))
    for table, rows in read.items():
        delta, meta = split_metadata(rows)
        assert all(m.get("_cdc_lsn") is not None for m in meta), f"{table}: rows without their LSN"
        counts[table] = len(delta)
    return counts


def test_sync_on_standalone_cluster(pg: Database, tmp_path: Path, cluster: StandaloneCluster) -> None:
    pg.execute(
        "CREATE TABLE customers (id int PRIMARY KEY, name text NOT NULL, email text, tier text);"
        " CREATE TABLE orders (id bigint PRIMARY KEY, customer_id int, status text NOT NULL,"
        "   total numeric(12,2), placed timestamptz, note text);"
        " INSERT INTO customers SELECT g, 'customer ' || g, 'c' || g || '@example.com', 'basic'"
        "   FROM generate_series(1, 300) g;"
        " INSERT INTO orders SELECT g, g % 300 + 1, CASE WHEN g % 5 = 0 THEN 'draft' ELSE 'placed' END,"
        "   g * 1.25, timestamptz '2026-01-01 00:00:00+00' + g * interval '1 minute', NULL"
        "   FROM generate_series(1, 800) g"
    )
    folder = tmp_path / "pipeline"
    config = write_config(
        folder,
        {table: ({"row_filter": f} if f else {}) for table, f in TABLES.items()},
        spark={
            "master": cluster.url,
            "conf": {
                "spark.driver.host": "127.0.0.1",
                "spark.driver.bindAddress": "127.0.0.1",
                "spark.driver.memory": "1g",
                "spark.executor.memory": "1g",
                "spark.executor.cores": "2",
                "spark.cores.max": "2",
                "spark.ui.enabled": "false",
                "spark.sql.shuffle.partitions": "4",
                "spark.default.parallelism": "2",
                "spark.databricks.delta.snapshotPartitions": "2",
            },
        },
    )
    env = {**cluster.environment(), DSN_VARIABLE: pg.dsn, "CDC_CONFIG": str(config)}
    env.pop("SPARK_MASTER_OPTS")
    env.pop("SPARK_WORKER_OPTS")

    _cli("setup", env=env, cwd=folder)
    with pg.connect() as conn:  # round 1: inserts, updates (into and out of the filter), deletes
        conn.execute("INSERT INTO customers SELECT g, 'new ' || g, NULL, 'gold' FROM generate_series(301, 360) g")
        conn.execute("UPDATE customers SET tier = 'silver', email = upper(email) WHERE id % 7 = 0")
        conn.execute("DELETE FROM customers WHERE id BETWEEN 20 AND 29")
        conn.execute("UPDATE orders SET status = 'placed', note = 'confirmed' WHERE id % 10 = 0")  # draft -> placed
        conn.execute("UPDATE orders SET status = 'draft' WHERE id % 11 = 0 AND status = 'placed'")  # placed -> draft
        conn.execute("DELETE FROM orders WHERE id % 13 = 0")
        with conn.transaction():
            conn.execute(
                "INSERT INTO orders VALUES (5001, 1, 'placed', 10.50, now(), 'one'), (5002, 2, 'draft', 3, now(), NULL)"
            )
            conn.execute("UPDATE orders SET total = total + 1 WHERE id IN (5001, 5002)")
    first = _cli("sync", env=env, cwd=folder)
    assert "drained" in first.stdout, first.stdout
    counts = _assert_delta_equals_source(pg, config)
    assert counts["public.customers"] == 350, counts

    with pg.connect() as conn:  # round 2: key changes, a delete of a changed key, mixed transactions
        conn.execute("UPDATE customers SET id = id + 10000, name = name || ' (moved)' WHERE id IN (3, 4, 5)")
        conn.execute("DELETE FROM customers WHERE id = 10004")
        with conn.transaction():
            conn.execute("UPDATE orders SET id = id + 100000 WHERE id IN (1, 2, 3)")  # key change
            conn.execute("UPDATE orders SET note = 'moved' WHERE id = 100001")
            conn.execute("DELETE FROM orders WHERE id = 100002")
            conn.execute("INSERT INTO orders VALUES (6001, 9, 'placed', 99.99, now(), 'late')")
        conn.execute("UPDATE orders SET status = 'shipped' WHERE status = 'placed' AND id % 4 = 1")
    _cli("sync", env=env, cwd=folder)
    counts = _assert_delta_equals_source(pg, config)
    assert counts["public.customers"] == 349, counts

    # The work ran on the cluster: both syncs registered with the master as applications that
    # finished, each got an executor on the worker, and the executor ran tasks with Delta's jars
    # fetched from the driver.
    master = cluster.master_status()
    apps = [app for app in master["completedapps"] + master["activeapps"] if app["name"] == APP_NAME]
    assert len(apps) == 2, f"expected the two syncs as applications of the master: {json.dumps(master, indent=1)}"
    assert all(app["state"] == "FINISHED" for app in apps), apps
    assert [w["state"] for w in master["workers"]] == ["ALIVE"], master["workers"]
    worker = cluster.worker_status()
    executors = {e["appid"] for e in worker["finishedexecutors"] + worker["executors"]}
    assert {app["id"] for app in apps} <= executors, f"the worker ran no executor for {apps}: {worker}"
    jar = delta_package().split(":")[1]  # delta-spark_4.2_2.13
    for app in apps:
        logs = sorted((cluster.work_dir / app["id"]).glob("*/stderr"))
        assert logs, f"no executor log for {app['id']} under {cluster.work_dir}"
        text = "\n".join(log.read_text(errors="replace") for log in logs)
        assert "Finished task" in text, f"the executor of {app['id']} finished no task:\n{text[-3000:]}"
        assert jar in text, f"the executor of {app['id']} did not fetch {jar} from the driver:\n{text[-3000:]}"
