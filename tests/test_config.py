"""The configuration file: substitution, defaults, validation messages, path resolution."""

from __future__ import annotations

from pathlib import Path

import pytest

from cdc_assets.config import load_config, parse_config
from cdc_assets.config.jdbc import jdbc_url
from cdc_assets.errors import ConfigError
from cdc_assets.names import TableName

EXAMPLE = """
source:
  dsn: ${CDC_SOURCE_DSN}
  publication: cdc_pub
  slot: cdc_slot
changelog:
  path: ./data/changelog
warehouse:
  path: s3://bucket/warehouse/
spark:
  master: local[2]
  conf: {spark.sql.shuffle.partitions: 4, spark.ui.enabled: false}
tables:
  public.orders:
    row_filter: "status <> 'draft'"
    truncate: apply
  public.customers: {}
  '"Odd Schema"."a.b"':
    truncate: ignore
"""


def parse(text: str, **env: str) -> object:
    return parse_config(text, origin=Path("/etc/cdc/cdc.yaml"), environ=env)


def test_design_example_parses_with_defaults_and_resolved_paths() -> None:
    config = parse(EXAMPLE, CDC_SOURCE_DSN="host=db password=hunter2")
    assert config.source.dsn == "host=db password=hunter2"
    assert "hunter2" not in repr(config)
    assert config.source.streaming == "off" and config.source.batch_changes == 1_000_000
    assert config.changelog.path == "/etc/cdc/data/changelog"
    assert config.warehouse.path == "s3://bucket/warehouse"
    assert [str(t.name) for t in config.tables] == ["public.orders", "public.customers", "Odd Schema.a.b"]
    orders = config.table("public.orders")
    assert orders.row_filter == "status <> 'draft'" and orders.truncate == "apply"
    assert config.target_path(orders) == "s3://bucket/warehouse/public/orders"
    assert config.table('"Odd Schema"."a.b"').truncate == "ignore"
    assert config.spark.conf == {"spark.sql.shuffle.partitions": "4", "spark.ui.enabled": "false"}
    assert config.schedule.drain_cron == "*/5 * * * *"
    assert config.schedule.merge_with_drain is False


def test_merge_with_drain_is_a_flag() -> None:
    merging = parse(EXAMPLE + "schedule: {merge_with_drain: true}\n", CDC_SOURCE_DSN="x")
    assert merging.schedule.merge_with_drain is True
    with pytest.raises(ConfigError, match=r"schedule.merge_with_drain: expected true or false, got 'yes please'"):
        parse(EXAMPLE + "schedule: {merge_with_drain: yes please}\n", CDC_SOURCE_DSN="x")


def test_ddl_capture_is_a_flag_on_by_default() -> None:
    assert parse(EXAMPLE, CDC_SOURCE_DSN="x").source.ddl_capture is True
    off = parse(EXAMPLE.replace("source:\n", "source:\n  ddl_capture: false\n", 1), CDC_SOURCE_DSN="x")
    assert off.source.ddl_capture is False
    with pytest.raises(ConfigError, match=r"source.ddl_capture: expected true or false, got 'sometimes'"):
        parse(EXAMPLE.replace("source:\n", "source:\n  ddl_capture: sometimes\n", 1), CDC_SOURCE_DSN="x")


def test_a_dagster_runs_concurrent_steps_and_the_parallel_merges_of_one_spark_are_two_settings() -> None:
    defaults = parse(EXAMPLE, CDC_SOURCE_DSN="x")
    assert defaults.schedule.run_max_concurrent == 2 and defaults.spark.parallel_merges == 4
    chosen = parse(EXAMPLE + "schedule: {run_max_concurrent: 6}\n", CDC_SOURCE_DSN="x")
    assert chosen.schedule.run_max_concurrent == 6 and chosen.spark.parallel_merges == 4
    with pytest.raises(ConfigError, match=r"schedule.run_max_concurrent: .*0"):
        parse(EXAMPLE + "schedule: {run_max_concurrent: 0}\n", CDC_SOURCE_DSN="x")


