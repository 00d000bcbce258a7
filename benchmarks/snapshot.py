"""Initial-snapshot benchmark: setup's copy of one large table against the source's own read rate.

    python benchmarks/snapshot.py [--pg 16] [--rows 10000000] [--workers 1,2,4] [--baseline-repeat 3]
                                  [--load-tps 500] [--part all|setup,online,read] [--path c|python] [--json out.json]

A throwaway cluster gets one table of ``--rows`` rows (8 columns: bigint key, int, text, timestamptz,
numeric, boolean, double, a text that is NULL in every fifth row; 10,000,000 rows are ~1.1 GiB of
heap), filled with ``INSERT … SELECT … FROM generate_series`` in steps, then VACUUM ANALYZE and
CHECKPOINT, and read once so that every run finds it in the page cache.

setup: the baseline is one ``COPY (SELECT * FROM ONLY t) TO STDOUT (FORMAT binary)`` read through
       psycopg in this process, bytes only (``--baseline-repeat`` times, median): the source's own
       limit for one connection. Then ``cdc_assets.pipeline.setup.setup`` into a fresh change log on local
       disk (durable: Parquet, fsync, checkpoint) with ``source.snapshot_workers`` each of
       ``--workers``, timed whole (checks, publication, slot, copy, close), its slot dropped
       afterwards. Reported: rows/s and MiB/s (of the table's heap) of each, the ratio setup ÷
       baseline (target ≥ 0.7), and the CPU seconds of this process and of the server's processes
       during each run, which show where the time goes. The baseline is measured again after the
       setups, and the ratio uses the faster of the two medians (the stricter).

online: the same table set up once (not timed), then ``cdc_assets.pipeline.online_snapshot.snapshot_tables``
       — the table copied again while a write load runs on another connection: single-statement
       autocommit transactions paced at ``--load-tps`` (80% updates of random keys, 10% inserts of
       new keys, 10% deletes). Reported: the copy's seconds, rows/s and MiB/s, CPU seconds, the
       write rate the load achieved during the copy, and the drain that follows (the load's changes
       and the run's announcement). The server CPU includes the load's backend.

read:  ``cdc_assets.source.binary_copy.read_columns`` over the whole table in this process: the rows
       received and split into one binary array per column (nothing converted or written), on the
       path ``--path`` chooses; ``--baseline-repeat`` times. Reported: seconds, rows/s, MiB/s of
       heap and this process's CPU µs per row (median run).

``--path`` chooses the copy's row splitter (``cdc_assets/source/copy_rows.py``): ``c``, the C
module, or ``python``, the pure Python one an install without a C compiler runs (the benchmark runs
itself again with ``CDC_ASSETS_COPY_ROWS`` set, which its copy workers inherit); by default C where
it was built.

Further parts run on the same table: add one to ``PARTS`` (a function taking the arguments, the
cluster, the table's facts and a work folder, returning its JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import _common as common
import psutil
import psycopg

from cdc_assets.config import Config, load_config
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.online_snapshot import TableCopied, snapshot_tables
from cdc_assets.pipeline.setup import setup
from cdc_assets.source.binary_copy import read_columns
from cdc_assets.source.connection import one_row
from cdc_assets.source.copy_rows import ENV as COPY_ROWS_ENV
from cdc_assets.source.copy_rows import PATH as COPY_ROWS_PATH
from cdc_sandbox.pgcluster import ThrowawayCluster

TABLE = "public.snap"
PUBLICATION = "bench_pub"
CREATE = """
CREATE TABLE snap (
    id bigint PRIMARY KEY,
    k integer NOT NULL,
    label text NOT NULL,
    created timestamptz NOT NULL,
    amount numeric(12, 2),
    ok boolean,
    score double precision,
    note text
)"""
FILL = """
INSERT INTO snap
SELECT g, g % 1000, md5(g::text), timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second',
       (g % 100000) / 100.0, g % 3 = 0, g / 7.0, CASE WHEN g % 5 = 0 THEN NULL ELSE 'note ' || (g % 977) END
