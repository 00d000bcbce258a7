"""Parallel merges benchmark: one apply over many tables, serial against ``spark.parallel_merges``.

    python benchmarks/parallel_merges.py [--pg 16] [--tables 20] [--rows 100000] [--changes 1000]
                                         [--rounds 6] [--parallel 4] [--out parallel.json]

A throwaway PostgreSQL gets ``--tables`` tables of ``--rows`` rows each (bigint key, int,
32-character text, numeric(12,2), timestamptz) in one publication; ``cdc_assets.pipeline.setup.setup``
copies them and one untimed apply writes the Delta tables, on one warm local Spark session
(``spark.master`` ``local[2]``, the default). Each round then commits, per table, one transaction
of ``--changes`` changes with random keys (80% updates of live keys, 10% deletes, 10% inserts of
new keys), drains them (``cdc_assets.pipeline.drain.drain``), and times one
``cdc_assets.apply.runner.apply_tables`` over every table, with the CPU seconds this process and
the JVM spent meanwhile — with ``spark.parallel_merges`` 1
(serial) or ``--parallel``, after one untimed round that warms the session up, the two taking
turns in the order A B B A A B … so that a drift of the machine falls on both. The figure is the median apply of each setting and their ratio (target:
parallel ≤ 0.6 × serial). Finally every Delta table is compared with its source
(``cdc_assets.pipeline.parity.verify_table``). Output: the table of rounds and the verdict; ``--out``: JSON.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import _common as common
import numpy as np
import psutil
import psycopg
from soak import ChangingTable

from cdc_assets.apply.runner import apply_tables
from cdc_assets.apply.session import quiet_start, spark_session
from cdc_assets.config import Config, load_config
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.parity import verify_table
from cdc_assets.pipeline.setup import setup

PUBLICATION = "parallel_pub"


def table_names(count: int) -> list[str]:
    return [f"t{i:02d}" for i in range(1, count + 1)]


def write_config(folder: Path, dsn: str, names: list[str]) -> Config:
    document = {
        "source": {"dsn": dsn, "publication": PUBLICATION, "slot": "parallel_merges"},
        "changelog": {"path": str(folder / "changelog")},
        "warehouse": {"path": str(folder / "warehouse")},
        "tables": {f"public.{name}": {} for name in names},
    }
    path = folder / "cdc.yaml"
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")  # JSON is YAML
    return load_config(path)


def with_parallel_merges(config: Config, merges: int) -> Config:
    return replace(config, spark=replace(config.spark, parallel_merges=merges))


def settings_order(rounds: int, parallel: int) -> list[int]:
    """``parallel_merges`` per round: 1, p, p, 1, 1, p, … (each setting first as often as second)."""
    pattern = [1, parallel, parallel, 1]
    return [pattern[i % 4] for i in range(rounds)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, default=16)
    parser.add_argument("--tables", type=int, default=20)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--changes", type=int, default=1_000)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--parallel", type=int, default=4)
    parser.add_argument("--out", help="write the results to this JSON file")
    args = parser.parse_args()
    code = common.code_version()
    names = table_names(args.tables)
    work = Path(tempfile.mkdtemp(prefix="cdc-parallel-"))
    cluster = common.start_cluster(args.pg)
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            tables = [ChangingTable.create(conn, name, args.rows) for name in names]
            conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE {', '.join(names)}")
            conn.execute("VACUUM ANALYZE")
        config = write_config(work, cluster.dsn(), names)
        setup(config)
        with quiet_start():
            spark = spark_session(config.spark, "cdc-assets-parallel-merges")
        apply_tables(config, spark)  # the initial copy, not timed
        rng = np.random.default_rng(20261127)
        before = common.load_snapshot()
        rounds: list[dict[str, Any]] = []
        me = psutil.Process()
        with psycopg.connect(cluster.dsn()) as conn:
            for number, merges in enumerate([args.parallel, *settings_order(args.rounds, args.parallel)]):
                for table in tables:
                    table.commit_changes(conn, args.changes, rng)
                drained = drain(config)
                cpu = common.tree_cpu_s(me)
                started = time.perf_counter()
                applied = apply_tables(with_parallel_merges(config, merges), spark)
                seconds = time.perf_counter() - started
                cpu_s = common.tree_cpu_s(me) - cpu
                records = sum(a.records for a in applied)
                if number:  # round 0 warms the session up (the JIT, Delta's caches) and is not counted
                    rounds.append(
                        {
                            "round": number,
                            "parallel_merges": merges,
                            "apply_s": seconds,
                            "cpu_s": cpu_s,
                            "records": records,
                        }
                    )
                print(
                    f"[parallel] round {number or 'warm-up'}: {drained.total_changes:,} changes drained;"
                    f" parallel_merges {merges}: {len(applied)} tables, {records:,} records applied in {seconds:.2f} s"
                    f" ({cpu_s:.1f} CPU-s: {cpu_s / seconds:.2f} of the cores busy)",
                    flush=True,
                )
        after = common.load_snapshot()
        medians = {
            merges: statistics.median(r["apply_s"] for r in rounds if r["parallel_merges"] == merges)
            for merges in (1, args.parallel)
        }
        ratio = medians[args.parallel] / medians[1]
        parity = {name: verify_table(config, config.table(f"public.{name}"), spark).parity.ok for name in names}
        print()
        print(
            common.table(
                ["parallel_merges", "applies", "median s", "each (s)", "median CPU s", "cores busy"],
                [
                    (
                        merges,
                        sum(1 for r in rounds if r["parallel_merges"] == merges),
                        f"{medians[merges]:.2f}",
                        ", ".join(f"{r['apply_s']:.2f}" for r in rounds if r["parallel_merges"] == merges),
                        f"{statistics.median(r['cpu_s'] for r in rounds if r['parallel_merges'] == merges):.1f}",
                        f"{statistics.median(r['cpu_s'] / r['apply_s'] for r in rounds if r['parallel_merges'] == merges):.2f}",
                    )
                    for merges in (1, args.parallel)
                ],
            )
        )
        verdict = "PASS" if ratio <= 0.6 else "FAIL"
        print(
            f"\n{args.tables} tables x {args.changes:,} changes: parallel_merges {args.parallel} / serial = {ratio:.2f}"
        )
        print(f"target <= 0.6: {verdict}; parity: {sum(parity.values())} of {len(parity)} tables equal their source")
        print(f"before: {common.describe_load(before)}\nafter: {common.describe_load(after)}")
        print(common.describe_code(code, common.code_version()))
        common.write_json(
            args.out,
            {
                "args": vars(args),
                "machine": common.machine(),
                "code": code,
                "rounds": rounds,
                "medians_s": medians,
                "ratio": ratio,
                "parity": parity,
                "load": {"before": before, "after": after},
            },
        )
        return 0 if all(parity.values()) else 1
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
