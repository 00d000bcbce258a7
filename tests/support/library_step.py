"""``python -m tests.support.library_step rebuild|history CONFIG TABLE``: the library calls of
Dagster's ``cdc/rebuild`` asset and of a table's history asset (today's partition), in a process of
their own, so that a test can kill them at a fault point (``CDC_ASSETS_FAULT``)."""

from __future__ import annotations

import sys
from datetime import UTC, datetime

from cdc_assets.apply.history import history_rows, write_history
from cdc_assets.apply.runner import rebuild_table
from cdc_assets.apply.session import spark_session
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import load_config
from dagster_project.assets import history_path


def main(step: str, config_path: str, table_name: str) -> None:
    config = load_config(config_path)
    table = config.table(table_name)
    spark = spark_session(config.spark)
    if step == "rebuild":
        print(rebuild_table(config, table, spark).summary())
        return
    reader = ChangeLogReader(changelog_store(config))
    state = reader.require_checkpoint().tables[table_name]
    day = datetime.now(UTC).date()
    rows = history_rows(reader, table_name, state, day)
    path = history_path(config, table)
    written = write_history(spark, path, rows, day, config.warehouse.table_properties, config.delta_storage_options)
    print(f"{table_name}: {written} history rows for {day}")


if __name__ == "__main__":
    main(*sys.argv[1:])
