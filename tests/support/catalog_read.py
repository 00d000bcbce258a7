"""A classic Spark application that reads every configured mirror by name from the configuration's
catalog: ``python -m tests.support.catalog_read CONFIG FOLDER`` writes each table's rows, as Spark
reads ``<catalog>.<schema>.<table>``, to ``FOLDER/<schema>.<table>.arrow`` (Arrow IPC), so a test
can compare what a second Spark application sees through the shared metastore."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow as pa

from cdc_assets.apply.catalog import catalog_name
from cdc_assets.apply.session import spark_session
from cdc_assets.config import load_config


def main(config_file: str, folder: str) -> None:
    config = load_config(config_file)
    assert config.warehouse.catalog is not None
    spark = spark_session(config.spark, "catalog reader")
    for table in config.tables:
        rows = spark.table(catalog_name(config.warehouse.catalog, table.name)).toArrow()
        with (
            pa.OSFile(str(Path(folder, f"{table.name}.arrow")), "wb") as sink,
            pa.ipc.new_file(sink, rows.schema) as out,
        ):
            out.write_table(rows)
    spark.stop()


if __name__ == "__main__":
    main(*sys.argv[1:])