def test_table_names_quote_and_default_schema() -> None:
    assert TableName.parse("orders") == TableName("public", "orders")
    assert TableName.parse('"My ""Q"""."t"').sql == '"My ""Q"""."t"'
    with pytest.raises(ValueError, match="not a table name"):
        TableName.parse("a.b.c")


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (("${CDC_SOURCE_DSN}", "${NOPE}"), r"cdc.yaml, line 3: environment variable NOPE is not set"),
        (
            ("truncate: apply", "truncate: drop"),
            r"tables.public.orders.truncate: expected 'apply' or 'ignore', got 'drop'",
        ),
        (("slot: cdc_slot", "slot: Bad-Slot"), r"source.slot: a replication slot name is 1-63"),
        (("publication: cdc_pub", "publication: cdc_pub\n  colour: blue"), r"source.colour: unknown setting"),
        (
            ("master: local[2]", "master: local[2]\n  remote: sc://x"),
            r"spark.remote: set either spark.master or spark.remote",
        ),
        (("  path: ./data/changelog", "  path: 7"), r"changelog.path: expected a non-empty string, got 7"),
    ],
)
def test_mistakes_name_the_file_and_key(edit: tuple[str, str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(EXAMPLE.replace(*edit), CDC_SOURCE_DSN="x")


def test_dsn_is_never_echoed() -> None:
    with pytest.raises(ConfigError) as caught:
        parse(EXAMPLE.replace("${CDC_SOURCE_DSN}", "[secret]"))
    assert "secret" not in str(caught.value)


def test_default_substitution_and_missing_file(tmp_path: Path) -> None:
    config = parse(EXAMPLE.replace("${CDC_SOURCE_DSN}", "${CDC_SOURCE_DSN:-dbname=demo}"))
    assert config.source.dsn == "dbname=demo"
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "absent.yaml")
    with pytest.raises(ConfigError, match=r"tables: is required"):
        parse("source: {dsn: x}\nchangelog: {path: a}\nwarehouse: {path: b}\n")


MAINTENANCE = "  path: s3://bucket/warehouse/\n  maintenance: {"


def test_maintenance_defaults_and_settings() -> None:
    defaults = parse(EXAMPLE, CDC_SOURCE_DSN="x").warehouse.maintenance
    assert (defaults.cron, defaults.compact_min_files, defaults.zorder) == ("0 * * * *", 8, False)
    assert (defaults.purge_min_deletion_vectors, defaults.vacuum_retention_hours) == (8, 168)
    assert parse(EXAMPLE, CDC_SOURCE_DSN="x").warehouse.small_table_mb == 4.0
    text = EXAMPLE.replace(
        "  path: s3://bucket/warehouse/",
        MAINTENANCE + "cron: '30 2 * * *', compact_min_files: 0, zorder: true, vacuum_retention_hours: 720}",
    )
    settings = parse(text, CDC_SOURCE_DSN="x").warehouse.maintenance
    assert (settings.cron, settings.compact_min_files, settings.zorder) == ("30 2 * * *", 0, True)
    assert (settings.purge_min_deletion_vectors, settings.vacuum_retention_hours) == (8, 720)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        (
            "vacuum_retention_hours: 24",
            r"warehouse.maintenance.vacuum_retention_hours: 24 is below Delta's safety check \(168 hours",
        ),
        ("compact_min_files: -1", r"warehouse.maintenance.compact_min_files: expected 0 \(off\) or a positive"),
        ("purge_min_deletion_vectors: many", r"purge_min_deletion_vectors: expected 0 \(off\) or a positive"),
        ("cron: hourly", r"warehouse.maintenance.cron: expected a cron expression of five fields"),
        ("zorder: 1", r"warehouse.maintenance.zorder: expected true or false, got 1"),
        ("optimise: true", r"warehouse.maintenance.optimise: unknown setting"),
    ],
)
def test_maintenance_mistakes_are_refused(setting: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(EXAMPLE.replace("  path: s3://bucket/warehouse/", f"{MAINTENANCE}{setting}}}"), CDC_SOURCE_DSN="x")


def test_changelog_retention_default_and_setting() -> None:
    assert parse(EXAMPLE, CDC_SOURCE_DSN="x").changelog.retention_hours == 168
    text = EXAMPLE.replace("  path: ./data/changelog", "  path: ./data/changelog\n  retention_hours: 0.5")
    assert parse(text, CDC_SOURCE_DSN="x").changelog.retention_hours == 0.5


def test_changelog_fold_policy_default_and_setting() -> None:
    defaults = parse(EXAMPLE, CDC_SOURCE_DSN="x")
    assert (defaults.changelog.fold_min_share, defaults.changelog.fold_max_segments) == (0.25, 200)
    settings = "  path: ./data/changelog\n  fold_min_share: 0\n  fold_max_segments: 50"
    config = parse(EXAMPLE.replace("  path: ./data/changelog", settings), CDC_SOURCE_DSN="x")
    assert (config.changelog.fold_min_share, config.changelog.fold_max_segments) == (0.0, 50)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("fold_min_share: -0.5", r"changelog.fold_min_share: expected a number, 0 or more, got -0.5"),
        ("fold_min_share: a quarter", r"changelog.fold_min_share: expected a number, 0 or more, got 'a quarter'"),
        ("fold_max_segments: 0", r"changelog.fold_max_segments: expected a positive integer, got 0"),
    ],
)
def test_changelog_fold_policy_mistakes_are_refused(setting: str, message: str) -> None:
    text = EXAMPLE.replace("  path: ./data/changelog", f"  path: ./data/changelog\n  {setting}")
    with pytest.raises(ConfigError, match=message):
        parse(text, CDC_SOURCE_DSN="x")


