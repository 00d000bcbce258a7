"""Maintenance benchmark: which way of keeping a merged Delta table compact serves best.

    python benchmarks/maintenance.py [--rows 200k] [--changes 1000] [--cycles 40] [--every 10]
                                     [--strategies none,optimize,zorder,auto,liquid] [--out maintenance.json]

One base table of ``--rows`` rows (the apply benchmark's ``public.big``: bigint key and six columns,
created as the apply creates tables: deletion vectors, column mapping), copied once per strategy;
on each copy, after an untimed warm-up of ``--every`` merges on another copy, ``--cycles`` merges of ``--changes`` changes with keys drawn uniformly over the live
keys (80% updates, 10% deletes, 10% inserts of new keys) through the project's apply path
(``planner.plan_changes`` + ``merge.write_plan``, each commit recording its LSN). Strategies:

* ``none``: merges only;
* ``optimize``: every ``--every`` merges, ``maintenance.maintain_table`` with the default settings
  (OPTIMIZE, REORG … APPLY (PURGE) when due; VACUUM off: nothing is old enough here);
* ``zorder``: the same with ``zorder`` (OPTIMIZE ZORDER BY the key);
* ``auto``: Delta's auto-compaction after merges (``delta.autoOptimize.autoCompact`` on the
  table, Delta's default thresholds), no scheduled maintenance;
* ``liquid``: ``ALTER TABLE … CLUSTER BY (id)``, then the ``optimize`` schedule (OPTIMIZE
  clusters).

Reported per strategy: median merge seconds of the last ``--every`` cycles, total merge seconds,
total maintenance seconds, data files and deletion-vector files at the end, and the time of a full
read (``sum(hash(*))`` over every row) and of a point lookup by key at the end. The strategies take
turns cycle by cycle, so a busy moment of a shared machine falls on all of them. Every run checks
the row count and that maintenance left the applied LSN unchanged.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import _common as common
import numpy as np
from apply import FIRST_COMMIT, KEYED, SLOT, TABLE, build_base, change_records, parse_count

from cdc_assets.apply.maintenance import maintain_table
from cdc_assets.apply.merge import write_plan
from cdc_assets.apply.session import quiet_start, spark_session
from cdc_assets.apply.table_files import table_files
from cdc_assets.apply.target import DeltaTarget, app_id
from cdc_assets.changelog.planner import plan_changes
from cdc_assets.config import MaintenanceConfig, SparkConfig
from cdc_assets.pgoutput.records import ChangeChunk

STRATEGIES = ("none", "optimize", "zorder", "auto", "liquid")
SCHEDULED = MaintenanceConfig(vacuum_retention_hours=0)


def cycle_changes(live: np.ndarray, next_key: int, n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """``n`` changes over ``live`` keys: ops and keys (80% updates, 10% deletes, 10% new keys)."""
    updates, deletes = int(n * 0.8), int(n * 0.1)
    inserts = n - updates - deletes
    existing = rng.choice(live, size=updates + deletes, replace=False)
    keys = np.concatenate([existing, np.arange(next_key, next_key + inserts, dtype=np.int64)])
    ops = np.array(["update"] * updates + ["delete"] * deletes + ["insert"] * inserts, dtype=object)
    order = rng.permutation(n)
    return ops[order], keys[order]


@dataclass
class Run:
    """One strategy's copy of the base table and what it measured."""

    strategy: str
    target: DeltaTarget
    rng: np.random.Generator
    live: np.ndarray
    next_key: int
    merges: list[float] = field(default_factory=list)
    maintenance: list[float] = field(default_factory=list)
    files: list[int] = field(default_factory=list)

    def cycle(self, number: int, args: argparse.Namespace) -> None:
        """One merge, then the scheduled maintenance when it is due."""
        ops, keys = cycle_changes(self.live, self.next_key, args.changes, self.rng)
        records, lsn = change_records(KEYED, ops, keys, 100, FIRST_COMMIT + number * 0x1000_0000)
        started = time.perf_counter()
        write_plan(self.target, plan_changes([ChangeChunk(KEYED, records)], KEYED), lsn)
        self.merges.append(time.perf_counter() - started)
        self.live = np.concatenate([np.setdiff1d(self.live, keys[ops == "delete"]), keys[ops == "insert"]])
        self.next_key += int((ops == "insert").sum())
        if self.strategy in ("optimize", "zorder", "liquid") and (number + 1) % args.every == 0:
            settings = replace(SCHEDULED, zorder=self.strategy == "zorder")
            done = maintain_table(self.target, settings, TABLE, "id")
            self.maintenance.append(done.elapsed_s)
            assert done.applied_lsn == lsn, (self.strategy, number, done.applied_lsn, lsn)
        self.files.append(table_files(self.target.path).files)

    def report(self, args: argparse.Namespace) -> dict[str, Any]:
        """The end state, a full read and a point lookup; checks rows and the applied LSN."""
        spark, path = self.target.spark, self.target.path
        end = table_files(path)
        started = time.perf_counter()
        spark.read.format("delta").load(path).selectExpr("sum(hash(*))").collect()
        full_read = time.perf_counter() - started
        probe = int(self.rng.choice(self.live))
        started = time.perf_counter()
        found = spark.read.format("delta").load(path).where(f"id = {probe}").count()
        lookup = time.perf_counter() - started
        rows = spark.read.format("delta").load(path).count()
        assert rows == len(self.live) and found == 1, (self.strategy, rows, len(self.live), found)
        return {
            "strategy": self.strategy,
            "merge_s": self.merges,
            "maintenance_s": self.maintenance,
            "files": self.files,
            "last_merges_median_s": statistics.median(self.merges[-args.every :]),
            "merge_total_s": sum(self.merges),
            "maintenance_total_s": sum(self.maintenance),
            "end": {"files": end.files, "deletion_vectors": end.deletion_vectors, "bytes": end.bytes},
            "full_read_s": full_read,
            "lookup_s": lookup,
        }


