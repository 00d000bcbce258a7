"""Drain benchmark: the drain's rate against pg_recvlogical, and peak memory on one huge transaction.

    python benchmarks/drain.py [--pg 16] [--part all|rate|rss|light|tables] [--transactions 260000] [--repeat 3]
                               [--rows 2000000] [--batch-changes N] [--big-batch N] [--profile]
                               [--light-rate 520] [--light-seconds 60] [--configured-tables 300] [--json out.json]

rate: ``pgbench -i``, then ``cdc_assets.pipeline.setup.setup`` of one slot and change log per measurement
      (same publication ``bench_pub`` on the four pgbench tables), all before the load, so that
      every slot holds the same range: ``pgbench -n -t <transactions / 2> -c 2`` (4 changes per
      transaction), then ``CHECKPOINT``; the range ends at the flush LSN after that. Its messages,
      changes and bytes are counted once over the stream (an extra slot, read with
      ``SlotStream`` without confirming). Then ``--repeat`` rounds, each over two fresh slots:
        * ``pg_recvlogical --start --no-loop --endpos=<end> -f /dev/null -F 0
          -o proto_version=<max> -o publication_names=bench_pub -o messages=true`` (PostgreSQL's
          own C client of the same protocol, the same pgoutput options as the drain's), timed as a
          whole command (process start, connection, the server's decoding, the transfer);
        * ``cdc_assets.pipeline.drain.drain(config)`` of the other slot, timed as a whole call (lock,
          connections, checks, the stream and its receiving child, assembling, Parquet,
          checkpoints, confirmations). The receiving child process is already started
          (the count pass leaves it idle in ``cdc_assets.stream.process.POOL``), as in every drain of
          a long-running process after its first;
      the two go first in turn (even rounds pg_recvlogical, odd rounds the drain), and each round
      then reads the range once more with ``SlotStream`` alone, nothing done per block
      (informative: the Python receiving child against the C client).
      ratio = drain changes/s / pg_recvlogical changes/s over the same range; the figure is the
      median of the rounds. Target: >= 0.9. Each drain also records the blocks the stream handed
      it (``SlotStream.next`` counted): the receiving child sends a block when it is full (8,192
      messages or 4 MiB) or once 50 ms have passed since its first message with libpq holding no
      whole message and the socket nothing more, and each block has a cost of its own.
      A drain makes a batch durable every ``drain.commit_seconds`` (2 s by default) or
      ``source.batch_changes`` messages, whichever comes first, catching up or following.
      Then, to show where the time goes, one drain under phase timers (library methods wrapped
      for the duration, exclusive times: waiting for the stream, feed_blocks, flush, writer close,
      checkpoint, confirm, ...) with the default ``batch_changes`` and one with ``--big-batch``;
      with ``--profile`` one more drain under cProfile (the drain's process only, not its
      receiving child). Slots: 2 x --repeat + 3 (+ 1 with --profile), at most 20.
rss:  a 7-column table, two slots per mode (``source.streaming`` off and on), one
      ``INSERT … SELECT … FROM generate_series(1, --rows)`` transaction, then each slot drained in
      a subprocess whose RSS (with its receiving child's) is sampled with psutil every 10 ms; the
      child also reports its own ``ru_maxrss`` and its receiving child's own peak (``VmHWM``, read
      before the child exits; its ``ru_maxrss`` would also count the drain's pages shared at the
      fork), the blocks and positions the stream handed it and the batches it made durable. The
      peak is the larger of the sampled sum and the two peaks added. Requirement: < 1 GiB.
light: a following drain under a light steady load, what it costs in CPU: ``pgbench -i``, one
      slot and change log (``drain.commit_seconds: 1``), ``python -m cdc_assets drain --follow``
      as a subprocess, then ``pgbench -n -c 4 -j 2 -R <--light-rate> -T <--light-seconds>``; the
      CPU seconds of the drain and its receiving child (psutil) over the load, as a share of one
      core. At a few hundred transactions a second the server sends a keepalive after each one:
      what a block and a frame cost, paid per transaction, is what this part shows.
tables: whether the drain's cost grows with the tables configured beside the ones that change:
      ``pgbench -i``, ``--configured-tables`` minus four more tables (empty, never written) in the
      publication, then ``--repeat`` pairs of slots set up before the load — one configured with
      the four pgbench tables, one with every table — and ``pgbench -n -t <transactions / 2> -c 2``;
      each pair's drains of the same range timed in turn (which goes first alternates). ratio =
      the drain with every table configured / the drain with four, median of the rounds.
      Target: <= 1 within noise (the drain opens no Delta table and reads no state per table).

Full-size runs (a quiet machine):

    python benchmarks/drain.py --pg 16 --part rate --json drain_rate.json
    python benchmarks/drain.py --pg 16 --part rss --json drain_rss.json
    python benchmarks/drain.py --pg 16 --part light --json drain_light.json
    python benchmarks/drain.py --pg 16 --part tables --json drain_tables.json
"""

