"""Hundreds of tables under the real Dagster daemon: ``dagster dev`` (daemon, webserver, code
server) on a code location of ``--tables`` configured tables, every run on one Spark Connect server.

    python benchmarks/many_tables.py [--tables 300] [--pg 16] [--merges sensors|drain]
                                     [--out many-tables-out]

On a fresh server: ``--tables`` small keyed tables (``public.t0001`` …, 5 rows each),
``cdc-assets spark-server`` (``local[2]``), ``cdc-assets setup`` and one ``cdc-assets apply`` —
**the first round of merges**, every table created over Spark Connect, timed. Then ``dagster dev``
with the instance settings of deploy/dagster.yaml that apply on one machine (a queued run
coordinator, pools of one, ``max_concurrent_runs: 8``, sensors and schedules on threads), and:

* **the code location**: seconds from ``dagster dev``'s start to the location loaded;
* **the asset graph**: headless Chromium opens the global asset lineage page (a node per asset
  group); seconds until it shows the groups with their assets counted, then the same for the
  mirrors' group's lineage (a node per mirror);
* **a light write load touching every table**: one transaction per table (an update and an
  insert). The drain sensor (``drain_lag_bytes: 1``, every 30 s) starts a drain; then, per table,
  the time from that drain's end to its merge being requested (the run's creation: a table
  sensor's request, or with ``--merges drain`` the drain run itself, which merges every table
  its drain brought changes to) and to its Delta table holding the load's changes (its applied
  LSN, read with delta-rs every 2 s).

Output: ``many_tables.json`` and a summary on standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import _common as common

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import load_config
from cdc_sandbox.pgcluster import free_port
from tests.support.browser import Browser

SLOT = "many_slot"
READY_TIMEOUT_S = 900.0
SETTLE_TIMEOUT_S = 1800.0
POLL_S = 2.0
LINEAGE_PAGE = "/asset-groups"
MIRROR_GROUP_PAGE = "/locations/dagster_project.definitions/asset-groups/mirror/lineage"


def table_names(count: int) -> list[str]:
    return [f"public.t{number:04d}" for number in range(1, count + 1)]


def create_tables(dsn: str, count: int) -> None:
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in table_names(count):
            conn.execute(f"CREATE TABLE {name} (id int PRIMARY KEY, v int NOT NULL, note text)")
            conn.execute(f"INSERT INTO {name} SELECT i, i, 'row ' || i FROM generate_series(1, 5) i")


def write_load(dsn: str, count: int) -> float:
    """One transaction per table; returns when the last committed (s since 1970)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in table_names(count):
            with conn.transaction():
                conn.execute(f"UPDATE {name} SET v = v + 1 WHERE id = 1")
                conn.execute(f"INSERT INTO {name} VALUES (100, 100, 'new')")
    return time.time()


def write_files(work: Path, server: str, count: int, merges: str) -> dict[str, str]:
    document: dict[str, Any] = {
        "source": {"dsn": "${CDC_SOURCE_DSN}", "publication": "many_pub", "slot": SLOT},
        "changelog": {"path": "./changelog"},
        "warehouse": {"path": "./warehouse"},
        "spark": {"remote": server, "conf": {"spark.sql.shuffle.partitions": "4"}},
        "schedule": {
            "drain_cron": "0 0 1 1 *",  # the drain sensor alone starts drains
            "drain_lag_bytes": 1,
            "drain_check_seconds": 30,
            "merge_check_seconds": 30,
            "merge_with_drain": merges == "drain",
            "freshness_minutes": 60,
        },
        "tables": {name: {} for name in table_names(count)},
    }
    (work / "cdc.yaml").write_text(json.dumps(document, indent=2), encoding="utf-8")  # JSON is YAML
    instance = {
        "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"},
        "concurrency": {"pools": {"default_limit": 1, "granularity": "run"}, "runs": {"max_concurrent_runs": 8}},
        "run_monitoring": {"enabled": True, "free_slots_after_run_end_seconds": 300},
        "sensors": {"use_threads": True, "num_workers": 4},
        "schedules": {"use_threads": True, "num_workers": 2},
        "telemetry": {"enabled": False},
        "nux": {"enabled": False},
    }
    return common.dagster_files(work, instance)


