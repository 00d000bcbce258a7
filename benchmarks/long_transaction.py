"""Long transactions: a following drain against periodic drains while an old write transaction stays open.

    python benchmarks/long_transaction.py [--pg 15|16|18] [--before 180] [--open 600] [--after 60]
                                          [--rate 300] [--bulk-mb 1] [--drain-every 30] [--json out.json]

Full-size runs (a quiet machine), one per server version:

    python benchmarks/long_transaction.py --pg 15 --json long_transaction_pg15.json
    python benchmarks/long_transaction.py --pg 18 --json long_transaction_pg18.json

Setup: a throwaway server (``--pg``), ``pgbench -i -s 1``, one more ``pgbench_accounts`` row
outside pgbench's key range (for the old transaction), a table ``bulk`` that is not published,
then ``cdc_assets.pipeline.setup.setup`` of two slots and change logs on the same publication (the four
pgbench tables), both before any load, with ``drain.commit_seconds: 2``:

* the follower: ONE ``cdc-assets drain --follow <before + open + after + 5>`` subprocess
  (``python -m cdc_assets``, this checkout), started first; the load starts once its slot is
  active;
* the periodic slot: a non-following ``cdc-assets drain`` subprocess started every
  ``--drain-every`` seconds (30; a drain that overruns delays the next one), each timed whole
  (interpreter start included; the drain's own elapsed time is recorded too).

Load, for ``before + open + after`` seconds: ``pgbench -n -c 2 -R 300 -T <duration>`` (tpcb-like:
3 updates and 1 insert on published tables per transaction) and a thread inserting
``--bulk-mb`` MiB (512-byte rows) into ``bulk`` every second (WAL the slots must read past, none
of it published). Phases: ``--before`` seconds without an old transaction; then a connection runs
``BEGIN; UPDATE pgbench_accounts … WHERE aid = <the extra row>`` and stays idle in transaction
for ``--open`` seconds (it pins both slots' ``restart_lsn``); then it commits; then ``--after``.

Every ``--sample`` seconds (5), for both slots, from ``pg_replication_slots``:

* lag bytes: ``pg_current_wal_lsn() - confirmed_flush_lsn``;
* lag seconds: how long ago the WAL at the slot's confirmed position was written. A thread records
  ``pg_current_wal_lsn()`` every 0.1 s with the time; the confirmed position was written after the
  last record below it, so the lag is at most now − that record's time (reported; the lower bound,
  now − the first record at or above it, is in the JSON). 0 when the slot has confirmed the
  current WAL position. This is the slot's lag behind the server's WAL, whatever commits or not;
  it says nothing of commit timestamps;
* WAL held: ``pg_current_wal_lsn() - restart_lsn`` (what a new decoding session reads from).

Each periodic drain records its wall time and the WAL held and lag bytes at its start.

Figures:

* follower: p95 of its lag bytes and lag seconds over the samples before the old transaction and
  over those while it is open, and the ratios open / before. Acceptance: while-open p95 <= 1.5 x
  before p95, for bytes and for seconds. (The after phase is reported, not judged.)
* periodic drains: a table of each drain's seconds against the WAL held at its start, and the
  least-squares slope in ms per MiB held (with intercept and r²) of the wall time (the figure;
  its intercept includes ~1-1.5 s of interpreter start and imports) and, beside it, of the
  drain's own elapsed time (``drained … (X s)`` in its output).
* correctness: after the load ends, the follower's subprocess exits and both slots are drained once
  more to the end (``cdc_assets.pipeline.drain.drain``); both change logs must hold the same transactions
  (xid and end LSN, ``ChangeLogReader.transactions()``), the old transaction among them, and as
  many as pgbench reports processed plus the old one (pgbench's count also against
  ``count(*)`` of ``pgbench_history``).

``--json`` writes every sample, every periodic drain, the WAL timeline at 1 s resolution, the
follower's output, pgbench's output, machine facts, load and code version.
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import _common as common
import numpy as np
import psycopg

from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, load_config
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.setup import setup

PUBLICATION = "bench_pub"
PGBENCH_TABLES = [
    "public.pgbench_accounts",
    "public.pgbench_branches",
    "public.pgbench_tellers",
    "public.pgbench_history",
]
FOLLOWER = "bench_follow"
PERIODIC = "bench_periodic"
TIMELINE_SECONDS = 0.1
BULK_ROW_BYTES = 512
ACCEPT = 1.5
DRAINED = re.compile(r"drained ([\d,]+) transactions, ([\d,]+) changes in (\d+) batches \(([\d.]+) s\)")
PROCESSED = re.compile(r"number of transactions actually processed: (\d+)")
FAILED = re.compile(r"number of failed transactions: (\d+)")


def write_config(folder: Path, dsn: str, slot: str, commit_seconds: float) -> Config:
    folder.mkdir(parents=True, exist_ok=True)
    text = {
        "source": {"dsn": dsn, "publication": PUBLICATION, "slot": slot},
        "changelog": {"path": str(folder / "changelog")},
        "warehouse": {"path": str(folder / "warehouse")},
        "tables": {name: {} for name in PGBENCH_TABLES},
        "drain": {"commit_seconds": commit_seconds},
    }
    path = folder / "cdc.yaml"
    path.write_text(json.dumps(text, indent=2), encoding="utf-8")  # JSON is YAML
    return load_config(path)


def cli(config: Config, *args: str) -> list[str]:
    assert config.path is not None
    return [sys.executable, "-m", "cdc_assets", "drain", *args, "-c", str(config.path)]


class WalTimeline(threading.Thread):
    """``pg_current_wal_lsn()`` every 0.1 s with the monotonic time: when each WAL position was
    written, to within 0.1 s."""

    def __init__(self, dsn: str) -> None:
        super().__init__(name="wal-timeline", daemon=True)
        self.dsn = dsn
        self.points: list[tuple[float, int]] = []  # (monotonic time, lsn), lsn non-decreasing
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.is_set():
                    before = time.monotonic()
                    (lsn,) = conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::int8").fetchone()  # type: ignore[misc]
                    after = time.monotonic()
                    self.points.append(((before + after) / 2, int(lsn)))
                    self.stop.wait(max(0.0, TIMELINE_SECONDS - (time.monotonic() - before)))
        except psycopg.Error:
            if not self.stop.is_set():
                raise

    def lag_seconds(self, now: float, current: int, confirmed: int) -> tuple[float, float]:
        """Bounds of how long ago the WAL at ``confirmed`` was written (``current``: the WAL
        position at ``now``): (lower, upper)."""
        if confirmed >= current:
            return 0.0, 0.0
        points = list(self.points)
        first_at_or_above = bisect.bisect_left(points, confirmed, key=lambda p: p[1])
        upper = now - points[first_at_or_above - 1][0] if first_at_or_above > 0 else now - points[0][0]
        lower = now - points[first_at_or_above][0] if first_at_or_above < len(points) else 0.0
        return max(0.0, lower), max(0.0, upper)


SLOT_QUERY = """
SELECT slot_name::text, (pg_current_wal_lsn() - '0/0')::int8, (confirmed_flush_lsn - '0/0')::int8,
       (restart_lsn - '0/0')::int8, active
  FROM pg_replication_slots WHERE slot_name = ANY(%s)