from __future__ import annotations

import argparse
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
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import _common as common
import psutil
import psycopg

from cdc_assets.changelog.stream_writer import DrainProgress
from cdc_assets.config import Config, load_config
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.setup import setup
from cdc_assets.stream.options import max_proto_version
from cdc_assets.stream.process import POOL

PUBLICATION = "bench_pub"
PGBENCH_TABLES = [
    "public.pgbench_accounts",
    "public.pgbench_branches",
    "public.pgbench_tellers",
    "public.pgbench_history",
]
GiB = 1 << 30
MAX_SLOTS = 20  # the throwaway cluster's max_replication_slots

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
    folder: Path,
    dsn: str,
    slot: str,
    tables: list[str],
    streaming: str = "off",
    batch_changes: int | None = None,
    commit_seconds: float | None = None,
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
    if commit_seconds is not None:
        text["drain"] = {"commit_seconds": commit_seconds}
    path = folder / "cdc.yaml"
    path.write_text(json.dumps(text, indent=2), encoding="utf-8")  # JSON is YAML
    return load_config(path)


def pgbench_initialized(conn: psycopg.Connection[Any], cluster: Any, scale: int, part: str) -> str:
    """``pgbench -i -s <scale>`` on the cluster; its server's version."""
    version: str = conn.execute("SHOW server_version").fetchone()[0]  # type: ignore[index]
    print(f"[{part}] PostgreSQL {version}; pgbench -i -s {scale}", flush=True)
    common.pgbench(cluster, "-i", "-q", "-s", str(scale))
    return version


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- rate -------------------------------------------------------------------------------------


def recv_options(major: int) -> list[tuple[str, str]]:
    """pg_recvlogical's pgoutput options: the drain's (``pgoutput_options`` with the defaults:
    text, streaming off, no two-phase; ``origin`` is ``any`` by default on 16+)."""
    return [("proto_version", str(max_proto_version(major))), ("publication_names", PUBLICATION), ("messages", "true")]


def count_range(config: Config, major: int, target: int) -> tuple[int, int, int]:
    """Messages, changes and payload bytes of the slot's range up to ``target`` (one untimed pass
    over the stream; the slot does not move)."""
    counts = [0, 0, 0]

    def count(block: Any) -> None:
        datas = block.messages()
        counts[0] += len(datas)
        counts[1] += sum(1 for data in datas if data[:1] in (b"I", b"U", b"D"))
        counts[2] += len(block.data)

    common.stream_range(config.source.dsn, config.source.slot, PUBLICATION, recv_options(major), target, count)
    return counts[0], counts[1], counts[2]


def stream_fetch_once(config: Config, major: int, target: int) -> tuple[float, int]:
    """The range read with SlotStream (the drain's receiving child), nothing done per block."""
    counts: dict[str, int] = {}
    gc.collect()
    with counting_blocks(counts):
        started = time.perf_counter()
        common.stream_range(config.source.dsn, config.source.slot, PUBLICATION, recv_options(major), target)
        seconds = time.perf_counter() - started
    return seconds, counts["blocks"]


