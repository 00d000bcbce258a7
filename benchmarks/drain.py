"""Drain benchmark: end-to-end drain rate, and peak memory on one huge transaction, against the drain's targets.

    python benchmarks/drain.py [--pg 16] [--part all|rate|rss] [--transactions 260000] [--repeat 3]
                               [--rows 2000000] [--batch-changes N] [--big-batch N] [--json out.json]

rate: ``pgbench -i``, then ``cdc_assets.setup.setup`` for ``--repeat`` + 3 configs in a temporary
      folder (one slot and change log each, same publication), then
      ``pgbench -n -c 2`` (4 changes per transaction; ``--batch-changes`` to set the timed drains'
      ``source.batch_changes``). For each of the ``--repeat`` slots: the bare
      peek fetch of the whole slot range (``SlotReader.peek``, the drain's query and cursor, nothing
      per row; its child process started beforehand) ``--fetches`` times, the same query streamed by
      psycopg in this process (``plain``, what any client would do) as often, then
      ``cdc_assets.drain.drain`` of that slot (everything timed: lock, connections, child, ...).
      Requirement: drain changes/s >= 0.5 x fetch changes/s over the same range (median of rounds),
      taking per round the faster of the two fetches' medians.
      Then, to show where the time goes: one drain under phase timers (library methods wrapped for
      the duration: server time to first row, row fetch, feed_blocks work, writer close, advance, ...),
      the same with ``batch_changes: --big-batch``, and one under cProfile (if the rate fails or
      with ``--profile``).
rss:  a 7-column table, two slots per mode (``source.streaming`` off and on), one
      ``INSERT … SELECT … FROM generate_series(1, --rows)`` transaction, then each slot drained in
      a subprocess whose RSS is sampled with psutil every 10 ms; the child also reports its own
      ``ru_maxrss``. Requirement: peak RSS < 1 GiB.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import gc
import io
import json
import os
import pstats
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _common as common
import psutil
import psycopg

from cdc_assets.config import Config, load_config
from cdc_assets.drain import DrainProgress, drain
from cdc_assets.setup import setup
from cdc_assets.source.connection import apply_pinned_settings
from cdc_assets.source.reader import FETCH_ROWS, PEEK_QUERY, SlotReader, pgoutput_options

NO_LIMIT = 2**31 - 1
PUBLICATION = "bench_pub"
PGBENCH_TABLES = [
    "public.pgbench_accounts",
    "public.pgbench_branches",
    "public.pgbench_tellers",
    "public.pgbench_history",
]
GiB = 1 << 30

BIG_TABLE = """
CREATE TABLE big (
    id bigint PRIMARY KEY,
    k integer NOT NULL,
    label text NOT NULL,
    created timestamptz NOT NULL,
    amount numeric(12, 2),
    ok boolean,
    score double precision
)"""
BIG_INSERT = """
INSERT INTO big
SELECT g, g % 1000, md5(g::text), timestamptz '2024-01-01 00:00:00+00' + g * interval '1 second',
       (g % 100000) / 100.0, g % 3 = 0, g / 7.0
FROM generate_series(1, %s) AS g"""


def write_config(
    folder: Path, dsn: str, slot: str, tables: list[str], streaming: str = "off", batch_changes: int | None = None
) -> Config:
    folder.mkdir(parents=True, exist_ok=True)
    source: dict[str, Any] = {"dsn": dsn, "publication": PUBLICATION, "slot": slot, "streaming": streaming}
    if batch_changes is not None:
        source["batch_changes"] = batch_changes
    text = {
        "source": source,
        "changelog": {"path": str(folder / "changelog")},
        "warehouse": {"path": str(folder / "warehouse")},
        "tables": {name: {} for name in tables},
    }
    path = folder / "cdc.yaml"
    path.write_text(json.dumps(text, indent=2), encoding="utf-8")  # JSON is YAML
    return load_config(path)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- rate -------------------------------------------------------------------------------------


def fetch_once(config: Config, major: int) -> float:
    """The drain's peek over the whole slot range (its child process), nothing done per row."""
    with (
        psycopg.connect(config.source.dsn, autocommit=True) as conn,
        SlotReader(conn, config.source, major, two_phase=False) as reader,
    ):
        with reader.peek(1) as blocks:  # the child started and connected: not timed
            collections.deque(blocks, maxlen=0)
        gc.collect()
        started = time.perf_counter()
        with reader.peek(NO_LIMIT) as blocks:
            collections.deque(blocks, maxlen=0)
        return time.perf_counter() - started


