"""Decode benchmark: fetch, decode and Arrow conversion rates of a pgbench slot, against the decoder's targets.

    python benchmarks/decode.py [--pg 16] [--transactions 90000] [--repeat 5] [--binary] [--json out.json]

Starts a throwaway PostgreSQL server, runs ``pgbench -i`` then ``pgbench -n -c 2`` with a slot on
the pgbench tables (and ``--repeat`` more slots for pg_recvlogical, all created before the load),
reads the slot's range once into memory over the streaming replication protocol
(``cdc_assets.stream.reader.SlotStream`` from the slot's position until the server's position
reaches the flush LSN after the load; nothing is confirmed, so the slot does not move; highest
protocol version, text mode unless ``--binary``) and measures, in one run, round-robin
``--repeat`` times:

  a.  fetch   -- the same range read again with ``SlotStream`` (the drain's receiving child process,
                 already started), no work per block;
  a0. (informative) the server's decoding alone: ``count(*)`` over
                 ``pg_logical_slot_peek_binary_changes`` with the same options (nothing sent);
  a1. (informative) ``pg_recvlogical`` (PostgreSQL's C client of the same protocol) over a fresh
                 slot holding the same range, into /dev/null, timed as a whole command;
  b.  decode  -- ``PgoutputDecoder.decode`` on every captured message;
  c.  arrow   -- ``TransactionAssembler.feed_blocks`` over the captured messages, in full blocks
                 (8,192 messages or 4 MiB, the receiving child's largest, and the size of the
                 former peek's blocks), with a sink that drops the record batches (every change
                 converted to typed Arrow arrays);
  c'. (informative) the same over the blocks as the stream cut them in the capture: the child
                 sends a block whenever libpq holds no whole message, so in practice a block is
                 what one read of the socket brought (1 to ~200 pgbench messages), their number
                 depends on timing, and each block has a cost of its own;
  d.  pypgoutput -- pypgoutput 0.0.3's message classes, dispatched by first byte, on the same bytes
                 (captured again with protocol 1, what pypgoutput was written for).

Requirements: b/d >= 3 and c/a >= 0.8 (messages/s, medians).

Full-size run (a quiet machine):

    python benchmarks/decode.py --pg 16 --json decode.json
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import gc
import io
import pstats
import sys
from typing import Any

import _common as common
import numpy as np
import psycopg
import pypgoutput
import pypgoutput.decoders as pgo

from cdc_assets.config import SourceConfig
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.decoder import PgoutputDecoder, message_name
from cdc_assets.stream.blocks import MessageBlock
from cdc_assets.stream.options import max_proto_version, pgoutput_options
from cdc_assets.stream.process import POOL
from cdc_assets.transactions import TransactionAssembler

SLOT = "bench_slot"
PUBLICATION = "bench_pub"

PYPGOUTPUT_CLASSES = {
    ord("B"): pgo.Begin,
    ord("C"): pgo.Commit,
    ord("R"): pgo.Relation,
    ord("I"): pgo.Insert,
    ord("U"): pgo.Update,
    ord("D"): pgo.Delete,
    ord("T"): pgo.Truncate,
}


class NullSink:
    """A ChangeSink that drops everything but counts records and transactions. Sink methods the
    library may add later are accepted and ignored (``__getattr__``)."""

    def __init__(self) -> None:
        self.records_rows = 0
        self.record_batches = 0
        self.committed = 0

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        return lambda *args, **kwargs: None

    def records(self, relation: Any, records: Any) -> None:
        self.records_rows += records.num_rows
        self.record_batches += 1

    def transaction(self, info: Any, changes: int, messages: Any) -> None:
        self.committed += 1

    def transactions(self, commit_lsns: Any, *columns: Any) -> None:
        self.committed += len(commit_lsns)

    def standalone_message(self, lsn: int, message: Any) -> None:
        pass

    def prepared(self, transaction: Any) -> None:
        pass

    def commit_prepared(self, gid: str, info: Any) -> None:
        pass

    def rollback_prepared(self, gid: str, end_lsn: int) -> None:
        pass


# -- the four measurements --------------------------------------------------------------------


def run_fetch(dsn: str, options: list[tuple[str, str]], target: int) -> int:
    """(a) The range read with SlotStream to the end, nothing done per block."""
    POOL.prestart()  # the receiving child is idle and ready (started by the capture)
    common.stream_range(dsn, SLOT, PUBLICATION, options, target)
    return 0


def run_server_only(conn: psycopg.Connection[Any], options: list[tuple[str, str]]) -> int:
    """(a0, informative) The same range decoded on the server by the SQL peek function, aggregated
    there: its decoding alone, nothing sent."""
    flat = [item for pair in options for item in pair]
    return conn.execute(
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes(%s::name, NULL, NULL, VARIADIC %s::text[])",
        (SLOT, flat),
    ).fetchone()[0]


def run_decode(datas: list[bytes]) -> int:
    """(b) Our decoder, one message at a time."""
    decode = PgoutputDecoder("off").decode
    for data in datas:
        decode(data)
    return len(datas)


def run_assemble(blocks: list[MessageBlock]) -> NullSink:
    """(c) Decode + assemble + Arrow: the drain's path from the stream's blocks to record batches."""
    sink = NullSink()
    assembler = TransactionAssembler(streaming="off")
    assembler.start_session(sink, 0)  # type: ignore[arg-type]
    assembler.feed_blocks(blocks)
    assembler.end_session()
    return sink


def run_pypgoutput(datas: list[bytes]) -> int:
    """(d) pypgoutput 0.0.3's classes on the same bytes."""
    classes = PYPGOUTPUT_CLASSES
    for data in datas:
        classes[data[0]](data)
    return len(datas)


