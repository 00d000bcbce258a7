"""The test run's one Spark session (the ``spark`` fixture) serves Spark Connect as well: the
commands a test runs in a subprocess reach it through ``spark.remote`` (:data:`COMMANDS_SPARK`)
instead of each starting a JVM of its own, and find it warm.

Spark's own Connect plugin (``spark-connect_2.13-*.jar``, shipped in pyspark's ``jars/``) listens
inside the session's driver: the commands' sessions share its SparkContext, its Delta extension
and catalog settings (those of ``cdc-assets spark-server`` for the same configuration, without a
storage or catalog section). A test about a command's own Spark (its JVM's start, its kill, a
bucket or a Hive metastore reached from the command) gives the command :data:`OWN_SPARK`.
"""

from __future__ import annotations

from typing import Any

from tests.support.spark_server import free_port

PORT = free_port()
SETTINGS = {
    "spark.plugins": "org.apache.spark.sql.connect.SparkConnectPlugin",
    "spark.connect.grpc.binding.address": "127.0.0.1",
    "spark.connect.grpc.binding.port": str(PORT),
}
COMMANDS_SPARK: dict[str, Any] = {"remote": f"sc://127.0.0.1:{PORT}", "conf": {"spark.sql.shuffle.partitions": "2"}}
OWN_SPARK: dict[str, Any] = {
    "master": "local[1]",
    "conf": {
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "2",
        "spark.default.parallelism": "1",
        "spark.driver.memory": "1g",
    },
}