def plain_fetch_once(config: Config, major: int) -> float:
    """The same query streamed by psycopg in this process, as any client would, nothing per row."""
    options = pgoutput_options(config.source, major, two_phase=False)
    with psycopg.connect(config.source.dsn, autocommit=True) as conn:
        gc.collect()
        started = time.perf_counter()
        with conn.transaction():
            apply_pinned_settings(conn)
            rows = conn.cursor(binary=True).stream(
                PEEK_QUERY, (config.source.slot, None, NO_LIMIT, options), size=FETCH_ROWS
            )
            collections.deque(rows, maxlen=0)
        return time.perf_counter() - started


def server_decode_once(config: Config) -> float:
    """The whole slot range decoded on the server alone (count(*)), nothing sent."""
    with psycopg.connect(config.source.dsn, autocommit=True) as conn:
        options = pgoutput_options(config.source, conn.info.server_version // 10000, two_phase=False)
        started = time.perf_counter()
        conn.execute(
            "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s::name, NULL, NULL, VARIADIC %s::text[])",
            (config.source.slot, options),
        ).fetchone()
        return time.perf_counter() - started


def count_range(config: Config, major: int) -> tuple[int, int, int]:
    """Messages, changes and payload bytes in the slot (one untimed pass)."""
    messages = changes = nbytes = 0
    with (
        psycopg.connect(config.source.dsn, autocommit=True) as conn,
        SlotReader(conn, config.source, major, two_phase=False) as reader,
        reader.peek(NO_LIMIT) as blocks,
    ):
        for data in (data for block in blocks for data in block.messages()):
            messages += 1
            nbytes += len(data)
            if data[0] in b"IUD":
                changes += 1
    return messages, changes, nbytes


PHASES = {
    "server": "server: peek call until its first block of rows (decoding from restart_lsn)",
    "fetch": "client: waiting for the receiving process's next block, after the first",
    "process": "client: feed_blocks work (decode, assemble, Arrow, records to writer)",
    "finish": "client: end_session (last conversions, records to writer)",
    "close": "writer.close (Parquet footers, fsync, transactions file)",
    "checkpoint": "write_checkpoint",
    "advance": "slot advance (server decodes the batch again)",
    "setup": "peek setup (publication check)",
    "other": "other (connect, lock, reconcile, cleanup)",
}


@contextlib.contextmanager
def phase_timers(acc: dict[str, float]) -> Iterator[None]:
    """Time the drain's phases by wrapping library methods for the duration (restored after)."""
    import cdc_assets.drain as drain_module
    from cdc_assets.changelog.writer import BatchWriter
    from cdc_assets.transactions import TransactionAssembler

    clock = time.perf_counter
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            started = clock()
            try:
                return original(*args, **kwargs)
            finally:
                acc[key] = acc.get(key, 0.0) + clock() - started

        patched.append((owner, name, original))
        setattr(owner, name, timed_call)

    original_peek = SlotReader.peek

    @contextlib.contextmanager
    def peek(self: SlotReader, limit: int, upto_lsn: int | None = None) -> Iterator[Iterator[Any]]:
        started = clock()
        with original_peek(self, limit, upto_lsn) as blocks:
            acc["setup"] = acc.get("setup", 0.0) + clock() - started

            def timed_blocks() -> Iterator[Any]:
                step = blocks.__next__
                key = "server"
                while True:
                    begun = clock()
                    try:
                        block = step()
                    except StopIteration:
                        acc[key] = acc.get(key, 0.0) + clock() - begun
                        return
                    acc[key] = acc.get(key, 0.0) + clock() - begun
                    key = "fetch"
                    yield block

            yield timed_blocks()

    patched.append((SlotReader, "peek", original_peek))
    SlotReader.peek = peek  # type: ignore[method-assign]
    wrap(TransactionAssembler, "feed_blocks", "feed_blocks")
    wrap(TransactionAssembler, "end_session", "finish")
    wrap(BatchWriter, "close", "close")
    wrap(drain_module, "write_checkpoint", "checkpoint")
    wrap(SlotReader, "advance", "advance")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)
        acc["process"] = acc.pop("feed_blocks", 0.0) - acc.get("server", 0.0) - acc.get("fetch", 0.0)


