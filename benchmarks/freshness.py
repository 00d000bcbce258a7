"""Freshness under load: how far behind its source each Delta table is while ``dagster dev`` runs
the pipeline as a user would configure it for low latency.

    python benchmarks/freshness.py [--pg 16] [--rate 500] [--minutes 10] [--scale 10]
                                   [--runtimes connect,local] [--merges drain,table] [--warmup 60]
                                   [--parallel-merges N] [--copy-on-write] [--conf KEY=VALUE ...]
                                   [--out freshness-out]

Per runtime, on a fresh server: ``pgbench -i`` (its three keyed tables: accounts, tellers,
branches; its keyless history table is not published), ``cdc-assets setup`` and one ``apply`` (the
initial copy, not measured), then ``dagster dev`` on the code location with

* ``schedule.drain_lag_bytes: 1``, ``drain_check_seconds: 5``: the drain sensor asks for a drain
  whenever the slot is behind and no drain is queued or running;
* ``merge_check_seconds: 5``: the merge sensor looks every 5 seconds;
* ``--merges drain``: ``schedule.merge_with_drain`` — each drain run merges the tables it brought
  changes to (one run per cycle); ``table``: the merge sensor launches a merge run per table;
  ``follow``: one drain run follows the slot's stream for the whole load (``drain.follow_seconds``,
  a durable batch every ``drain.commit_seconds: 1``) and the merge sensor launches a merge run
  per table; ``follow-drain``: the same following drain run with ``schedule.merge_with_drain``,
  so it merges the tables after each durable batch itself (one Spark session for the whole load);
* a queued run coordinator that dequeues every second, pools of one (one drain, one writer per
  table), the default run launcher (a process per run);
* ``--copy-on-write``: ``warehouse.table_properties: {delta.enableDeletionVectors: "false"}`` —
  a MERGE rewrites the files it touches instead of writing deletion vectors and new files;
* ``--conf KEY=VALUE``: one more ``spark.conf`` setting (on a Connect server: its sessions' default);
* ``connect``: ``spark.remote`` to a ``cdc-assets spark-server`` started first (a run opens a
  session, no JVM start); ``local``: ``spark.master: local[2]`` (each run starts its own Spark).

Each (runtime, merges) pair is measured in turn, on a fresh server. ``pgbench -R <rate> -T <minutes>`` (TPC-B: every transaction changes all three tables) writes the
load; every 10 s each table's **freshness** is sampled: now minus the source commit time of the
newest transaction its Delta table has applied (its applied LSN, read from the Delta log with
delta-rs, against the change log's transactions). Samples of the first ``--warmup`` seconds of
the load are left out (the pipeline's first cycle under load; a fresh Spark Connect server's JIT
takes a few minutes under the load to bring a MERGE down to its steady time: ``--minutes 15
--warmup 300`` measures the last 10 minutes); a later sample taken before a table
applied any transaction of the load counts as the time since the load began. Reported per runtime and table:
p50, p95 and max freshness; the rate pgbench reached; the runs Dagster ran — per kind (drain,
drain with merges, merge) how many, the median time from the run's creation to its start (the
queue and the launch: a process, Dagster's imports) and the median run time.

Where the machine's CPU went during the load: each process's CPU seconds from the load's start to
10 s before its end (those alive then), by role — PostgreSQL's backends and its walsender, pgbench,
the Spark JVM, Dagster's daemon, webserver and code server, the run workers (the following drain
and its merges), the drain's stream receiver, this benchmark (its sampler) — as a share of the
cores.

Output: ``freshness.json`` and a table on standard output.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as common
import psutil

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, load_config
from cdc_sandbox.pgcluster import free_port

TABLES = ("public.pgbench_accounts", "public.pgbench_tellers", "public.pgbench_branches")
SLOT = "fresh_slot"
SAMPLE_EVERY_S = 10.0
FOLLOW_COMMIT_SECONDS = 1.0
READY_TIMEOUT_S = 600.0


@dataclass(slots=True)
class Transactions:
    """The change log's transactions seen so far: end LSNs and commit times, in log order."""

    reader: ChangeLogReader
    end_lsns: list[int] = field(default_factory=list)
    commit_times_s: list[float] = field(default_factory=list)

    def refresh(self) -> None:
        """Take in the transactions drained since the last call."""
        new = self.reader.transactions(after=self.end_lsns[-1] if self.end_lsns else -1)
        if new.num_rows:
            self.end_lsns += new.column("end_lsn").to_pylist()
            self.commit_times_s += [t.timestamp() for t in new.column("commit_time").to_pylist()]

    def commit_time_at(self, lsn: int) -> float | None:
        """The commit time (s since 1970) of the newest transaction that ends at or before ``lsn``."""
        found = _last_at_or_below(self.end_lsns, lsn)
        return None if found is None else self.commit_times_s[found]


