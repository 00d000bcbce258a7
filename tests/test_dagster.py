"""The Dagster code location (``dagster_project``) against a real PostgreSQL and the test run's
one Spark session: loading (``dg check defs`` / ``dg list defs``), schedule-driven drains and
sensor-driven merges, the metadata they record, pools and the run queue, the rebuild and history
backfills, and the parity and lag checks.

Most tests share one module-scoped pipeline (:func:`env`: a database, its change log, Delta tables
and a persistent Dagster instance) so Spark work stays small; each test brings the pipeline to the
state it needs (:func:`sync`) and leaves its tables equal to their sources. The run-queue tests use
their own database and instance.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from collections.abc import Iterator
from datetime import date, datetime, time, timedelta, timezone
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dagster as dg
import pyarrow as pa
import pytest
import yaml
from dagster._core.execution.api import create_execution_plan
from dagster._core.instance.config import dagster_instance_config
from dagster._core.remote_representation.external_data import RepositorySnap
from dagster._core.run_coordinator import SubmitRunContext
from dagster._core.test_utils import freeze_time
from dagster._daemon.monitoring.concurrency import execute_concurrency_slots_iteration
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import QueuedRunCoordinatorDaemon
from dagster._serdes import serialize_value
from delta.tables import DeltaTable

from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.config import load_config
from cdc_assets.errors import ConfigError
from cdc_assets.lsn import format_lsn
from cdc_assets.setup import setup
from cdc_assets.source import DrainLock
from dagster_project.assets import CHANGELOG_KEY, REBUILD_KEY, build_history_asset, history_key, mirror_key
from dagster_project.demo.run import DAGSTER_YAML as DEMO_INSTANCE_YAML
from dagster_project.settings import load_settings
from tests.conftest import Database
from tests.support.dagster_env import (
    DDL,
    DSN_VARIABLE,
    ROOT,
    SLOT,
    TABLES,
    DagsterEnv,
    ThreadRunLauncher,
    load_code_location,
    write_config,
)
from tests.support.delta_read import canonical, difference, rust_table
from tests.support.oracle import replay, to_python
from tests.support.pipeline import wait_until

CUSTOMERS, ORDERS, NOTES = TABLES
SECRET_DSN = "postgresql://cdc_reader:Sup3r-S3cret-Pw@db.example.internal:5432/shop"
DEMO_INSTANCE = yaml.safe_load(DEMO_INSTANCE_YAML)
DEPLOY = ROOT / "deploy"
MIRROR_KEYS = {t: dg.AssetKey(["delta", *t.split(".")]) for t in TABLES}

# Round 1 leaves public.notes idle; round 2 leaves public.orders idle. Every statement changes
# one row, so the change records per table are the statements per table.
ROUND_1 = [
    [
        "INSERT INTO public.customers VALUES (6, 'customer 6', 'bronze', DATE '2024-02-01')",
        "INSERT INTO public.orders VALUES (7, 6, 'draft', 70)",  # filtered out
    ],
    [
        "UPDATE public.customers SET tier = 'gold' WHERE id = 1",
        "UPDATE public.orders SET status = 'paid' WHERE id = 3",  # moves into the row filter
        "UPDATE public.orders SET status = 'draft' WHERE id = 2",  # moves out of it
    ],
    [
        "DELETE FROM public.customers WHERE id = 5",
        "DELETE FROM public.orders WHERE id = 4",
        "INSERT INTO public.customers VALUES (7, 'customer 7', 'silver', DATE '2024-02-02')",
        "INSERT INTO public.orders VALUES (8, 7, 'paid', 80)",
    ],
]
ROUND_1_CHANGES = {CUSTOMERS: 4, ORDERS: 5}
ROUND_1_MERGED = {CUSTOMERS: (2, 1, 1), ORDERS: (2, 0, 2)}  # inserted, updated, deleted in Delta
ROUND_2 = [
    ["UPDATE public.customers SET name = 'Customer Two' WHERE id = 2", "INSERT INTO public.notes VALUES (4, 'note 4')"],
    ["UPDATE public.notes SET body = 'edited' WHERE id = 1", "DELETE FROM public.notes WHERE id = 2"],
]
ROUND_2_CHANGES = {CUSTOMERS: 1, NOTES: 3}
ROUND_2_MERGED = {CUSTOMERS: (0, 1, 0), NOTES: (1, 1, 1)}


# -- fixtures and helpers ---------------------------------------------------------------------------


def create_source(db: Database, folder: Path) -> None:
    """The three tables with rows, the configuration file, and ``cdc-assets setup``."""
    with db.connect() as conn:
        conn.execute(DDL)
    write_config(folder / "cdc.yaml")
    setup(load_config(folder / "cdc.yaml", environ={DSN_VARIABLE: db.dsn}))


@pytest.fixture(scope="module")
def env(pg_module: Database, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterEnv]:
    """The shared pipeline: set up, nothing merged yet; the code location loaded from
    ``$CDC_CONFIG`` with the DSN in ``$CDC_SOURCE_DSN``; a persistent instance with the demo's
    instance settings (pools, run monitoring)."""
    folder = tmp_path_factory.mktemp("dagster")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CDC_CONFIG", str(folder / "cdc.yaml"))
        patch.setenv(DSN_VARIABLE, pg_module.dsn)
        create_source(pg_module, folder)
        with dg.instance_for_test(overrides=DEMO_INSTANCE) as instance:
            yield DagsterEnv(pg_module, folder, instance)


def tick_time(minute: int) -> datetime:
    return datetime(2026, 1, 5, 12, minute, tzinfo=timezone.utc)


def requested(ticks: dict[str, Any]) -> set[str]:
    return {table for table, tick in ticks.items() if tick.run_requests}


def merge_requested(env: DagsterEnv, ticks: dict[str, Any]) -> dict[str, dg.ExecuteInProcessResult]:
    """Execute every run request of ``ticks``; each run's mirror materialization, by table."""
    results = {}
    for table, tick in ticks.items():
        for request in tick.run_requests:
            results[table] = env.execute_request(tick, request)
    return results