def start_run(spark: Any, strategy: str, base: Path, path: Path, args: argparse.Namespace) -> Run:
    shutil.copytree(base, path)
    target = DeltaTarget(spark, str(path), app_id(SLOT, TABLE))
    if strategy == "auto":
        spark.sql(f"ALTER TABLE {target.sql_name} SET TBLPROPERTIES ('delta.autoOptimize.autoCompact' = 'true')")
    if strategy == "liquid":
        spark.sql(f"ALTER TABLE {target.sql_name} CLUSTER BY (id)")
    live = np.arange(1, args.rows + 1, dtype=np.int64)
    return Run(strategy, target, np.random.default_rng(args.seed), live, args.rows + 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=parse_count, default=200_000, help="rows of the base table")
    parser.add_argument("--rows-per-file", type=parse_count, default=50_000)
    parser.add_argument("--changes", type=parse_count, default=1_000, help="changes per merge")
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--every", type=int, default=10, help="merges between scheduled maintenance runs")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--master", default="local[2]")
    parser.add_argument("--seed", type=int, default=20261125)
    parser.add_argument("--out", "--json", dest="out", help="write the results to this JSON file")
    args = parser.parse_args()
    strategies = args.strategies.split(",")
    code = common.code_version()
    load = common.load_snapshot()
    workdir = Path(tempfile.mkdtemp(prefix="cdc-bench-maintenance-"))
    with quiet_start():
        spark = spark_session(SparkConfig(master=args.master, conf={"spark.ui.enabled": "false"}))
    spark.sparkContext.setLogLevel("ERROR")
    try:
        base = workdir / "base"
        build_base(spark, base, args.rows, args.rows_per_file)
        warm_up = start_run(spark, "none", base, workdir / "warm-up", args)
        for number in range(args.every):
            warm_up.cycle(number, args)
        runs = [start_run(spark, strategy, base, workdir / strategy, args) for strategy in strategies]
        for number in range(args.cycles):  # round-robin, so the machine's load falls on every strategy alike
            print(f"cycle {number + 1} of {args.cycles}", flush=True)
            for run in runs:
                run.cycle(number, args)
        reports = [run.report(args) for run in runs]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    rows = [
        (
            r["strategy"],
            f"{r['last_merges_median_s']:.2f}",
            f"{r['merge_total_s']:.1f}",
            f"{r['maintenance_total_s']:.1f}",
            f"{r['merge_total_s'] + r['maintenance_total_s']:.1f}",
            r["end"]["files"],
            r["end"]["deletion_vectors"],
            f"{r['full_read_s']:.2f}",
            f"{r['lookup_s']:.2f}",
        )
        for r in reports
    ]
    headers = (
        "strategy",
        f"merge s, median of last {args.every}",
        "merges s",
        "maintenance s",
        "total s",
        "files at end",
        "DV files at end",
        "full read s",
        "lookup s",
    )
    print(common.table(headers, rows))
    print(common.describe_code(code, common.code_version()))
    print("before:", common.describe_load(load), "\nafter:", common.describe_load(common.load_snapshot()))
    common.write_json(
        args.out, {"benchmark": "maintenance", "command": " ".join(["python", *sys.argv]), "runs": reports}
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