@pytest.mark.parametrize("value", ["-1", "a week", "true", ".nan", ".inf"])
def test_changelog_retention_mistakes_are_refused(value: str) -> None:
    text = EXAMPLE.replace("  path: ./data/changelog", f"  path: ./data/changelog\n  retention_hours: {value}")
    with pytest.raises(ConfigError, match=r"changelog.retention_hours: expected a number of hours, 0 or more, got"):
        parse(text, CDC_SOURCE_DSN="x")


def test_small_table_writer_is_a_choice() -> None:
    assert parse(EXAMPLE, CDC_SOURCE_DSN="x").warehouse.small_table_writer == "delta-rs"
    spark = EXAMPLE.replace(
        "  path: s3://bucket/warehouse/", "  path: s3://bucket/warehouse/\n  small_table_writer: spark"
    )
    assert parse(spark, CDC_SOURCE_DSN="x").warehouse.small_table_writer == "spark"
    message = r"warehouse.small_table_writer: expected 'delta-rs' or 'spark', got 'rust'"
    with pytest.raises(ConfigError, match=message):
        parse(spark.replace("writer: spark", "writer: rust"), CDC_SOURCE_DSN="x")


def test_merge_sensors_is_a_choice() -> None:
    assert parse(EXAMPLE, CDC_SOURCE_DSN="x").schedule.merge_sensors == "auto"
    shared = parse(EXAMPLE + "schedule: {merge_sensors: shared}\n", CDC_SOURCE_DSN="x")
    assert shared.schedule.merge_sensors == "shared"
    message = r"schedule.merge_sensors: expected 'auto' or 'per_table' or 'shared', got 'per-table'"
    with pytest.raises(ConfigError, match=message):
        parse(EXAMPLE + "schedule: {merge_sensors: per-table}\n", CDC_SOURCE_DSN="x")