@contextlib.contextmanager
def counting_blocks(counts: dict[str, int]) -> Iterator[None]:
    """Count the blocks and messages ``SlotStream.next`` hands out for the duration: how the
    receiving child cut the stream (it sends a block when it is full, 8,192 messages or 4 MiB, or
    whenever libpq holds no whole message)."""
    from cdc_assets.stream.blocks import MessageBlock
    from cdc_assets.stream.reader import SlotStream

    original = SlotStream.next
    counts.update(blocks=0, messages=0, single=0)

    def counted(self: SlotStream, timeout: float | None = None) -> Any:
        frame = original(self, timeout)
        if isinstance(frame, MessageBlock):
            counts["blocks"] += 1
            counts["messages"] += len(frame)
            counts["single"] += len(frame) == 1
        return frame

    SlotStream.next = counted  # type: ignore[method-assign]
    try:
        yield
    finally:
        SlotStream.next = original  # type: ignore[method-assign]


PHASES = {
    "start": "SlotStream start (role and publication checks, child, connect, START_REPLICATION)",
    "wait": "waiting for the stream's next block or position (server decoding + transfer not hidden)",
    "process": "TransactionAssembler.feed_blocks (decode, assemble, Arrow, records to the writer)",
    "flush": "TransactionAssembler.flush / end_session (a batch's last conversions, records to the writer)",
    "close": "BatchWriter.close (Parquet footers, fsync, transactions file)",
    "checkpoint": "write_checkpoint",
    "confirm": "SlotStream.confirm (the flushed position to the child)",
    "stop": "SlotStream.stop (CopyDone, the server lets the slot go)",
    "other": "other (lock, connections, checks, batch splitting, ...)",
}


@contextlib.contextmanager
def phase_timers(acc: dict[str, float]) -> Iterator[None]:
    """Time the drain's phases by wrapping library methods for the duration (restored after).
    Times are exclusive (a wrapped call inside another counts for itself only), on the calling
    thread only."""
    import cdc_assets.changelog.stream_writer as stream_writer
    from cdc_assets.changelog.writer import BatchWriter
    from cdc_assets.stream.reader import SlotStream
    from cdc_assets.transactions import TransactionAssembler

    clock = time.perf_counter
    caller = threading.current_thread()
    inner: list[float] = []  # per active wrapped call: time spent in wrapped calls inside it
    patched: list[tuple[Any, str, Any]] = []

    def wrap(owner: Any, name: str, key: str) -> None:
        original = getattr(owner, name)

        def timed_call(*args: Any, **kwargs: Any) -> Any:
            if threading.current_thread() is not caller:
                return original(*args, **kwargs)
            started = clock()
            inner.append(0.0)
            try:
                return original(*args, **kwargs)
            finally:
                elapsed = clock() - started
                acc[key] = acc.get(key, 0.0) + elapsed - inner.pop()
                if inner:
                    inner[-1] += elapsed

        patched.append((owner, name, original))
        setattr(owner, name, timed_call)

    wrap(SlotStream, "__init__", "start")
    wrap(SlotStream, "next", "wait")
    wrap(SlotStream, "confirm", "confirm")
    wrap(SlotStream, "stop", "stop")
    wrap(TransactionAssembler, "feed_blocks", "process")
    wrap(TransactionAssembler, "flush", "flush")
    wrap(TransactionAssembler, "end_session", "flush")
    wrap(BatchWriter, "close", "close")
    wrap(stream_writer, "write_checkpoint", "checkpoint")
    try:
        yield
    finally:
        for owner, name, original in reversed(patched):
            setattr(owner, name, original)


def drain_with_phases(config: Config, recv_s: float, changes: int) -> dict[str, Any]:
    """One drain under phase timers; compared with the rounds' median pg_recvlogical time."""
    phases: dict[str, float] = {}
    counts: dict[str, int] = {}
    with counting_blocks(counts), phase_timers(phases):
        gc.collect()
        started = time.perf_counter()
        result = drain(config)
        drain_s = time.perf_counter() - started
    phases["other"] = drain_s - sum(phases.values())
    client = phases.get("process", 0.0) + phases.get("flush", 0.0)
    return {
        "batch_changes": config.source.batch_changes,
        "recv_median_s": recv_s,
        "drain_s": drain_s,
        "batches": result.batches,
        "blocks": counts["blocks"],
        "changes": result.total_changes,
        "ratio": (result.total_changes / drain_s) / (changes / recv_s),
        # the ratio if decode/assemble/Arrow/records cost nothing, everything else unchanged
        "bound_free_processing": (result.total_changes / (drain_s - client)) / (changes / recv_s),
        "seconds": phases,
    }


