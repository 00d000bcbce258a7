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
* **a light write load touching every table**, twice (the Spark server's first merges, its JIT
  cold; then the same again): one transaction per table (an update and an insert). Per table, the
  time from the drain that brought it (the moment every table's entry in the change log's
  checkpoint has moved) to its merge being requested and to its Delta table holding the load's
  changes (the mirror's materialization that reports it, read from the Dagster instance every
  5 s; each table's Delta log is checked once at the end).

  ``--merges sensors`` (the defaults): the drain sensor (``drain_lag_bytes: 1``, every 30 s) starts
  a drain run, and the merge sensor (every 30 s) requests a merge run per table — requested at
  the run's creation. ``--merges drain``: the settings the README recommends for many tables — a
  drain run that follows the stream (``drain.follow_seconds: 3600``, ``commit_seconds: 2``) and
  merges as it goes (``schedule.merge_with_drain``, ``spark.parallel_merges: 4``), the merge
  sensor looking every 300 s (it only catches up what a failed run left and keeps idle mirrors
  fresh), maintenance of every table nightly (``warehouse.maintenance.cron: 0 3 * * *``) instead
  of hourly — a table's merge is requested by that run as the batch that brought it is durable.

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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import _common as common

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, load_config
from cdc_assets.lsn import parse_lsn
from cdc_sandbox.pgcluster import free_port
from tests.support.browser import Browser

SLOT = "many_slot"
READY_TIMEOUT_S = 900.0
SETTLE_TIMEOUT_S = 1800.0
POLL_S = 5.0
ROUNDS = 2  # the Spark server's first merges (its JIT cold), then the same load again
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


def write_load(dsn: str, count: int, number: int) -> float:
    """Round ``number`` of the load: one transaction per table (an update, an insert); returns when
    the last committed (s since 1970)."""
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        for name in table_names(count):
            with conn.transaction():
                conn.execute(f"UPDATE {name} SET v = v + 1 WHERE id = 1")
                conn.execute(f"INSERT INTO {name} VALUES ({100 + number}, 100, 'new')")
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
            "freshness_minutes": 60,
        },
        "tables": {name: {} for name in table_names(count)},
    }
    if merges == "drain":  # the settings README.md recommends for many tables
        document["drain"] = {"follow_seconds": 3600, "commit_seconds": 2}
        document["schedule"] |= {"merge_with_drain": True, "merge_check_seconds": 300}
        document["warehouse"]["maintenance"] = {"cron": "0 3 * * *"}  # one nightly run over every table
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


@contextmanager
def dagster_instance(home: Path) -> Iterator[Any]:
    os.environ["DAGSTER_HOME"] = str(home)
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        yield instance


def run_records(home: Path) -> list[Any]:
    with dagster_instance(home) as instance:
        return list(instance.get_run_records())


def merges_reported(instance: Any, config: Config, logged: dict[str, Any], known: set[str]) -> dict[str, float]:
    """The tables (but ``known``) whose mirror's latest materialization reports an applied LSN
    holding their entry in ``logged``, and when it was logged — one query for every mirror: the
    Delta logs are read once at the end, not polled (300 tables read every 2 s took half a core)."""
    import dagster as dg

    keys = {str(t.name): dg.AssetKey(["delta", t.name.schema, t.name.name]) for t in config.tables}
    events = instance.get_latest_materialization_events(list(keys.values()))
    found: dict[str, float] = {}
    for name, key in keys.items():
        event = events.get(key)
        if name in known or event is None or event.asset_materialization is None:
            continue
        applied = event.asset_materialization.metadata.get("applied_lsn")
        text = str(applied.value) if applied is not None else "none"
        if text != "none" and logged[name].held_by(parse_lsn(text)):
            found[name] = event.timestamp
    return found


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
        rounds = [load_round(config, cluster.dsn(), work, args.tables, number) for number in range(ROUNDS)]
        records = run_records(work / "dagster_home")
        for process in reversed(processes):
            common.stop(process)
        processes.clear()
        return {
            "tables": args.tables,
            "merges": args.merges,
            "first_round_of_merges_s": round(first_round_s, 1),
            "code_location_load_s": round(load_s, 1),
            "asset_graph_s": round(graph_s, 1),
            "mirror_group_graph_s": round(group_s, 1),
            "load_rounds": rounds,
            "runs": len(records),
            "work": str(work),
        }
    finally:
        for process in reversed(processes):
            common.stop(process)
        cluster.stop()


def load_round(config: Config, dsn: str, work: Path, count: int, number: int) -> dict[str, Any]:
    """One write load touching every table, and per table the seconds from the drain that brought
    it to its merge being requested and to its Delta table holding it."""
    reader = ChangeLogReader(changelog_store(config))
    before = reader.require_checkpoint().tables
    written_at = write_load(dsn, count, number)

    def drained() -> bool:
        tables = reader.require_checkpoint().tables
        return all(tables[name].last_change_lsn > state.last_change_lsn for name, state in before.items())

    drained_s = wait(drained, SETTLE_TIMEOUT_S, "the drain of the load")
    drained_at = time.time()
    print(f"[many] round {number}: the load drained {drained_s:.0f} s after its last commit", flush=True)
    logged = reader.require_checkpoint().tables
    merged_at: dict[str, float] = {}
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    with dagster_instance(work / "dagster_home") as instance:
        while len(merged_at) < count and time.monotonic() < deadline:
            merged_at |= merges_reported(instance, config, logged, set(merged_at))
            time.sleep(POLL_S)
    unmerged = [n for n in merged_at if not logged[n].held_by(table_applied_lsn(config, config.table(n)))]
    if unmerged:
        raise RuntimeError(f"reported merged, but the Delta table does not hold the load: {unmerged}")
    requested: dict[str, float] = {}
    for record in run_records(work / "dagster_home"):
        tags, created = record.dagster_run.tags, record.create_timestamp.timestamp()
        if "cdc/table" in tags and created >= written_at:  # a table's merge run
            tables, at = [tags["cdc/table"]], created
        elif "cdc/merges" in tags and (record.end_time is None or record.end_time >= written_at):
            tables, at = list(merged_at), max(created, drained_at)  # a drain run merges what it drains
        else:
            continue
        for name in tables:
            requested[name] = min(requested.get(name, at), at)
    merge_lags = [merged_at[n] - drained_at for n in merged_at]
    print(
        f"[many] round {number}: {len(merged_at)} of {count} merged, the last {max(merge_lags, default=0):.0f} s"
        " after the drain",
        flush=True,
    )
    return {
        "drain_after_load_s": round(drained_s, 1),
        "merges_requested": len(requested),
        "request_after_drain_s": _spread([requested[n] - drained_at for n in requested]),
        "merged": len(merged_at),
        "merged_after_drain_s": _spread(merge_lags),
    }


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
    common.report_result(args.out, "many_tables.json", measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