def sync(env: DagsterEnv, minute: int) -> dict[str, dg.ExecuteInProcessResult]:
    """A scheduled drain, then the merges the sensors request."""
    env.run_schedule(tick_time(minute))
    return merge_requested(env, env.evaluate_sensors())


def materialization(result: dg.ExecuteInProcessResult, key: dg.AssetKey) -> dict[str, Any]:
    events = [e for e in result.get_asset_materialization_events() if e.asset_key == key]
    assert len(events) == 1, events
    return {k: v.value for k, v in events[0].materialization.metadata.items()}


def drain_metadata(result: dg.ExecuteInProcessResult) -> dict[str, Any]:
    return materialization(result, CHANGELOG_KEY)


def counts(metadata: dict[str, Any]) -> tuple[int, int, int]:
    return metadata["inserted"], metadata["updated"], metadata["deleted"]


def check_results(result: dg.ExecuteInProcessResult) -> dict[tuple[str, str], Any]:
    """Asset check evaluations by (table, check name)."""
    return {(".".join(e.asset_key.path[1:]), e.check_name): e for e in result.get_asset_check_evaluations()}


def dg_command(*args: str, config: Path, dsn: str | None = None) -> subprocess.Popen[str]:
    environ = {**os.environ, "CDC_CONFIG": str(config)}
    environ.pop(DSN_VARIABLE, None)
    if dsn is not None:
        environ[DSN_VARIABLE] = dsn
    return subprocess.Popen(
        ["dg", *args], cwd=ROOT, env=environ, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def expected_keys() -> dict[str, set[str]]:
    return {
        "assets": {"cdc/changelog", "cdc/rebuild"}
        | {f"delta/{t.replace('.', '/')}" for t in TABLES}
        | {f"history/{t.replace('.', '/')}" for t in TABLES},
        "checks": {f"delta/{t.replace('.', '/')}:{check}" for t in TABLES for check in ("parity", "lag")},
        "sensors": {f"cdc_merge__{t.replace('.', '__')}" for t in TABLES},
    }


# -- 1. loading -------------------------------------------------------------------------------------


def test_code_location_loads_with_dg_and_lists_its_definitions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    custom = write_config(tmp_path / "custom" / "cdc.yaml", cron="*/7 * * * *")
    literal = write_config(tmp_path / "literal" / "cdc.yaml", dsn=SECRET_DSN)
    default = write_config(tmp_path / "default" / "cdc.yaml")
    # The three dg commands run side by side (each loads the code location in its own process).
    check = dg_command("check", "defs", config=custom, dsn=SECRET_DSN)
    listing = dg_command("list", "defs", "--json", config=custom, dsn=SECRET_DSN)
    refused = dg_command("check", "defs", config=literal)
    outputs = {name: process.communicate(timeout=240) for name, process in
               (("check", check), ("list", listing), ("refused", refused))}  # fmt: skip

    out, err = outputs["check"]
    assert check.returncode == 0, out + err
    assert "All definitions loaded successfully" in out + err

    out, err = outputs["list"]
    assert listing.returncode == 0, err
    listed = json.loads(out)
    expected = expected_keys()
    assert {a["asset_key"] for a in listed["assets"]} == expected["assets"]
    assert {c["key"] for c in listed["asset_checks"]} == expected["checks"]
    assert {s["name"] for s in listed["sensors"]} == expected["sensors"]
    assert listed["schedules"] == [{"name": "cdc_drain_schedule", "cron_schedule": "*/7 * * * *"}]
    assert {r["name"] for r in listed["resources"]} == {"source", "spark"}
    assert SECRET_DSN not in out and "Sup3r-S3cret" not in out

    # A literal DSN in the file is refused, loudly, without echoing it.
    out, err = outputs["refused"]
    assert refused.returncode != 0
    assert "source.dsn must be an environment variable reference" in out + err
    assert "Sup3r-S3cret" not in out + err

    # In-process, through the same entry point: the default cron, the resources, the pools.
    monkeypatch.setenv("CDC_CONFIG", str(default))
    monkeypatch.setenv(DSN_VARIABLE, SECRET_DSN)
    defs = load_code_location()
    dg.Definitions.validate_loadable(defs)
    assert defs.resolve_schedule_def("cdc_drain_schedule").cron_schedule == "*/5 * * * *"
    assert {s.name for s in defs.sensors} == expected["sensors"]
    specs = {"/".join(spec.key.path) for spec in defs.resolve_all_asset_specs()}
    assert specs == expected["assets"]
    source = defs.resources["source"]
    assert type(source.dsn) is dg.EnvVar and source.dsn.env_var_name == DSN_VARIABLE  # read at launch
    snapshot = serialize_value(RepositorySnap.from_def(defs.get_repository_def()))
    assert '{\\"env\\": \\"CDC_SOURCE_DSN\\"}' in snapshot  # the resource's config, as the UI gets it
    assert "Sup3r-S3cret" not in snapshot and "Sup3r-S3cret" not in repr(defs)

    monkeypatch.setenv("CDC_CONFIG", str(literal))
    with pytest.raises(ConfigError, match="must be an environment variable reference") as refusal:
        load_code_location()
    assert "Sup3r-S3cret" not in str(refusal.value)


# -- 2. schedule-driven drains, sensor-driven merges -----------------------------------------------


def test_schedule_drains_and_sensors_merge_only_tables_with_changes(env: DagsterEnv) -> None:
    # Right after setup every table has a snapshot to load: every sensor asks for a merge.
    drained = drain_metadata(env.run_schedule(tick_time(0)))
    assert drained["transactions"] == 0 and drained["changes"] == 0
    ticks = env.evaluate_sensors()
    assert requested(ticks) == set(TABLES)
    for table, tick in ticks.items():
        [request] = tick.run_requests
        assert request.run_key == f"{table}@{env.checkpoint_lsn()}"
        assert request.tags["cdc/table"] == table.replace(".", "__")
        assert tick.cursor == str(env.checkpoint_lsn())
    results = merge_requested(env, ticks)
    env.assert_mirrors()
    for table, result in results.items():
        metadata = materialization(result, MIRROR_KEYS[table])
        assert metadata["applied_lsn"] == format_lsn(env.checkpoint_lsn()) == format_lsn(env.applied(table))
        assert metadata["dagster/row_count"] == metadata["inserted"] == len(env.source_rows(table))
        assert metadata["delta_version"] == env.version(table)
        # A merge run brings its cheap lag check along, never the parity check (a full source scan).
        assert set(check_results(result)) == {(table, "lag")} and check_results(result)[(table, "lag")].passed

    for number, (transactions, changes, merged) in enumerate(
        ((ROUND_1, ROUND_1_CHANGES, ROUND_1_MERGED), (ROUND_2, ROUND_2_CHANGES, ROUND_2_MERGED)), start=1
    ):
        versions = {t: env.version(t) for t in TABLES}
        env.transactions(*transactions)
        drained = drain_metadata(env.run_schedule(tick_time(5 * number)))
        checkpoint = env.checkpoint_lsn()
        assert drained["transactions"] == len(transactions)
        assert {k.removeprefix("changes/"): v for k, v in drained.items() if k.startswith("changes/")} == changes
        assert drained["changes"] == sum(changes.values())
        assert drained["checkpoint_lsn"] == format_lsn(checkpoint)
        assert isinstance(drained["slot_lag_bytes"], int) and drained["slot_lag_bytes"] >= 0
        assert drained["wal_status"] in ("reserved", "extended")
        assert isinstance(drained["duration_s"], float) and drained["duration_s"] >= 0

        # Only the tables with new changes are requested; the idle one is up to date.
        ticks = env.evaluate_sensors()
        assert requested(ticks) == set(changes), {t: tick.skip_message for t, tick in ticks.items()}
        for table in set(TABLES) - set(changes):
            assert "up to date" in ticks[table].skip_message
        for table in changes:
            assert [r.run_key for r in ticks[table].run_requests] == [f"{table}@{checkpoint}"]
        # Evaluated again before the merges ran: the cursor holds the range already requested.
        again = env.evaluate_sensors()
        assert requested(again) == set()
        for table in changes:
            assert "already requested" in again[table].skip_message

        results = merge_requested(env, ticks)
        env.assert_mirrors()
        for table, result in results.items():
            metadata = materialization(result, MIRROR_KEYS[table])
            assert counts(metadata) == merged[table], (table, metadata)
            assert metadata["applied_lsn"] == drained["checkpoint_lsn"] == format_lsn(env.applied(table))
            assert metadata["delta_version"] == versions[table] + 1 == env.version(table)
            assert metadata["dagster/row_count"] == len(env.source_rows(table))
        for table in set(TABLES) - set(changes):
            assert env.version(table) == versions[table]  # not touched

        # Merged: even with a fresh cursor there is nothing to request.
        fresh = env.evaluate_sensors(fresh=True)
        assert requested(fresh) == set(), {t: tick.skip_message for t, tick in fresh.items()}