"""


def read_slots(conn: psycopg.Connection[Any]) -> tuple[float, dict[str, dict[str, Any]]]:
    rows = conn.execute(SLOT_QUERY, ([FOLLOWER, PERIODIC],)).fetchall()
    now = time.monotonic()
    out = {}
    for name, current, confirmed, restart, active in rows:
        out[name] = {
            "current_lsn": current,
            "confirmed_lsn": confirmed,
            "restart_lsn": restart,
            "lag_bytes": current - confirmed,
            "held_bytes": current - restart,
            "active": active,
        }
    return now, out


class Periodic(threading.Thread):
    """A non-following drain of the periodic slot every ``every`` seconds until ``end``."""

    def __init__(self, config: Config, dsn: str, t0: float, every: float, end: float, phase: Any) -> None:
        super().__init__(name="periodic-drains", daemon=True)
        self.config, self.dsn, self.t0, self.every, self.end, self.phase = config, dsn, t0, every, end, phase
        self.stop = threading.Event()
        self.drains: list[dict[str, Any]] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                due = self.t0 + self.every
                while not self.stop.wait(max(0.0, due - time.monotonic())):
                    if time.monotonic() >= self.end:
                        return
                    self.drains.append(self.one(conn))
                    due += self.every
                    due = max(due, time.monotonic())
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            self.error = error

    def one(self, conn: psycopg.Connection[Any]) -> dict[str, Any]:
        _, slots = read_slots(conn)
        slot = slots[PERIODIC]
        start = time.monotonic()
        phase = self.phase()
        done = subprocess.run(cli(self.config), capture_output=True, text=True, cwd=common.ROOT, check=False)
        wall = time.monotonic() - start
        found = DRAINED.search(done.stdout)
        record = {
            "t": round(start - self.t0, 2),
            "phase": phase,
            "held_bytes": slot["held_bytes"],
            "lag_bytes": slot["lag_bytes"],
            "seconds": wall,
            "returncode": done.returncode,
            "transactions": int(found.group(1).replace(",", "")) if found else None,
            "changes": int(found.group(2).replace(",", "")) if found else None,
            "batches": int(found.group(3)) if found else None,
            "drain_elapsed_s": float(found.group(4)) if found else None,
        }
        if done.returncode != 0:
            record["stderr"] = done.stderr[-2000:]
            print(f"WARNING: periodic drain failed ({done.returncode}): {done.stderr[-500:]}", flush=True)
        print(
            f"[{record['t']:6.1f} s {phase:6}] periodic drain: {wall:.2f} s, WAL held at start"
            f" {slot['held_bytes'] / common.MiB:,.1f} MiB, lag {slot['lag_bytes'] / common.MiB:,.1f} MiB,"
            f" {record['transactions']} transactions",
            flush=True,
        )
        return record


class Bulk(threading.Thread):
    """``mib`` MiB of 512-byte rows into the unpublished table ``bulk`` every second."""

    def __init__(self, dsn: str, t0: float, mib: float) -> None:
        super().__init__(name="bulk", daemon=True)
        self.dsn, self.t0 = dsn, t0
        self.rows = max(1, round(mib * common.MiB / BULK_ROW_BYTES))
        self.stop = threading.Event()
        self.inserts = 0
        self.late = 0  # inserts that started more than a second late
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            with psycopg.connect(self.dsn, autocommit=True) as conn:
                while not self.stop.wait(max(0.0, self.t0 + self.inserts - time.monotonic())):
                    self.late += time.monotonic() - (self.t0 + self.inserts) > 1.0
                    conn.execute(
                        "INSERT INTO bulk (pad) SELECT repeat(md5(g::text || clock_timestamp()::text), %s)"
                        " FROM generate_series(1, %s) g",
                        (BULK_ROW_BYTES // 32, self.rows),
                    )
                    self.inserts += 1
        except BaseException as error:  # noqa: BLE001 - reported by the main thread
            self.error = error


def p95(values: list[float]) -> float | None:
    return float(np.percentile(values, 95)) if values else None


def least_squares(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    if len(xs) < 2 or len(set(xs)) < 2:
        return None
    x, y = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    fitted = slope * x + intercept
    total = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float(((y - fitted) ** 2).sum()) / total if total > 0 else 1.0
    return {"slope_s_per_mib": float(slope), "intercept_s": float(intercept), "r2": r2}


def log_transactions(config: Config) -> tuple[set[tuple[int, int]], int]:
    """(xid, end LSN) of every transaction in the change log, and their changes in total."""
    table = ChangeLogReader(changelog_store(config)).transactions()
    pairs = set(zip(table.column("xid").to_pylist(), table.column("end_lsn").to_pylist(), strict=True))
    return pairs, sum(table.column("changes").to_pylist())


def run(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    total = args.before + args.open + args.after
    cluster = common.start_cluster(args.pg)
    procs: list[subprocess.Popen[Any]] = []
    threads: list[WalTimeline | Bulk | Periodic] = []
    try:
        dsn = cluster.dsn()
        with psycopg.connect(dsn, autocommit=True) as conn:
            version = conn.execute("SHOW server_version").fetchone()[0]
            print(f"PostgreSQL {version}; pgbench -i -s {args.scale}", flush=True)
            common.pgbench(cluster, "-i", "-q", "-s", str(args.scale))
            old_aid = 100_000 * args.scale + 1  # pgbench picks aid in 1 … 100000 x scale: never this one
            conn.execute("INSERT INTO pgbench_accounts (aid, bid, abalance, filler) VALUES (%s, 1, 0, '')", (old_aid,))
            conn.execute("CREATE TABLE bulk (id bigserial PRIMARY KEY, pad text NOT NULL)")  # not published
            follower_config = write_config(workdir / "follower", dsn, FOLLOWER, args.commit_seconds)
            periodic_config = write_config(workdir / "periodic", dsn, PERIODIC, args.commit_seconds)
            setup(follower_config)
            setup(periodic_config)
            print(f"set up slots {FOLLOWER} and {PERIODIC}", flush=True)

            timeline = WalTimeline(dsn)
            threads.append(timeline)
            timeline.start()
            follow_s = total + 5
            follower_out = open(workdir / "follower.out", "w+", encoding="utf-8")  # noqa: SIM115 - read at the end
            follower_err = open(workdir / "follower.err", "w+", encoding="utf-8")  # noqa: SIM115
            follower = subprocess.Popen(
                cli(follower_config, "--follow", str(follow_s)),
                cwd=common.ROOT,
                stdout=follower_out,
                stderr=follower_err,
                text=True,
            )
            procs.append(follower)
            deadline = time.monotonic() + 120
            while not read_slots(conn)[1][FOLLOWER]["active"]:
                if follower.poll() is not None or time.monotonic() > deadline:
                    follower_err.seek(0)
                    raise RuntimeError(f"the following drain did not start: {follower_err.read()[-2000:]}")
                time.sleep(0.1)
            print(f"follower streaming (cdc-assets drain --follow {follow_s}); load for {total} s", flush=True)

            pgbench_args = ["-n", "-c", str(args.clients), "-R", str(args.rate), "-T", str(total)]
            pgbench_command = "pgbench " + " ".join(pgbench_args)
            pgbench_out = open(workdir / "pgbench.out", "w+", encoding="utf-8")  # noqa: SIM115
            t0 = time.monotonic()
            pgbench = subprocess.Popen(
                [*common.client_command(cluster, "pgbench", *pgbench_args), "postgres"],
                stdout=pgbench_out,
                stderr=subprocess.STDOUT,
                text=True,
                cwd="/",
            )
            procs.append(pgbench)
            bulk = Bulk(dsn, t0, args.bulk_mb)
            threads.append(bulk)
            bulk.start()
            state = {"phase": "before"}
            periodic = Periodic(periodic_config, dsn, t0, args.drain_every, t0 + total, lambda: state["phase"])
            threads.append(periodic)
            periodic.start()

            samples: list[dict[str, Any]] = []
            old: dict[str, Any] = {}
            old_conn = psycopg.connect(dsn, autocommit=True)
            events = [(args.before, 0, "open"), (args.before + args.open, 0, "commit")]
            events += [(k * args.sample, 1, "sample") for k in range(1, int(total // args.sample) + 1)]
            for at, _, what in sorted(events):
                time.sleep(max(0.0, t0 + at - time.monotonic()))
                if what == "open":
                    (old["lsn_before"],) = old_conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::int8").fetchone()
                    old_conn.execute("BEGIN")
                    old_conn.execute("UPDATE pgbench_accounts SET abalance = abalance + 1 WHERE aid = %s", (old_aid,))
                    (xid,) = old_conn.execute("SELECT txid_current()").fetchone()
                    old.update(xid=int(xid) & 0xFFFFFFFF, opened_t=round(time.monotonic() - t0, 2))
                    state["phase"] = "open"
                    print(f"[{at:6.1f} s] old transaction {old['xid']} open (idle in transaction)", flush=True)
                elif what == "commit":
                    old_conn.execute("COMMIT")
                    (old["lsn_after"],) = old_conn.execute("SELECT (pg_current_wal_lsn() - '0/0')::int8").fetchone()
                    old["committed_t"] = round(time.monotonic() - t0, 2)
                    state["phase"] = "after"
                    print(f"[{at:6.1f} s] old transaction committed", flush=True)
                else:
                    now, slots = read_slots(conn)
                    sample: dict[str, Any] = {"t": round(now - t0, 2), "phase": state["phase"]}
                    for name, key in ((FOLLOWER, "follower"), (PERIODIC, "periodic")):
                        slot = slots[name]
                        low, high = timeline.lag_seconds(now, slot["current_lsn"], slot["confirmed_lsn"])
                        sample[key] = {**slot, "lag_s": high, "lag_s_low": low}
                    sample["follower"]["running"] = follower.poll() is None
                    samples.append(sample)
                    f, p = sample["follower"], sample["periodic"]
                    print(
                        f"[{sample['t']:6.1f} s {sample['phase']:6}] follower lag {f['lag_bytes'] / common.MiB:6.2f} MiB"
                        f" {f['lag_s']:5.2f} s, held {f['held_bytes'] / common.MiB:7.1f} MiB | periodic lag"
                        f" {p['lag_bytes'] / common.MiB:6.1f} MiB {p['lag_s']:5.1f} s, held"
                        f" {p['held_bytes'] / common.MiB:7.1f} MiB",
                        flush=True,
                    )
                    if not f["running"]:
                        print("WARNING: the following drain has exited", flush=True)
                    if pgbench.poll() not in (None, 0):
                        pgbench_out.seek(0)
                        raise RuntimeError(f"pgbench failed ({pgbench.returncode}):\n{pgbench_out.read()}")
            old_conn.close()

            bulk.stop.set()
            periodic.stop.set()
            pgbench.wait(timeout=120)
            bulk.join()
            periodic.join()
            for thread in (bulk, periodic):
                if thread.error is not None:
                    raise RuntimeError(f"{thread.name} failed: {thread.error!r}") from thread.error
            pgbench_out.seek(0)
            pgbench_text = pgbench_out.read()
            if pgbench.returncode != 0:
                raise RuntimeError(f"pgbench failed ({pgbench.returncode}):\n{pgbench_text}")
            processed_match = PROCESSED.search(pgbench_text)
            processed = int(processed_match.group(1)) if processed_match else None
            failed_match = FAILED.search(pgbench_text)
            failed = int(failed_match.group(1)) if failed_match else 0
            try:
                follower.wait(timeout=follow_s + 120 - (time.monotonic() - t0))
            except subprocess.TimeoutExpired:
                print("WARNING: the following drain did not end on time; stopping it (SIGTERM)", flush=True)
                follower.terminate()
                follower.wait(timeout=60)
            follower_out.seek(0)
            follower_err.seek(0)
            follower_text, follower_stderr = follower_out.read(), follower_err.read()
            for file in (follower_out, follower_err, pgbench_out):
                file.close()
            summary = DRAINED.search(follower_text)
            print(
                f"follower exited ({follower.returncode}): {summary.group(0) if summary else follower_stderr[-500:]}",
                flush=True,
            )
            timeline.stop.set()
            timeline.join()

            # Correctness: both slots drained to the end, then the two change logs compared.
            final = {}
            for key, config in (("follower", follower_config), ("periodic", periodic_config)):
                result = drain(config)
                final[key] = {
                    "transactions": result.transactions,
                    "changes": result.total_changes,
                    "checkpoint_lsn": result.checkpoint_lsn,
                }
            history = conn.execute("SELECT count(*) FROM pgbench_history").fetchone()[0]
        follower_log, follower_changes = log_transactions(follower_config)
        periodic_log, periodic_changes = log_transactions(periodic_config)
        old_in = [pair for pair in follower_log if pair[0] == old.get("xid")]
        checks = {
            "same_transactions": follower_log == periodic_log,
            "only_in_follower": len(follower_log - periodic_log),
            "only_in_periodic": len(periodic_log - follower_log),
            "follower_transactions": len(follower_log),
            "periodic_transactions": len(periodic_log),
            "follower_changes": follower_changes,
            "periodic_changes": periodic_changes,
            "old_transaction_logged": len(old_in) == 1 and old_in[0] in periodic_log,
            "pgbench_processed": processed,
            "pgbench_failed": failed,
            "pgbench_history_rows": history,
            "expected_transactions": None if processed is None else processed + 1,
        }
        checks["count_matches"] = processed is not None and len(follower_log) == processed + 1 and history == processed
        checks["pass"] = checks["same_transactions"] and checks["old_transaction_logged"] and checks["count_matches"]

        def figures(phase: str) -> dict[str, Any]:
            chosen = [s["follower"] for s in samples if s["phase"] == phase]
            return {
                "samples": len(chosen),
                "lag_bytes_p95": p95([s["lag_bytes"] for s in chosen]),
                "lag_s_p95": p95([s["lag_s"] for s in chosen]),
                "lag_bytes_max": max((s["lag_bytes"] for s in chosen), default=None),
                "lag_s_max": max((s["lag_s"] for s in chosen), default=None),
                "held_bytes_max": max((s["held_bytes"] for s in chosen), default=None),
            }

        follower_figures = {phase: figures(phase) for phase in ("before", "open", "after")}
        ratios = {}
        for unit in ("bytes", "s"):
            before, during = follower_figures["before"][f"lag_{unit}_p95"], follower_figures["open"][f"lag_{unit}_p95"]
            ratios[unit] = during / before if before and during is not None else None
        follower_pass = all(r is not None and r <= ACCEPT for r in ratios.values())
        drains = [d for d in periodic.drains if d["returncode"] == 0]
        held = [d["held_bytes"] / common.MiB for d in drains]
        fit = least_squares(held, [d["seconds"] for d in drains])
        own = [(h, d["drain_elapsed_s"]) for h, d in zip(held, drains, strict=True) if d["drain_elapsed_s"] is not None]
        fit_own = least_squares([h for h, _ in own], [e for _, e in own])
        timeline_1s: list[tuple[float, int]] = []
        for t, lsn in timeline.points:
            if not timeline_1s or t - t0 >= timeline_1s[-1][0] + 1.0:
                timeline_1s.append((round(t - t0, 2), lsn))
        return {
            "server_version": version,
            "pgbench_command": pgbench_command,
            "pgbench_output": pgbench_text,
            "follower_command": f"cdc-assets drain --follow {follow_s}",
            "commit_seconds": args.commit_seconds,
            "phases_s": {"before": args.before, "open": args.open, "after": args.after},
            "bulk": {"mib_per_s": args.bulk_mb, "rows": bulk.rows, "inserts": bulk.inserts, "late": bulk.late},
            "old_transaction": old,
            "samples": samples,
            "periodic_drains": periodic.drains,
            "periodic_fit": fit,
            "periodic_fit_own": fit_own,
            "follower": follower_figures,
            "follower_ratios": ratios,
            "follower_pass": follower_pass,
            "follower_returncode": follower.returncode,
            "follower_output": follower_text[-5000:],
            "follower_stderr": follower_stderr[-5000:],
            "final_drains": final,
            "checks": checks,
            "wal_timeline_1s": timeline_1s,
        }
    finally:
        for thread in threads:
            thread.stop.set()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        cluster.stop()


def mib(value: float | None) -> str:
    return "—" if value is None else f"{value / common.MiB:,.2f}"


def seconds(value: float | None) -> str:
    return "—" if value is None else f"{value:,.2f}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, default=18, choices=(15, 16, 18), help="PostgreSQL major version")
    parser.add_argument("--before", type=int, default=180, help="seconds of load before the old transaction")
    parser.add_argument("--open", type=int, default=600, help="seconds the old transaction stays open")
    parser.add_argument("--after", type=int, default=60, help="seconds of load after it commits")
    parser.add_argument("--rate", type=int, default=300, help="pgbench -R: transactions per second")
    parser.add_argument("--clients", type=int, default=2)
    parser.add_argument("--scale", type=int, default=1)
    parser.add_argument("--bulk-mb", type=float, default=1.0, help="MiB into the unpublished table every second")
    parser.add_argument("--drain-every", type=float, default=30, help="seconds between periodic drains")
    parser.add_argument("--commit-seconds", type=float, default=2.0, help="drain.commit_seconds of both slots")
    parser.add_argument("--sample", type=float, default=5, help="seconds between samples")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args()

    machine = common.machine()
    code_start = common.code_version()
    load_before = common.load_snapshot()
    workdir = Path(tempfile.mkdtemp(prefix="cdc-bench-longtx-"))
    try:
        result = run(args, workdir)
    finally:
        if not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    load_after = common.load_snapshot()
    code_end = common.code_version()

    print()
    print(
        f"Long transaction, PostgreSQL {result['server_version']}: {result['pgbench_command']} and"
        f" {args.bulk_mb:g} MiB/s into an unpublished table; old transaction open from"
        f" {args.before:g} s for {args.open:g} s, then {args.after:g} s; drain.commit_seconds {args.commit_seconds:g}"
    )
    f = result["follower"]
    rows = [
        [
            phase,
            f[phase]["samples"],
            mib(f[phase]["lag_bytes_p95"]),
            seconds(f[phase]["lag_s_p95"]),
            mib(f[phase]["lag_bytes_max"]),
            seconds(f[phase]["lag_s_max"]),
            mib(f[phase]["held_bytes_max"]),
        ]
        for phase in ("before", "open", "after")
    ]
    print(f"\nfollower ({result['follower_command']}), samples every {args.sample:g} s:")
    print(
        common.table(
            ["phase", "samples", "lag MiB p95", "lag s p95", "lag MiB max", "lag s max", "WAL held MiB max"], rows
        )
    )
    ratios = result["follower_ratios"]
    verdict = "PASS" if result["follower_pass"] else "FAIL"
    print(
        f"while open / before, p95: bytes {seconds(ratios['bytes'])}, seconds {seconds(ratios['s'])};"
        f" required <= {ACCEPT}: {verdict}"
    )
    print(f"\nperiodic drains (cdc-assets drain every {args.drain_every:g} s):")
    print(
        common.table(
            ["start s", "phase", "WAL held MiB", "lag MiB", "drain s (wall)", "drain's own s", "transactions"],
            [
                [
                    f"{d['t']:.0f}",
                    d["phase"],
                    mib(d["held_bytes"]),
                    mib(d["lag_bytes"]),
                    seconds(d["seconds"]),
                    seconds(d["drain_elapsed_s"]),
                    d["transactions"] if d["transactions"] is not None else f"failed ({d['returncode']})",
                ]
                for d in result["periodic_drains"]
            ],
        )
    )
    for key, what in (("periodic_fit", "wall time"), ("periodic_fit_own", "the drain's own elapsed time")):
        fit = result[key]
        if fit is not None:
            print(
                f"least squares, {what}: {1000 * fit['slope_s_per_mib']:.2f} ms per MiB of WAL held, intercept"
                f" {fit['intercept_s']:.2f} s, r² {fit['r2']:.3f}"
            )
    checks = result["checks"]
    print(
        f"\ncorrectness: follower {checks['follower_transactions']:,} transactions, periodic"
        f" {checks['periodic_transactions']:,}, same set: {checks['same_transactions']}"
        f" ({checks['only_in_follower']} only in the follower, {checks['only_in_periodic']} only in the periodic);"
        f" old transaction logged: {checks['old_transaction_logged']}; pgbench processed {checks['pgbench_processed']}"
        f" (+1 old = {checks['expected_transactions']}), pgbench_history rows {checks['pgbench_history_rows']}:"
        f" {'PASS' if checks['pass'] else 'FAIL'}"
    )
    print(f"\nbefore: {common.describe_load(load_before)}\nafter:  {common.describe_load(load_after)}")
    print(common.describe_code(code_start, code_end))
    common.write_json(
        args.json,
        {
            "benchmark": "long_transaction",
            "command": " ".join(["python", *sys.argv]),
            "machine": machine,
            "code_start": code_start,
            "code_end": code_end,
            "load_before": load_before,
            "load_after": load_after,
            **result,
        },
    )
    return 0 if result["follower_pass"] and checks["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