def profile_text(profiler: cProfile.Profile, label: str, sort: str, count: int) -> str:
    out = io.StringIO()
    pstats.Stats(profiler, stream=out).sort_stats(sort).print_stats(count)
    text = out.getvalue()
    return f"### cProfile: {label} (sorted by {sort})\n" + text[text.find("   ncalls") :]


def run_recv(cluster: Any, config: Config, end: int, changes: int) -> dict[str, Any]:
    gc.collect()
    run = common.recvlogical(cluster, config.source.slot, end, recv_options(cluster.version))
    with psycopg.connect(config.source.dsn, autocommit=True) as conn:
        (confirmed,) = conn.execute(
            "SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s",
            (config.source.slot,),
        ).fetchone()
    if confirmed < end:
        print(f"WARNING: pg_recvlogical stopped at {format_lsn(confirmed)}, before {format_lsn(end)}", flush=True)
    return {**run, "confirmed_lsn": confirmed, "changes_per_s": changes / run["seconds"]}


def run_drain(config: Config) -> dict[str, Any]:
    batches: list[DrainProgress] = []
    counts: dict[str, int] = {}
    me = psutil.Process()
    gc.collect()
    with counting_blocks(counts):
        cpu_before = common.tree_cpu_s(me)
        started = time.perf_counter()
        result = drain(config, progress=batches.append)
        wall = time.perf_counter() - started
        cpu = common.tree_cpu_s(me) - cpu_before
    per_batch = [round(b.elapsed_s - (batches[j - 1].elapsed_s if j else 0.0), 3) for j, b in enumerate(batches)]
    return {
        "seconds": wall,
        "cpu_s": cpu,  # the drain's process and its receiving child
        "elapsed_s": result.elapsed_s,
        "changes": result.total_changes,
        "transactions": result.transactions,
        "batches": result.batches,
        "blocks": counts["blocks"],
        "single_message_blocks": counts["single"],
        "batch_seconds": per_batch,
        "checkpoint_lsn": result.checkpoint_lsn,
        "changes_per_s": result.total_changes / wall,
        "changelog_bytes": folder_bytes(Path(config.changelog.path)),
    }


