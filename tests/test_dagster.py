"""The Dagster code location (``dagster_project``) against a real PostgreSQL and the test run's
one Spark session: loading (``dg check defs`` / ``dg list defs``), schedule-driven drains and
sensor-driven merges, the metadata they record, pools and the run queue, the rebuild and history
backfills, and the parity and lag checks.

Most tests share one module-scoped pipeline (:func:`env`: a database, its change log, Delta tables
and a persistent Dagster instance) so Spark work stays small; each test brings the pipeline to the
state it needs (:meth:`DagsterEnv.sync`) and leaves its tables equal to their sources. The run-queue tests use
their own database and instance.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, date, datetime, time, timedelta
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import dagster as dg
import pytest
from dagster._core.execution.api import create_execution_plan
from dagster._core.instance.config import dagster_instance_config
from dagster._core.remote_origin import RegisteredCodeLocationOrigin, RemoteJobOrigin, RemoteRepositoryOrigin
from dagster._core.remote_representation.external_data import RepositorySnap
from dagster._core.run_coordinator import SubmitRunContext
from dagster._core.test_utils import create_run_for_test, freeze_time
from dagster._daemon.monitoring.concurrency import execute_concurrency_slots_iteration
from dagster._daemon.run_coordinator.queued_run_coordinator_daemon import (
    QueuedRunCoordinatorDaemon,
)
from dagster._serdes import serialize_value
from delta.tables import DeltaTable

from cdc_assets.apply.runner import rebuild_table
from cdc_assets.apply.table_files import table_files
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.config import load_config
from cdc_assets.errors import ConfigError
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.drain import drain
from cdc_assets.source import DrainLock
from cdc_assets.source.lock import TableWriteLock
from dagster_project.assets import HISTORY_START, history_path
from dagster_project.factory import build_definitions
from dagster_project.merge_verdict import TableCursor
from dagster_project.naming import Naming
from dagster_project.settings import load_settings
from tests.support.commit_time import commit_at
from tests.support.dagster_env import (
    DEMO_INSTANCE,
    DSN_VARIABLE,
    MIRROR_KEYS,
    ROOT,
    SLOT,
    TABLES,
    DagsterEnv,
    SensorTick,
    ThreadRunLauncher,
    commit_each,
    create_source,
    execute,
    load_code_location,
    materialization,
    requested,
    tick_time,
    write_dagster_config,
)
from tests.support.dagster_rounds import (
    ROUND_1,
    ROUND_1_CHANGES,
    ROUND_1_MERGED,
    ROUND_2,
    ROUND_2_CHANGES,
    ROUND_2_MERGED,
)
from tests.support.database import Database
from tests.support.mirror_diff import rust_table
from tests.support.pipeline import wait_until
from tests.support.rows import difference, multiset

NAMES = Naming()
CHANGELOG_KEY, REBUILD_KEY, POINT_KEY, VERIFY_KEY = NAMES.changelog, NAMES.rebuild, NAMES.consistent_point, NAMES.verify
history_key, maintenance_key = NAMES.history, NAMES.maintenance

CUSTOMERS, ORDERS, NOTES = TABLES
SECRET_DSN = "postgresql://cdc_reader:Sup3r-S3cret-Pw@db.example.internal:5432/shop"
DEPLOY = ROOT / "deploy"
QUEUE_SLOT = "cdc_queue_slot"


# -- fixtures and helpers ---------------------------------------------------------------------------


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


def publish_requested_point(env: DagsterEnv) -> dict[str, Any]:
    """One tick of the consistent point's sensor, which must request a run; that run executed as
    the daemon would; the point's materialization. A second tick finds nothing new."""
    sensor = env.defs.resolve_sensor_def("cdc_consistent_point")
    context = dg.build_sensor_context(instance=env.instance, definitions=env.defs)
    [request] = sensor.evaluate_tick(context).run_requests
    assert request.run_key == f"point@{env.checkpoint_lsn()}"
    result = env.execute_request(SensorTick("", sensor, [request], None, None), request)
    assert result.dagster_run.tags["cdc/point"] == SLOT
    again = sensor.evaluate_tick(context)
    assert not again.run_requests and "no new consistent point" in (again.skip_message or ""), again.skip_message
    return materialization(result, POINT_KEY)


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
        "assets": {"cdc/changelog", "cdc/snapshot", "cdc/rebuild", "cdc/verify", "cdc/consistent_point"}
        | {f"delta/{t.replace('.', '/')}" for t in TABLES}
        | {f"history/{t.replace('.', '/')}" for t in TABLES}
        | {f"maintenance/{t.replace('.', '/')}" for t in TABLES},
        "checks": {"cdc/changelog:slot_held_wal"}
        | {f"delta/{t.replace('.', '/')}:{check}" for t in TABLES for check in ("parity", "lag")},
        "sensors": {"cdc_consistent_point"} | {f"cdc_merges__{t.replace('.', '__')}" for t in TABLES},
        "schedules": {"cdc_drain_schedule", "cdc_maintain"},
    }


# -- 1. loading -------------------------------------------------------------------------------------


