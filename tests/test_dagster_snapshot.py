"""The online snapshot in Dagster: a backfill of ``cdc/snapshot`` over a damaged table repairs it
through the merge the merge sensor requests, while the other tables' merges go on; a table added to
the config shows its assets, merge job and backfill partition when the code location is reloaded
(docs/architecture.md, "Online snapshots"; README, "Operations")."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
from delta.tables import DeltaTable
from deltalake import DeltaTable as RustDeltaTable

from cdc_assets.config import load_config
from cdc_assets.pipeline.setup import setup
from dagster_project.naming import Naming
from tests.support.dagster_env import (
    DDL,
    DEMO_INSTANCE,
    DSN_VARIABLE,
    TABLES,
    DagsterEnv,
    load_code_location,
    tick_time,
    write_dagster_config,
)
from tests.support.database import Database
from tests.support.rows import difference

NAMES = Naming()
SNAPSHOT_KEY, COPY_JOB, table_pool = NAMES.snapshot, NAMES.copy_job, NAMES.table_pool

CUSTOMERS, ORDERS, NOTES = TABLES


@pytest.fixture(scope="module")
def env(pg_module: Database, spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[DagsterEnv]:
    folder = tmp_path_factory.mktemp("dagster_snapshot")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CDC_CONFIG", str(folder / "cdc.yaml"))
        patch.setenv(DSN_VARIABLE, pg_module.dsn)
        with pg_module.connect() as conn:
            conn.execute(DDL)
        setup(load_config(write_dagster_config(folder), environ={DSN_VARIABLE: pg_module.dsn}))
        with dg.instance_for_test(overrides=DEMO_INSTANCE) as instance:
            yield DagsterEnv(pg_module, folder, instance)


@pytest.mark.slow
def test_snapshot_backfill_repairs_a_table_while_the_others_merge(env: DagsterEnv, spark: Any) -> None:
    assert set(env.sync(0)) == set(TABLES)
    DeltaTable.forPath(spark, env.path(CUSTOMERS)).delete("id = 1")
    DeltaTable.forPath(spark, env.path(CUSTOMERS)).update("id = 2", {"name": "'damaged'"})
    assert difference(env.delta_rows(CUSTOMERS), env.source_rows(CUSTOMERS)), "the damage is not visible"
    applied = {table: env.applied(table) for table in TABLES}

    result = env.execute(
        dg.AssetSelection.assets(SNAPSHOT_KEY), partition_key=CUSTOMERS, tags={"dagster/backfill": "snapshot"}
    )
    assert result.success
    (event,) = [e for e in result.get_asset_materialization_events() if e.asset_key == SNAPSHOT_KEY]
    metadata = {k: v.value for k, v in event.materialization.metadata.items()}
    assert metadata["rows"] == len(env.source_rows(CUSTOMERS)) and metadata["chunks"] >= 1, metadata
    assert env.applied(CUSTOMERS) == applied[CUSTOMERS]  # the copy itself writes no Delta table

    env.transactions(["UPDATE public.orders SET amount = amount + 1 WHERE id = 1"])
    assert set(env.sync(5)) == {CUSTOMERS, ORDERS}  # the copy makes customers due; orders has a change
    env.assert_delta_equals_source()
    assert all((env.applied(t) or 0) > (applied[t] or 0) for t in (CUSTOMERS, ORDERS))
    # The copy takes no table's pool: the table's merges (and every other) are not held up by it.
    assert env.defs.resolve_assets_def(SNAPSHOT_KEY).op.pool not in {table_pool(t) for t in env.config().tables}


@pytest.mark.slow
def test_a_migration_moves_the_mirror_and_a_rewrite_is_copied_by_the_sensor(env: DagsterEnv) -> None:
    """A rename and an ADD COLUMN … DEFAULT reach the mirror through the merge the sensor requests,
    recorded on its materialization (what changed, ``dagster/column_schema``); a rewrite holds the
    table, and the sensor requests its copy (``cdc_copy_held__<schema>__<table>``, once), after which its merge makes it
    equal to its source (docs/architecture.md, "Schema migrations")."""
    env.sync(10)
    env.transactions(
        ["ALTER TABLE public.customers RENAME COLUMN tier TO level"],
        ["ALTER TABLE public.customers ADD COLUMN points int DEFAULT 100"],
        ["UPDATE public.customers SET points = 5 WHERE id = 1"],
    )
    env.run_schedule(tick_time(15))
    (request,) = env.evaluate_sensors()[CUSTOMERS].run_requests
    result = env.execute_request(env.evaluate_sensors(fresh=True)[CUSTOMERS], request)
    (event,) = [
        e
        for e in result.get_asset_materialization_events()
        if e.asset_key == dg.AssetKey(["delta", "public", "customers"])
    ]
    metadata = {k: v.value for k, v in event.materialization.metadata.items()}
    assert metadata["schema_change"] == "renamed tier to level, added points (its default in every row)", metadata
    columns = [c.name for c in metadata["dagster/column_schema"].columns]
    assert columns[:5] == ["id", "name", "level", "since", "points"], columns
    env.assert_delta_equals_source([CUSTOMERS])

    env.transactions(["ALTER TABLE public.notes ALTER COLUMN stars TYPE bigint USING stars * 10"])
    env.run_schedule(tick_time(20))
    tick = env.evaluate_sensors()[NOTES]
    (copy,) = tick.run_requests
    assert copy.job_name == f"{COPY_JOB}__public__notes" and copy.partition_key == NOTES, copy  # the table's own
    assert "ALTER TABLE rewrote it (column type)" in copy.tags["cdc/copy_reason"], copy.tags
    env.execute_request(tick, copy)
    (again,) = env.evaluate_sensors()[NOTES].run_requests  # until the drain passes the copy: the same run key,
    assert again.run_key == copy.run_key  # which the daemon does not launch twice
    assert NOTES in env.sync(25)  # the drain records the copy: the table is due, and merged
    env.assert_delta_equals_source([NOTES])
    data = next(c for c in RustDeltaTable(env.path(NOTES)).history(5) if "userMetadata" in c)  # the copy's commit
    assert "ALTER TABLE rewrote it (column type)" in json.loads(data["userMetadata"])["cdc_assets_note"], data


def test_a_table_added_to_the_config_appears_on_reload(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_dagster_config(tmp_path, tables=TABLES[:2])
    monkeypatch.setenv("CDC_CONFIG", str(path))
    monkeypatch.setenv(DSN_VARIABLE, "postgresql://unused")
    before = load_code_location()
    write_dagster_config(tmp_path, tables=TABLES)
    after = load_code_location()
    key = dg.AssetKey(["delta", "public", "notes"])
    assert key not in {spec.key for spec in before.resolve_all_asset_specs()}
    assert key in {spec.key for spec in after.resolve_all_asset_specs()}
    assert "cdc_merge__public__notes" in {j.name for j in after.resolve_sensor_def("cdc_merges__public__notes").jobs}
    partitions = after.resolve_assets_def(SNAPSHOT_KEY).partitions_def
    assert partitions is not None and NOTES in partitions.get_partition_keys()
    old = before.resolve_assets_def(SNAPSHOT_KEY).partitions_def
    assert old is not None and NOTES not in old.get_partition_keys()
