"""The commit floor: what a Delta commit of one row costs on a warm session, against our merges.

    python benchmarks/commit_floor.py [--runtime classic|connect] [--rounds 7] [--warm-up 2] [--pg 16]
                                      [--scale 10] [--small-changes 3] [--big-changes 5000]
                                      [--conf KEY=VALUE] [--out floor.json]

A throwaway PostgreSQL gets ``pgbench -i -s <scale>`` (scale 10: 1,000,000 accounts, 10 branches),
both tables published; ``setup`` copies them and one untimed ``apply_tables`` writes their Delta
tables. The session is one warm ``local[2]`` Spark (a 4 GB driver) with the project's
``session_settings`` and its UI on: classic, the benchmark's own driver; ``--runtime connect``, a ``cdc-assets spark-server``
started with the same configuration file, reached through ``spark.remote``. ``--conf`` adds a
Spark setting to that file's ``spark.conf`` (both runtimes: the server takes all of them, a
Connect session the SQL ones), to try one without changing code.

Each round then times, on that session:

* **insert**: ``INSERT INTO delta.`<path>` VALUES (<n>, '<text>')`` — one row into a small Delta
  table (two columns, the project's default table properties) created before the rounds: Spark's
  own floor for a Delta commit;
* **small merge**: ``--small-changes`` branches updated in one PostgreSQL transaction, drained,
  then ``apply_tables`` of ``public.pgbench_branches`` alone — the apply's real path (write lock,
  change log read, plan, ``write_plan``'s MERGE, the result's reads of the Delta log);
* **big merge**: ``--big-changes`` random accounts updated in one transaction (drained with the
  branches), then ``apply_tables`` of ``public.pgbench_accounts``.

Per statement: the wall time, and from the UI's REST API the Spark jobs it ran (their stages and
tasks, completed and skipped, and each job's description — on a classic session Delta names its
own, e.g. "Compute snapshot for version: 5"; under Connect each is described by the statement's
plan — when it was submitted, in ms after the statement began, and how long it ran: the gaps are
the driver's time between jobs). The first ``--warm-up`` rounds are not counted; the table printed holds
the median time of the other rounds, and the jobs of the last one. Finally both mirrors are
compared with their source (``verify_table``).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as dt
import json
import os
import pstats
import shutil
import socket
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import _common as common
import numpy as np
import psycopg

from cdc_assets.apply.runner import apply_tables
from cdc_assets.apply.session import quiet_start, spark_session
from cdc_assets.apply.spark_literals import backquote
from cdc_assets.apply.target import DEFAULT_TABLE_PROPERTIES
from cdc_assets.config import Config, load_config
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.parity import verify_table
from cdc_assets.pipeline.setup import setup

PUBLICATION = "floor_pub"
SMALL, BIG = "public.pgbench_branches", "public.pgbench_accounts"
STATEMENTS = ("insert", "small merge", "big merge")
READY_TIMEOUT_S = 600.0
SETTLED_S = 0.3  # the UI's job list unchanged this long after a statement: its listener has caught up
SETTLE_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def write_config(folder: Path, dsn: str, remote: str | None, ui_port: int, conf: dict[str, str]) -> Config:
    # the heap holds the 1M-row copy's batch when Connect sends it to the server
    settings = {"spark.ui.enabled": "true", "spark.ui.port": str(ui_port), "spark.driver.memory": "4g", **conf}
    spark: dict[str, Any] = {"remote": remote, "conf": settings} if remote else {"master": "local[2]", "conf": settings}
    document = {
        "source": {"dsn": dsn, "publication": PUBLICATION, "slot": "commit_floor"},
        "changelog": {"path": str(folder / "changelog")},
        "warehouse": {"path": str(folder / "warehouse")},
        "tables": {SMALL: {}, BIG: {}},
        "spark": spark,
    }
    path = folder / "cdc.yaml"
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")  # JSON is YAML
    return load_config(path)


class Jobs:
    """The Spark jobs of the application behind the UI at ``url`` (REST API)."""

    def __init__(self, url: str) -> None:
        self.base = f"{url.rstrip('/')}/api/v1/applications"
        self.app = self._get(self.base)[0]["id"]

    def _get(self, url: str) -> Any:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return json.load(reply)

    def all(self) -> list[dict[str, Any]]:
        return list(self._get(f"{self.base}/{self.app}/jobs"))

    def last_id(self) -> int:
        return max((job["jobId"] for job in self.settled()), default=-1)

    def settled(self) -> list[dict[str, Any]]:
        """The job list once no job runs and it has not changed for ``SETTLED_S`` (the UI learns of
        jobs through Spark's listener bus, after the statement that ran them returned)."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        seen = self.all()
        while time.monotonic() < deadline:
            time.sleep(SETTLED_S)
            now = self.all()
            if now == seen and all(job["status"] != "RUNNING" for job in now):
                return now
            seen = now
        raise RuntimeError(f"the UI's job list did not settle within {SETTLE_TIMEOUT_S:.0f} s")

    def since(self, last: int) -> list[dict[str, Any]]:
        return sorted((job for job in self.settled() if job["jobId"] > last), key=lambda job: job["jobId"])


def job_time(job: dict[str, Any], key: str) -> dt.datetime:
    """One of a job's times in the UI (``2026-12-06T18:40:01.123GMT``), in UTC."""
    return dt.datetime.strptime(job[key], "%Y-%m-%dT%H:%M:%S.%f%Z").replace(tzinfo=dt.UTC)


def job_ms(job: dict[str, Any]) -> float:
    """How long a job ran, submission to completion."""
    return (job_time(job, "completionTime") - job_time(job, "submissionTime")).total_seconds() * 1000


def job_name(job: dict[str, Any]) -> str:
    """A job's description: Delta's own (e.g. "Delta: Compute snapshot for version: 5") on a
    classic session; under Spark Connect every job is described by the statement's plan."""
    return str(job.get("description") or job["name"]).replace("\n", " ")[:90]


def job_summary(jobs: list[dict[str, Any]], started: dt.datetime) -> dict[str, Any]:
    return {
        "jobs": len(jobs),
        "jobs_ms": sum(job_ms(job) for job in jobs),
        "stages": sum(job["numCompletedStages"] for job in jobs),
        "skipped_stages": sum(job["numSkippedStages"] for job in jobs),
        "tasks": sum(job["numCompletedTasks"] for job in jobs),
        "names": [job_name(job) for job in jobs],
        "timeline": [
            [round((job_time(job, "submissionTime") - started).total_seconds() * 1000), round(job_ms(job))]
            for job in jobs
        ],
    }


def add_to_balances(conn: psycopg.Connection[Any], table: str, key: str, balance: str, keys: list[int]) -> None:
    """``balance`` + 1 in the rows of ``keys``, in one transaction."""
    with conn.transaction():
        conn.execute(f"UPDATE {table} SET {balance} = {balance} + 1 WHERE {key} = ANY(%s)", (keys,))


def timed(jobs: Jobs, run: Callable[[], object], profile: cProfile.Profile | None = None) -> dict[str, Any]:
    last = jobs.last_id()
    at = dt.datetime.now(dt.UTC)
    started = time.perf_counter()
    if profile is None:
        run()
    else:
        profile.runcall(run)
    seconds = time.perf_counter() - started
    return {"ms": seconds * 1000, **job_summary(jobs.since(last), at)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runtime", choices=("classic", "connect"), default="classic")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warm-up", type=int, default=2)
    parser.add_argument("--pg", type=int, default=16)
    parser.add_argument("--scale", type=int, default=10)
    parser.add_argument("--small-changes", type=int, default=3)
    parser.add_argument("--big-changes", type=int, default=5000)
    parser.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--profile", action="store_true", help="print where the small merges' Python time went")
    parser.add_argument("--out", help="write the results to this JSON file")
    args = parser.parse_args()
    conf = {key.strip(): value.strip() for key, _, value in (item.partition("=") for item in args.conf)}
    code = common.code_version()
    work = Path(tempfile.mkdtemp(prefix="cdc-floor-"))
    cluster = common.start_cluster(args.pg)
    server = None
    try:
        common.pgbench(cluster, "-i", "-q", "-s", str(args.scale))
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE pgbench_branches, pgbench_accounts")
        ui_port = free_port()
        remote = f"sc://127.0.0.1:{free_port()}" if args.runtime == "connect" else None
        config = write_config(work, cluster.dsn(), remote, ui_port, conf)
        if remote:
            command = [sys.executable, "-m", "cdc_assets", "spark-server", "-c", str(work / "cdc.yaml")]
            command += ["--port", remote.rsplit(":", 1)[1], "--master", "local[2]"]
            server = common.started(command, dict(os.environ), work / "spark-server.log", work)
            common.wait_for_line(work / "spark-server.log", "listening at", server, READY_TIMEOUT_S)
        setup(config)
        with quiet_start():
            spark = spark_session(config.spark, "cdc-assets-commit-floor")
        apply_tables(config, spark)  # the copies: the Delta tables created, not timed
        # classic: where the UI is (a port taken meanwhile moves it); Connect: the server's, as configured
        jobs = Jobs(f"http://127.0.0.1:{ui_port}" if remote else str(spark.sparkContext.uiWebUrl))
        floor = backquote(str(work / "warehouse" / "floor"))
        properties = ", ".join(f"'{k}' = '{v}'" for k, v in DEFAULT_TABLE_PROPERTIES.items())
        spark.sql(f"CREATE TABLE delta.{floor} (id BIGINT, note STRING) USING delta TBLPROPERTIES ({properties})")
        rng = np.random.default_rng(20261206)
        accounts, branches = args.scale * 100_000, args.scale
        rounds: list[dict[str, dict[str, Any]]] = []
        profile = cProfile.Profile() if args.profile else None
        with psycopg.connect(cluster.dsn()) as conn:
            for number in range(args.warm_up + args.rounds):
                insert = f"INSERT INTO delta.{floor} VALUES ({number}, 'row {number}')"
                measured = {"insert": timed(jobs, partial(spark.sql, insert))}
                small = rng.choice(branches, size=min(args.small_changes, branches), replace=False) + 1
                big = rng.choice(accounts, size=args.big_changes, replace=False) + 1
                add_to_balances(conn, "pgbench_branches", "bid", "bbalance", small.tolist())
                add_to_balances(conn, "pgbench_accounts", "aid", "abalance", big.tolist())
                drain(config, wait=True)
                counted = number >= args.warm_up
                small_merge = partial(apply_tables, config, spark, [SMALL])
                measured["small merge"] = timed(jobs, small_merge, profile if counted else None)
                measured["big merge"] = timed(jobs, partial(apply_tables, config, spark, [BIG]))
                if counted:
                    rounds.append(measured)
                print(
                    f"[floor] round {number + 1}{'' if counted else ' (warm-up)'}: "
                    + ", ".join(f"{s} {m['ms']:.0f} ms / {m['jobs']} jobs" for s, m in measured.items()),
                    flush=True,
                )
        parity = {t: verify_table(config, config.table(t), spark).parity.ok for t in (SMALL, BIG)}
        medians = {s: statistics.median(r[s]["ms"] for r in rounds) for s in STATEMENTS}
        last = rounds[-1]
        print()
        print(
            common.table(
                ["statement", "ms (median)", "each (ms)", "in jobs ms (median)", "jobs", "stages (skipped)", "tasks"],
                [
                    (
                        s,
                        f"{medians[s]:.0f}",
                        ", ".join(f"{r[s]['ms']:.0f}" for r in rounds),
                        f"{statistics.median(r[s]['jobs_ms'] for r in rounds):.0f}",
                        last[s]["jobs"],
                        f"{last[s]['stages']} ({last[s]['skipped_stages']})",
                        last[s]["tasks"],
                    )
                    for s in STATEMENTS
                ],
            )
        )
        for s in STATEMENTS:
            print(f"\n{s}: the jobs of the last round (submitted ms after the statement began, ran ms)")
            for name, (offset, ms) in zip(last[s]["names"], last[s]["timeline"], strict=True):
                print(f"  - +{offset:>5} ms {ms:>5} ms  {name}")
        if profile is not None:
            print("\nthe small merges' Python time (cumulative):")
            pstats.Stats(profile).sort_stats("cumulative").print_stats(40)
        ratio = medians["small merge"] / medians["insert"]
        print(f"\n{args.runtime}: small merge / one-row insert = {ratio:.2f} (target <= 1.5)")
        print("parity:", ", ".join(f"{t} {'equal' if ok else 'DIFFERENT'}" for t, ok in parity.items()))
        print(common.describe_code(code, common.code_version()))
        common.write_json(
            args.out,
            {
                "args": vars(args),
                "machine": common.machine(),
                "code": code,
                "rounds": rounds,
                "medians_ms": medians,
                "ratio": ratio,
                "parity": parity,
            },
        )
        return 0 if all(parity.values()) else 1
    finally:
        if server is not None:
            common.stop(server)
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