def test_code_location_loads_with_dg_and_lists_its_definitions(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    custom = write_dagster_config(tmp_path / "custom", schedule={"drain_cron": "*/7 * * * *"})
    literal = write_dagster_config(tmp_path / "literal", source={"dsn": SECRET_DSN})
    default = write_dagster_config(tmp_path / "default")
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
    assert {a.get("asset_key", a.get("key")) for a in listed["assets"]} == expected["assets"]  # `key` before dg 1.12.19
    assert {c["key"] for c in listed["asset_checks"]} == expected["checks"]
    assert {s["name"] for s in listed["sensors"]} == expected["sensors"]
    schedules = {s["name"]: s["cron_schedule"] for s in listed["schedules"]}
    assert set(schedules) == expected["schedules"] and schedules.pop("cdc_drain_schedule") == "*/7 * * * *"
    assert set(schedules.values()) == {"0 * * * *"}  # warehouse.maintenance.cron
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


def test_loading_the_code_location_reads_no_storage(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The change log and the warehouse in a bucket whose S3 endpoint accepts connections and closes
    them at once (any read fails): the code location loads, and nothing connected to the endpoint."""
    connections: list[str] = []
    with socket.create_server(("127.0.0.1", 0)) as endpoint:

        def refuse() -> None:
            with contextlib.suppress(OSError):  # the listener shut down: the test is over
                while True:
                    conn, peer = endpoint.accept()
                    connections.append(f"{peer[0]}:{peer[1]}")
                    conn.close()

        refuser = threading.Thread(target=refuse, daemon=True)
        refuser.start()
        storage = {
            "endpoint": f"http://127.0.0.1:{endpoint.getsockname()[1]}",
            "access_key_id": "k",
            "secret_access_key": "s",
        }
        config = write_dagster_config(
            tmp_path,
            changelog={"path": "s3://nowhere/changelog"},
            warehouse={"path": "s3://nowhere/warehouse"},
            storage=storage,
        )
        monkeypatch.setenv("CDC_CONFIG", str(config))
        monkeypatch.setenv(DSN_VARIABLE, SECRET_DSN)
        defs = load_code_location()
        dg.Definitions.validate_loadable(defs)
        RepositorySnap.from_def(defs.get_repository_def())  # what the code server sends the UI
        endpoint.shutdown(socket.SHUT_RDWR)  # ends the accept() it waits in
        refuser.join(timeout=10)
    assert not refuser.is_alive()
    assert not connections, f"loading the code location reached the storage: {connections}"
    assert {s.name for s in defs.sensors} == expected_keys()["sensors"]


# -- 2. schedule-driven drains, sensor-driven merges -----------------------------------------------


@pytest.mark.slow
def test_schedule_drains_and_sensors_merge_only_tables_with_changes(env: DagsterEnv) -> None:
    # Right after setup every table has a snapshot to load: every sensor asks for a merge.
    drained = drain_metadata(env.run_schedule(tick_time(0)))
    assert drained["transactions"] == 0 and drained["changes"] == 0
    ticks = env.evaluate_sensors()
    assert requested(ticks) == set(TABLES)
    for table, tick in ticks.items():
        [request] = tick.run_requests
        assert request.run_key == f"{table}@{env.checkpoint_lsn()}"
        assert TableCursor.from_json(json.loads(tick.cursor or "")).requested == env.checkpoint_lsn()
        assert request.job_name == f"cdc_merge__{table.replace('.', '__')}"
        assert env.defs.resolve_job_def(request.job_name).executor_def.name == "in_process"
    results = env.merge_requested(ticks)
    env.assert_delta_equals_source()
    for table, result in results.items():
        assert result.dagster_run.tags["cdc/table"] == table.replace(".", "__")  # the merge job's tag
        metadata = materialization(result, MIRROR_KEYS[table])
        assert metadata["applied_lsn"] == format_lsn(env.checkpoint_lsn()) == format_lsn(env.applied(table))
        assert metadata["dagster/row_count"] == metadata["inserted"] == len(env.source_rows(table))
        assert metadata["delta_version"] == env.version(table)
        # A merge run brings its cheap lag check along, never the parity check (a full source scan).
        assert set(check_results(result)) == {(table, "lag")} and check_results(result)[(table, "lag")].passed
    # Every mirror holds the checkpoint: the point's sensor requests a run that publishes it, once.
    point = publish_requested_point(env)
    assert point["lsn"] == format_lsn(env.checkpoint_lsn()) and point["lag_bytes"] == 0
    assert point["tables"] == {t: env.version(t) for t in TABLES}
    # The checkpoint moves on with no table changed: the same versions at a later position wait.
    published = env.checkpoint_lsn()
    env.db.execute("SELECT pg_logical_emit_message(false, 'cdc-test', 'tick')")
    env.run_schedule(tick_time(1))
    assert env.checkpoint_lsn() > published
    sensor = env.defs.resolve_sensor_def("cdc_consistent_point")
    idle = sensor.evaluate_tick(dg.build_sensor_context(instance=env.instance, definitions=env.defs))
    assert not idle.run_requests and "no table changed since the point at" in (idle.skip_message or "")

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
        for table in changes:
            assert [(r.run_key, r.job_name) for r in ticks[table].run_requests] == [
                (f"{table}@{checkpoint}", f"cdc_merge__{table.replace('.', '__')}")
            ]
        # Evaluated again before the merges ran: the cursor holds the range already requested.
        again = env.evaluate_sensors()
        assert requested(again) == set()
        for table in changes:
            assert again[table].reason() == f"a merge up to {format_lsn(checkpoint)} was already requested"
        for table in set(TABLES) - set(changes):
            assert again[table].reason() == "up to date"

        results = env.merge_requested(ticks)
        env.assert_delta_equals_source()
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


# -- 3. rebuild backfill ---------------------------------------------------------------------------


def ensure_incremental_merges(env: DagsterEnv) -> None:
    """Every table merged from the log, and merged incrementally at least once (the test above
    leaves it so; run alone, this does it)."""
    env.sync(20)
    if any(env.version(t) == 0 for t in TABLES):
        env.transactions(*ROUND_1, *ROUND_2)
        env.sync(25)
    assert all(env.version(t) >= 1 for t in TABLES)


@pytest.mark.slow
def test_rebuild_backfill_rebuilds_selected_tables_from_snapshot_and_log(env: DagsterEnv, spark: Any) -> None:
    ensure_incremental_merges(env)
    checkpoint = env.checkpoint_lsn()
    before = {t: rust_table(env.path(t)).to_pylist() for t in TABLES}  # data and _cdc_ metadata
    versions = {t: env.version(t) for t in TABLES}
    applied = {t: env.applied(t) for t in TABLES}  # each table's last merge: at or below the checkpoint
    assert all(lsn is not None and lsn <= checkpoint for lsn in applied.values())

    # Damage two tables behind the pipeline's back.
    DeltaTable.forPath(spark, env.path(CUSTOMERS)).delete("id = 1")
    DeltaTable.forPath(spark, env.path(ORDERS)).update("id = 1", {"amount": "amount + 1000"})
    for table in (CUSTOMERS, ORDERS):
        assert difference(env.delta_rows(table), env.source_rows(table)), f"{table} was not damaged"

    # A backfill of two of the three partitions of cdc/rebuild: one run per partition.
    selected = (CUSTOMERS, ORDERS)
    runs = {
        table: env.execute(
            dg.AssetSelection.assets(REBUILD_KEY), partition_key=table, tags={"dagster/backfill": "rebuild"}
        )
        for table in selected
    }
    for table, result in runs.items():
        assert result.success
        after = rust_table(env.path(table)).to_pylist()
        problem = difference(after, before[table], ("rebuilt", "incrementally merged"))
        assert not problem, f"{table}: the rebuild differs from the incremental merges:\n{problem}"
        env.assert_delta_equals_source([table])
        assert env.applied(table) == checkpoint  # the change log's checkpoint, as a merge would record it
        assert env.version(table) > versions[table] + 1  # the damage, then the rebuild's commit
        rebuilt = materialization(result, REBUILD_KEY)
        assert rebuilt["applied_lsn"] == format_lsn(checkpoint)
        assert rebuilt["dagster/row_count"] == rebuilt["inserted"] == len(env.source_rows(table))
        # The mirror asset itself records the rebuild as a materialization of this run.
        event = env.instance.get_latest_materialization_event(MIRROR_KEYS[table])
        assert event is not None and event.run_id == result.run_id
        mirror = event.asset_materialization
        assert mirror is not None and mirror.metadata["rebuilt"].value is True
        assert mirror.metadata["applied_lsn"].value == format_lsn(checkpoint)

    # The partition not in the backfill is left alone.
    assert env.version(NOTES) == versions[NOTES] and env.applied(NOTES) == applied[NOTES]
    event = env.instance.get_latest_materialization_event(MIRROR_KEYS[NOTES])
    assert event is not None and event.run_id not in {r.run_id for r in runs.values()}
    assert env.instance.get_materialized_partitions(REBUILD_KEY) == set(selected)


# -- 4. asset checks -------------------------------------------------------------------------------


@pytest.mark.slow
def test_parity_and_lag_checks_pass_on_correct_tables_and_fail_on_damage(env: DagsterEnv, spark: Any) -> None:
    """The checks only read: the parity check compares the Delta version that holds the source's
    state at a fresh snapshot point (the following drain passes it; the tables are quiet), and
    records nothing; a damaged table fails, the others pass; with no drain to pass its point it
    warns that it could not compare. ``cdc/verify`` drains and merges up to its point itself and
    records the drain, the merge and the verdict."""
    env.sync(40)
    lag_keys = [dg.AssetCheckKey(MIRROR_KEYS[t], "lag") for t in TABLES]
    parity_keys = [dg.AssetCheckKey(MIRROR_KEYS[t], "parity") for t in TABLES]
    versions = {t: env.version(t) for t in TABLES}
    follower = subprocess.Popen(
        [sys.executable, "-m", "cdc_assets", "drain", "--follow", "600", "-c", str(env.config_path)],
        env={**os.environ, DSN_VARIABLE: env.db.dsn},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Correct tables: lag within the default bound everywhere, parity for one table.
        result = env.execute(dg.AssetSelection.checks(*lag_keys, parity_keys[1]))
        checks = check_results(result)
        assert set(checks) == {(t, "lag") for t in TABLES} | {(ORDERS, "parity")}
        assert all(e.passed for e in checks.values()), {k: e.metadata for k, e in checks.items() if not e.passed}
        parity = {k: v.value for k, v in checks[(ORDERS, "parity")].metadata.items()}
        assert parity["source_rows"] == parity["delta_rows"] == len(env.source_rows(ORDERS))
        assert parity["source_checksum"] == parity["delta_checksum"]
        assert parity["delta_version"] == versions[ORDERS]
        assert not result.get_asset_materialization_events()  # read only: nothing drained or merged by it
        assert {t: env.version(t) for t in TABLES} == versions
        for table in TABLES:
            lag = {k: v.value for k, v in checks[(table, "lag")].metadata.items()}
            assert lag["applied_lsn"] == format_lsn(env.applied(table))
            assert 0 <= lag["lag_bytes"] <= lag["bound_bytes"] == 1 << 30

        # Damage one table: parity fails for it, and only for it.
        version = env.version(ORDERS)
        DeltaTable.forPath(spark, env.path(ORDERS)).delete("id = 1")
        try:
            checks = check_results(env.execute(dg.AssetSelection.checks(*parity_keys)))
            assert {k: e.passed for k, e in checks.items()} == {
                (CUSTOMERS, "parity"): True,
                (ORDERS, "parity"): False,
                (NOTES, "parity"): True,
            }
            failed = checks[(ORDERS, "parity")]
            assert failed.severity == dg.AssetCheckSeverity.ERROR
            metadata = {k: v.value for k, v in failed.metadata.items()}
            assert metadata["source_rows"] == len(env.source_rows(ORDERS)) == metadata["delta_rows"] + 1
            assert metadata["source_checksum"] != metadata["delta_checksum"]
            assert "differs from its source" in (failed.description or "")
        finally:  # undo the damage with Delta's time travel (the applied LSN is untouched by both)
            DeltaTable.forPath(spark, env.path(ORDERS)).restoreToVersion(version)
    finally:
        follower.terminate()
        assert follower.wait(timeout=120) == 130, follower.stderr.read() if follower.stderr else ""
    env.assert_delta_equals_source([ORDERS])

    # No drain passes the check's point: it waits schedule.parity_wait_seconds, then warns that it
    # could not compare — not that the table differs.
    env.transactions(["UPDATE public.orders SET amount = amount + 1 WHERE id = (SELECT max(id) FROM public.orders)"])
    patient = write_dagster_config(env.folder, schedule={"parity_wait_seconds": 2}, name="cdc-patient.yaml")
    patient_defs = build_definitions(load_settings(str(patient)))
    waited = check_results(execute(patient_defs, env.instance, dg.AssetSelection.checks(parity_keys[1]), name="wait"))
    uncompared = waited[(ORDERS, "parity")]
    assert not uncompared.passed and uncompared.severity == dg.AssetCheckSeverity.WARN
    assert "not compared" in uncompared.description and "has not reached the snapshot point" in uncompared.description

    # cdc/verify drains up to its point and merges the table: the drain, the merge and the verdict
    # are recorded on the assets they concern; a damaged table fails its run.
    verified = env.execute(dg.AssetSelection.assets(VERIFY_KEY), partition_key=ORDERS)
    assert materialization(verified, CHANGELOG_KEY)["changes"] >= 1
    assert materialization(verified, MIRROR_KEYS[ORDERS])["updated"] == 1
    verdict = check_results(verified)[(ORDERS, "parity")]
    assert verdict.passed and verdict.metadata["delta_version"].value == env.version(ORDERS)
    env.assert_delta_equals_source([ORDERS])
    version = env.version(ORDERS)
    DeltaTable.forPath(spark, env.path(ORDERS)).delete("id = 1")
    try:
        broken = env.execute(dg.AssetSelection.assets(VERIFY_KEY), partition_key=ORDERS, raise_on_error=False)
        assert not broken.success
        logged = env.instance.all_logs(broken.run_id, of_type=dg.DagsterEventType.ASSET_CHECK_EVALUATION)
        evaluations = [e.get_dagster_event().event_specific_data for e in logged]
        assert [(e.check_name, e.passed) for e in evaluations] == [("parity", False)]  # type: ignore[union-attr]
    finally:
        DeltaTable.forPath(spark, env.path(ORDERS)).restoreToVersion(version)
    env.assert_delta_equals_source([ORDERS])

    # A lag bound smaller than the lag: the same check, built from a file with a 1-byte bound.
    strict = write_dagster_config(env.folder, schedule={"max_lag_bytes": 1}, name="cdc-strict.yaml")
    env.transactions(["INSERT INTO public.scratch VALUES (1)"])  # WAL past every applied LSN
    strict_defs = build_definitions(load_settings(str(strict)))
    checks = check_results(execute(strict_defs, env.instance, dg.AssetSelection.checks(*lag_keys), name="strict_lag"))
    for table in TABLES:
        evaluation = checks[(table, "lag")]
        assert not evaluation.passed and evaluation.severity == dg.AssetCheckSeverity.WARN
        lag = {k: v.value for k, v in evaluation.metadata.items()}
        assert lag["bound_bytes"] == 1 < lag["lag_bytes"]


# -- 5. history backfill ---------------------------------------------------------------------------


@pytest.mark.slow
def test_history_backfill_writes_each_commit_day_exactly_and_idempotently(env: DagsterEnv) -> None:
    today = datetime.now(UTC).date()
    first, empty, last = (today - timedelta(days=n) for n in (3, 2, 1))

    def at(day: date, hour: int, minute: int = 0) -> datetime:
        return datetime.combine(day, time(hour, minute), tzinfo=UTC)

    commit_at(
        env.db,
        at(first, 12),
        "INSERT INTO public.notes VALUES (101, 'a', 1)",
        "INSERT INTO public.notes VALUES (102, 'b', 2)",
    )
    commit_at(env.db, at(first, 18, 30), "UPDATE public.notes SET body = 'a2' WHERE id = 101")
    commit_at(
        env.db,
        at(last, 9, 15),
        "DELETE FROM public.notes WHERE id = 102",
        "UPDATE public.notes SET stars = 7 WHERE id = 101",
        "UPDATE public.customers SET tier = 'platinum' WHERE id = 3",  # another table, same day
    )
    env.transactions(["INSERT INTO public.notes VALUES (103, 'today', 3)"])  # committed now
    env.run_schedule(tick_time(50))

    # The change log's own account of public.notes, by commit day (snapshot rows are not changes).
    log: dict[date, list[dict[str, Any]]] = {}
    for chunk in ChangeLogReader(env.config().changelog.path).read_changes(NOTES):
        for record in chunk.records.to_pylist():
            if record["_cdc_op"] != "snapshot":
                log.setdefault(record["_cdc_commit_time"].astimezone(UTC).date(), []).append(record)
    assert [r["_cdc_commit_time"] for r in log[first]] == [at(first, 12)] * 2 + [at(first, 18, 30)]
    assert [r["_cdc_commit_time"] for r in log[last]] == [at(last, 9, 15)] * 2
    assert empty not in log and today in log  # three commit days with changes, one day without

    # The code location's history partitions: daily (UTC) from a fixed first day (loading the code
    # location reads no change log), so they hold these earlier (upstream) commit days too.
    settings = load_settings(str(env.config_path))
    history = env.defs.resolve_assets_def(history_key(settings.config.table(NOTES)))
    located = history.partitions_def
    assert isinstance(located, dg.DailyPartitionsDefinition)
    assert located.start.date().isoformat() == HISTORY_START and str(located.timezone) == "UTC"
    days = [first, empty, last]
    keys = located.get_partition_keys()
    assert keys[0] == HISTORY_START and keys[-3:] == [d.isoformat() for d in days]  # up to yesterday

    def backfill() -> dict[date, int]:
        written = {}
        for day in days:
            result = env.execute(
                dg.AssetSelection.assets(history.key),
                partition_key=day.isoformat(),
                tags={"dagster/backfill": "history"},
            )
            metadata = materialization(result, history.key)
            assert metadata["day"] == day.isoformat()
            written[day] = metadata["dagster/partition_row_count"]
        return written

    def partitions() -> dict[date, list[dict[str, Any]]]:
        rows = rust_table(history_path(settings.config, settings.config.table(NOTES))).to_pylist()
        by_day: dict[date, list[dict[str, Any]]] = {}
        for row in rows:
            by_day.setdefault(row["commit_day"], []).append(row)
        return by_day

    assert backfill() == {first: 3, empty: 0, last: 2}
    held = partitions()
    assert set(held) == {first, last}  # the empty day holds nothing; today is outside the range
    for day in (first, last):
        got = [history_view(r, "before", "after") for r in held[day]]
        want = [history_view(r, "old", "new") for r in log[day]]
        assert multiset(got) == multiset(want), (day, got, want)
    # The same changes, by hand: operations, images before and after, in commit order.
    ordered = {day: [(r["_cdc_op"], r["before"], r["after"]) for r in sorted(held[day], key=lambda r: (r["_cdc_commit_lsn"], r["_cdc_position"]))]
               for day in (first, last)}  # fmt: skip
    assert ordered[first] == [
        ("insert", None, {"id": 101, "body": "a", "stars": 1}),
        ("insert", None, {"id": 102, "body": "b", "stars": 2}),
        ("update", {"id": 101, "body": "a", "stars": 1}, {"id": 101, "body": "a2", "stars": 1}),
    ]
    assert ordered[last] == [
        ("delete", {"id": 102, "body": "b", "stars": 2}, None),
        ("update", {"id": 101, "body": "a2", "stars": 1}, {"id": 101, "body": "a2", "stars": 7}),
    ]

    # The backfill again: every partition the same.
    assert backfill() == {first: 3, empty: 0, last: 2}
    again = partitions()
    assert {d: multiset(rows) for d, rows in again.items()} == {d: multiset(rows) for d, rows in held.items()}
    assert env.instance.get_materialized_partitions(history.key) == {d.isoformat() for d in days}


def history_view(row: dict[str, Any], before: str, after: str) -> dict[str, Any]:
    """The columns a history row and a change record share: operation, LSNs, position, xid, commit
    time, images."""
    keys = ("_cdc_op", "_cdc_commit_lsn", "_cdc_end_lsn", "_cdc_position", "_cdc_xid", "_cdc_commit_time")
    return {**{k: row[k] for k in keys}, "before": row[before], "after": row[after]}


# -- 6. maintenance ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_maintenance_compacts_a_table_beside_its_mirror_under_its_write_lock(env: DagsterEnv) -> None:
    env.sync(55)
    config = env.config()
    table = config.table(CUSTOMERS)
    key = maintenance_key(table)
    assets = env.defs.resolve_assets_def(key)
    every = {maintenance_key(t) for t in config.tables}
    assert assets.keys == every and assets.can_subset and assets.op.pool is None  # one step for every table
    assert assets.specs_by_key[key].group_name == "mirror"
    assert {d.asset_key for d in assets.specs_by_key[key].deps} == {MIRROR_KEYS[CUSTOMERS]}
    schedule = env.defs.resolve_schedule_def("cdc_maintain")
    assert env.defs.resolve_job_def(schedule.job_name).asset_layer.selected_asset_keys == every
    before, applied = table_files(env.path(CUSTOMERS)), env.applied(CUSTOMERS)
    assert before.files >= 2 and before.deletion_vectors >= 1, before

    with ThreadPoolExecutor(1) as pool:
        with TableWriteLock(config.source, CUSTOMERS):  # a merge of the table is writing: maintenance waits
            running = pool.submit(env.execute, dg.AssetSelection.assets(key))
            wait_until(lambda: advisory_waiters(env.db) == 1, timeout=120, what="the maintenance waiting")
            assert table_files(env.path(CUSTOMERS)).version == before.version
        result = running.result(timeout=300)
    assert {m.asset_key for m in result.get_asset_materialization_events()} == {key}  # the selected table only
    metadata = materialization(result, key)
    after = table_files(env.path(CUSTOMERS))
    assert metadata["steps"] == "OPTIMIZE, VACUUM"
    assert (metadata["files_before"], metadata["files"]) == (before.files, after.files) and after.files < before.files
    assert (metadata["deletion_vectors_before"], metadata["deletion_vectors"]) == (before.deletion_vectors, 0)
    assert metadata["size_mb"] == round(after.bytes / 1e6, 3) and metadata["vacuumed_files"] == 0
    assert metadata["delta_version"] == after.version == env.version(CUSTOMERS) > before.version
    assert metadata["applied_lsn"] == format_lsn(applied) == format_lsn(env.applied(CUSTOMERS))  # type: ignore[arg-type]
    env.assert_delta_equals_source()
    assert all(not tick.run_requests for tick in env.evaluate_sensors().values())  # nothing to merge again


@pytest.mark.slow
def test_an_apply_a_maintenance_run_and_a_rebuild_of_one_table_wait_for_each_other(env: DagsterEnv, spark: Any) -> None:
    """One write path ("One write path" in docs/architecture.md): a CLI ``apply`` (a process of its
    own), a Dagster maintenance run and a rebuild of one table, started together while the source
    takes writes and drains move the checkpoint, each wait for the table's write lock (held here
    until all three wait for it), then write one after the other: all three succeed, none loses a
    Delta conflict, and the table equals its source."""
    env.sync(57)
    config = env.config()
    table = config.table(CUSTOMERS)
    stop = threading.Event()
    written = [0]

    def write_and_drain() -> None:
        while not stop.is_set():
            written[0] += 1
            env.transactions(
                [f"UPDATE public.customers SET tier = 'gold {written[0]}' WHERE id = {1 + written[0] % 5}"],
                [f"INSERT INTO public.customers VALUES ({1000 + written[0]}, 'new {written[0]}', 'bronze', NULL)"],
            )
            drain(config, wait=True)

    apply = None
    with ThreadPoolExecutor(3) as pool:
        writing = pool.submit(write_and_drain)
        try:
            wait_until(lambda: written[0] >= 2, timeout=120, what="writes drained")
            with TableWriteLock(config.source, CUSTOMERS):  # every writer of the table waits for this one
                apply = subprocess.Popen(
                    [sys.executable, "-m", "cdc_assets", "apply", "-c", str(env.config_path)],
                    env={**os.environ, DSN_VARIABLE: env.db.dsn},
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
                maintained = pool.submit(env.execute, dg.AssetSelection.assets(maintenance_key(table)))
                rebuilt = pool.submit(rebuild_table, config, table, spark.newSession())
                wait_until(lambda: advisory_waiters(env.db) == 3, timeout=300, what="the three writers waiting")
            out, err = apply.communicate(timeout=600)
            result, rebuild = maintained.result(timeout=600), rebuilt.result(timeout=600)
        finally:
            stop.set()
            writing.result(timeout=120)
            if apply is not None and apply.poll() is None:
                apply.kill()
    assert apply.returncode == 0, err
    assert any(line.startswith(f"{CUSTOMERS}: ") for line in out.splitlines()), out
    assert result.success and materialization(result, maintenance_key(table))["steps"]
    assert rebuild.table == CUSTOMERS and rebuild.applied_lsn is not None
    env.sync(58)
    env.assert_delta_equals_source()


# -- 7. pools and the run queue --------------------------------------------------------------------


@pytest.mark.slow
def test_run_queue_never_runs_two_drains_or_two_writers_of_one_table_at_once(
    pg: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("CDC_CONFIG", str(tmp_path / "cdc.yaml"))
    monkeypatch.setenv(DSN_VARIABLE, pg.dsn)
    create_source(pg, tmp_path, QUEUE_SLOT)  # slots are per cluster: not the module pipeline's
    config = load_config(tmp_path / "cdc.yaml", environ={DSN_VARIABLE: pg.dsn})
    defs = load_code_location()

    # The pools the definitions declare.
    assert defs.resolve_assets_def(CHANGELOG_KEY).op.pool == f"cdc_drain__{QUEUE_SLOT}"
    for table in TABLES:
        slug = table.replace(".", "__")
        assert defs.resolve_assets_def(MIRROR_KEYS[table]).op.pool == f"cdc_table__{slug}"
    # A run over several tables (launched from the UI) merges up to schedule.run_max_concurrent at
    # once, each step a process (a Spark each): not spark.parallel_merges, the sessions of one Spark.
    executor = defs.resolve_implicit_global_asset_job_def().executor_def
    assert executor.name == "multiprocess"
    max_concurrent = executor.config_schema.resolve_config({}).value["config"]["max_concurrent"]
    assert max_concurrent == config.schedule.run_max_concurrent == 2 != config.spark.parallel_merges
    drain_job = defs.resolve_job_def(defs.resolve_schedule_def("cdc_drain_schedule").job_name)
    merge_jobs = {t: defs.resolve_job_def(f"cdc_merge__{t.replace('.', '__')}") for t in (CUSTOMERS, NOTES)}
    for table, job in merge_jobs.items():  # each table's merge sensor launches its job
        assert job.name in {j.name for j in defs.resolve_sensor_def(f"cdc_merges__{table.replace('.', '__')}").jobs}
    maintain_job = defs.resolve_job_def(defs.resolve_schedule_def("cdc_maintain").job_name)

    # The demo's instance settings (pools: limit 1, run granularity), the queued run coordinator,
    # and a launcher that executes drains in this process and holds merges as "starting".
    overrides = {
        **DEMO_INSTANCE,
        "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "QueuedRunCoordinator"},
        "run_launcher": {"module": "tests.support.dagster_env", "class": "ThreadRunLauncher"},
    }
    ThreadRunLauncher.HOLD = {job.name for job in (*merge_jobs.values(), maintain_job)}
    with dg.instance_for_test(overrides=overrides) as instance:
        daemon = QueuedRunCoordinatorDaemon(interval_seconds=1)
        location = RemoteRepositoryOrigin(RegisteredCodeLocationOrigin("cdc_assets"), "__repository__")
        workspace = SimpleNamespace(instance=instance, create_request_context=lambda: None)

        def submit(job: dg.JobDefinition) -> str:
            run = instance.create_run_for_job(
                job,
                execution_plan=create_execution_plan(job),
                status=dg.DagsterRunStatus.NOT_STARTED,
                remote_job_origin=RemoteJobOrigin(location, job.name),  # queued runs must name their code location
            )
            return instance.run_coordinator.submit_run(SubmitRunContext(run, workspace=None)).run_id  # type: ignore[arg-type]

        def dequeue() -> dict[str, dg.DagsterRunStatus]:
            list(daemon.run_iteration(workspace))  # type: ignore[arg-type]
            return {name: instance.get_run_by_id(run_id).status for name, run_id in runs.items()}  # type: ignore[union-attr]

        def finished(name: str) -> bool:
            return instance.get_run_by_id(runs[name]).status in (
                dg.DagsterRunStatus.SUCCESS,
                dg.DagsterRunStatus.FAILURE,
            )  # type: ignore[union-attr]

        # Dagster enforces a pool from the dequeue pass after the one that first sees it (the pass
        # reads the configured pools before it initializes new ones): a deployment's pools exist
        # after their first runs; here they are set up front, as `dagster instance concurrency` would.
        pools = {f"cdc_drain__{QUEUE_SLOT}"} | {f"cdc_table__{t.replace('.', '__')}" for t in TABLES}
        for pool in pools:
            assert instance.event_log_storage.initialize_concurrency_limit_to_default(pool)
        commit_each(pg, ROUND_1)
        runs = {
            "drain 1": submit(drain_job), "drain 2": submit(drain_job),
            "customers 1": submit(merge_jobs[CUSTOMERS]), "customers 2": submit(merge_jobs[CUSTOMERS]),
            "customers maintenance": submit(maintain_job), "notes": submit(merge_jobs[NOTES]),
        }  # fmt: skip
        assert instance.get_run_by_id(runs["drain 1"]).run_op_concurrency.all_pools == {f"cdc_drain__{QUEUE_SLOT}"}  # type: ignore[union-attr]
        queued, starting = dg.DagsterRunStatus.QUEUED, (dg.DagsterRunStatus.STARTING, dg.DagsterRunStatus.STARTED)

        with DrainLock(config.source, wait=False):  # the first drain will wait for this lock
            statuses = dequeue()
            assert statuses["drain 1"] in starting and statuses["drain 2"] == queued
            assert statuses["customers 1"] in starting and statuses["customers 2"] == queued
            assert statuses["customers maintenance"] in starting  # no pool: it waits for each table's write lock
            assert statuses["notes"] in starting  # another table's pool: not blocked
            wait_until(lambda: advisory_waiters(pg) == 1, timeout=60, what="the first drain waiting for the drain lock")
            assert instance.get_run_by_id(runs["drain 1"]).status == dg.DagsterRunStatus.STARTED  # type: ignore[union-attr]
            statuses = dequeue()  # the first drain is running: the second stays queued
            assert statuses["drain 2"] == queued and statuses["customers 2"] == queued
        wait_until(lambda: finished("drain 1"), timeout=120, what="the first drain to finish")
        statuses = dequeue()
        assert statuses["drain 1"] == dg.DagsterRunStatus.SUCCESS and statuses["drain 2"] in starting
        wait_until(lambda: finished("drain 2"), timeout=120, what="the second drain to finish")
        launcher = instance.run_launcher
        assert not launcher.errors  # type: ignore[attr-defined]
        first, second = (instance.get_run_record_by_id(runs[n]) for n in ("drain 1", "drain 2"))
        assert first.dagster_run.status == second.dagster_run.status == dg.DagsterRunStatus.SUCCESS  # type: ignore[union-attr]
        assert first.end_time <= second.start_time  # type: ignore[operator,union-attr]
        records = instance.fetch_materializations(CHANGELOG_KEY, limit=10).records
        changes = {r.run_id: r.asset_materialization.metadata["changes"].value for r in records}  # type: ignore[union-attr]
        assert changes == {runs["drain 1"]: sum(ROUND_1_CHANGES.values()), runs["drain 2"]: 0}

        # A merge whose run is cancelled before its worker started frees the table's pool.
        assert statuses["customers 2"] == queued
        assert instance.run_coordinator.cancel_run(runs["customers 1"])
        statuses = dequeue()
        assert statuses["customers 1"] == dg.DagsterRunStatus.CANCELED and statuses["customers 2"] in starting
        assert instance.run_coordinator.cancel_run(runs["customers 2"])
        for name in ("customers maintenance", "notes"):
            assert instance.run_coordinator.cancel_run(runs[name])


def advisory_waiters(db: Database) -> int:
    return db.execute("SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted")[0][0]


def test_cancelled_run_frees_its_pool_slot_with_the_deployment_run_monitoring(monkeypatch: pytest.MonkeyPatch) -> None:
    # The deployment's and the demo's instance files pass Dagster's instance config validation.
    for name in ("DAGSTER_PG_USER", "DAGSTER_PG_PASSWORD", "DAGSTER_PG_DB"):
        monkeypatch.setenv(name, "dagster")
    deployed, _ = dagster_instance_config(str(DEPLOY))
    for settings in (deployed, DEMO_INSTANCE):
        assert settings["concurrency"]["pools"] == {"default_limit": 1, "granularity": "run"}
        assert settings["run_monitoring"]["enabled"] is True
        assert settings["run_monitoring"]["free_slots_after_run_end_seconds"] > 0
    seconds = deployed["run_monitoring"]["free_slots_after_run_end_seconds"]
    pool, step = f"cdc_drain__{SLOT}", "cdc__changelog"
    logger = logging.getLogger("test_dagster")

    # With op granularity slots are claimed in the instance; a run killed while holding one never
    # frees it. Run monitoring does, once the run has been over for that many seconds.
    for monitoring, frees in ((deployed["run_monitoring"], True), ({"enabled": True}, False)):
        overrides = {"concurrency": {"pools": {"default_limit": 1, "granularity": "op"}}, "run_monitoring": monitoring}
        with dg.instance_for_test(overrides=overrides) as instance:
            storage = instance.event_log_storage
            assert storage.initialize_concurrency_limit_to_default(pool)
            killed = create_run_for_test(instance, job_name="drain", status=dg.DagsterRunStatus.STARTED)
            waiting = create_run_for_test(instance, job_name="drain", status=dg.DagsterRunStatus.STARTED)
            assert storage.claim_concurrency_slot(pool, killed.run_id, step).is_claimed
            instance.report_run_canceled(killed)
            assert not storage.claim_concurrency_slot(pool, waiting.run_id, step).is_claimed
            workspace = SimpleNamespace(instance=instance)
            list(execute_concurrency_slots_iteration(workspace, logger))  # type: ignore[arg-type]
            assert storage.get_concurrency_info(pool).active_run_ids == {killed.run_id}  # too early
            ended = instance.get_run_record_by_id(killed.run_id).end_time  # type: ignore[union-attr]
            with freeze_time(ended + seconds + 1):
                list(execute_concurrency_slots_iteration(workspace, logger))  # type: ignore[arg-type]
            if frees:
                assert storage.get_concurrency_info(pool).active_run_ids == set()
                assert storage.claim_concurrency_slot(pool, waiting.run_id, step).is_claimed
            else:
                assert storage.get_concurrency_info(pool).active_run_ids == {killed.run_id}