def drain_with_phases(config: Config, major: int) -> dict[str, Any]:
    """Fetch once, decode once on the server, then drain under phase timers."""
    fetch_s = fetch_once(config, major)
    server_s = server_decode_once(config)
    phases: dict[str, float] = {}
    with phase_timers(phases):
        gc.collect()
        started = time.perf_counter()
        result = drain(config)
        drain_s = time.perf_counter() - started
    phases["other"] = drain_s - sum(phases.values())
    client = phases["process"] + phases["finish"]
    return {
        "batch_changes": config.source.batch_changes,
        "fetch_s": fetch_s,
        "server_decode_once_s": server_s,
        "drain_s": drain_s,
        "batches": result.batches,
        "changes": result.total_changes,
        "ratio": fetch_s / drain_s,
        # the ratio if decode/assemble/Arrow/records cost nothing, everything else unchanged
        "bound_free_processing": fetch_s / (drain_s - client),
        "seconds": phases,
    }


def profile_text(profiler: cProfile.Profile, label: str, sort: str, count: int) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(count)
    text = out.getvalue()
    return f"### cProfile: {label} (sorted by {sort})\n" + text[text.find("   ncalls") :]


def part_rate(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cluster = common.start_cluster(args.pg)
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
            print(f"[rate] PostgreSQL {version}; pgbench -i -s {args.scale}", flush=True)
            common.pgbench(cluster, "-i", "-q", "-s", str(args.scale))
            # --repeat timed slots, then one drained with phase timers, one with a larger
            # batch_changes (informative), one under cProfile.
            configs = []
            for i in range(args.repeat + 3):
                batch = args.big_batch if i == args.repeat + 1 else args.batch_changes
                config = write_config(
                    workdir / f"rate{i + 1}", cluster.dsn(), f"bench_rate_{i + 1}", PGBENCH_TABLES, batch_changes=batch
                )
                result = setup(config)
                configs.append(config)
            breakdown_config, big_config, profile_config = configs[args.repeat :]
            print(f"[rate] set up {len(configs)} slots (snapshot rows: {result.rows})", flush=True)
            per_client = -(-args.transactions // args.clients)
            command = f"pgbench -n -t {per_client} -c {args.clients}"
            print(f"[rate] {command} ...", flush=True)
            pgbench_s = common.pgbench(cluster, "-n", "-t", str(per_client), "-c", str(args.clients))
            conn.execute("CHECKPOINT")
        major = cluster.version
        messages, changes, nbytes = count_range(configs[0], major)
        print(
            f"[rate] slot range: {messages:,} messages, {changes:,} changes, {nbytes / common.MiB:.1f} MiB", flush=True
        )
        if changes < 1_000_000:
            print(f"WARNING: fewer than 1,000,000 changes ({changes:,}); raise --transactions", flush=True)

        rounds = []
        for i, config in enumerate(configs[: args.repeat]):
            fetches = [fetch_once(config, major) for _ in range(args.fetches)]
            plains = [plain_fetch_once(config, major) for _ in range(args.fetches)]
            load = os.getloadavg()
            batches: list[DrainProgress] = []
            gc.collect()
            started = time.perf_counter()
            result = drain(config, progress=batches.append)
            wall = time.perf_counter() - started
            if result.total_changes != changes:
                print(f"WARNING: drained {result.total_changes:,} changes, the range holds {changes:,}", flush=True)
            fetch_median = min(statistics.median(fetches), statistics.median(plains))  # the stricter
            rate = result.total_changes / wall
            fetch_rate = changes / fetch_median
            per_batch = [
                round(b.elapsed_s - (batches[j - 1].elapsed_s if j else 0.0), 3) for j, b in enumerate(batches)
            ]
            rounds.append(
                {
                    "slot": config.source.slot,
                    "fetch_seconds": [round(f, 3) for f in fetches],
                    "plain_fetch_seconds": [round(f, 3) for f in plains],
                    "fetch_median_s": fetch_median,
                    "fetch_changes_per_s": fetch_rate,
                    "fetch_messages_per_s": messages / fetch_median,
                    "drain_seconds": wall,
                    "drain_elapsed_s": result.elapsed_s,
                    "drain_changes": result.total_changes,
                    "drain_transactions": result.transactions,
                    "drain_batches": result.batches,
                    "drain_changes_per_s": rate,
                    "ratio": rate / fetch_rate,
                    "batch_seconds": per_batch,
                    "changelog_bytes": folder_bytes(Path(config.changelog_path)),
                    "loadavg": [round(x, 2) for x in load],
                }
            )
            print(
                f"[rate] round {i + 1}: fetch {', '.join(f'{f:.2f}' for f in fetches)} s,"
                f" plain psycopg fetch {', '.join(f'{f:.2f}' for f in plains)} s"
                f" ({fetch_rate:,.0f} changes/s median); drain {wall:.2f} s, {result.batches} batches"
                f" ({rate:,.0f} changes/s); ratio {rate / fetch_rate:.2f}",
                flush=True,
            )

        # Where the time goes: two more drains of the same range under phase timers, one with the
        # default batch_changes and one with --big-batch, each after its own fetch measurement.
        breakdowns = [drain_with_phases(breakdown_config, major), drain_with_phases(big_config, major)]
        for b in breakdowns:
            print(
                f"[rate] phases, batch_changes {b['batch_changes']:,}: fetch {b['fetch_s']:.2f} s, drain {b['drain_s']:.2f} s"
                f" ({b['batches']} batches), ratio {b['ratio']:.2f}; with free client processing at most"
                f" {b['bound_free_processing']:.2f}",
                flush=True,
            )
            for key, seconds in sorted(b["seconds"].items(), key=lambda kv: -kv[1]):
                print(f"    {seconds:6.2f} s {100 * seconds / b['drain_s']:5.1f}%  {PHASES[key]}")
            print(
                f"    (the whole range decoded once on the server, count(*): {b['server_decode_once_s']:.2f} s)",
                flush=True,
            )

        profiles = []
        ratio_median = statistics.median(r["ratio"] for r in rounds)
        if args.profile or ratio_median < 0.5:
            profiler = cProfile.Profile()
            profiler.enable()
            started = time.perf_counter()
            drain(profile_config)
            profiled_s = time.perf_counter() - started
            profiler.disable()
            label = f"drain of {changes:,} changes ({profiled_s:.1f} s under the profiler)"
            profiles = [profile_text(profiler, label, "tottime", 25), profile_text(profiler, label, "cumulative", 35)]
            for text in profiles:
                print("\n" + text)

        return {
            "server_version": version,
            "pgbench_command": command,
            "pgbench_seconds": round(pgbench_s, 1),
            "pgbench_tps": round(per_client * args.clients / pgbench_s),
            "messages": messages,
            "changes": changes,
            "bytes": nbytes,
            "batch_changes": configs[0].source.batch_changes,
            "rounds": rounds,
            "ratio_median": ratio_median,
            "ratio_best": max(r["ratio"] for r in rounds),
            "drain_rate_best": max(r["drain_changes_per_s"] for r in rounds),
            "drain_rate_median": statistics.median(r["drain_changes_per_s"] for r in rounds),
            "fetch_rate_best": changes / min(min(r["fetch_seconds"]) for r in rounds),
            "fetch_rate_median": changes / statistics.median(f for r in rounds for f in r["fetch_seconds"]),
            "plain_fetch_rate_median": changes / statistics.median(f for r in rounds for f in r["plain_fetch_seconds"]),
            "pass": ratio_median >= 0.5,
            "breakdowns": breakdowns,
            "profiles": profiles,
        }
    finally:
        cluster.stop()


# -- rss --------------------------------------------------------------------------------------


CHILD = """
import json, resource, sys, time
import psutil
from cdc_assets.config import load_config
from cdc_assets.drain import drain
from cdc_assets.source.reader import SlotReader
config = load_config(sys.argv[1])
peeks = []  # (limit, rows) of every peek call: a streamed transaction larger than a batch is re-peeked
original_peek = SlotReader.peek
def counting_peek(self, limit, upto_lsn=None):
    import contextlib
    @contextlib.contextmanager
    def wrapper():
        with original_peek(self, limit, upto_lsn) as blocks:
            entry = [limit, 0]
            peeks.append(entry)
            def counted():
                for block in blocks:
                    entry[1] += len(block.lsns)
                    yield block
            yield counted()
    return wrapper()
SlotReader.peek = counting_peek
baseline = psutil.Process().memory_info().rss
started = time.perf_counter()
result = drain(config)
from cdc_assets.source.receiver import POOL
POOL.clear()  # waits for the peek's receiving process, so that RUSAGE_CHILDREN counts it
print(json.dumps({
    "seconds": time.perf_counter() - started,
    "changes": result.total_changes,
    "transactions": result.transactions,
    "batches": result.batches,
    "baseline_rss": baseline,
    "peeks": peeks,
    "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "children_ru_maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
}))
"""


def drain_in_child(config: Config) -> dict[str, Any]:
    """Drain in a subprocess; sample its RSS plus its children's (the peek's receiving process)
    every 10 ms."""
    assert config.path is not None
    process = subprocess.Popen([sys.executable, "-c", CHILD, str(config.path)], stdout=subprocess.PIPE, text=True)
    watched = psutil.Process(process.pid)
    peak = 0
    samples = 0
    while process.poll() is None:
        try:
            family = [watched, *watched.children(recursive=True)]
            peak = max(peak, sum(p.memory_info().rss for p in family))
            samples += 1
        except psutil.NoSuchProcess:
            break
        time.sleep(0.01)
    out, _ = process.communicate()
    if process.returncode != 0:
        raise RuntimeError(f"the drain subprocess failed ({process.returncode})")
    report = json.loads(out.strip().splitlines()[-1])
    report["sampled_peak_rss"] = peak
    report["samples"] = samples
    # the two processes' own peaks added up: an upper bound, in case the sampling missed a peak
    report["peak_rss"] = max(peak, report["ru_maxrss"] + report["children_ru_maxrss"])
    return report


def part_rss(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cluster = common.start_cluster(args.pg)
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
            conn.execute(BIG_TABLE)
            configs = []
            for mode in ("off", "on"):
                for i in range(args.rss_repeat):
                    slot = f"bench_rss_{mode}_{i + 1}"
                    config = write_config(workdir / slot, cluster.dsn(), slot, ["public.big"], streaming=mode)
                    setup(config)
                    configs.append((mode, config))
            print(f"[rss] PostgreSQL {version}; one INSERT of {args.rows:,} rows ...", flush=True)
            started = time.perf_counter()
            conn.execute(BIG_INSERT.replace("%s", str(int(args.rows))))
            insert_s = time.perf_counter() - started
            size = conn.execute("SELECT pg_total_relation_size('big')").fetchone()[0]
            conn.execute("CHECKPOINT")
        runs = []
        for mode, config in configs:
            report = drain_in_child(config)
            report["streaming"] = mode
            report["changes_per_s"] = report["changes"] / report["seconds"]
            report["pass"] = report["peak_rss"] < GiB
            report["changelog_bytes"] = folder_bytes(Path(config.changelog_path))
            runs.append(report)
            print(
                f"[rss] streaming {mode}: peak RSS {report['peak_rss'] / common.MiB:,.0f} MiB"
                f" (sampled {report['sampled_peak_rss'] / common.MiB:,.0f}, ru_maxrss {report['ru_maxrss'] / common.MiB:,.0f},"
                f" after imports {report['baseline_rss'] / common.MiB:,.0f}); {report['changes']:,} changes in"
                f" {report['seconds']:.1f} s ({report['changes_per_s']:,.0f}/s), {report['batches']} batch(es),"
                f" peek calls (limit, rows): {report['peeks']}",
                flush=True,
            )
        return {
            "server_version": version,
            "rows": args.rows,
            "insert_seconds": round(insert_s, 1),
            "table_bytes": size,
            "runs": runs,
            "pass": all(r["pass"] for r in runs),
        }
    finally:
        cluster.stop()


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, default=16, choices=(15, 16, 18))
    parser.add_argument("--part", choices=("all", "rate", "rss"), default="all")
    parser.add_argument(
        "--transactions", type=int, default=260_000, help="pgbench transactions in total (4 changes each)"
    )
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3, help="slots drained (each with its own fetch measurements)")
    parser.add_argument("--fetches", type=int, default=3, help="bare fetches per slot before its drain")
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the one big transaction")
    parser.add_argument("--rss-repeat", type=int, default=2, help="slots drained per streaming mode")
    parser.add_argument(
        "--batch-changes",
        type=int,
        default=None,
        help="source.batch_changes of the timed drains and the first phase breakdown (default: the library's default)",
    )
    parser.add_argument(
        "--big-batch", type=int, default=10_000_000, help="batch_changes of the informative extra drain"
    )
    parser.add_argument("--profile", action="store_true", help="profile one extra drain even if the rate passes")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()

    machine = common.machine()
    code_start = common.code_version()
    load_before = common.load_snapshot()
    workdir = Path(tempfile.mkdtemp(prefix="cdc-bench-drain-"))
    results: dict[str, Any] = {"benchmark": "drain", "command": " ".join(["python", *sys.argv]), "machine": machine}
    try:
        if args.part in ("all", "rate"):
            results["rate"] = part_rate(args, workdir)
        if args.part in ("all", "rss"):
            results["rss"] = part_rss(args, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    load_after = common.load_snapshot()
    code_end = common.code_version()
    results["load_before"], results["load_after"] = load_before, load_after
    results["code_start"], results["code_end"] = code_start, code_end

    print()
    ok = True
    if "rate" in results:
        rate = results["rate"]
        print(
            f"Drain rate, PostgreSQL {rate['server_version']}, {rate['changes']:,} changes ({rate['messages']:,} messages,"
            f" {rate['bytes'] / common.MiB:.0f} MiB), batch_changes {rate['batch_changes']:,}"
        )
        rows = [
            [
                r["slot"],
                f"{r['fetch_median_s']:.2f}",
                f"{r['fetch_changes_per_s']:,.0f}",
                f"{r['drain_seconds']:.2f}",
                r["drain_batches"],
                f"{r['drain_changes_per_s']:,.0f}",
                f"{r['ratio']:.2f}",
            ]
            for r in rate["rounds"]
        ]
        print(
            common.table(
                [
                    "slot",
                    "fetch s (median of 3)",
                    "fetch changes/s",
                    "drain s",
                    "batches",
                    "drain changes/s",
                    "drain/fetch",
                ],
                rows,
            )
        )
        print(
            f"drain/fetch = {rate['ratio_median']:.2f} (median of rounds; best {rate['ratio_best']:.2f}), required >= 0.5:"
            f" {'PASS' if rate['pass'] else 'FAIL'}"
        )
        for b in rate["breakdowns"]:
            print(
                f"\nwhere a drain's {b['drain_s']:.2f} s go, batch_changes {b['batch_changes']:,} ({b['batches']} batches;"
                f" fetch just before: {b['fetch_s']:.2f} s, ratio {b['ratio']:.2f}; the range decoded once on the server:"
                f" {b['server_decode_once_s']:.2f} s):"
            )
            print(
                common.table(
                    ["phase", "s", "%"],
                    [
                        [PHASES[k], f"{v:.2f}", f"{100 * v / b['drain_s']:.1f}"]
                        for k, v in sorted(b["seconds"].items(), key=lambda kv: -kv[1])
                    ],
                )
            )
            print(
                f"ratio if client processing (feed_blocks work + end_session) cost nothing: {b['bound_free_processing']:.2f}"
            )
        ok &= rate["pass"]
    if "rss" in results:
        rss = results["rss"]
        print(f"\nPeak RSS, one transaction of {rss['rows']:,} rows, PostgreSQL {rss['server_version']}")
        rows = [
            [
                r["streaming"],
                f"{r['peak_rss'] / common.MiB:,.0f}",
                f"{r['ru_maxrss'] / common.MiB:,.0f}",
                f"{r['sampled_peak_rss'] / common.MiB:,.0f}",
                f"{r['baseline_rss'] / common.MiB:,.0f}",
                f"{r['seconds']:.1f}",
                f"{r['changes_per_s']:,.0f}",
                r["batches"],
                "PASS" if r["pass"] else "FAIL",
            ]
            for r in rss["runs"]
        ]
        print(
            common.table(
                [
                    "streaming",
                    "peak RSS MiB",
                    "ru_maxrss MiB",
                    "sampled MiB",
                    "after imports MiB",
                    "drain s",
                    "changes/s",
                    "batches",
                    "< 1 GiB",
                ],
                rows,
            )
        )
        ok &= rss["pass"]
    print(f"\nbefore: {common.describe_load(load_before)}\nafter:  {common.describe_load(load_after)}")
    print(common.describe_code(code_start, code_end))
    common.write_json(args.json, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
