"""Where one MERGE's time goes, stage by stage (a diagnostic beside ``apply.py``).

    python benchmarks/merge_stages.py [--n 100000] [--m 1000000] [--recent 1.0] [--rounds 3] [--port 4050]

Builds the same base table and change set as ``apply.py``, then runs ``--rounds`` merge/append
pairs (the real ``plan_changes`` + ``write_plan``) with Spark's UI on, and prints the completed
stages of the last pair from the UI's REST API: tasks, executor run time, input and shuffle bytes,
output bytes. It shows, e.g., which of Delta's joins shuffle the target table.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

import apply as bench
import numpy as np

from cdc_assets.apply.session import quiet_start, spark_session
from cdc_assets.config import SparkConfig


def completed_stages(port: int, app: str) -> list[dict[str, Any]]:
    with urllib.request.urlopen(f"http://localhost:{port}/api/v1/applications/{app}/stages?status=complete") as reply:
        return json.load(reply)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--m", type=int, default=1_000_000)
    parser.add_argument("--recent", type=float, default=1.0, help="as apply.py's --recent")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--port", type=int, default=4050)
    args = parser.parse_args()
    conf = {"spark.driver.memory": "8g", "spark.ui.enabled": "true", "spark.ui.port": str(args.port)}
    with quiet_start():
        spark = spark_session(SparkConfig(master="local[*]", conf=conf))
    app = spark.sparkContext.applicationId
    work = Path(tempfile.mkdtemp(prefix="cdc-merge-stages-"))
    try:
        base = work / "base"
        print("base table:", bench.build_base(spark, base, args.m, 500_000))
        changes = bench.change_set(args.n, args.m, np.random.default_rng(1), 100, args.recent)
        for round_ in range(args.rounds):
            for kind in ("merge", "append"):
                before = {s["stageId"] for s in completed_stages(args.port, app)}
                run = bench.run_one(spark, kind, base, work / f"{kind}{round_}", changes, args.m, args.n)
                metrics = run["delta"]["metrics"]
                timings = {k: metrics[k] for k in ("executionTimeMs", "scanTimeMs", "rewriteTimeMs") if k in metrics}
                print(f"{kind} {round_ + 1}: {run['total_s']:.2f} s {timings}")
                if round_ < args.rounds - 1:
                    continue
                new = [s for s in completed_stages(args.port, app) if s["stageId"] not in before]
                for s in sorted(new, key=lambda s: s["stageId"]):
                    print(
                        f"  stage {s['stageId']:4d}: {s['numTasks']:3d} tasks, run {s['executorRunTime']:6d} ms,"
                        f" in {s['inputRecords']:8d} rows, shuffle read {s['shuffleReadBytes'] / 1e6:5.1f} MB"
                        f" write {s['shuffleWriteBytes'] / 1e6:5.1f} MB, out {s['outputBytes'] / 1e6:5.1f} MB"
                        f" | {s['name'][:60]}"
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