def _last_at_or_below(values: list[int], limit: int) -> int | None:
    low, high = 0, len(values)
    while low < high:
        middle = (low + high) // 2
        if values[middle] <= limit:
            low = middle + 1
        else:
            high = middle
    return low - 1 if low else None


def write_files(
    work: Path, dsn_variable: str, spark: dict[str, Any], merges: str, minutes: float, copy_on_write: bool
) -> dict[str, str]:
    """The cdc-assets configuration, the Dagster instance and workspace; the environment to run in."""
    warehouse: dict[str, Any] = {"path": "./warehouse"}
    if copy_on_write:
        warehouse["table_properties"] = {"delta.enableDeletionVectors": "false"}
    document: dict[str, Any] = {
        "source": {"dsn": "${" + dsn_variable + "}", "publication": "fresh_pub", "slot": SLOT, "heartbeat": True},
        "changelog": {"path": "./changelog"},
        "warehouse": warehouse,
        "spark": spark,
        "schedule": {
            "drain_lag_bytes": 1,
            "drain_check_seconds": 5,
            "merge_check_seconds": 5,
            "merge_with_drain": merges in ("drain", "follow-drain"),
        },
        "tables": {name: {} for name in TABLES},
    }
    if merges.startswith("follow"):  # one drain run follows the stream for the whole load
        document["drain"] = {"follow_seconds": minutes * 60 + 600, "commit_seconds": FOLLOW_COMMIT_SECONDS}
    (work / "cdc.yaml").write_text(json.dumps(document, indent=2), encoding="utf-8")  # JSON is YAML
    instance = {
        "run_coordinator": {
            "module": "dagster._core.run_coordinator",
            "class": "QueuedRunCoordinator",
            "config": {"dequeue_interval_seconds": 1},
        },
        "concurrency": {"pools": {"default_limit": 1}},
        "run_monitoring": {"enabled": True, "free_slots_after_run_end_seconds": 60},
        "sensors": {"use_threads": True, "num_workers": 4},
        "telemetry": {"enabled": False},
    }
    return common.dagster_files(work, instance)


