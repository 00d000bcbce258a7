"""Mirrors by name: each Delta table registered as an external table of a Spark catalog
(``warehouse.catalog``) — ``public.orders`` as ``<catalog>.public.orders``, a database per source
schema.

A merge registers its table the first time in a process that it finds the table or creates it:
``CREATE SCHEMA IF NOT EXISTS``, ``CREATE TABLE IF NOT EXISTS … USING delta LOCATION``, then a
check that the name is this table's (a table of that name elsewhere is an error, never replaced).
The entry holds the name and the location only: Delta's catalog reads a table's columns from its
log at every lookup (a Hive metastore keeps an empty column list for a Delta table), so a column a
merge adds shows by name at once, and there is no second copy of the schema to keep true.
Dropping an entry (``setup --prune``) leaves the table's files.
"""

from __future__ import annotations

from collections.abc import Callable

from pyspark.errors import AnalysisException
from pyspark.sql import SparkSession

from cdc_assets.apply.spark_literals import backquote, sql_string
from cdc_assets.errors import CdcError
from cdc_assets.names import TableName

SESSION_CATALOG = "spark_catalog"
_registered: set[tuple[str, str, str]] = set()  # (catalog, table, location) registered by this process


class CatalogError(CdcError):
    """A mirror cannot be registered by name."""


def catalog_name(catalog: str, table: TableName) -> str:
    """The mirror's name in ``catalog``, quoted for Spark SQL (``spark_catalog.`public`.`orders```)."""
    return f"{catalog}.{backquote(table.schema)}.{backquote(table.name)}"


def register_mirror(spark: SparkSession, catalog: str, table: TableName, location: str) -> None:
    """Register the Delta table at ``location`` as ``table`` in ``catalog`` (once per process)."""
    key = (catalog, str(table), location)
    if key in _registered:
        return
    name = catalog_name(catalog, table)
    if catalog == SESSION_CATALOG:
        _require_metastore(spark, name)
    _unless_exists(lambda: spark.sql(f"CREATE SCHEMA IF NOT EXISTS {catalog}.{backquote(table.schema)}"))
    _unless_exists(lambda: spark.sql(f"CREATE TABLE IF NOT EXISTS {name} USING delta LOCATION {sql_string(location)}"))
    found = registered_location(spark, name)
    if found is None or not same_location(found, location):
        raise CatalogError(
            f"{name} already names the table at {found or 'no Delta location'}, not the mirror of {table} at"
            f" {location}: drop that entry (DROP TABLE {name}) or set warehouse.catalog to another catalog"
        )
    _registered.add(key)


def unregister_mirrors(spark: SparkSession, catalog: str, tables: list[tuple[TableName, str]]) -> list[str]:
    """Drop the catalog entries of the mirrors ``(table, location)`` that name them — the files stay
    (external tables); returns the names dropped."""
    dropped = []
    for table, location in tables:
        name = catalog_name(catalog, table)
        found = registered_location(spark, name)
        if found is not None and same_location(found, location):
            spark.sql(f"DROP TABLE IF EXISTS {name}")
            _registered.discard((catalog, str(table), location))
            dropped.append(f"{catalog}.{table}")
    return dropped


def registered_location(spark: SparkSession, name: str) -> str | None:
    """Where the catalog's ``name`` keeps its Delta table (None: no such table, or not Delta)."""
    try:
        row = spark.sql(f"DESCRIBE DETAIL {name}").first()
    except AnalysisException:  # no such table, or not one DESCRIBE DETAIL (Delta's) can describe
        return None
    return None if row is None or row["format"] != "delta" else str(row["location"])


def same_location(found: str, location: str) -> bool:
    """Whether Spark's spelling of a table's location (``file:/tmp/w/t``) is ``location``."""
    return _plain(found) == _plain(location)


def _plain(location: str) -> str:
    if location.startswith("file:"):
        location = "/" + location.removeprefix("file:").lstrip("/")
    return location.rstrip("/")


def _require_metastore(spark: SparkSession, name: str) -> None:
    """The session catalog keeps its tables beyond this application (a Hive metastore)."""
    if spark.conf.get("spark.sql.catalogImplementation", "in-memory") != "hive":
        raise CatalogError(
            f"cannot register {name}: warehouse.catalog is {SESSION_CATALOG}, but this Spark keeps its catalog in"
            " memory and forgets it when it stops; set spark.metastore_dsn (a PostgreSQL database for Spark's"
            " Hive metastore), or Hive metastore settings in spark.conf"
        )


def _unless_exists(statement: Callable[[], object]) -> None:
    """Run a ``CREATE … IF NOT EXISTS``; another process creating the same thing meanwhile is no error."""
    try:
        statement()
    except AnalysisException as error:
        if "ALREADY_EXISTS" not in str(error):
            raise