def location_loaded(url: str) -> bool:
    query = "{ workspaceOrError { ... on Workspace { locationEntries { loadStatus locationOrLoadError { __typename } } } } }"
    request = urllib.request.Request(
        f"{url}/graphql", json.dumps({"query": query}).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            entries = json.load(response)["data"]["workspaceOrError"]["locationEntries"]
    except OSError:
        return False
    return bool(entries) and all(
        e["loadStatus"] == "LOADED" and e["locationOrLoadError"]["__typename"] == "RepositoryLocation" for e in entries
    )


def wait(condition: Any, timeout_s: float, what: str) -> float:
    """Seconds until ``condition()`` holds."""
    started = time.monotonic()
    while not condition():
        if time.monotonic() - started > timeout_s:
            raise RuntimeError(f"{what}: not within {timeout_s:.0f} s")
        time.sleep(0.5)
    return time.monotonic() - started


def shown_in(browser: Browser, url: str, needles: tuple[str, ...]) -> float:
    """Seconds from opening ``url`` until the page shows every one of ``needles``."""
    started = time.monotonic()
    browser.open(url)
    browser.wait_for(*needles, timeout=READY_TIMEOUT_S)
    return time.monotonic() - started


def run_records(home: Path) -> list[Any]:
    os.environ["DAGSTER_HOME"] = str(home)
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        return list(instance.get_run_records())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cdc-many-"))
    cluster = common.start_cluster(args.pg)
    processes = []
    try:
        create_tables(cluster.dsn(), args.tables)
        port = free_port()
        env = {
            **os.environ,
            "CDC_SOURCE_DSN": cluster.dsn(),
            **write_files(work, f"sc://127.0.0.1:{port}", args.tables, args.merges),
        }
        server = [sys.executable, "-m", "cdc_assets", "spark-server", "--port", str(port), "--master", "local[2]"]
        processes.append(common.started(server, env, work / "spark-server.log", work))
        common.wait_for_line(work / "spark-server.log", "listening at", processes[-1], READY_TIMEOUT_S)
        common.cdc(env, work, "setup")
        first_round_s, _ = common.timed(lambda: common.cdc(env, work, "apply"))
        print(f"[many] first round of merges over {args.tables} tables: {first_round_s:.0f} s", flush=True)

        web = free_port()
        dagster = ["dagster", "dev", "-w", str(work / "workspace.yaml"), "-p", str(web)]
        processes.append(common.started(dagster, env, work / "dagster.log", work))
        url = f"http://127.0.0.1:{web}"
        load_s = wait(lambda: location_loaded(url), READY_TIMEOUT_S, "the code location loaded")
        print(f"[many] code location loaded in {load_s:.1f} s", flush=True)

        browser = Browser(work / "chromium")
        try:
            # the global lineage: one node per asset group, with its assets' status counts
            graph_s = shown_in(browser, url + LINEAGE_PAGE, ("Global asset lineage", "mirror", str(args.tables)))
            browser.screenshot(work / "asset-graph.png")
            # the mirrors' group: a node per mirror
            group_s = shown_in(browser, url + MIRROR_GROUP_PAGE, ("consistent_point", "Latest event", "Materialized"))
            browser.screenshot(work / "mirror-group.png")
        finally:
            browser.close()
        print(f"[many] asset graph shown in {graph_s:.1f} s, the mirrors' group in {group_s:.1f} s", flush=True)

        config = load_config(work / "cdc.yaml", env)
        reader = ChangeLogReader(changelog_store(config))
        before = reader.require_checkpoint().tables
        written_at = write_load(cluster.dsn(), args.tables)

        def drained() -> bool:
            tables = reader.require_checkpoint().tables
            return all(tables[name].last_change_lsn > state.last_change_lsn for name, state in before.items())

        drained_s = wait(drained, SETTLE_TIMEOUT_S, "the drain of the load")
        drained_at = time.time()
        print(f"[many] the load drained {drained_s:.0f} s after its last commit", flush=True)
        logged = reader.require_checkpoint().tables
        merged_at: dict[str, float] = {}
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while len(merged_at) < args.tables and time.monotonic() < deadline:
            for table in config.tables:
                name = str(table.name)
                if name not in merged_at and logged[name].held_by(table_applied_lsn(config, table)):
                    merged_at[name] = time.time()
            time.sleep(POLL_S)
        records = run_records(work / "dagster_home")
        requested: dict[str, float] = {}
        for record in records:
            created = record.create_timestamp.timestamp()
            if created < written_at:
                continue
            tags = record.dagster_run.tags
            tables = [tags["cdc/table"]] if "cdc/table" in tags else list(merged_at) if "cdc/merges" in tags else []
            for name in tables:
                requested[name] = min(requested.get(name, created), created)
        for process in reversed(processes):
            common.stop(process)
        processes.clear()
        request_lags = [requested[n] - drained_at for n in requested]
        merge_lags = [merged_at[n] - drained_at for n in merged_at]
        return {
            "tables": args.tables,
            "merges": args.merges,
            "first_round_of_merges_s": round(first_round_s, 1),
            "code_location_load_s": round(load_s, 1),
            "asset_graph_s": round(graph_s, 1),
            "mirror_group_graph_s": round(group_s, 1),
            "drain_after_load_s": round(drained_s, 1),
            "merges_requested": len(requested),
            "request_after_drain_s": _spread(request_lags),
            "merged": len(merged_at),
            "merged_after_drain_s": _spread(merge_lags),
            "runs": len(records),
            "work": str(work),
        }
    finally:
        for process in reversed(processes):
            common.stop(process)
        cluster.stop()


def _spread(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "max": None}
    return {"p50": round(statistics.median(values), 1), "max": round(max(values), 1)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=300)
    parser.add_argument("--pg", type=int, default=16)
    parser.add_argument("--merges", choices=("sensors", "drain"), default="sensors")
    parser.add_argument("--out", default="many-tables-out")
    args = parser.parse_args()
    result = {"machine": common.machine(), "code": common.code_version(), "result": measure(args)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    common.write_json(str(Path(args.out) / "many_tables.json"), result)
    print(json.dumps(result["result"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