def test_drain_defaults_and_settings() -> None:
    defaults = parse(EXAMPLE, CDC_SOURCE_DSN="x").drain
    assert (defaults.follow_seconds, defaults.commit_seconds) == (0.0, 2.0)
    following = parse(EXAMPLE + "drain: {follow_seconds: 3600, commit_seconds: 0.5}\n", CDC_SOURCE_DSN="x").drain
    assert (following.follow_seconds, following.commit_seconds) == (3600.0, 0.5)


@pytest.mark.parametrize(
    ("setting", "message"),
    [
        ("drain: {follow_seconds: -1}", r"drain.follow_seconds: expected a number of seconds, 0 or more, got -1"),
        ("drain: {commit_seconds: 0}", r"drain.commit_seconds: expected a number of seconds above 0, got 0.0"),
        ("drain: {commit_seconds: soon}", r"drain.commit_seconds: expected a number of seconds, 0 or more, got 'soon'"),
        ("drain: {follow: 10}", r"drain.follow: unknown setting"),
    ],
)
def test_drain_mistakes_are_refused(setting: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse(EXAMPLE + setting + "\n", CDC_SOURCE_DSN="x")


def test_a_catalog_and_a_metastore_database() -> None:
    """``warehouse.catalog`` names the Spark catalog of the mirrors; ``spark.metastore_dsn`` is a
    libpq DSN the loader checks the metastore's JDBC driver can use, never echoed."""
    text = EXAMPLE.replace("  path: s3://bucket/warehouse/", "  path: s3://bucket/warehouse/\n  catalog: spark_catalog")
    dsn = "postgresql://hive:hunter2@meta.example.com:6543/metastore?sslmode=require"
    config = parse(
        text.replace("  master: local[2]", f"  master: local[2]\n  metastore_dsn: '{dsn}'"), CDC_SOURCE_DSN="x"
    )
    assert config.warehouse.catalog == "spark_catalog" and config.spark.metastore_dsn == dsn
    assert "hunter2" not in repr(config)
    assert parse(EXAMPLE, CDC_SOURCE_DSN="x").warehouse.catalog is None
    with pytest.raises(ConfigError, match=r"warehouse.catalog: expected a name of letters, digits and underscores"):
        parse(text.replace("catalog: spark_catalog", "catalog: my-lake"), CDC_SOURCE_DSN="x")


@pytest.mark.parametrize(
    ("dsn", "message"),
    [
        ("host=/var/run/postgresql dbname=m", r"spark.metastore_dsn: needs one TCP host .*got /var/run/postgresql"),
        ("host=a,b dbname=m", r"spark.metastore_dsn: needs one TCP host"),
        ("host=db", r"spark.metastore_dsn: names no database"),
        ("host=db dbname=m target_session_attrs=any", r"spark.metastore_dsn: target_session_attrs has no JDBC"),
        ("host=db password=hunter2 = broken", r"spark.metastore_dsn: not a PostgreSQL connection string"),
    ],
)
def test_metastore_dsn_mistakes_are_refused(dsn: str, message: str) -> None:
    text = EXAMPLE.replace("  master: local[2]", f"  master: local[2]\n  metastore_dsn: '{dsn}'")
    with pytest.raises(ConfigError, match=message) as caught:
        parse(text, CDC_SOURCE_DSN="x")
    assert "hunter2" not in str(caught.value)


@pytest.mark.parametrize(
    ("dsn", "url"),
    [
        ("host=db.example.com dbname=metastore", "jdbc:postgresql://db.example.com:5432/metastore"),
        (
            "postgresql://u:p@10.0.0.5:6543/hive?sslmode=verify-full",
            "jdbc:postgresql://10.0.0.5:6543/hive?sslmode=verify-full",
        ),
        ("host=::1 port=5 dbname=m", "jdbc:postgresql://[::1]:5/m"),
    ],
)
def test_the_metastore_jdbc_url(dsn: str, url: str) -> None:
    assert jdbc_url(dsn) == url
