"""cdc-assets inside a user's Dagster project: the names of one pipeline (``naming.py``), two
pipelines side by side in one code location, the ``CdcComponent`` type, and — slow — a project
scaffolded with ``dg`` that mirrors two PostgreSQL databases and runs an asset of its own after the
merges of the mirror it depends on (declarative automation)."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import yaml

from cdc_assets.config import load_config
from cdc_assets.errors import ConfigError
from cdc_assets.pipeline.setup import setup
from dagster_project.component import CdcComponent
from dagster_project.factory import build_definitions
from dagster_project.naming import Naming
from dagster_project.settings import load_settings
from tests.support.config_file import DSN_VARIABLE, SOURCE, write_config
from tests.support.dagster_env import SPARK, commit_each, execute
from tests.support.database import Database
from tests.support.dg_project import COMPONENT, ROOT, run_dg, write_project
from tests.support.mirror_diff import assert_delta_equals_source

TABLES = ("public.customers", "public.orders")
EVERY_PART = {"warehouse": {"consistent_points": True}, "schedule": {"drain_lag_bytes": 1_000_000}}


def names(defs: dg.Definitions) -> dict[str, set[str]]:
    """Every name ``defs`` defines, by kind (pools: of its assets)."""
    repository = defs.get_repository_def()
    assets = [defs.resolve_assets_def(key) for key in defs.resolve_all_asset_keys()]
    return {
        "assets": {key.to_user_string() for key in defs.resolve_all_asset_keys()},
        "jobs": {job.name for job in repository.get_all_jobs() if not job.name.startswith("__")},
        "sensors": {sensor.name for sensor in repository.sensor_defs},
        "schedules": {schedule.name for schedule in repository.schedule_defs},
        "resources": set(defs.resources or {}),
        "pools": {asset.op.pool for asset in assets if asset.op.pool},
    }


def pipeline(folder: Path, prefix: tuple[str, ...] = ()) -> dg.Definitions:
    path = write_config(folder, TABLES, **EVERY_PART)
    return build_definitions(load_settings(str(path), naming=Naming(prefix)))


def test_the_default_naming_gives_the_code_location_its_names(tmp_path: Path) -> None:
    found = names(pipeline(tmp_path))
    tables = [("public", "customers"), ("public", "orders")]
    assert found == {
        "assets": {"cdc/changelog", "cdc/snapshot", "cdc/rebuild", "cdc/verify", "cdc/consistent_point"}
        | {f"{kind}/{schema}/{table}" for kind in ("delta", "history", "maintenance") for schema, table in tables},
        "jobs": {"cdc_drain", "cdc_consistent_point", "cdc_recover", "cdc_maintain"}
        | {f"cdc_{kind}__{schema}__{table}" for kind in ("merge", "copy_held") for schema, table in tables},
        "sensors": {"cdc_drain_on_lag", "cdc_consistent_point"} | {f"cdc_merges__{s}__{t}" for s, t in tables},
        "schedules": {"cdc_drain_schedule", "cdc_maintain"},
        "resources": {"source", "spark"},
        "pools": {f"cdc_drain__{SOURCE['slot']}"}
        | {f"cdc_{kind}__{schema}__{table}" for kind in ("table", "history") for schema, table in tables},
    }


def test_two_prefixed_pipelines_share_one_code_location_without_a_common_name(tmp_path: Path) -> None:
    """The same tables and slot name in both (two servers could have them): only the prefix tells
    them apart, in every kind of name and in the run tags the sensors find runs in flight by."""
    shop = pipeline(tmp_path / "shop", ("shop",))
    billing = pipeline(tmp_path / "billing", ("billing", "eu"))
    merged = dg.Definitions.merge(shop, billing)
    dg.Definitions.validate_loadable(merged)
    found = {"shop": names(shop), "billing": names(billing)}
    for kind, shop_names in found["shop"].items():
        assert shop_names and not shop_names & found["billing"][kind], kind
        assert all(n.startswith(("shop/", "shop__")) for n in shop_names), (kind, shop_names)
        assert all(n.startswith(("billing/eu/", "billing__eu__")) for n in found["billing"][kind]), kind
    assert names(merged)["assets"] == found["shop"]["assets"] | found["billing"]["assets"]
    drains = [
        defs.resolve_job_def(job).tags["cdc/drain"]
        for defs, job in ((shop, "shop__cdc_drain"), (billing, "billing__eu__cdc_drain"))
    ]
    assert drains == [f"shop__{SOURCE['slot']}", f"billing__eu__{SOURCE['slot']}"]


def test_a_key_prefix_part_must_be_a_name() -> None:
    with pytest.raises(ConfigError, match=r"key_prefix: 'a/b'"):
        Naming(("a/b",))


def inline(**sections: Any) -> CdcComponent:
    return CdcComponent(
        source=dict(SOURCE), changelog={"path": "./changelog"}, warehouse={"path": "./warehouse"}, **sections
    )


def test_a_component_takes_the_sections_inline_and_names_its_defs_yaml_in_errors(tmp_path: Path) -> None:
    settings = inline(tables={"public.orders": {}}, key_prefix=["shop"]).settings(tmp_path)
    assert settings.config.warehouse.path == str(tmp_path / "warehouse")  # relative to the defs.yaml's folder
    assert settings.naming.mirror(settings.config.tables[0]) == dg.AssetKey(["shop", "delta", "public", "orders"])
    assert settings.dsn_env == DSN_VARIABLE
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'defs.yaml'}: tables.public.orders.truncat: unknown"):
        inline(tables={"public.orders": {"truncat": "apply"}}).settings(tmp_path)
    with pytest.raises(ConfigError, match=r"defs.yaml: attributes: `config` names a file"):
        inline(tables={"public.orders": {}}, config="cdc.yaml").settings(tmp_path)
    with pytest.raises(ConfigError, match=rf"^{tmp_path / 'defs.yaml'}: attributes.key_prefix"):
        inline(tables={"public.orders": {}}, key_prefix=["a b"]).settings(tmp_path)


def test_the_package_registers_the_component_for_dg() -> None:
    """``dg list components`` lists the types of the modules under this entry point group."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    modules = project["entry-points"]["dagster_dg_cli.registry_modules"].values()
    assert COMPONENT.rsplit(".", 1)[0] in modules


