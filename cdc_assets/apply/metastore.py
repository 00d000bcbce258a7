"""Spark's Hive metastore in a PostgreSQL database (``spark.metastore_dsn``).

A Spark application keeps its catalog — databases, and tables by name — in a metastore; Spark's
default one lives in memory and is forgotten when the application stops. With
``spark.metastore_dsn`` every Spark application the configuration starts (a run's classic session,
``cdc-assets spark-server``) uses Spark's own Hive client with the metastore's tables in that
PostgreSQL database, so all of them, and any other Spark given the same settings, see the same
tables by name.

Two settings differ from what Hive's documentation suggests, both found on this stack:

* PostgreSQL's JDBC driver goes on the driver's own class path (``spark.driver.extraClassPath``):
  the metastore opens its connections through ``java.sql.DriverManager``, which does not see the
  jars of ``spark.jars`` or ``spark.jars.packages`` ("No suitable driver"). The jar is fetched once
  from Maven Central into the cache folder and its SHA-256 checked; a class path that already
  names a ``postgresql`` jar, or Spark's own jars holding one (deploy/Dockerfile's image), is used
  as it is.
* The metastore's tables are created on first use without foreign keys
  (``datanucleus.schema.autoCreateConstraints=false``): with them, the metastore adds a foreign key
  on one connection while its open transaction on another holds the table the key references, and
  on PostgreSQL the two wait on each other for good (the first ``CREATE TABLE`` hangs). A metastore
  database shared with Hive's own tools is better made by Hive's ``schematool`` first; these
  settings then use the tables they find.
"""

from __future__ import annotations

import getpass
import hashlib
import os
import urllib.request
from collections.abc import Mapping
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

from cdc_assets.apply.java_runtime import cache_folder
from cdc_assets.config.jdbc import jdbc_url
from cdc_assets.errors import ConfigError

DRIVER_VERSION = "42.7.8"
DRIVER_SHA256 = "2a32a9dcbc42d67a50ad3a0de5efd102c8d2be46720045f2cbd6689f160ab7c7"
DRIVER_URL = (
    f"https://repo1.maven.org/maven2/org/postgresql/postgresql/{DRIVER_VERSION}/postgresql-{DRIVER_VERSION}.jar"
)
CLASS_PATH = "spark.driver.extraClassPath"


def metastore_settings(dsn: str, conf: Mapping[str, str], driver_in_spark: bool) -> dict[str, str]:
    """The Spark settings of a Hive metastore in the PostgreSQL database at ``dsn``; ``conf`` is the
    user's ``spark.conf``, whose driver class path gets the JDBC driver unless it names one or
    Spark's own jars have it (``driver_in_spark``)."""
    parts = conninfo_to_dict(dsn)
    jdo = "spark.hadoop.javax.jdo.option."
    settings = {
        "spark.sql.catalogImplementation": "hive",
        f"{jdo}ConnectionURL": jdbc_url(dsn),
        f"{jdo}ConnectionDriverName": "org.postgresql.Driver",
        # libpq's defaults where the DSN names no user or password
        f"{jdo}ConnectionUserName": str(parts.get("user") or os.environ.get("PGUSER") or getpass.getuser()),
        f"{jdo}ConnectionPassword": str(parts.get("password") or os.environ.get("PGPASSWORD") or ""),
        "spark.hadoop.datanucleus.schema.autoCreateTables": "true",
        "spark.hadoop.datanucleus.schema.autoCreateColumns": "true",
        "spark.hadoop.datanucleus.schema.autoCreateConstraints": "false",
        "spark.hadoop.hive.metastore.schema.verification": "false",
    }
    class_path = conf.get(CLASS_PATH, "")
    if not driver_in_spark and "postgresql" not in class_path:
        settings[CLASS_PATH] = os.pathsep.join(filter(None, [class_path, str(jdbc_driver_jar())]))
    return settings


def jdbc_driver_jar() -> Path:
    """PostgreSQL's JDBC driver jar in the cache folder, fetched from Maven Central the first time."""
    jar = cache_folder() / "jars" / f"postgresql-{DRIVER_VERSION}.jar"
    if jar.exists():
        return jar
    jar.parent.mkdir(parents=True, exist_ok=True)
    try:
        with urllib.request.urlopen(DRIVER_URL, timeout=120) as response:
            content = response.read()
    except OSError as error:
        raise ConfigError(
            f"spark.metastore_dsn: cannot fetch PostgreSQL's JDBC driver from {DRIVER_URL} ({error}); put a"
            f" postgresql jar on {CLASS_PATH} in spark.conf instead"
        ) from None
    digest = hashlib.sha256(content).hexdigest()
    if digest != DRIVER_SHA256:
        raise ConfigError(f"the JDBC driver fetched from {DRIVER_URL} has SHA-256 {digest}, not {DRIVER_SHA256}")
    partial = jar.with_name(f"{jar.name}.{os.getpid()}.part")
    partial.write_bytes(content)
    partial.replace(jar)
    return jar