# -- setup ------------------------------------------------------------------------------------


def recv_slot(i: int) -> str:
    return f"bench_recv_{i + 1}"


def prepare(args: argparse.Namespace) -> tuple[common.ThrowawayCluster, dict[str, Any]]:
    cluster = common.start_cluster(args.pg)
    info: dict[str, Any] = {"server_version": None}
    with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
        info["server_version"] = conn.execute("SHOW server_version").fetchone()[0]
        print(f"PostgreSQL {info['server_version']} at port {cluster.port}; pgbench -i -s {args.scale}", flush=True)
        common.pgbench(cluster, "-i", "-q", "-s", str(args.scale))
        conn.execute(
            f"CREATE PUBLICATION {PUBLICATION} FOR TABLE pgbench_accounts, pgbench_branches, pgbench_tellers,"
            " pgbench_history"
        )
        for slot in [SLOT, *(recv_slot(i) for i in range(args.repeat))]:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        per_client = -(-args.transactions // args.clients)
        print(f"pgbench -n -t {per_client} -c {args.clients} ...", flush=True)
        seconds = common.pgbench(cluster, "-n", "-t", str(per_client), "-c", str(args.clients))
        info["pgbench_command"] = f"pgbench -n -t {per_client} -c {args.clients}"
        info["pgbench_transactions"] = per_client * args.clients
        info["pgbench_seconds"] = round(seconds, 1)
        info["pgbench_tps"] = round(per_client * args.clients / seconds)
        conn.execute("CHECKPOINT")
        info["end_lsn"] = common.flush_lsn(conn)
    return cluster, info


BLOCK_ROWS = 8_192
BLOCK_BYTES = 4 << 20


def recut(blocks: list[MessageBlock]) -> list[MessageBlock]:
    """The same messages in full blocks (8,192 messages or 4 MiB, the receiving child's largest):
    c does not depend on how the stream happened to cut the capture."""
    rows = [row for block in blocks for row in block.rows()]
    out: list[MessageBlock] = []
    start = 0
    while start < len(rows):
        stop, size = start, 0
        while stop < len(rows) and stop - start < BLOCK_ROWS and (size < BLOCK_BYTES or stop == start):
            size += len(rows[stop][1])
            stop += 1
        chunk = rows[start:stop]
        ends = np.cumsum([len(data) for _, data in chunk], dtype=np.int64)
        lsns = np.array([lsn for lsn, _ in chunk], dtype=np.int64)
        out.append(MessageBlock(lsns, ends, b"".join(data for _, data in chunk)))
        start = stop
    return out


def capture(dsn: str, options: list[tuple[str, str]], target: int) -> list[MessageBlock]:
    """The slot's range, as the stream's blocks (the slot does not move)."""
    blocks: list[MessageBlock] = []
    common.stream_range(dsn, SLOT, PUBLICATION, options, target, blocks.append)
    return blocks


def profile(label: str, function: Any, *args: Any) -> str:
    profiler = cProfile.Profile()
    profiler.enable()
    function(*args)
    profiler.disable()
    out = io.StringIO()
    stats = pstats.Stats(profiler, stream=out)
    stats.sort_stats("tottime").print_stats(18)
    text = out.getvalue()
    # strip the preamble lines pstats prints before the table
    return f"### cProfile: {label} (sorted by tottime)\n" + text[text.find("   ncalls") :]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, default=16, choices=(15, 16, 18), help="PostgreSQL major version")
    parser.add_argument(
        "--transactions", type=int, default=90_000, help="pgbench transactions in total (6 messages each)"
    )
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1, help="pgbench -i scale")
    parser.add_argument("--repeat", type=int, default=5, help="repetitions of each measurement (>= 3)")
    parser.add_argument("--binary", action="store_true", help="pgoutput option binary 'true' (a, a0, a1, b, c)")
    parser.add_argument("--profile", action="store_true", help="print cProfile top entries of b, c and d")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()
    if args.repeat < 3:
        parser.error("--repeat must be at least 3")

    machine = common.machine()
    code_start = common.code_version()
    load_before = common.load_snapshot()
    cluster, info = prepare(args)
    try:
        dsn = cluster.dsn()
        target = info["end_lsn"]
        source = SourceConfig(dsn=dsn, publication=PUBLICATION, slot=SLOT, binary=args.binary)
        options = pgoutput_options(source, cluster.version, two_phase=False)
        conn = psycopg.connect(dsn, autocommit=True)
        print(f"stream options: {options}; range up to {format_lsn(target)}", flush=True)
        as_received = capture(dsn, options, target)
        captured = recut(as_received)
        datas = [data for block in captured for data in block.messages()]
        kinds = collections.Counter(message_name(d[0]) for d in datas)
        nbytes = sum(map(len, datas))
        changes = sum(kinds.get(k, 0) for k in ("Insert", "Update", "Delete"))
        print(f"captured {len(datas):,} messages, {nbytes / common.MiB:.1f} MiB: {dict(kinds)}", flush=True)
        print(
            f"the stream cut them into {len(as_received):,} blocks ({len(datas) / max(1, len(as_received)):,.1f}"
            f" messages per block, {sum(len(b) == 1 for b in as_received):,} of one message); c runs on"
            f" {len(captured):,} blocks of up to {BLOCK_ROWS:,} messages, c' on the blocks as received",
            flush=True,
        )
        if len(datas) < 500_000:
            print(f"WARNING: fewer than 500,000 messages ({len(datas):,}); raise --transactions", flush=True)

        # pypgoutput: only the types it has classes for, on protocol-1 text bytes.
        proto1 = [
            d
            for block in capture(dsn, [("proto_version", "1"), ("publication_names", PUBLICATION)], target)
            for d in block.messages()
        ]
        identical = proto1 == datas
        known = [d for d in (datas if identical else proto1) if d[0] in PYPGOUTPUT_CLASSES]
        skipped = (len(datas) if identical else len(proto1)) - len(known)
        same_set = identical and skipped == 0
        print(
            f"protocol-1 text capture: {len(proto1):,} messages, byte-identical to the measured capture: {identical};"
            f" pypgoutput skips {skipped} messages of types it has no class for",
            flush=True,
        )
        known_bytes = sum(map(len, known))

        fetch = common.Series("a. fetch: SlotStream to the end, nothing per block", len(datas), nbytes)
        server = common.Series("(a0. server decoding only: count(*) over the SQL peek)", len(datas), nbytes)
        recv = common.Series("(a1. pg_recvlogical to /dev/null, whole command)", len(datas), nbytes)
        decode = common.Series("b. cdc_assets PgoutputDecoder.decode", len(datas), nbytes)
        arrow = common.Series(
            f"c. cdc_assets feed_blocks -> typed Arrow (null sink), {len(captured):,} blocks", len(datas), nbytes
        )
        arrow_received = common.Series(
            f"(c'. the same on the blocks as received, {len(as_received):,} blocks)", len(datas), nbytes
        )
        pypg = common.Series(
            f"d. pypgoutput {getattr(pypgoutput, '__version__', '0.0.3')} classes", len(known), known_bytes
        )
        decode_known = (
            None if same_set else common.Series("b'. PgoutputDecoder on d's messages", len(known), known_bytes)
        )

        sink_rows = sink_committed = None
        for round_ in range(args.repeat):
            gc.collect()
            fetch.add(common.timed(lambda: run_fetch(dsn, options, target))[0])
            server.add(common.timed(lambda: run_server_only(conn, options))[0])
            recv.add(common.recvlogical(cluster, recv_slot(round_), target, options)["seconds"])
            gc.collect()
            decode.add(common.timed(lambda: run_decode(datas))[0])
            gc.collect()
            seconds, sink = common.timed(lambda: run_assemble(captured))
            arrow.add(seconds)
            sink_rows, sink_committed = sink.records_rows, sink.committed  # type: ignore[attr-defined]
            gc.collect()
            arrow_received.add(common.timed(lambda: run_assemble(as_received))[0])
            gc.collect()
            pypg.add(common.timed(lambda: run_pypgoutput(known))[0])
            if decode_known is not None:
                gc.collect()
                decode_known.add(common.timed(lambda: run_decode(known))[0])
            print(
                f"round {round_ + 1}: a {fetch.seconds[-1]:.3f}s (server only {server.seconds[-1]:.3f}s,"
                f" pg_recvlogical {recv.seconds[-1]:.3f}s)  b {decode.seconds[-1]:.3f}s  c {arrow.seconds[-1]:.3f}s"
                f" (c' {arrow_received.seconds[-1]:.3f}s)  d {pypg.seconds[-1]:.3f}s",
                flush=True,
            )
        if sink_rows != changes or sink_committed != kinds.get("Commit", 0):
            print(
                f"WARNING: the sink got {sink_rows} change records for {changes} change messages and"
                f" {sink_committed} transactions for {kinds.get('Commit', 0)} commits",
                flush=True,
            )
        load_after = common.load_snapshot()
        code_end = common.code_version()

        series = [fetch, server, recv, decode, arrow, arrow_received, pypg] + ([decode_known] if decode_known else [])
        rows = [
            [
                s.name,
                f"{s.items:,}",
                f"{s.best:.3f}",
                f"{s.median:.3f}",
                f"{s.rate('best'):,.0f}",
                f"{s.rate('median'):,.0f}",
                f"{s.mb_rate('median'):.1f}",
            ]
            for s in series
        ]
        print()
        mode = "binary" if args.binary else "text"
        print(
            f"PostgreSQL {info['server_version']}, proto_version {max_proto_version(cluster.version)}, {mode} mode,"
            f" {len(datas):,} messages ({changes:,} changes), {nbytes / common.MiB:.1f} MiB, {args.repeat} rounds"
        )
        print(
            common.table(
                ["measurement", "messages", "best s", "median s", "msg/s best", "msg/s median", "MiB/s median"], rows
            )
        )
        base_b = decode if same_set else decode_known
        assert base_b is not None
        ratio_bd = base_b.rate() / pypg.rate()
        ratio_bd_best = base_b.rate("best") / pypg.rate("best")
        ratio_ca = arrow.rate() / fetch.rate()
        ratio_ca_best = arrow.rate("best") / fetch.rate("best")
        verdicts = {
            "b/d": {"median": ratio_bd, "best": ratio_bd_best, "required": 3.0, "pass": ratio_bd >= 3.0},
            "c/a": {"median": ratio_ca, "best": ratio_ca_best, "required": 0.8, "pass": ratio_ca >= 0.8},
        }
        print()
        for name, v in verdicts.items():
            print(
                f"{name} = {v['median']:.2f} (median; best-vs-best {v['best']:.2f}), required >= {v['required']}:"
                f" {'PASS' if v['pass'] else 'FAIL'}"
            )
        if not same_set:
            print("(b/d is computed on d's message set with b'.)")
        print(f"\nbefore: {common.describe_load(load_before)}\nafter:  {common.describe_load(load_after)}")
        print(common.describe_code(code_start, code_end))

        profiles = []
        if args.profile or not all(v["pass"] for v in verdicts.values()):
            profiles.append(profile("c. feed_blocks -> Arrow", run_assemble, captured))
            profiles.append(profile("b. PgoutputDecoder.decode", run_decode, datas))
            profiles.append(profile("d. pypgoutput", run_pypgoutput, known))
            for text in profiles:
                print("\n" + text)

        common.write_json(
            args.json,
            {
                "benchmark": "decode",
                "command": " ".join(["python", *sys.argv]),
                "machine": machine,
                "code_start": code_start,
                "code_end": code_end,
                "postgres": info,
                "proto_version": max_proto_version(cluster.version),
                "mode": mode,
                "stream_options": options,
                "end_lsn": format_lsn(target),
                "blocks_as_received": len(as_received),
                "single_message_blocks_as_received": sum(len(b) == 1 for b in as_received),
                "blocks_recut": len(captured),
                "messages": len(datas),
                "changes": changes,
                "bytes": nbytes,
                "message_types": dict(kinds),
                "proto1_identical": identical,
                "pypgoutput_messages": len(known),
                "series": [s.to_json() for s in series],
                "ratios": verdicts,
                "load_before": load_before,
                "load_after": load_after,
                "profiles": profiles,
            },
        )
        conn.close()
        return 0 if all(v["pass"] for v in verdicts.values()) else 1
    finally:
        cluster.stop()


if __name__ == "__main__":
    sys.exit(main())