# -- a user's project, with dg ----------------------------------------------------------------------

SHOP = """
CREATE TABLE public.customers (id int PRIMARY KEY, name text NOT NULL);
CREATE TABLE public.orders (id int PRIMARY KEY, customer_id int, amount numeric(10,2));
INSERT INTO public.customers SELECT i, 'customer ' || i FROM generate_series(1, 5) i;
INSERT INTO public.orders SELECT i, 1 + i % 5, i * 2.5 FROM generate_series(1, 8) i;
"""
BILLING = """
CREATE TABLE public.invoices (id int PRIMARY KEY, total numeric(10,2), paid boolean);
INSERT INTO public.invoices SELECT i, i * 100, i % 2 = 0 FROM generate_series(1, 4) i;
"""
REPORT = dg.AssetKey(["customer_count"])


def scaffold(root: Path, name: str, dsn_env: str, tables: list[str]) -> Path:
    """``dg scaffold defs`` a component for one database; its ``cdc.yaml``, given the tests' Spark."""
    params = json.dumps({"dsn_env": dsn_env, "tables": tables})
    done = run_dg(root, "scaffold", "defs", COMPONENT, name, "--json-params", params)
    assert done.returncode == 0, done.stdout + done.stderr
    folder = next(root.glob(f"src/*/defs/{name}"))
    assert yaml.safe_load((folder / "defs.yaml").read_text())["attributes"] == {
        "config": "cdc.yaml",
        "key_prefix": [name],
    }
    path = folder / "cdc.yaml"
    path.write_text(yaml.safe_dump(yaml.safe_load(path.read_text()) | {"spark": SPARK}), encoding="utf-8")
    return path