FROM generate_series({first}::int8, {last}::int8) AS g"""
FILL_STEP = 2_000_000

_T = TypeVar("_T")


@dataclass(slots=True)
class TableFacts:
    rows: int
    heap_bytes: int


class CpuMeter:
    """CPU seconds of this process's tree (all threads, its copy workers) and of the cluster's
    server processes (live ones, plus what the postmaster has reaped from exited backends) between
    two readings (:func:`_common.tree_cpu_s`)."""

    def __init__(self, cluster: ThrowawayCluster) -> None:
        pid = int((cluster.data_dir / "postmaster.pid").read_text().split()[0])
        self.postmaster = psutil.Process(pid)
        self.me = psutil.Process()

    def reading(self) -> tuple[float, float]:
        return common.tree_cpu_s(self.me), common.tree_cpu_s(self.postmaster)

    def measure(self, work: Callable[[], _T]) -> tuple[dict[str, float], _T]:
        before = {child.pid for child in self.postmaster.children()}
        client0, server0 = self.reading()
        started = time.perf_counter()
        result = work()
        wall = time.perf_counter() - started
        self._reaped(before)
        client1, server1 = self.reading()
        return {"seconds": wall, "client_cpu_s": client1 - client0, "server_cpu_s": server1 - server0}, result

    def _reaped(self, before: set[int], timeout_s: float = 30.0) -> None:
        """Wait until the server processes the work started have exited and the postmaster has
        reaped them: a backend's CPU time then is in the postmaster's ``children_*`` (read while
        it exits, it can be in neither)."""
        deadline = time.monotonic() + timeout_s
        while {child.pid for child in self.postmaster.children()} - before and time.monotonic() < deadline:
            time.sleep(0.05)


def create_table(cluster: ThrowawayCluster, rows: int) -> TableFacts:
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        conn.execute(CREATE)
        for first in range(1, rows + 1, FILL_STEP):
            conn.execute(FILL.format(first=first, last=min(first + FILL_STEP - 1, rows)))
            print(f"[table] {min(first + FILL_STEP - 1, rows):,} of {rows:,} rows", flush=True)
        conn.execute("VACUUM ANALYZE snap")
        conn.execute("CHECKPOINT")
        (heap,) = one_row(conn.execute("SELECT pg_relation_size('snap')"))
        conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE snap")
    return TableFacts(rows, heap)


def binary_copy(cluster: ThrowawayCluster) -> int:
    """One connection, ``COPY … (FORMAT binary)``, every byte received and nothing parsed."""
    received = 0
    with (
        psycopg.connect(cluster.dsn()) as conn,
        conn.cursor().copy("COPY (SELECT * FROM ONLY snap) TO STDOUT (FORMAT binary)") as copy,
    ):
        for data in copy:
            received += len(data)
    return received


def write_config(folder: Path, dsn: str, slot: str, workers: int) -> Config:
    folder.mkdir(parents=True, exist_ok=True)
    document = {
        "source": {"dsn": dsn, "publication": PUBLICATION, "slot": slot, "snapshot_workers": workers},
        "changelog": {"path": str(folder / "changelog")},
        "warehouse": {"path": str(folder / "warehouse")},
        "tables": {TABLE: {}},
    }
    path = folder / "cdc.yaml"
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")  # JSON is YAML
    return load_config(path)


def baseline(cluster: ThrowawayCluster, meter: CpuMeter, table: TableFacts, repeat: int) -> dict[str, Any]:
    runs = []
    for _ in range(repeat):
        measured, received = meter.measure(lambda: binary_copy(cluster))
        runs.append({**measured, "bytes": received})
    median = statistics.median(r["seconds"] for r in runs)
    seconds = ", ".join(f"{r['seconds']:.2f}" for r in runs)
    print(
        f"[setup] baseline COPY (FORMAT binary): {seconds} s"
        f" ({table.rows / median:,.0f} rows/s, {table.heap_bytes / common.MiB / median:,.0f} MiB/s of heap)",
        flush=True,
    )
    return {"runs": runs, "median_s": median}


def part_setup(args: argparse.Namespace, cluster: ThrowawayCluster, table: TableFacts, work: Path) -> dict[str, Any]:
    meter = CpuMeter(cluster)
    before = baseline(cluster, meter, table, args.baseline_repeat)
    runs = []
    for workers in args.workers:
        config = write_config(work / f"w{workers}", cluster.dsn(), f"bench_snap_{workers}", workers)
        measured, result = meter.measure(partial(setup, config))
        copied = result.rows[TABLE]
        if copied != table.rows:
            print(f"WARNING: setup copied {copied:,} rows, the table holds {table.rows:,}", flush=True)
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (config.source.slot,))
        log_bytes = sum(f.stat().st_size for f in Path(config.changelog.path).rglob("*") if f.is_file())
        shutil.rmtree(work / f"w{workers}")
        runs.append({"workers": workers, **measured, "changelog_bytes": log_bytes, "load": os.getloadavg()})
        print(
            f"[setup] {workers} worker(s): {measured['seconds']:.2f} s ({table.rows / measured['seconds']:,.0f} rows/s,"
            f" {table.heap_bytes / common.MiB / measured['seconds']:,.0f} MiB/s of heap); CPU s: this process"
            f" {measured['client_cpu_s']:.1f}, server {measured['server_cpu_s']:.1f}",
            flush=True,
        )
    after = baseline(cluster, meter, table, args.baseline_repeat)
    base_s = min(before["median_s"], after["median_s"])
    for run in runs:
        run["rows_per_s"] = table.rows / run["seconds"]
        run["mib_per_s"] = table.heap_bytes / common.MiB / run["seconds"]
        run["ratio"] = base_s / run["seconds"]
    rows = [
        (
            "COPY (FORMAT binary), 1 connection",
            f"{base_s:.2f}",
            f"{table.rows / base_s:,.0f}",
            f"{table.heap_bytes / common.MiB / base_s:,.0f}",
            "1.00",
            f"{statistics.median(r['client_cpu_s'] for r in before['runs'] + after['runs']):.1f}",
            f"{statistics.median(r['server_cpu_s'] for r in before['runs'] + after['runs']):.1f}",
        ),
        *(
            (
                f"setup, snapshot_workers {r['workers']}",
                f"{r['seconds']:.2f}",
                f"{r['rows_per_s']:,.0f}",
                f"{r['mib_per_s']:,.0f}",
                f"{r['ratio']:.2f}",
                f"{r['client_cpu_s']:.1f}",
                f"{r['server_cpu_s']:.1f}",
            )
            for r in runs
        ),
    ]
    print()
    print(common.table(["read", "s", "rows/s", "MiB/s", "÷ baseline", "client CPU s", "server CPU s"], rows))
    print(f"\ntarget: setup >= 0.7 x the baseline; best {max(r['ratio'] for r in runs):.2f}", flush=True)
    return {"baseline_before": before, "baseline_after": after, "baseline_s": base_s, "setups": runs}


class WriteLoad:
    """Single-statement autocommit writes on their own connection, paced at ``tps``, in a thread."""

    def __init__(self, dsn: str, rows: int, tps: int) -> None:
        self.dsn, self.rows, self.tps = dsn, rows, tps
        self.ops = 0
        self._stop = threading.Event()
        self._connected = threading.Event()
        self._thread = threading.Thread(target=self._run, name="write-load")

    def __enter__(self) -> WriteLoad:
        """Start writing; return once the load's connection is open (its backend is no process the
        measured work started)."""
        self._thread.start()
        if not self._connected.wait(60):
            raise RuntimeError("the write load could not connect")
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        rng = random.Random(7)
        new_id = self.rows + 1
        started = time.perf_counter()
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            self._connected.set()
            while not self._stop.is_set():
                roll = rng.random()
                if roll < 0.8:
                    conn.execute("UPDATE snap SET amount = amount + 1 WHERE id = %s", (rng.randint(1, self.rows),))
                elif roll < 0.9:
                    conn.execute("INSERT INTO snap VALUES (%s, 1, 'new', now(), 1, true, 1, NULL)", (new_id,))
                    new_id += 1
                else:
                    conn.execute("DELETE FROM snap WHERE id = %s", (rng.randint(1, self.rows),))
                self.ops += 1
                ahead = self.ops / self.tps - (time.perf_counter() - started)
                if ahead > 0:
                    self._stop.wait(ahead)  # pacing the load, not synchronising anything


def part_online(args: argparse.Namespace, cluster: ThrowawayCluster, table: TableFacts, work: Path) -> dict[str, Any]:
    meter = CpuMeter(cluster)
    workers = max(args.workers)
    config = write_config(work / "online", cluster.dsn(), "bench_online", workers)
    setup(config)
    with WriteLoad(cluster.dsn(), table.rows, args.load_tps) as load:

        def copy() -> tuple[TableCopied, int]:
            before = load.ops
            (copied,) = snapshot_tables(config, [TABLE])
            return copied, load.ops - before

        measured, (copied, writes) = meter.measure(copy)
    drained_s = time.perf_counter()
    drained = drain(config)
    drained_s = time.perf_counter() - drained_s
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(%s)", (config.source.slot,))
    shutil.rmtree(work / "online")
    seconds = measured["seconds"]
    result = {
        "workers": workers,
        **measured,
        "rows": copied.rows,
        "chunks": copied.chunks,
        "rows_per_s": copied.rows / seconds,
        "mib_per_s": table.heap_bytes / common.MiB / seconds,
        "load_tps_target": args.load_tps,
        "load_writes": writes,
        "load_tps": writes / seconds,
        "drain_changes": drained.total_changes,
        "drain_s": drained_s,
    }
    print(
        f"[online] snapshot of {copied.rows:,} rows in {copied.chunks} chunks with {workers} worker(s) under"
        f" {writes / seconds:,.0f} writes/s (target {args.load_tps}): {seconds:.2f} s"
        f" ({result['rows_per_s']:,.0f} rows/s, {result['mib_per_s']:,.0f} MiB/s of heap); CPU s: this process"
        f" {measured['client_cpu_s']:.1f}, server {measured['server_cpu_s']:.1f}; then a drain of"
        f" {drained.total_changes:,} changes in {drained_s:.1f} s",
        flush=True,
    )
    return result


def part_read(args: argparse.Namespace, cluster: ThrowawayCluster, table: TableFacts, work: Path) -> dict[str, Any]:
    select = f"SELECT * FROM ONLY {TABLE}"
    query = f"COPY ({select}) TO STDOUT (FORMAT binary)"
    runs = []
    for _ in range(args.baseline_repeat):
        with psycopg.connect(cluster.dsn()) as conn:
            columns = len(conn.execute(f"{select} LIMIT 0").description or [])
            cpu, started = time.process_time(), time.perf_counter()
            rows = sum(len(block[0]) for block in read_columns(conn, query, columns))
            runs.append({"seconds": time.perf_counter() - started, "cpu_s": time.process_time() - cpu, "rows": rows})
    run = sorted(runs, key=lambda r: r["seconds"])[len(runs) // 2]
    result = {
        "path": COPY_ROWS_PATH,
        "runs": runs,
        "rows_per_s": run["rows"] / run["seconds"],
        "mib_per_s": table.heap_bytes / common.MiB / run["seconds"],
        "cpu_us_per_row": run["cpu_s"] / run["rows"] * 1e6,
    }
    seconds = ", ".join(f"{r['seconds']:.2f}" for r in runs)
    print(
        f"[read] {COPY_ROWS_PATH} path: {seconds} s"
        f" ({result['rows_per_s']:,.0f} rows/s, {result['mib_per_s']:,.0f} MiB/s of heap,"
        f" {result['cpu_us_per_row']:.2f} µs of CPU per row)",
        flush=True,
    )
    return result


PARTS: dict[str, Callable[[argparse.Namespace, ThrowawayCluster, TableFacts, Path], dict[str, Any]]] = {
    "setup": part_setup,
    "online": part_online,
    "read": part_read,
}


def _parts(text: str) -> list[str]:
    parts = text.split(",")
    if unknown := set(parts) - {*PARTS, "all"}:
        raise argparse.ArgumentTypeError(f"no part {', '.join(sorted(unknown))}; parts: all, {', '.join(PARTS)}")
    return parts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pg", type=int, default=16, help="PostgreSQL major version")
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--workers", type=lambda s: [int(w) for w in s.split(",")], default=[1, 2, 4])
    parser.add_argument("--baseline-repeat", type=int, default=3)
    parser.add_argument("--load-tps", type=int, default=500, help="write rate during the online snapshot")
    parser.add_argument("--part", type=_parts, default=["all"], help=f"all, or some of {','.join(PARTS)}")
    parser.add_argument("--path", choices=["c", "python"], help="the copy's row splitter (default: C where built)")
    parser.add_argument("--json", help="write every figure to this file")
    args = parser.parse_args()
    if args.path is not None and args.path != COPY_ROWS_PATH:  # chosen at import: run again with it set
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, COPY_ROWS_ENV: args.path})
    print(f"copy rows split on the {COPY_ROWS_PATH} path", flush=True)
    code = common.code_version()
    load = common.load_snapshot()
    print(common.describe_code(code), flush=True)
    print(common.describe_load(load), flush=True)
    cluster = common.start_cluster(args.pg)
    work = Path(tempfile.mkdtemp(prefix="cdc-bench-snapshot-"))
    report: dict[str, Any] = {
        "machine": common.machine(),
        "command": sys.argv,
        "copy_path": COPY_ROWS_PATH,
        "load_before": load,
    }
    try:
        with psycopg.connect(cluster.dsn()) as conn:
            report["server_version"] = one_row(conn.execute("SHOW server_version"))[0]
        table = create_table(cluster, args.rows)
        report["table"] = {"rows": table.rows, "heap_bytes": table.heap_bytes}
        print(f"[table] {table.rows:,} rows, {table.heap_bytes / common.MiB:,.0f} MiB of heap", flush=True)
        binary_copy(cluster)  # into the page cache
        for name, part in PARTS.items():
            if name in args.part or "all" in args.part:
                report[name] = part(args, cluster, table, work)
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)
    report["load_after"] = common.load_snapshot()
    report["code_end"] = common.code_version()
    print(common.describe_code(code, report["code_end"]))
    print(common.describe_load(report["load_after"]))
    common.write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