def part_rate(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    slots = 2 * args.repeat + 3 + (1 if args.profile else 0)
    if slots > MAX_SLOTS:
        raise SystemExit(f"--repeat {args.repeat} needs {slots} slots, the cluster has {MAX_SLOTS}")
    cluster = common.start_cluster(args.pg)
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            version = pgbench_initialized(conn, cluster, args.scale, "rate")

            def make(name: str, batch: int | None = args.batch_changes) -> Config:
                config = write_config(
                    workdir / name, cluster.dsn(), f"bench_{name}", PGBENCH_TABLES, batch_changes=batch
                )
                setup(config)
                return config

            count_config = make("count")
            pairs = [(make(f"recv_{i + 1}"), make(f"drain_{i + 1}")) for i in range(args.repeat)]
            phase_config = make("phases")
            big_config = make("big", args.big_batch)
            profile_config = make("profile") if args.profile else None
            print(f"[rate] set up {slots} slots and change logs", flush=True)
            per_client = -(-args.transactions // args.clients)
            command = f"pgbench -n -t {per_client} -c {args.clients}"
            print(f"[rate] {command} ...", flush=True)
            pgbench_s = common.pgbench(cluster, "-n", "-t", str(per_client), "-c", str(args.clients))
            conn.execute("CHECKPOINT")
            end = common.flush_lsn(conn)
        major = cluster.version
        messages, changes, nbytes = count_range(count_config, major, end)
        print(
            f"[rate] slot range up to {format_lsn(end)}: {messages:,} messages, {changes:,} changes,"
            f" {nbytes / common.MiB:.1f} MiB",
            flush=True,
        )
        if changes < 1_000_000:
            print(f"WARNING: fewer than 1,000,000 changes ({changes:,}); raise --transactions", flush=True)

        rounds = []
        for i, (recv_config, drain_config) in enumerate(pairs):
            load = os.getloadavg()
            POOL.prestart()  # the drain's receiving child is idle and ready, as after any first drain
            if i % 2 == 0:
                recv = run_recv(cluster, recv_config, end, changes)
                drained = run_drain(drain_config)
            else:
                drained = run_drain(drain_config)
                recv = run_recv(cluster, recv_config, end, changes)
            fetch_s, fetch_blocks = stream_fetch_once(count_config, major, end)
            if drained["changes"] != changes:
                print(f"WARNING: drained {drained['changes']:,} changes, the range holds {changes:,}", flush=True)
            ratio = drained["changes_per_s"] / recv["changes_per_s"]
            rounds.append(
                {
                    "first": "pg_recvlogical" if i % 2 == 0 else "drain",
                    "recv_slot": recv_config.source.slot,
                    "drain_slot": drain_config.source.slot,
                    "recv_seconds": recv["seconds"],
                    "recv_cpu_s": recv["cpu_s"],
                    "recv_changes_per_s": recv["changes_per_s"],
                    "recv_messages_per_s": messages / recv["seconds"],
                    "recv_confirmed_lsn": recv["confirmed_lsn"],
                    "drain_seconds": drained["seconds"],
                    "drain_cpu_s": drained["cpu_s"],
                    "drain_elapsed_s": drained["elapsed_s"],
                    "drain_changes": drained["changes"],
                    "drain_transactions": drained["transactions"],
                    "drain_batches": drained["batches"],
                    "drain_blocks": drained["blocks"],
                    "drain_single_message_blocks": drained["single_message_blocks"],
                    "drain_batch_seconds": drained["batch_seconds"],
                    "drain_changes_per_s": drained["changes_per_s"],
                    "changelog_bytes": drained["changelog_bytes"],
                    "stream_fetch_seconds": fetch_s,
                    "stream_fetch_blocks": fetch_blocks,
                    "stream_fetch_changes_per_s": changes / fetch_s,
                    "ratio": ratio,
                    "loadavg": [round(x, 2) for x in load],
                }
            )
            print(
                f"[rate] round {i + 1} ({rounds[-1]['first']} first): pg_recvlogical {recv['seconds']:.2f} s"
                f" ({recv['changes_per_s']:,.0f} changes/s, {recv['cpu_s']:.2f} s CPU); drain {drained['seconds']:.2f} s,"
                f" {drained['batches']} batches, {drained['blocks']:,} blocks ({drained['changes_per_s']:,.0f} changes/s,"
                f" {drained['cpu_s']:.2f} s CPU);"
                f" ratio {ratio:.2f}; SlotStream alone {fetch_s:.2f} s ({fetch_blocks:,} blocks)",
                flush=True,
            )
        ratio_median = statistics.median(r["ratio"] for r in rounds)
        recv_median = statistics.median(r["recv_seconds"] for r in rounds)

        # Where the time goes: two more drains of the same range under phase timers, one with the
        # default batch_changes and one with --big-batch.
        breakdowns = [drain_with_phases(c, recv_median, changes) for c in (phase_config, big_config)]
        for b in breakdowns:
            print(
                f"[rate] phases, batch_changes {b['batch_changes']:,}: drain {b['drain_s']:.2f} s ({b['batches']} batches,"
                f" {b['blocks']:,} blocks),"
                f" ratio to the median pg_recvlogical {b['ratio']:.2f}; with free client processing at most"
                f" {b['bound_free_processing']:.2f}",
                flush=True,
            )
            for key, seconds in sorted(b["seconds"].items(), key=lambda kv: -kv[1]):
                print(f"    {seconds:6.2f} s {100 * seconds / b['drain_s']:5.1f}%  {PHASES[key]}")

        profiles = []
        if profile_config is not None:
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
            "pgbench_transactions": per_client * args.clients,
            "pgbench_seconds": round(pgbench_s, 1),
            "pgbench_tps": round(per_client * args.clients / pgbench_s),
            "end_lsn": format_lsn(end),
            "recv_command": " ".join(
                ["pg_recvlogical", *common.recvlogical_args(pairs[0][0].source.slot, end, recv_options(major))]
            ),
            "messages": messages,
            "changes": changes,
            "bytes": nbytes,
            "batch_changes": pairs[0][1].source.batch_changes,
            "rounds": rounds,
            "ratio_median": ratio_median,
            "ratio_best": max(r["ratio"] for r in rounds),
            "drain_rate_best": max(r["drain_changes_per_s"] for r in rounds),
            "drain_rate_median": statistics.median(r["drain_changes_per_s"] for r in rounds),
            "recv_rate_best": changes / min(r["recv_seconds"] for r in rounds),
            "recv_rate_median": changes / recv_median,
            "stream_fetch_rate_median": changes / statistics.median(r["stream_fetch_seconds"] for r in rounds),
            "pass": ratio_median >= 0.9,
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
from cdc_assets.pipeline.drain import drain
from cdc_assets.stream.blocks import MessageBlock, StreamPosition
from cdc_assets.stream.reader import SlotStream
config = load_config(sys.argv[1])
stream = {"blocks": 0, "messages": 0, "bytes": 0, "largest_block_rows": 0, "largest_block_bytes": 0, "positions": 0}
original_next = SlotStream.next
def counting_next(self, timeout=None):
    frame = original_next(self, timeout)
    if isinstance(frame, MessageBlock):
        stream["blocks"] += 1
        stream["messages"] += len(frame)
        stream["bytes"] += len(frame.data)
        stream["largest_block_rows"] = max(stream["largest_block_rows"], len(frame))
        stream["largest_block_bytes"] = max(stream["largest_block_bytes"], len(frame.data))
    elif isinstance(frame, StreamPosition):
        stream["positions"] += 1
    return frame
SlotStream.next = counting_next
baseline = psutil.Process().memory_info().rss
started = time.perf_counter()
result = drain(config)
seconds = time.perf_counter() - started
def high_water(pid):  # a process's own peak RSS (VmHWM: its address space's since exec)
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
children_hwm = sum(high_water(child.pid) for child in psutil.Process().children(recursive=True))
from cdc_assets.stream.process import POOL
POOL.clear()  # waits for the stream's receiving child, so that RUSAGE_CHILDREN counts it
print(json.dumps({
    "seconds": seconds,
    "changes": result.total_changes,
    "transactions": result.transactions,
    "batches": result.batches,
    "baseline_rss": baseline,
    "stream": stream,
    "ru_maxrss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    "children_ru_maxrss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
    "children_hwm": children_hwm,
}))
"""


def drain_in_child(config: Config) -> dict[str, Any]:
    """Drain in a subprocess; sample its RSS plus its children's (the stream's receiving child)
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
    # the two processes' own peaks added up: an upper bound, in case the sampling missed a peak. The
    # child's own peak is its VmHWM, read while it is still alive: its ru_maxrss (RUSAGE_CHILDREN) also
    # counts the drain's pages it shared after the fork, before its exec.
    report["peak_rss"] = max(peak, report["ru_maxrss"] + report["children_hwm"])
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
            report["changelog_bytes"] = folder_bytes(Path(config.changelog.path))
            runs.append(report)
            print(
                f"[rss] streaming {mode}: peak RSS {report['peak_rss'] / common.MiB:,.0f} MiB"
                f" (sampled {report['sampled_peak_rss'] / common.MiB:,.0f}, ru_maxrss {report['ru_maxrss'] / common.MiB:,.0f},"
                f" receiving child {report['children_hwm'] / common.MiB:,.0f},"
                f" after imports {report['baseline_rss'] / common.MiB:,.0f}); {report['changes']:,} changes in"
                f" {report['seconds']:.1f} s ({report['changes_per_s']:,.0f}/s), {report['batches']} batch(es);"
                f" the stream handed it {report['stream']['blocks']:,} blocks ({report['stream']['messages']:,} messages,"
                f" largest {report['stream']['largest_block_rows']:,} messages /"
                f" {report['stream']['largest_block_bytes'] / common.MiB:.1f} MiB) and {report['stream']['positions']} positions",
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


# -- light ------------------------------------------------------------------------------------


def part_light(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    cluster = common.start_cluster(args.pg)
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            version = pgbench_initialized(conn, cluster, args.scale, "light")
            config = write_config(workdir / "light", cluster.dsn(), "bench_light", PGBENCH_TABLES, commit_seconds=1)
            setup(config)
            follow_s = args.light_seconds + 60
            log = workdir / "light" / "drain.log"
            command = [sys.executable, "-m", "cdc_assets", "drain", "--follow", str(follow_s), "-c", str(config.path)]
            follower = common.started(command, dict(os.environ), log, common.ROOT)
            try:
                deadline = time.monotonic() + 120
                while not conn.execute(
                    "SELECT active FROM pg_replication_slots WHERE slot_name = 'bench_light'"
                ).fetchone()[0]:
                    if follower.poll() is not None or time.monotonic() > deadline:
                        raise RuntimeError(f"the following drain did not start: {log.read_text()[-2000:]}")
                    time.sleep(0.2)
                process = psutil.Process(follower.pid)
                load = ["-n", "-c", "4", "-j", "2", "-R", str(args.light_rate), "-T", str(args.light_seconds)]
                print(f"[light] drain --follow {follow_s}; pgbench {' '.join(load)}", flush=True)
                cpu_before, started = common.tree_cpu_s(process), time.monotonic()
                common.pgbench(cluster, *load)
                cpu_s, seconds = common.tree_cpu_s(process) - cpu_before, time.monotonic() - started
            finally:
                common.stop(follower)
    finally:
        cluster.stop()
    result = {
        "server_version": version,
        "rate": args.light_rate,
        "seconds": round(seconds, 1),
        "cpu_s": round(cpu_s, 2),
        "cores": round(cpu_s / seconds, 3),
    }
    print(f"[light] drain and child: {result['cores']:.3f} of a core at {args.light_rate} tx/s", flush=True)
    return result


# -- tables -----------------------------------------------------------------------------------


def part_tables(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    extra = [f"public.quiet_{i:03d}" for i in range(args.configured_tables - len(PGBENCH_TABLES))]
    if 2 * args.repeat > MAX_SLOTS:
        raise SystemExit(f"--repeat {args.repeat} needs {2 * args.repeat} slots, the cluster has {MAX_SLOTS}")
    cluster = common.start_cluster(args.pg)
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            version = pgbench_initialized(conn, cluster, args.scale, "tables")
            conn.execute("".join(f"CREATE TABLE {name} (id int PRIMARY KEY, v int);" for name in extra))

            def make(name: str, tables: list[str]) -> Config:
                config = write_config(workdir / name, cluster.dsn(), f"bench_{name}", tables)
                setup(config)
                return config

            pairs = [
                (make(f"few_{i + 1}", PGBENCH_TABLES), make(f"all_{i + 1}", PGBENCH_TABLES + extra))
                for i in range(args.repeat)
            ]
            print(f"[tables] set up {2 * args.repeat} slots: {len(PGBENCH_TABLES)} and {args.configured_tables} tables")
            per_client = -(-args.transactions // args.clients)
            common.pgbench(cluster, "-n", "-t", str(per_client), "-c", str(args.clients))
            conn.execute("CHECKPOINT")
        rounds = []
        for i, (few, every) in enumerate(pairs):
            POOL.prestart()
            order = [("few", few), ("all", every)] if i % 2 == 0 else [("all", every), ("few", few)]
            timed = {label: run_drain(config) for label, config in order}
            if timed["few"]["changes"] != timed["all"]["changes"]:
                print(f"WARNING: the drains read {timed['few']['changes']:,} and {timed['all']['changes']:,} changes")
            rounds.append(
                {
                    "first": order[0][0],
                    "changes": timed["few"]["changes"],
                    "few_seconds": timed["few"]["seconds"],
                    "all_seconds": timed["all"]["seconds"],
                    "ratio": timed["all"]["seconds"] / timed["few"]["seconds"],
                }
            )
            print(
                f"[tables] round {i + 1}: " + ", ".join(f"{k} {v:.2f}" for k, v in rounds[-1].items() if k != "first")
            )
    finally:
        cluster.stop()
    return {
        "server_version": version,
        "configured_tables": args.configured_tables,
        "rounds": rounds,
        "ratio_median": statistics.median(r["ratio"] for r in rounds),
    }


# -- main -------------------------------------------------------------------------------------


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, default=16, choices=(15, 16, 18))
    parser.add_argument("--part", choices=("all", "rate", "rss", "light", "tables"), default="all")
    parser.add_argument(
        "--transactions", type=int, default=260_000, help="pgbench transactions in total (4 changes each)"
    )
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument(
        "--repeat", type=int, default=3, help="rounds: pg_recvlogical over one slot, the drain of another"
    )
    parser.add_argument("--rows", type=int, default=2_000_000, help="rows of the one big transaction")
    parser.add_argument("--rss-repeat", type=int, default=2, help="slots drained per streaming mode")
    parser.add_argument(
        "--batch-changes",
        type=int,
        default=None,
        help="source.batch_changes of the timed drains and the first phase breakdown (default: the library's)",
    )
    parser.add_argument(
        "--big-batch", type=int, default=10_000_000, help="batch_changes of the informative extra drain"
    )
    parser.add_argument("--profile", action="store_true", help="profile one extra drain (cProfile)")
    parser.add_argument("--light-rate", type=int, default=520, help="light: pgbench -R (transactions/s)")
    parser.add_argument("--light-seconds", type=int, default=60, help="light: pgbench -T (seconds)")
    parser.add_argument(
        "--configured-tables", type=int, default=300, help="tables: the tables of the larger configuration"
    )
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
        if args.part in ("all", "light"):
            results["light"] = part_light(args, workdir)
        if args.part in ("all", "tables"):
            results["tables"] = part_tables(args, workdir)
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
        print(f"pg_recvlogical: {rate['recv_command']}")
        rows = [
            [
                i + 1,
                r["first"],
                f"{r['recv_seconds']:.2f}",
                f"{r['recv_changes_per_s']:,.0f}",
                f"{r['drain_seconds']:.2f}",
                r["drain_batches"],
                f"{r['drain_blocks']:,}",
                f"{r['drain_changes_per_s']:,.0f}",
                f"{r['ratio']:.2f}",
                f"{r['recv_cpu_s']:.2f}",
                f"{r['drain_cpu_s']:.2f}",
                f"{r['stream_fetch_seconds']:.2f}",
            ]
            for i, r in enumerate(rate["rounds"])
        ]
        print(
            common.table(
                [
                    "round",
                    "first",
                    "pg_recvlogical s",
                    "changes/s",
                    "drain s",
                    "batches",
                    "blocks",
                    "drain changes/s",
                    "drain/recv",
                    "recv CPU s",
                    "drain CPU s",
                    "SlotStream alone s",
                ],
                rows,
            )
        )
        print(
            f"drain/pg_recvlogical = {rate['ratio_median']:.2f} (median of rounds; best {rate['ratio_best']:.2f}),"
            f" required >= 0.9: {'PASS' if rate['pass'] else 'FAIL'}"
        )
        for b in rate["breakdowns"]:
            print(
                f"\nwhere a drain's {b['drain_s']:.2f} s go, batch_changes {b['batch_changes']:,} ({b['batches']} batches,"
                f" {b['blocks']:,} blocks;"
                f" ratio to the rounds' median pg_recvlogical ({b['recv_median_s']:.2f} s): {b['ratio']:.2f}):"
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
                f"ratio if client processing (feed_blocks + flush/end_session) cost nothing: {b['bound_free_processing']:.2f}"
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
                f"{r['children_hwm'] / common.MiB:,.0f}",
                f"{r['sampled_peak_rss'] / common.MiB:,.0f}",
                f"{r['baseline_rss'] / common.MiB:,.0f}",
                f"{r['seconds']:.1f}",
                f"{r['changes_per_s']:,.0f}",
                r["batches"],
                f"{r['stream']['blocks']:,}",
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
                    "child VmHWM MiB",
                    "sampled MiB",
                    "after imports MiB",
                    "drain s",
                    "changes/s",
                    "batches",
                    "stream blocks",
                    "< 1 GiB",
                ],
                rows,
            )
        )
        ok &= rss["pass"]
    if "tables" in results:
        tables = results["tables"]
        print(
            f"\nDrain of one range, {len(PGBENCH_TABLES)} against {tables['configured_tables']} configured tables:"
            f" ratio {tables['ratio_median']:.2f} (median of rounds)"
        )
    print(f"\nbefore: {common.describe_load(load_before)}\nafter:  {common.describe_load(load_after)}")
    print(common.describe_code(code_start, code_end))
    common.write_json(args.json, results)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