class Sampler(threading.Thread):
    """Every ``SAMPLE_EVERY_S``: each table's freshness, until stopped."""

    def __init__(self, config: Config) -> None:
        super().__init__(daemon=True)
        self.config = config
        self.transactions = Transactions(ChangeLogReader(changelog_store(config)))
        self.samples: list[dict[str, Any]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(SAMPLE_EVERY_S):
            now = time.time()
            applied = {str(t.name): table_applied_lsn(self.config, t) for t in self.config.tables}
            self.transactions.refresh()
            sample: dict[str, Any] = {"time": now}
            for name, lsn in applied.items():
                commit = None if lsn is None else self.transactions.commit_time_at(lsn)
                sample[name] = None if commit is None else now - commit
            self.samples.append(sample)


def percentile(values: list[float], share: float) -> float | None:
    """The nearest-rank percentile (None without values)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(share * (len(ordered) - 1)))] if ordered else None


def _rounded(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def run_kind(tags: Mapping[str, str]) -> str:
    """A run's kind by its tags: a drain (that merges, or not), a table's merge, or other (maintenance)."""
    for tag, kind in (("cdc/merges", "drain+merge"), ("cdc/drain", "drain"), ("cdc/table", "merge")):
        if tag in tags:
            return kind
    return "other"


def run_figures(home: Path, stopped_at: float) -> dict[str, Any]:
    """The runs Dagster ran, per kind (drain, drain+merge, merge, other): how many, the median wait from
    creation to start and the median run time; how many failed, and how many were still running
    when the benchmark stopped ``dagster dev`` at ``stopped_at`` (a following drain: Dagster marks
    them failed, "interrupted")."""
    os.environ["DAGSTER_HOME"] = str(home)
    import dagster as dg

    with dg.DagsterInstance.get() as instance:
        records = instance.get_run_records()
    kinds: dict[str, list[tuple[float, float]]] = {}
    failed = stopped = 0
    for record in records:
        kind = run_kind(record.dagster_run.tags)
        if record.dagster_run.status == dg.DagsterRunStatus.FAILURE:
            if record.end_time is not None and record.end_time >= stopped_at:
                stopped += 1
            else:
                failed += 1
        if record.start_time and record.end_time:
            waited = record.start_time - record.create_timestamp.timestamp()
            kinds.setdefault(kind, []).append((waited, record.end_time - record.start_time))
    return {
        "failed": failed,
        "stopped": stopped,
        "runs": {
            kind: {
                "count": len(runs),
                "median_wait_s": round(statistics.median(w for w, _ in runs), 2),
                "median_s": round(statistics.median(r for _, r in runs), 2),
            }
            for kind, runs in kinds.items()
        },
    }


ROLES = (
    ("walsender", "postgres", "walsender"),
    ("postgres", "postgres", ""),
    ("pgbench", "pgbench", ""),
    ("spark (JVM)", "java", ""),
    ("dagster run workers", "", "execute_run"),
    ("dagster run workers", "", "multiprocessing.spawn"),  # how the code server starts a run's process
    ("dagster code server", "", "api grpc"),
    ("dagster daemon", "", "dagster-daemon"),
    ("dagster webserver", "", "dagster-webserver"),
    ("drain's stream receiver", "", "cdc_assets.stream"),
)
"""(role, process name, a word of its command line): the first that matches names a process's role."""


CPU_WINDOW_MARGIN_S = 10.0
"""The CPU shares are taken this long before the load's end."""


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """Every process's role and CPU seconds so far."""
    found: dict[int, tuple[str, float]] = {}
    me = os.getpid()
    for process in psutil.process_iter(["name", "cmdline", "cpu_times"]):
        times = process.info["cpu_times"]
        if times is None:
            continue
        command = " ".join(process.info["cmdline"] or [])
        role = "this benchmark" if process.pid == me else "other"
        for name, program, word in ROLES:
            if (not program or process.info["name"] == program) and word in command:
                role = name
                break
        found[process.pid] = (role, times.user + times.system)
    return found


def cpu_shares(before: dict[int, tuple[str, float]], seconds: float) -> dict[str, float]:
    """Each role's share of the cores since ``before`` (1.0: one core all along)."""
    shares: dict[str, float] = {}
    for pid, (role, cpu) in cpu_by_process().items():
        spent = cpu - before[pid][1] if pid in before else cpu
        shares[role] = shares.get(role, 0.0) + spent / seconds
    return {role: round(share, 2) for role, share in sorted(shares.items(), key=lambda item: -item[1])}


def measure(runtime: str, merges: str, args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix=f"cdc-fresh-{runtime}-{merges}-"))
    cluster = common.start_cluster(args.pg)
    processes: list[subprocess.Popen[bytes]] = []
    try:
        common.pgbench(cluster, "-i", "-q", "-s", str(args.scale))
        port = free_port()
        # the first apply sends the 1,000,000-row copy to the driver (over Connect: one local relation)
        conf = {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4", "spark.driver.memory": "6g"}
        conf |= dict(setting.split("=", 1) for setting in args.conf)
        spark = {"remote": f"sc://127.0.0.1:{port}"} if runtime == "connect" else {"master": "local[2]"}
        if args.parallel_merges is not None:
            spark["parallel_merges"] = args.parallel_merges
        env = {
            **os.environ,
            "CDC_SOURCE_DSN": cluster.dsn(),
            **write_files(work, "CDC_SOURCE_DSN", spark | {"conf": conf}, merges, args.minutes, args.copy_on_write),
        }
        if runtime == "connect":
            server = [sys.executable, "-m", "cdc_assets", "spark-server", "--port", str(port), "--master", "local[2]"]
            processes.append(common.started(server, env, work / "spark-server.log", work))
            common.wait_for_line(work / "spark-server.log", "listening at", processes[-1], READY_TIMEOUT_S)
        common.cdc(env, work, "setup")
        common.cdc(env, work, "apply")
        webserver_port = str(free_port())
        dagster = ["dagster", "dev", "-w", str(work / "workspace.yaml"), "-p", webserver_port]
        processes.append(common.started(dagster, env, work / "dagster.log", work))
        common.wait_for_line(work / "dagster.log", "Serving dagster-webserver", processes[-1], READY_TIMEOUT_S)
        config = load_config(work / "cdc.yaml", env)
        sampler = Sampler(config)
        load_started = time.time()
        cpu_before = cpu_by_process()
        cpu: dict[str, float] = {}
        # taken just before the load ends, while pgbench and its PostgreSQL backends still run
        cpu_window_s = max(args.minutes * 60 - CPU_WINDOW_MARGIN_S, 1.0)
        cpu_timer = threading.Timer(cpu_window_s, lambda: cpu.update(cpu_shares(cpu_before, cpu_window_s)))
        cpu_timer.daemon = True  # a failed load does not keep the benchmark waiting for it
        cpu_timer.start()
        sampler.start()
        print(
            f"[freshness] {runtime}, merges by {merges}: pgbench at {args.rate} tx/s for {args.minutes} min", flush=True
        )
        pgbench_s = common.pgbench(
            cluster, "-n", "-c", "4", "-j", "2", "-R", str(args.rate), "-T", str(round(args.minutes * 60))
        )
        cpu_timer.join()
        sampler.halt.set()
        sampler.join()
        transactions = len(sampler.transactions.end_lsns)
        steady = [s for s in sampler.samples if s["time"] >= load_started + args.warmup]
        per_table: dict[str, Any] = {}
        for name in TABLES:
            # a sample before the table applied any transaction of the load counts as its age
            values = [s["time"] - load_started if s[name] is None else s[name] for s in steady]
            per_table[name] = {
                "p50_s": _rounded(percentile(values, 0.5)),
                "p95_s": _rounded(percentile(values, 0.95)),
                "max_s": _rounded(max(values, default=None)),
                "samples": len(values),
            }
        stopped_at = time.time()
        for process in reversed(processes):
            common.stop(process)
        processes.clear()
        return {
            "tables": per_table,
            "logged_transactions": transactions,
            "load_s": round(pgbench_s, 1),
            "tx_per_s": round(transactions / pgbench_s, 1),
            "dagster": run_figures(work / "dagster_home", stopped_at),
            "cpu_cores_by_role": cpu,
            "samples": sampler.samples,
            "work": str(work),
        }
    finally:
        for process in reversed(processes):
            common.stop(process)
        cluster.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, default=16)
    parser.add_argument("--rate", type=int, default=500)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--runtimes", default="connect,local")
    parser.add_argument(
        "--merges",
        default="drain,table",
        help="drain: merge_with_drain; table: a run per table; follow: a drain run that follows, a merge run per"
        " table; follow-drain: a drain run that follows and merges after each durable batch",
    )
    parser.add_argument("--warmup", type=float, default=60.0)
    parser.add_argument("--parallel-merges", type=int, help="spark.parallel_merges (default: the config's)")
    parser.add_argument(
        "--copy-on-write", action="store_true", help="tables without deletion vectors (MERGE rewrites touched files)"
    )
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE", help="one more spark.conf setting")
    parser.add_argument("--out", default="freshness-out")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    code = common.code_version()
    results = {
        f"{runtime}/{merges}": measure(runtime, merges, args)
        for runtime in args.runtimes.split(",")
        for merges in args.merges.split(",")
    }
    common.write_json(
        str(out / "freshness.json"),
        {"args": vars(args), "machine": common.machine(), "code": code, "results": results},
    )
    rows = [
        (runtime, table, t["p50_s"], t["p95_s"], t["max_s"], t["samples"], r["tx_per_s"])
        for runtime, r in results.items()
        for table, t in r["tables"].items()
    ]
    print(common.table(["runtime/merges", "table", "p50 (s)", "p95 (s)", "max (s)", "samples", "tx/s logged"], rows))
    for runtime, r in results.items():
        dagster = r["dagster"]
        print(f"{runtime}: Dagster runs {dagster['runs']}, failed {dagster['failed']}, stopped {dagster['stopped']}")
        print(f"{runtime}: cores used by role during the load {r['cpu_cores_by_role']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
