"""Schema-migration benchmark: ``ALTER TABLE … ADD COLUMN … DEFAULT`` on a large table, applied in
place, against copying the table again.

    python benchmarks/migration.py [--pg 16] [--rows 1000000] [--json out.json]

A throwaway cluster gets one table of ``--rows`` rows (bigint key, int, text, timestamptz,
numeric), set up, drained and applied once (not timed) into a local change log and a local Delta
table, on ``spark.master local[2]``. Then, twice each in turn (the first round warms Spark's code
for each statement; round 2 is the figure), ``ALTER TABLE t ADD COLUMN e<n> int DEFAULT <v>`` and
one update, and, timed:

* **in place**: a drain and an apply — the DDL's message, the column added to the Delta table and
  its default filled into every row it holds (one ``MERGE … ON true``), the update merged;
* **copied again**: ``cdc_assets.pipeline.online_snapshot.snapshot_tables`` of the table (what a
  re-copy costs), a drain to its announcement and an apply (the Delta table overwritten).

Both end with the mirror equal to the source (its row count and the default's sum are checked).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import _common as common

from cdc_assets.apply.runner import apply_tables
from cdc_assets.apply.session import spark_session
from cdc_assets.config import load_config
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.online_snapshot import snapshot_tables
from cdc_assets.pipeline.setup import setup

TABLE = "public.t"
CREATE = "CREATE TABLE t (id bigint PRIMARY KEY, k int, label text, created timestamptz, amount numeric(12,2))"
FILL = (
    "INSERT INTO t SELECT g, g % 1000, md5(g::text), timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second',"
    " (g % 100000) / 100.0 FROM generate_series(1, {rows}) g"
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--json")
    args = parser.parse_args()
    cluster = common.start_cluster(args.pg)
    try:
        with tempfile.TemporaryDirectory(prefix="cdc-bench-migration-") as folder:
            results = run(cluster.dsn(), Path(folder), args.rows)
    finally:
        cluster.stop()
    print(
        common.table(
            ["path", "seconds", "rows"],
            [[name, f"{r['seconds']:.1f}", f"{r['rows']:,}"] for name, r in results.items()],
        )
    )
    ratio = results["copied again, round 2"]["seconds"] / results["in place, round 2"]["seconds"]
    print(f"round 2: in place is {ratio:.1f}x faster than copying {args.rows:,} rows again")
    common.write_json(args.json, {"machine": common.machine(), "rows": args.rows, "results": results, "ratio": ratio})
    return 0


def run(dsn: str, work: Path, rows: int) -> dict[str, dict[str, Any]]:
    import psycopg

    document = {
        "source": {"dsn": dsn, "publication": "bench_pub", "slot": "bench_slot"},
        "changelog": {"path": str(work / "changelog")},
        "warehouse": {"path": str(work / "warehouse")},
        "spark": {"master": "local[2]", "conf": {"spark.sql.shuffle.partitions": "4", "spark.ui.enabled": "false"}},
        "tables": {TABLE: {}},
    }
    (work / "cdc.yaml").write_text(json.dumps(document), encoding="utf-8")  # JSON is YAML
    config = load_config(work / "cdc.yaml")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(CREATE)
        conn.execute(FILL.format(rows=rows))
        conn.execute("VACUUM ANALYZE t")
        setup(config)
        spark = spark_session(config.spark, app_name="cdc-assets-bench-migration")
        drain(config, wait=True)
        apply_tables(config, spark)
        results = {}
        paths = [("in place", "e", "7"), ("copied again", "e", "8")] * 2  # twice each: the first warms Spark
        for round, (name, column, default) in enumerate(paths):
            column = f"{column}{round}"
            conn.execute(f"ALTER TABLE t ADD COLUMN {column} int DEFAULT {default}")
            conn.execute("UPDATE t SET k = -1 WHERE id = 1")
            started = time.monotonic()
            if name == "copied again":
                snapshot_tables(config, [TABLE])
            drain(config, wait=True)
            (applied,) = apply_tables(config, spark)
            seconds = time.monotonic() - started
            assert applied.skipped is None, applied.summary()
            (count, total) = spark.sql(
                f"SELECT count(*), sum({column}) FROM delta.`{config.target_path(config.tables[0])}`"
            ).first()
            expected = conn.execute(f"SELECT count(*), sum({column}) FROM t").fetchone()
            assert (count, total) == expected, f"{name}: Delta {(count, total)}, source {expected}"
            results[f"{name}, round {round // 2 + 1}"] = {
                "seconds": seconds,
                "rows": count,
                "write": applied.write,
                "columns": applied.columns,
            }
        spark.stop()
    return results


if __name__ == "__main__":
    raise SystemExit(main())
