"""A table's applied LSN recorded without Spark: the idempotent-write marker the apply commits
(``txnAppId`` / ``txnVersion``), written by delta-rs on a Delta table of no rows. What reads only
the applied LSN (retention, the merge sensors) sees a table applied up to there."""

from __future__ import annotations

import pyarrow as pa
from deltalake import CommitProperties, Transaction, write_deltalake

from cdc_assets.apply.target import app_id
from cdc_assets.config import Config


def mark_applied(config: Config, table: str, lsn: int) -> None:
    """Record ``lsn`` as ``table``'s applied LSN in its Delta log, as the apply's commit does."""
    marker = Transaction(app_id(config.source.slot, table), lsn)
    write_deltalake(
        config.target_path(config.table(table)),
        pa.table({"marker": pa.array([], pa.int64())}),
        mode="append",
        commit_properties=CommitProperties(app_transactions=[marker]),
    )
