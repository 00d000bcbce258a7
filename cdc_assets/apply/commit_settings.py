"""The Spark session settings a Delta commit of cdc-assets runs with, set around its statement and
the session's own put back after: Delta's idempotency marker and user metadata, and the settings
that make a commit into a small table cheap (docs/architecture.md, "Small tables")."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from pyspark.sql import SparkSession

TXN_APP_ID = "spark.databricks.delta.write.txnAppId"
TXN_VERSION = "spark.databricks.delta.write.txnVersion"
USER_METADATA = "spark.databricks.delta.commitInfo.userMetadata"
# A commit into a small table: the files a MERGE or a REPLACE ON changes are rewritten instead of
# marked in deletion vectors; its plan runs as planned, in one partition after each shuffle
# (adaptive execution makes a Spark job of every shuffle stage — 4 of a tiny MERGE's 11 jobs — and
# without it the rewrite writes a file per shuffle partition); a source that is the batch's own rows
# is not copied first (Delta materializes a MERGE's source lest a second read give other rows: rows
# held in the driver cannot); a small batch's expressions are evaluated without generating code.
MERGE_DELETION_VECTORS = "spark.databricks.delta.merge.deletionVectors.persistent"
DELETE_DELETION_VECTORS = "spark.databricks.delta.delete.deletionVectors.persistent"
ADAPTIVE_EXECUTION = "spark.sql.adaptive.enabled"
SHUFFLE_PARTITIONS = "spark.sql.shuffle.partitions"
MATERIALIZE_SOURCE = "spark.databricks.delta.merge.materializeSource"
CODEGEN_FACTORY = "spark.sql.codegen.factoryMode"
SMALL_BATCH_ROWS = 10_000
REPLACE_MATERIALIZE_SOURCE = "spark.databricks.delta.insertReplaceOnOrUsing.materializeSource"
"""Whether a REPLACE ON copies its rows before it starts (lest its two reads of them differ): never
for :meth:`~cdc_assets.apply.target.DeltaTarget.replace`, whose rows are a batch's, held in the
driver."""


def small_table_settings(batch_rows: int, local_source: bool) -> dict[str, str]:
    """The settings of a commit of ``batch_rows`` rows into a small table: a MERGE or REPLACE ON
    rewrites the files it changes (no deletion vectors), runs without adaptive execution in one
    shuffle partition, and does not copy a ``local_source`` (the batch's rows alone, not a read of
    the table) before it starts; a batch of fewer than :data:`SMALL_BATCH_ROWS` rows is evaluated
    without generated code — each costs a tiny MERGE more than it saves."""
    settings = {
        MERGE_DELETION_VECTORS: "false",
        DELETE_DELETION_VECTORS: "false",
        ADAPTIVE_EXECUTION: "false",
        SHUFFLE_PARTITIONS: "1",
    }
    if local_source:
        settings[MATERIALIZE_SOURCE] = "none"
    if batch_rows < SMALL_BATCH_ROWS:
        settings[CODEGEN_FACTORY] = "NO_CODEGEN"
    return settings


@contextmanager
def settings_around(spark: SparkSession, settings: Mapping[str, str]) -> Iterator[None]:
    """``settings`` on the session while the block runs; the session's own values (its 16 shuffle
    partitions, a user's) put back after, and a setting it did not have unset."""
    conf = spark.conf
    before = conf.getAll
    for key, value in settings.items():
        conf.set(key, value)
    try:
        yield
    finally:
        for key in settings:
            if key in before:
                conf.set(key, before[key])
            else:
                conf.unset(key)
