"""What the merge sensors cost Dagster's daemon and code server: ``--tables`` idle tables with a
merge sensor each (``schedule.merge_sensors: per_table``), then the one shared sensor (``shared``),
under ``dagster-daemon run`` and a code server of its own (``dagster api grpc``, as deploy/'s
workspace has it: a daemon that starts its own code servers starts a new one every minute, loading
the code location again); no webserver, no Spark.

    python benchmarks/merge_sensors.py [--tables 300] [--minutes 5] [--warmup-minutes 2] [--pg 16]
                                       [--shapes per_table,shared] [--out merge-sensors-out]

On a fresh server: ``--tables`` small keyed tables (``benchmarks/many_tables.py``'s), ``cdc-assets
setup``, each Delta table marked applied up to the checkpoint with delta-rs (the apply's commit
marker: what the sensors read), so no merge is due. Per shape, the code server and
``dagster-daemon run`` with the instance settings of ``many_tables.py`` (sensors on 4 threads, ``merge_check_seconds: 30``); every
minute a ``cdc-assets drain`` (of writes to an unpublished table) moves the checkpoint on, as the
drains of a live deployment do, so each tick takes the "current" path and reports an idle mirror
now and then. After ``--warmup-minutes`` (every sensor's first ticks: a Delta read and a report
each), the CPU of the daemon and of the code server over ``--minutes``, and the ticks recorded meanwhile; with both shapes, the CPU seconds one more tick
costs (the difference of the two shapes' CPU over the difference of their ticks: the daemon's other
work — the run queue, the other daemons — counted once).

Output: ``merge_sensors.json`` and a summary on standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as common
import psutil
import psycopg
from many_tables import create_tables, table_names

from cdc_assets.changelog.checkpoint import require_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import load_config
from cdc_sandbox.pgcluster import free_port
from tests.support.applied_marker import mark_applied

CHECK_SECONDS = 30
DRAIN_EVERY_S = 60.0
READY_TIMEOUT_S = 300.0


def write_files(work: Path, tables: int, shape: str) -> dict[str, str]:
    document: dict[str, Any] = {
        "source": {"dsn": "${CDC_SOURCE_DSN}", "publication": "sensors_pub", "slot": "sensors_slot"},
        "changelog": {"path": "./changelog"},
        "warehouse": {"path": "./warehouse", "consistent_points": False},
        "schedule": {"drain_cron": "0 0 1 1 *", "merge_check_seconds": CHECK_SECONDS, "merge_sensors": shape},
        "tables": {name: {} for name in table_names(tables)},
    }
    (work / "cdc.yaml").write_text(json.dumps(document, indent=2), encoding="utf-8")  # JSON is YAML
    instance = {
        "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"},
        "sensors": {"use_threads": True, "num_workers": 4},
        "schedules": {"use_threads": True, "num_workers": 2},
        "telemetry": {"enabled": False},
    }
    home = work / "dagster_home"
    if home.exists():  # the second shape: a fresh instance
        for path in sorted(home.rglob("*"), reverse=True):
            path.unlink() if path.is_file() else path.rmdir()
        home.rmdir()
    return common.dagster_files(work, instance)


def write_unpublished(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO public.unpublished SELECT generate_series(1, 100)")


def cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def ticks_since(home: Path, since: float) -> int:
    os.environ["DAGSTER_HOME"] = str(home)
    import dagster as dg
    from dagster._core.scheduler.instigation import InstigatorType

    with dg.DagsterInstance.get() as instance:
        return sum(
            len(instance.get_ticks(state.instigator_origin_id, state.selector_id, after=since, limit=100_000))
            for state in instance.all_instigator_state(instigator_type=InstigatorType.SENSOR)
        )


def measure_shape(args: argparse.Namespace, work: Path, env: dict[str, str], shape: str) -> dict[str, Any]:
    env = {**env, **write_files(work, args.tables, shape)}
    port = free_port()
    workspace = {"load_from": [{"grpc_server": {"host": "127.0.0.1", "port": port, "location_name": "cdc_assets"}}]}
    (work / "workspace.yaml").write_text(json.dumps(workspace), encoding="utf-8")  # JSON is YAML
    server = ["dagster", "api", "grpc", "-m", "dagster_project.definitions", "-h", "127.0.0.1", "-p", str(port)]
    started = [common.started(server, env, work / f"code-server-{shape}.log", work)]
    try:
        common.wait_for_line(
            work / f"code-server-{shape}.log", "Started Dagster code server", started[0], READY_TIMEOUT_S
        )
        daemon_command = ["dagster-daemon", "run", "-w", str(work / "workspace.yaml")]
        started.append(common.started(daemon_command, env, work / f"daemon-{shape}.log", work))
        roles = {"daemon": psutil.Process(started[1].pid), "code server": psutil.Process(started[0].pid)}
        started_at = time.monotonic()
        next_drain = time.monotonic()
        window_start = started_at + args.warmup_minutes * 60
        window_end = window_start + args.minutes * 60
        before: dict[str, float] = {}
        since = 0.0
        while time.monotonic() < window_end:
            if not before and time.monotonic() >= window_start:
                before = {role: cpu_s(p) for role, p in roles.items()}
                since = time.time()
            if time.monotonic() >= next_drain:  # the slot moves on: the drain moves the checkpoint
                write_unpublished(env["CDC_SOURCE_DSN"])
                common.cdc(env, work, "drain")
                next_drain += DRAIN_EVERY_S
            time.sleep(1)
        after = {role: cpu_s(p) for role, p in roles.items()}
        seconds = args.minutes * 60
        cores = {role: round((after[role] - before[role]) / seconds, 3) for role in before}
        ticks = ticks_since(work / "dagster_home", since)
        return {
            "shape": shape,
            "sensors": args.tables if shape == "per_table" else 1,
            "cores": cores,
            "cores_total": round(sum(cores.values()), 3),
            "ticks": ticks,
            "ticks_per_sensor_minute": round(ticks / (args.tables if shape == "per_table" else 1) / args.minutes, 2),
        }
    finally:
        for process in reversed(started):
            common.stop(process)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="cdc-sensors-"))
    cluster = common.start_cluster(args.pg)
    try:
        create_tables(cluster.dsn(), args.tables)
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:  # no table of the publication
            conn.execute("CREATE TABLE public.unpublished (n int)")
        env = {**os.environ, "CDC_SOURCE_DSN": cluster.dsn()}
        write_files(work, args.tables, "per_table")
        common.cdc(env, work, "setup")
        config = load_config(work / "cdc.yaml", env)
        checkpoint = require_checkpoint(changelog_store(config)).lsn
        for name in table_names(args.tables):
            mark_applied(config, name, checkpoint)
        write_unpublished(cluster.dsn())
        shapes = {shape: measure_shape(args, work, env, shape) for shape in args.shapes.split(",")}
        result: dict[str, Any] = {"tables": args.tables, "minutes": args.minutes, "check_seconds": CHECK_SECONDS}
        if {"per_table", "shared"} <= shapes.keys():  # what one more tick costs, the daemon's other work aside
            table, shared = shapes["per_table"], shapes["shared"]
            extra_cpu_s = (table["cores_total"] - shared["cores_total"]) * args.minutes * 60
            result["cpu_s_per_extra_tick"] = round(extra_cpu_s / max(table["ticks"] - shared["ticks"], 1), 3)
        return result | {"shapes": list(shapes.values())}
    finally:
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tables", type=int, default=300)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--warmup-minutes", type=float, default=2.0)
    parser.add_argument("--pg", type=int, default=16)
    parser.add_argument("--shapes", default="per_table,shared")
    parser.add_argument("--out", default="merge-sensors-out")
    args = parser.parse_args()
    common.report_result(args.out, "merge_sensors.json", measure(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