@pytest.mark.slow
def test_a_dg_project_mirrors_two_databases_and_runs_its_own_asset_after_the_mirror(
    tmp_path: Path, pg: Database, pg_other: Database, spark: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cdc_user_project"
    write_project(root, "cdc_user_project")
    shop_file = scaffold(root, "shop", "SHOP_DSN", list(TABLES))
    billing_file = scaffold(root, "billing", "BILLING_DSN", ["public.invoices"])
    checked = run_dg(root, "check", "defs")
    assert checked.returncode == 0, checked.stdout + checked.stderr

    pg.execute(SHOP)
    pg_other.execute(BILLING)
    monkeypatch.setenv("SHOP_DSN", pg.dsn)
    monkeypatch.setenv("BILLING_DSN", pg_other.dsn)
    sources = {
        Naming(("shop",)): (pg, load_config(shop_file)),
        Naming(("billing",)): (pg_other, load_config(billing_file)),
    }
    for _, config in sources.values():
        setup(config)
    monkeypatch.syspath_prepend(str(root / "src"))
    defs = dg.ComponentTree.for_project(root).build_defs()
    dg.Definitions.validate_loadable(defs)
    mirror = Naming(("shop",)).mirror(sources[Naming(("shop",))][1].table("public.customers"))

    def drain_and_merge() -> None:
        """Each database's drain, then each table's merge, as the drain schedule and merge sensor launch them."""
        for naming, (_, config) in sources.items():
            assert defs.resolve_job_def(naming.drain_job).execute_in_process(instance=instance).success
            for table in config.tables:
                assert defs.resolve_job_def(naming.merge_job(table)).execute_in_process(instance=instance).success

    def latest(key: dg.AssetKey) -> dg.EventLogRecord:
        record = instance.fetch_materializations(key, limit=1).records
        assert record, key
        return record[0]

    with dg.instance_for_test() as instance:
        tick = dg.evaluate_automation_conditions(defs=defs, instance=instance)
        assert tick.get_num_requested(REPORT) == 0  # its mirror is not there yet
        drain_and_merge()
        for round_number in range(2):
            tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
            assert tick.get_num_requested(REPORT) == 1, round_number  # the mirror changed: the report is due
            report = execute(defs, instance, dg.AssetSelection.assets(REPORT), name=f"report_{round_number}")
            rows = report.get_asset_materialization_events()[0].materialization.metadata["rows"].value
            assert rows == pg.execute("SELECT count(*) FROM public.customers")[0][0]
            assert latest(REPORT).storage_id > latest(mirror).storage_id
            tick = dg.evaluate_automation_conditions(defs=defs, instance=instance, cursor=tick.cursor)
            assert tick.get_num_requested(REPORT) == 0  # nothing new upstream
            first = 10 + 2 * round_number
            customers = f"INSERT INTO public.customers VALUES ({first}, 'late'), ({first + 1}, 'later')"
            commit_each(pg, [[customers, f"DELETE FROM public.orders WHERE id = {round_number + 2}"]])
            invoices = f"INSERT INTO public.invoices VALUES ({first}, 1, false)"
            commit_each(pg_other, [["UPDATE public.invoices SET paid = NOT paid", invoices]])
            drain_and_merge()

    for db, config in sources.values():
        with db.connect(autocommit=True) as conn:
            assert_delta_equals_source(conn, config)


@pytest.mark.slow
def test_dg_check_defs_names_the_file_and_the_key_of_a_bad_setting(tmp_path: Path) -> None:
    root = tmp_path / "cdc_checked_project"
    write_project(root, "cdc_checked_project")
    config = scaffold(root, "shop", "SHOP_DSN", ["public.orders"])
    component = config.parent / "defs.yaml"
    good_config, good_component = config.read_text(), component.read_text()

    config.write_text(good_config.replace("  slot: cdc_shop\n", "  slot: cdc_shop\n  slott: x\n"), encoding="utf-8")
    bad_setting = run_dg(root, "check", "defs")
    assert bad_setting.returncode != 0
    assert f"{config}: source.slott: unknown setting" in bad_setting.stdout + bad_setting.stderr

    config.write_text(good_config, encoding="utf-8")
    component.write_text(good_component.replace("key_prefix:", "key_prefx:"), encoding="utf-8")
    bad_attribute = run_dg(root, "check", "defs")
    output = bad_attribute.stdout + bad_attribute.stderr
    assert bad_attribute.returncode != 0
    assert f"{component}:" in output and "attributes.key_prefx" in output, output
