"""Mirrors by name (``warehouse.catalog``): every Delta table registered as an external table of
Spark's session catalog, kept in a Hive metastore whose database is in PostgreSQL
(``spark.metastore_dsn``), so that two Spark applications — a classic one and a Spark Connect
server — both find every mirror by name and read what the source holds, a column added at the
source included after the next merge; ``setup --prune`` drops a removed table's entry, not its
files."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

from cdc_assets.apply.catalog import CatalogError, catalog_name, register_mirror, same_location
from cdc_assets.apply.metastore import CLASS_PATH
from cdc_assets.apply.runner import apply_tables
from cdc_assets.apply.session import close_connect_sessions, session_settings
from cdc_assets.apply.target import delta_table_exists
from cdc_assets.config import SparkConfig
from cdc_assets.names import TableName
from dagster_project.demo import workload
from tests.support.config_file import DSN_VARIABLE
from tests.support.database import Database
from tests.support.mirror import ROOT, Mirror, child_environ
from tests.support.rows import difference, source_rows, split_metadata, table_rows
from tests.support.spark_server import (  # classic_mode_restored: autouse here too
    RunningServer,
    classic_mode_restored,  # noqa: F401
    connect_session,
    start_server,
)

CATALOG = "spark_catalog"
SHOP = ["public.customers", "public.orders", "public.order_lines"]


def assert_equals_source(pg: Database, table: str, read: pa.Table, who: str) -> list[str]:
    """``read`` (a mirror as a Spark application read it by name) holds the source's rows; returns
    its columns without the metadata columns."""
    data, _ = split_metadata(table_rows(read))
    with pg.connect() as conn:
        problem = difference(data, source_rows(conn, table), (who, "the source"))
    assert not problem, f"{table} read by name through {who} differs:\n{problem}"
    return [name for name in read.column_names if not name.startswith("_cdc_")]


def read_by_classic_application(mirror: Mirror, folder: Path) -> dict[str, pa.Table]:
    """Every mirror as a new classic Spark application reads it by name (tests/support/catalog_read.py)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "tests.support.catalog_read", str(mirror.config_path), str(folder)],
        cwd=ROOT,
        env={**child_environ(), DSN_VARIABLE: mirror.db.dsn},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return {table: pa.ipc.open_file(str(folder / f"{table}.arrow")).read_all() for table in mirror.tables}


@pytest.mark.slow
def test_two_spark_applications_read_every_mirror_by_name(pg: Database, metastore: str, tmp_path: Path) -> None:
    with pg.connect() as conn:
        workload.create(conn)
    spark_settings: dict[str, Any] = {
        "metastore_dsn": metastore,
        "conf": {"spark.sql.warehouse.dir": str(tmp_path / "spark-warehouse")},
    }
    mirror = Mirror(
        pg,
        tmp_path / "pipeline",
        {t: {} for t in SHOP},
        None,
        warehouse={"catalog": CATALOG},
        spark_settings=spark_settings,
    )
    mirror.setup()
    with pg.connect() as conn:
        workload.run_round(conn, 0)
    mirror.drain()
    server: RunningServer = start_server(
        tmp_path / "connect", "-c", str(mirror.config_path), environ={DSN_VARIABLE: pg.dsn}
    )
    session = connect_session(server)
    try:
        apply_tables(mirror.config(), session)  # over Connect: creates the tables and registers them
        for table in SHOP:
            name = catalog_name(CATALOG, TableName.parse(table))
            assert_equals_source(pg, table, session.table(name).toArrow(), "Spark Connect")

        with pg.connect() as conn:
            conn.execute("ALTER TABLE orders ADD COLUMN note text")
            conn.execute("UPDATE orders SET note = 'gift ' || id WHERE id % 7 = 0")
            workload.run_round(conn, 1)
        mirror.drain()
        apply_tables(mirror.config(), session)  # merged over Connect: the column is added
        orders = catalog_name(CATALOG, TableName.parse("public.orders"))
        described = [row["col_name"] for row in session.sql(f"DESCRIBE TABLE {orders}").collect()]
        assert "note" in described, described
        for table in SHOP:
            name = catalog_name(CATALOG, TableName.parse(table))
            assert_equals_source(pg, table, session.table(name).toArrow(), "Spark Connect")

        by_classic = read_by_classic_application(mirror, tmp_path / "classic")  # finds them in the metastore
        columns = {t: assert_equals_source(pg, t, by_classic[t], "a classic application") for t in SHOP}
        assert "note" in columns["public.orders"], columns

        elsewhere = str(tmp_path / "elsewhere")
        with pytest.raises(CatalogError, match=r"already names the table at .*public/orders"):
            register_mirror(session, CATALOG, TableName.parse("public.orders"), elsewhere)

        del mirror.tables["public.order_lines"]
        mirror.write_config()
        pruned = mirror.cli("setup", "--prune")
        assert pruned.returncode == 0, pruned.stderr[-4000:]
        assert f"dropped {CATALOG}.public.order_lines from the catalog (its files stay)" in pruned.stdout, pruned.stdout
        assert not session.catalog.tableExists(catalog_name(CATALOG, TableName.parse("public.order_lines")))
        assert session.catalog.tableExists(orders)
        assert delta_table_exists(str(tmp_path / "pipeline" / "warehouse" / "public" / "order_lines"))
    finally:
        session.stop()
        close_connect_sessions()
        server.stop()


def test_the_session_catalog_in_memory_is_refused(spark: Any, tmp_path: Path) -> None:
    """A Spark whose session catalog lives in memory would forget every name when it stops:
    registering in it is an error that says what to configure."""
    with pytest.raises(CatalogError, match=r"keeps its catalog in memory .* set spark.metastore_dsn"):
        register_mirror(spark, CATALOG, TableName.parse("public.orders"), str(tmp_path / "orders"))


def test_the_metastore_settings_of_a_session() -> None:
    """``spark.metastore_dsn`` becomes Spark's Hive client settings: the JDBC URL, the DSN's user and
    password, tables made without foreign keys; a driver jar the user's class path names is kept."""
    dsn = "postgresql://hive:s3cret@meta.example.com:6543/metastore"
    settings = session_settings(SparkConfig(metastore_dsn=dsn, conf={CLASS_PATH: "/opt/jars/postgresql-42.7.3.jar"}))
    jdo = "spark.hadoop.javax.jdo.option."
    assert settings["spark.sql.catalogImplementation"] == "hive"
    assert settings[f"{jdo}ConnectionURL"] == "jdbc:postgresql://meta.example.com:6543/metastore"
    assert (settings[f"{jdo}ConnectionUserName"], settings[f"{jdo}ConnectionPassword"]) == ("hive", "s3cret")
    assert settings["spark.hadoop.datanucleus.schema.autoCreateConstraints"] == "false"
    assert settings[CLASS_PATH] == "/opt/jars/postgresql-42.7.3.jar"
    assert "spark.sql.catalogImplementation" not in session_settings(SparkConfig())


@pytest.mark.parametrize(
    ("found", "location", "same"),
    [
        ("file:/tmp/w/public/orders", "/tmp/w/public/orders", True),
        ("file:///tmp/w/public/orders/", "/tmp/w/public/orders", True),
        ("s3://lake/w/public/orders", "s3://lake/w/public/orders", True),
        ("file:/tmp/w/public/orders_old", "/tmp/w/public/orders", False),
    ],
)
def test_a_registered_location_is_compared_as_spark_spells_it(found: str, location: str, same: bool) -> None:
    assert same_location(found, location) is same
