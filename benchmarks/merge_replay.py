"""Replay the merges a finished run made into one table, with other Spark settings (a diagnostic).

    python benchmarks/merge_replay.py WORK [--table public.pgbench_accounts] [--from-version 0]
                                      [--merges 30] [--conf KEY=VALUE ...] [--small-table-mb MB]
                                      [--remote sc://HOST:PORT]

``WORK`` is the folder of a run that kept its change log and Delta tables — a freshness run's
``work`` (``freshness.json``) or any ``cdc.yaml`` folder. The table is copied with its Delta log cut
back to ``--from-version``, then every later commit of the original is replayed in order: the real
``apply_table`` up to the LSN that commit applied, so each replayed MERGE takes the same batch as
the original did, on a classic ``local[2]`` session with the run's Spark settings plus ``--conf``
(``--remote``: on a session of that Spark Connect server, e.g. a ``cdc-assets spark-server``).
No PostgreSQL is needed: the copy has no other writer, so the merges run on a mirror made here
rather than opened under the table's write lock on the source. Printed per merge: its wall time, Delta's ``executionTimeMs``, rows
updated, files added and deletion vectors written; then the medians of the merges after the first
ten (the JIT's warm-up): the wall time, and the time outside Delta's execution of the statement
(the client's reads of the log and the change log, planning, round trips). Compare two settings
with ``farm-bench --vs``, which alternates them.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import _common  # noqa: F401 - puts this checkout first on sys.path
import yaml
from deltalake import DeltaTable as RustDeltaTable

from cdc_assets.apply.runner import apply_table
from cdc_assets.apply.session import spark_session
from cdc_assets.apply.target import APPLIED_KEY, delta_target
from cdc_assets.apply.write_path import Mirror
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import load_config

WARM_UP_MERGES = 10


def commits(path: Path) -> list[dict[str, Any]]:
    """Each commit of the Delta table at ``path``, oldest first (delta-rs's history)."""
    return sorted(RustDeltaTable(str(path)).history(), key=lambda commit: commit["version"])


def cut_back(log: Path, version: int) -> None:
    """Remove every log file past ``version``, checkpoints and checksums included (Hadoop's hidden
    ``.crc`` files too), and ``_last_checkpoint``: the table reads as of ``version``."""
    for path in log.iterdir():
        stem = path.name.lstrip(".").split(".")[0]
        past = stem.isdigit() and int(stem) > version
        if path.is_file() and (path.name.startswith(".") or path.name == "_last_checkpoint" or past):
            path.unlink()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("work", type=Path)
    parser.add_argument("--table", default="public.pgbench_accounts")
    parser.add_argument("--from-version", type=int, default=0)
    parser.add_argument("--merges", type=int, default=30)
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--small-table-mb", type=float, help="warehouse.small_table_mb (default: the run's)")
    parser.add_argument("--remote", help="a Spark Connect server to replay on (default: a classic local[2] session)")
    args = parser.parse_args()

    document = yaml.safe_load((args.work / "cdc.yaml").read_text(encoding="utf-8"))
    schema, name = args.table.split(".")
    original = args.work / document["warehouse"]["path"] / schema / name
    replay = Path(tempfile.mkdtemp(prefix="cdc-replay-"))
    shutil.copytree(args.work / document["changelog"]["path"], replay / "changelog")
    shutil.copytree(original, replay / "warehouse" / schema / name)
    cut_back(replay / "warehouse" / schema / name / "_delta_log", args.from_version)
    targets = [
        json.loads(commit["userMetadata"])[APPLIED_KEY]
        for commit in commits(original)
        if commit["version"] > args.from_version and "userMetadata" in commit  # not maintenance's
    ][: args.merges]

    spark_conf = {k: v for k, v in document["spark"].get("conf", {}).items() if k != "spark.ui.enabled"}
    runtime = {"remote": args.remote} if args.remote else {"master": "local[2]"}
    document["spark"] = runtime | {"conf": spark_conf | dict(kv.split("=", 1) for kv in args.conf)}
    document["changelog"]["path"], document["warehouse"]["path"] = "./changelog", "./warehouse"
    document["tables"] = {args.table: document["tables"].get(args.table, {})}
    if args.small_table_mb is not None:
        document["warehouse"]["small_table_mb"] = args.small_table_mb
    (replay / "cdc.yaml").write_text(json.dumps(document), encoding="utf-8")
    os.chdir(replay)
    config = load_config(replay / "cdc.yaml", {**os.environ, "CDC_SOURCE_DSN": "dbname=unused"})
    spark = spark_session(config.spark, app_name="merge-replay")
    if not args.remote:
        spark.sparkContext.setLogLevel("FATAL")  # Delta logs a benign ERROR per scan of a table with deletion vectors
    reader = ChangeLogReader(changelog_store(config))
    checkpoint = reader.require_checkpoint()
    table = config.table(args.table)
    print(f"replaying {len(targets)} merges of {args.table} from version {args.from_version} in {replay}")
    times, outside = [], []
    for number, lsn in enumerate(targets):
        started = time.perf_counter()
        mirror = Mirror(config, table, delta_target(config, table, spark), reader, replace(checkpoint, lsn=lsn))
        applied = apply_table(mirror)
        times.append(time.perf_counter() - started)
        last = RustDeltaTable(str(replay / "warehouse" / schema / name)).history(1)[0]
        metrics = last.get("operationMetrics", {})
        outside.append(times[-1] - int(metrics.get("executionTimeMs", 0)) / 1000)
        print(
            f"{number:3d}: {times[-1]:5.2f} s, executionTimeMs {metrics.get('executionTimeMs', '-')},"
            f" updated {applied.updated}, files added {metrics.get('numTargetFilesAdded', '-')},"
            f" deletion vectors {metrics.get('numTargetDeletionVectorsAdded', '-')}",
            flush=True,
        )
    steady = times[WARM_UP_MERGES:] or times
    print(
        f"median of merges {len(times) - len(steady)}–{len(times) - 1}: {statistics.median(steady):.2f} s,"
        f" outside the statement's execution {statistics.median(outside[-len(steady) :]):.2f} s"
    )
    spark.stop()
    shutil.rmtree(replay, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
