"""A thousand kills: the command line SIGKILLed at random moments, again and again, while a random
workload writes; then one full sync, and every Delta table must equal its source exactly.

    python benchmarks/crash_kills.py [--kills 1000] [--seed 4848] [--deadline-seconds 7200]
                                     [--rate 25] [--pg 16] [--overlap] [--out crash-kills-out] [--keep]

The source: a throwaway PostgreSQL (the tests' settings: ``logical_decoding_work_mem`` 64 kB, so
large transactions spill) with the differential test's eight tables (``tests/support/workload.py``:
enum, arrays, jsonb, numerics, timestamps, bytea, TOAST, cascades, REPLICA IDENTITY FULL / USING
INDEX, keyless, a row filter, truncates, prepared and large transactions) and :data:`TYPED_DDL`'s
``typed`` table, for the types the workload lacks: domains (over ``integer``, over a domain, over
``numeric(10,2)``), an array of a domain, ranges (``int4range``, ``tstzrange``), a composite (with a
``text[]`` field), an enum and an array of it. A writer thread runs both at ``--rate`` operations
per second for the whole run. The pipeline: ``changelog.retention_hours: 0``, ``fold_min_share: 0``
(retention folds after every drain), ``compact_min_files: 2``, ``purge_min_deletion_vectors: 1``
(maintenance due after almost every merge), ``small_table_mb: 0``, ``source.batch_changes: 500``,
and ``spark.remote``: every command talks to one ``cdc-assets spark-server`` started here, so no
command pays a JVM start.

Each attempt picks a command — ``drain``, ``apply``, ``sync``, ``sync --follow 4``, ``snapshot
<a random table>``, ``maintain`` — at random among those killed least so far (so each gets a sixth
of the kills), starts it in a process group of its own and SIGKILLs the group a uniform 0.2–3 s
later (``sync --follow``: 0.2–6 s), or for a quarter of the attempts 3–12 s later (past the
start-up and the first merges: later tables' merges, the maintenance). An attempt that exits by itself first is a run, not a kill; it
must exit 0, or non-zero with one ``cdc-assets: …`` line naming what to do (a command in
backquotes, or run / rerun / retry / drop / set / wait / copy / upgrade): every other exit — a
traceback, a signal, a message without a remedy — is recorded with its error output and fails the
run at the end. After each kill: the group's processes gone, then its PostgreSQL sessions (those
named ``cdc-assets:…``) ended, then every Delta table's applied LSN read with delta-rs — it never
goes back and never passes the change log's checkpoint. A killed client's statement runs on in the
Spark server, and commits, after the client is gone. With ``--overlap`` the next command meets it
there — what the apply's fence and its retry after a lost Delta commit are for (docs/architecture.md,
"Other writers"); without, before the next command that uses Spark, and before the final sync, the
server must have no SQL statement or job running (its UI's REST API).

After ``--kills`` kills (the run fails if ``--deadline-seconds`` pass first) the writer stops,
resolves what it left open and commits one transaction touching every table; one ``cdc-assets
sync`` runs to completion; then every table is compared with its source by Spark (over the same
server) and by delta-rs (``tests/support/mirror_diff.py``: values and Delta types), rows lost,
duplicated and changed are counted from delta-rs's read, each table's Delta schema must equal the
one its first sync (before any kill) created — a column whose type differs is *retyped* — and
each table's applied LSN must be the checkpoint.

Output: a progress line every 25 kills, ``crash_kills.json`` in ``--out`` (kills, runs and
completions per command, kills by the lines the command had printed, non-zero exits with their
messages, rows compared, mismatches, lost, duplicated, retyped, the time spent waiting for the
Spark server, elapsed, the Delta schemas) also printed; exit status 1 when anything failed (the
work folder is then kept).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from pathlib import Path
from typing import Any

import _common as common
import psycopg
from deltalake import DeltaTable

from cdc_assets.apply.target import table_applied_lsn
from cdc_assets.changelog.checkpoint import read_checkpoint
from cdc_assets.changelog.store import LogStore
from cdc_assets.config import Config, load_config
from cdc_assets.lsn import format_lsn
from cdc_sandbox.pgcluster import ThrowawayCluster, free_port
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.mirror_diff import compare_all, conform, report, rust_table, without_metadata
from tests.support.processes import cdc_sessions, group_alive
from tests.support.rows import multiset, source_table, table_rows
from tests.support.workload import Workload, tables_section

SCHEMA = "kills"
SLOT = "kills_slot"
FOLLOW_S = "4"
COMMANDS = ("drain", "apply", "sync", "sync --follow", "snapshot", "maintain")
SPARK_COMMANDS = ("apply", "sync", "sync --follow", "maintain")
# A kill's delay after the start: most early (start-up, the drain, the first merges), a quarter
# late enough to reach later tables' merges and the maintenance.
DELAY_S = {"sync --follow": (0.2, 6.0)}  # the others: DEFAULT_DELAY_S
DEFAULT_DELAY_S = (0.2, 3.0)
LATE_DELAY_S = (3.0, 12.0)
LATE_SHARE = 0.25
PROGRESS_EVERY = 25
SESSIONS_TIMEOUT_S = 60.0
STATEMENTS_TIMEOUT_S = 300.0
GROUP_TIMEOUT_S = 30.0
FINAL_SYNC_TIMEOUT_S = 1800.0
SERVER_START_TIMEOUT_S = 600.0  # a first start resolves Delta's jars through Ivy
MAINTENANCE = {"compact_min_files": 2, "purge_min_deletion_vectors": 1}
SERVER_CONF = {
    "spark.sql.shuffle.partitions": "2",
    "spark.default.parallelism": "2",
    "spark.driver.memory": "2g",
    "spark.databricks.delta.snapshotPartitions": "1",
    # a killed client never releases its session: let the server drop it after 5 idle minutes
    "spark.connect.session.manager.defaultSessionTimeout": "5m",
}
# A remedy in a one-line error: a command in backquotes, or a verb telling what to do.
REMEDY = re.compile(r"`[^`]+`|\b(run|rerun|retry|drop|set|wait|copy|upgrade)\b", re.IGNORECASE)

TYPED_DDL = """
CREATE DOMAIN {s}.posint AS integer CHECK (VALUE > 0);
CREATE DOMAIN {s}.small_posint AS {s}.posint CHECK (VALUE < 1000);
CREATE DOMAIN {s}.price AS numeric(10,2) CHECK (VALUE >= 0);
CREATE TYPE {s}.pair AS (x int, label text, tags text[]);
CREATE TYPE {s}.shade AS ENUM ('red', 'green', 'blue', 'ultra violet', 'it''s "odd"');
CREATE TABLE {s}.typed (
    id bigint PRIMARY KEY, score {s}.posint, rank {s}.small_posint, scores {s}.posint[], price {s}.price,
    r int4range, span tstzrange, c {s}.pair, e {s}.shade, es {s}.shade[], a int[]);
"""
SHADES = ("red", "green", "blue", "ultra violet", 'it\'s "odd"')
LABELS = ("plain", "a,b", 'say "hi"', "(paren)", "back\\slash", "", " spaced ", "ünï ✓", "NULL")
TYPED_COLUMNS = ("score", "rank", "scores", "price", "r", "span", "c", "e", "es", "a")


class TypedTable:
    """Inserts, updates (key changes among them), deletes and small transactions (some rolled
    back) on ``<schema>.typed``, decided by ``random.Random(seed)`` against the keys it holds."""

    def __init__(self, dsn: str, schema: str, seed: int) -> None:
        self.schema = schema
        self.rng = random.Random(seed)
        self.conn = psycopg.connect(dsn, autocommit=True, application_name="crash-kills-typed")
        self.keys: dict[int, None] = {}
        self.next_key = 1
        self.ops = 0

    @property
    def name(self) -> str:
        return f"{self.schema}.typed"

    def create(self) -> None:
        self.conn.execute(TYPED_DDL.format(s=self.schema))

    def populate(self, rows: int = 25) -> None:
        for _ in range(rows):
            self._insert()

    def run(self, ops: int) -> None:
        """At least ``ops`` statements: autocommit ones, or a transaction of 2–5 (one in five rolled back)."""
        target = self.ops + ops
        while self.ops < target:
            if self.rng.random() < 0.3:
                saved = (dict(self.keys), self.next_key)
                with self.conn.transaction(force_rollback=self.rng.random() < 0.2) as tx:
                    for _ in range(self.rng.randint(2, 5)):
                        self._operation()
                if tx.force_rollback:
                    self.keys, self.next_key = saved
            else:
                self._operation()

    def touch(self) -> None:
        self._insert()

    def close(self) -> None:
        self.conn.close()

    def _operation(self) -> None:
        r = self.rng.random()
        if r < 0.4 or len(self.keys) < 5:
            self._insert()
        elif r < 0.8:
            self._update()
        elif r < 0.85:
            self._key_change()
        else:
            self._delete()

    def _insert(self) -> None:
        key = self.next_key
        self.next_key += 1
        columns = {name: self._value(name) for name in TYPED_COLUMNS}
        names = ", ".join(["id", *columns])
        values = ", ".join(["%s", *(sql for sql, _ in columns.values())])
        params = [key, *(p for _, ps in columns.values() for p in ps)]
        self._execute(f"INSERT INTO {self.name} ({names}) VALUES ({values})", params)
        self.keys[key] = None

    def _update(self) -> None:
        key = self.rng.choice(list(self.keys))
        columns = {name: self._value(name) for name in self.rng.sample(TYPED_COLUMNS, self.rng.randint(1, 4))}
        assignments = ", ".join(f"{name} = {sql}" for name, (sql, _) in columns.items())
        params = [*(p for _, ps in columns.values() for p in ps), key]
        self._execute(f"UPDATE {self.name} SET {assignments} WHERE id = %s", params)

    def _key_change(self) -> None:
        old = self.rng.choice(list(self.keys))
        new = self.next_key
        self.next_key += 1
        self._execute(f"UPDATE {self.name} SET id = %s WHERE id = %s", [new, old])
        del self.keys[old]
        self.keys[new] = None

    def _delete(self) -> None:
        key = self.rng.choice(list(self.keys))
        self._execute(f"DELETE FROM {self.name} WHERE id = %s", [key])
        del self.keys[key]

    def _execute(self, sql: str, params: list[Any]) -> None:
        self.conn.execute(sql, params)
        self.ops += 1

    def _value(self, column: str) -> tuple[str, list[Any]]:
        """One value of ``column``: its SQL expression and parameters (NULL now and then)."""
        rng, s = self.rng, self.schema
        if rng.random() < 0.1:
            return "NULL", []
        if column == "score":
            return "%s", [rng.randint(1, 2**31 - 1)]
        if column == "rank":
            return "%s", [rng.randint(1, 999)]
        if column == "scores":
            return f"%s::integer[]::{s}.posint[]", [self._ints(1)]
        if column == "price":
            return "%s", [Decimal(rng.randint(0, 10**10 - 1)) / 100]
        if column == "r":
            low, high = sorted(rng.sample(range(-1000, 1000), 2))
            text = rng.choice(["empty", f"[{low},{high})", f"({low},{high}]", f"[{low},)", f"(,{high})", "(,)"])
            return "%s::int4range", [text]
        if column == "span":
            start = datetime(2020, 1, 1, tzinfo=UTC) + timedelta(microseconds=rng.randint(0, 10**15))
            end = start + timedelta(seconds=rng.randint(1, 10**6), microseconds=rng.randint(0, 999_999))
            text = rng.choice([f'["{start}","{end}")', f'("{start}",)', f'[,"{end}"]', "empty"])
            return "%s::tstzrange", [text]
        if column == "c":
            tags = [rng.choice([*LABELS, None]) for _ in range(rng.randint(0, 3))]
            return f"ROW(%s, %s, %s::text[])::{s}.pair", [
                rng.choice([rng.randint(-99, 99), None]),
                rng.choice(LABELS),
                tags,
            ]
        if column == "e":
            return f"%s::{s}.shade", [rng.choice(SHADES)]
        if column == "es":
            return f"%s::text[]::{s}.shade[]", [[rng.choice([*SHADES, None]) for _ in range(rng.randint(0, 4))]]
        return "%s::integer[]", [self._ints(-999)]

    def _ints(self, low: int) -> list[int | None]:
        return [self.rng.choice([self.rng.randint(low, 999), None]) for _ in range(self.rng.randint(0, 4))]


class Writer(threading.Thread):
    """The workload and the typed table at about ``rate`` operations per second until :meth:`stop`."""

    def __init__(self, workload: Workload, typed: TypedTable, rate: float) -> None:
        super().__init__(name="crash-kills-writer", daemon=True)
        self.workload = workload
        self.typed = typed
        self.rate = rate
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self.pace = random.Random(workload.seed + 1)

    def run(self) -> None:
        try:
            while not self.stopping.is_set():
                ops = self.pace.randint(5, 30)
                started = time.monotonic()
                self.workload.run(ops, allow_pending=False)
                self.typed.run(max(1, ops // 8))
                # pacing of the load generator: about `rate` operations per second
                self.stopping.wait(max(0.0, ops / self.rate - (time.monotonic() - started)))
        except BaseException as error:  # noqa: BLE001 — re-raised by stop()
            self.error = error

    def stop(self) -> None:
        self.stopping.set()
        self.join(timeout=300)
        if self.is_alive():
            raise RuntimeError("the writer did not stop")
        if self.error is not None:
            raise self.error


@dataclass(slots=True)
class Exit:
    """A run that exited non-zero by itself: what it was, how it ended, what ran before it."""

    number: int
    command: str
    code: int
    seconds: float
    message: str
    remedy: bool
    before: str  # the previous run: command and how it ended
    stderr: str


@dataclass(slots=True)
class Tally:
    """Everything counted during the kill loop."""

    kills: Counter[str] = field(default_factory=Counter)
    runs: Counter[str] = field(default_factory=Counter)
    completions: Counter[str] = field(default_factory=Counter)
    exits: list[Exit] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    kill_seconds: list[float] = field(default_factory=list)
    depth: dict[str, Counter[int]] = field(default_factory=dict)  # kills by lines the command had printed
    session_wait_s: float = 0.0
    statement_wait_s: float = 0.0
    previous: str = "none"

    def least_killed(self, rng: random.Random) -> str:
        fewest = min(self.kills[c] for c in COMMANDS)
        return rng.choice([c for c in COMMANDS if self.kills[c] == fewest])

    def line(self, elapsed: float) -> str:
        total = sum(self.kills.values())
        per = ", ".join(f"{c} {self.kills[c]}" for c in COMMANDS)
        return (
            f"{total} kills ({per}); {sum(self.runs.values())} runs, {sum(self.completions.values())} completed,"
            f" {len(self.exits)} non-zero exits; {elapsed:.0f} s ({self.statement_wait_s:.0f} s waiting for the"
            f" Spark server), {elapsed / max(total, 1):.2f} s per kill"
        )


@dataclass(slots=True)
class ServerProbe:
    """The statements and jobs the Connect server is running, from its UI's REST API: a killed
    client's statement runs on in the server (and commits) after the client is gone."""

    api: str  # http://127.0.0.1:<ui port>/api/v1
    app: str = ""

    def busy(self) -> int:
        """Statements and jobs running; 1 when the list could not be read (the server answers 404
        when it drops an old statement while listing them: look again)."""
        try:
            if not self.app:
                self.app = self._get("applications")[0]["id"]
            statements = self._get(f"applications/{self.app}/sql?details=false&planDescription=false&length=10000")
            jobs = self._get(f"applications/{self.app}/jobs?status=running")
        except urllib.error.HTTPError:
            return 1
        return sum(1 for s in statements if s["status"] == "RUNNING") + len(jobs)

    def wait_idle(self, what: str) -> None:
        """Until nothing runs, twice 0.25 s apart (a statement sent just before a kill may still be
        on its way)."""

        def idle() -> bool:
            if self.busy():
                return False
            time.sleep(0.25)
            return not self.busy()

        wait_for(idle, STATEMENTS_TIMEOUT_S, what)

    def _get(self, path: str) -> Any:
        with urllib.request.urlopen(f"{self.api}/{path}", timeout=30) as response:
            return json.load(response)


@dataclass(slots=True)
class Bench:
    """The source, the server, the configuration and the environment the commands run in."""

    work: Path
    dsn: str
    config_path: Path
    env: dict[str, str]
    tables: list[str]

    def argv(self, command: str, rng: random.Random) -> list[str]:
        if command == "sync --follow":
            args = ["sync", "--follow", FOLLOW_S]
        elif command == "snapshot":
            args = ["snapshot", rng.choice(self.tables)]
        else:
            args = [command]
        return [sys.executable, "-m", "cdc_assets", *args, "-c", str(self.config_path)]

    def start(self, argv: list[str]) -> subprocess.Popen[bytes]:
        with (self.work / "run.out").open("wb") as out, (self.work / "run.err").open("wb") as err:
            return subprocess.Popen(argv, stdout=out, stderr=err, env=self.env, cwd=self.work, start_new_session=True)

    def output(self) -> tuple[str, str]:
        return tuple(  # type: ignore[return-value]
            (self.work / name).read_text(encoding="utf-8", errors="replace") for name in ("run.out", "run.err")
        )

    def run(self, *args: str, timeout: float = FINAL_SYNC_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
        argv = [sys.executable, "-m", "cdc_assets", *args, "-c", str(self.config_path)]
        return subprocess.run(argv, env=self.env, cwd=self.work, capture_output=True, text=True, timeout=timeout)


def wait_for(condition: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not met within {timeout:.0f} s")
        time.sleep(0.02)


def without_traces(stderr: str) -> str:
    """Error output without JVM stack frames and Spark's warnings, the last 4,000 characters."""
    lines = [line for line in stderr.splitlines() if not line.lstrip().startswith("at ") and " WARN " not in line]
    return "\n".join(lines)[-4000:]


def judge(number: int, command: str, code: int, seconds: float, stderr: str, before: str) -> Exit:
    """A non-zero exit: has it one ``cdc-assets: …`` line (no traceback) that names a remedy?"""
    lines = [line for line in stderr.splitlines() if line.startswith("cdc-assets: ")]
    message = lines[-1] if lines else (stderr.strip().splitlines() or [f"no error output (exit {code})"])[-1]
    remedy = code > 0 and bool(lines) and "Traceback" not in stderr and bool(REMEDY.search(message))
    return Exit(number, command, code, round(seconds, 2), message, remedy, before, without_traces(stderr))


def check_after_kill(config: Config, applied: dict[str, int], tally: Tally, where: str) -> None:
    """Each Delta table's applied LSN never goes back and never passes the checkpoint."""
    checkpoint = read_checkpoint(LogStore(config.changelog.path))
    if checkpoint is None:
        tally.violations.append(f"{where}: the change log has no checkpoint")
        return
    for table in config.tables:
        name = str(table.name)
        lsn = table_applied_lsn(config, table)
        if lsn is None:
            continue
        if lsn > checkpoint.lsn:
            tally.violations.append(
                f"{where}: {name} applied {format_lsn(lsn)}, past the checkpoint {format_lsn(checkpoint.lsn)}"
            )
        if lsn < applied.get(name, 0):
            tally.violations.append(
                f"{where}: {name} applied LSN went back from {format_lsn(applied[name])} to {format_lsn(lsn)}"
            )
        applied[name] = max(lsn, applied.get(name, 0))


def kill_loop(
    bench: Bench, config: Config, probe: ServerProbe | None, args: argparse.Namespace, tally: Tally, started: float
) -> None:
    """Attempts until ``args.kills`` kills; raises past the deadline or when a killed command's
    processes, sessions or Spark statements do not end. A command that uses Spark starts once
    the statements of the Spark commands killed before it have ended on the server (``probe``;
    None: at once, meeting them)."""
    rng = random.Random(args.seed)
    applied: dict[str, int] = {}
    orphans = False  # a Spark command was killed: its statements may run on in the server
    monitor = psycopg.connect(bench.dsn, autocommit=True, application_name="crash-kills-monitor")
    try:
        while sum(tally.kills.values()) < args.kills:
            if time.monotonic() - started > args.deadline_seconds:
                raise RuntimeError(
                    f"{args.kills} kills not reached within {args.deadline_seconds:.0f} s:"
                    f" {tally.line(time.monotonic() - started)}"
                )
            command = tally.least_killed(rng)
            argv = bench.argv(command, rng)
            label = " ".join(argv[3:-2])
            number = sum(tally.runs.values()) + 1
            late = rng.random() < LATE_SHARE
            delay = rng.uniform(*(LATE_DELAY_S if late else DELAY_S.get(command, DEFAULT_DELAY_S)))
            if orphans and probe is not None and command in SPARK_COMMANDS:
                waited = time.monotonic()
                probe.wait_idle(f"the Spark statements of the commands killed before run {number} to end")
                tally.statement_wait_s += time.monotonic() - waited
                orphans = False
            tally.runs[command] += 1
            process = bench.start(argv)
            began = time.monotonic()
            try:
                code = process.wait(timeout=delay)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
                seconds = time.monotonic() - began
                tally.kills[command] += 1
                tally.kill_seconds.append(seconds)
                tally.depth.setdefault(command, Counter())[len(bench.output()[0].splitlines())] += 1
                tally.previous = f"run {number}: {label} killed at {seconds:.2f} s"
                after_kill(process.pid, monitor, config, applied, tally)
                orphans = orphans or command in SPARK_COMMANDS
                if sum(tally.kills.values()) % PROGRESS_EVERY == 0:
                    print(f"[kills] {tally.line(time.monotonic() - started)}", flush=True)
                continue
            seconds = time.monotonic() - began
            if code == 0:
                tally.completions[command] += 1
            else:
                failed = judge(number, label, code, seconds, bench.output()[1], tally.previous)
                tally.exits.append(failed)
                print(
                    f"[kills] run {number}: {label} exited {code} after {tally.previous}: {failed.message}", flush=True
                )
            tally.previous = f"run {number}: {label} exited {code} after {seconds:.2f} s"
    finally:
        monitor.close()


def after_kill(
    pgid: int, monitor: psycopg.Connection[Any], config: Config, applied: dict[str, int], tally: Tally
) -> None:
    """The killed group's processes gone, then its PostgreSQL sessions ended; then the applied
    LSNs checked."""
    wait_for(lambda: not group_alive(pgid), GROUP_TIMEOUT_S, f"the processes of {tally.previous} to end")
    waited = time.monotonic()
    try:
        wait_for(lambda: not cdc_sessions(monitor), SESSIONS_TIMEOUT_S, f"the sessions of {tally.previous} to end")
    except RuntimeError as error:
        raise RuntimeError(f"{error}: {cdc_sessions(monitor)}") from None
    tally.session_wait_s += time.monotonic() - waited
    check_after_kill(config, applied, tally, tally.previous)


def delta_schemas(config: Config) -> dict[str, dict[str, str]]:
    """Each Delta table's columns and their types (delta-rs)."""
    out = {}
    for table in config.tables:
        fields = DeltaTable(config.target_path(table)).schema().fields
        out[str(table.name)] = {f.name: str(f.type) for f in fields}
    return out


@dataclass(slots=True)
class TableCount:
    """One table's rows by delta-rs against its source: lost, duplicated, changed."""

    table: str
    source_rows: int
    delta_rows: int
    lost: int  # source rows missing from Delta (as many times as missing)
    duplicated: int  # surplus copies in Delta of rows the source holds
    changed: int  # Delta rows the source does not hold at all
    retyped: list[str]


def count_rows(config: Config, conn: psycopg.Connection[Any], before: dict[str, dict[str, str]]) -> list[TableCount]:
    counts = []
    now = delta_schemas(config)
    for table in config.tables:
        name = str(table.name)
        retyped = [
            f"{column}: {kind} at the first sync, now {now[name].get(column)}"
            for column, kind in before[name].items()
            if now[name].get(column) != kind
        ]
        expected, _ = source_table(conn, table.name, table.row_filter)
        got, problems = conform(without_metadata(rust_table(config.target_path(table))), expected.schema, "delta-rs")
        retyped += problems
        want = multiset(table_rows(expected))
        have = multiset(table_rows(got)) if got is not None else Counter()
        surplus = have - want
        counts.append(
            TableCount(
                name,
                expected.num_rows,
                sum(have.values()),
                sum((want - have).values()),
                sum(n for row, n in surplus.items() if row in want),
                sum(n for row, n in surplus.items() if row not in want),
                retyped,
            )
        )
    return counts


def verify(bench: Bench, config: Config, address: str, before: dict[str, dict[str, str]]) -> dict[str, Any]:
    """Every table against its source (Spark over the server, delta-rs), counted; applied LSNs."""
    from pyspark.sql import SparkSession

    spark = SparkSession.builder.remote(address).create()
    try:
        parity = compare_all(config, bench.dsn, spark)
    finally:
        spark.stop()
    with psycopg.connect(bench.dsn, autocommit=True) as conn:
        counts = count_rows(config, conn, before)
    checkpoint = read_checkpoint(LogStore(config.changelog.path))
    assert checkpoint is not None
    lsns = {str(t.name): table_applied_lsn(config, t) for t in config.tables}
    behind = {name: format_lsn(lsn) if lsn is not None else None for name, lsn in lsns.items() if lsn != checkpoint.lsn}
    return {
        "checkpoint": format_lsn(checkpoint.lsn),
        "rows_compared": sum(p.rows_compared for p in parity),
        "mismatches": sum(len(p.problems) for p in parity),
        "lost": sum(c.lost for c in counts),
        "duplicated": sum(c.duplicated for c in counts),
        "changed": sum(c.changed for c in counts),
        "retyped": [f"{c.table}.{line}" for c in counts for line in c.retyped],
        "applied_lsn_not_checkpoint": behind,
        "tables": [asdict(c) for c in counts],
        "report": report(parity),
    }


def start_server(
    work: Path, tables: list[str], env: dict[str, str]
) -> tuple[subprocess.Popen[bytes], str, ServerProbe]:
    """``cdc-assets spark-server`` (``local[2]``, :data:`SERVER_CONF`, its UI on a free port)
    waited on until it listens."""
    ui = free_port()
    conf = SERVER_CONF | {"spark.ui.enabled": "true", "spark.ui.port": str(ui), "spark.ui.showConsoleProgress": "false"}
    server_config = write_config(work, tables, spark={"conf": conf}, name="server.yaml")
    port = free_port()
    argv = [sys.executable, "-m", "cdc_assets", "spark-server", "--port", str(port), "--master", "local[2]"]
    argv += ["--log", str(work / "spark-server.log"), "-c", str(server_config)]
    process = common.started(argv, env, work / "spark-server.out", work)
    common.wait_for_line(work / "spark-server.out", "listening at", process, SERVER_START_TIMEOUT_S)
    return process, f"sc://127.0.0.1:{port}", ServerProbe(f"http://127.0.0.1:{ui}/api/v1")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kills", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=4848)
    parser.add_argument("--deadline-seconds", type=float, default=7200.0, help="the kill loop's bound")
    parser.add_argument("--rate", type=float, default=25.0, help="workload operations per second")
    parser.add_argument("--pg", type=int, default=16)
    parser.add_argument("--out", default="crash-kills-out")
    parser.add_argument(
        "--overlap",
        action="store_true",
        help="start each command, the final sync too, without waiting for killed ones' statements on the Spark server",
    )
    parser.add_argument("--keep", action="store_true", help="keep the work folder (kept anyway when the run fails)")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    code = common.code_version()
    work = Path(tempfile.mkdtemp(prefix="cdc-crash-kills-"))
    print(f"[kills] work folder {work}", flush=True)
    cluster = ThrowawayCluster(args.pg)
    cluster.start()
    server: subprocess.Popen[bytes] | None = None
    started = time.monotonic()
    tally = Tally()
    summary: dict[str, Any] = {
        "kills_wanted": args.kills,
        "seed": args.seed,
        "rate": args.rate,
        "pg": args.pg,
        "overlap": args.overlap,
    }
    failures: list[str] = []
    try:
        dsn = cluster.dsn()
        workload = Workload(dsn, SCHEMA, args.seed, application_name="crash-kills-writer")
        workload.create()
        workload.populate()
        typed = TypedTable(dsn, SCHEMA, args.seed + 7)
        typed.create()
        typed.populate()
        tables = [*workload.tables, typed.name]
        env = {k: v for k, v in os.environ.items() if k not in ("CDC_ASSETS_FAULT", "CDC_CONFIG")}
        env |= {DSN_VARIABLE: dsn, "PYTHONUNBUFFERED": "1"}  # a killed command's output up to the kill
        server, address, probe = start_server(work, tables, env)
        config_path = write_config(
            work,
            tables_section(workload.tables) | {typed.name: {}},
            source={"publication": f"{SLOT}_pub", "slot": SLOT, "batch_changes": 500},
            changelog={"retention_hours": 0, "retention_every_minutes": 0, "fold_min_share": 0},
            warehouse={"maintenance": MAINTENANCE, "small_table_mb": 0},
            spark={"remote": address},
        )
        bench = Bench(work, dsn, config_path, env, tables)
        config = load_config(config_path, environ=env)
        for step in ("setup", "sync"):  # the first sync, before any kill: the Delta schemas to hold
            done = bench.run(step)
            if done.returncode != 0:
                raise RuntimeError(f"{step} failed ({done.returncode}):\n{without_traces(done.stderr)}")
        schemas = delta_schemas(config)
        summary["delta_schemas"] = schemas
        print(f"[kills] set up in {time.monotonic() - started:.0f} s; {args.kills} kills to go", flush=True)
        writer = Writer(workload, typed, args.rate)
        writer.start()
        loop_started = time.monotonic()
        try:
            kill_loop(bench, config, None if args.overlap else probe, args, tally, loop_started)
        except RuntimeError as error:
            failures.append(f"kill loop: {error}")
        finally:
            writer.stop()
        loop_s = time.monotonic() - loop_started
        print(f"[kills] {tally.line(loop_s)}", flush=True)
        if not args.overlap:
            probe.wait_idle("the Spark server to finish the killed commands' statements")
        workload.finish()
        workload.touch_all()
        typed.touch()
        final_started = time.monotonic()
        final = bench.run("sync")
        final_s = time.monotonic() - final_started
        summary |= {
            "kills": sum(tally.kills.values()),
            "kills_by_command": dict(tally.kills),
            "runs": sum(tally.runs.values()),
            "runs_by_command": dict(tally.runs),
            "completions": sum(tally.completions.values()),
            "completions_by_command": dict(tally.completions),
            "kills_by_lines_printed": {c: dict(sorted(d.items())) for c, d in tally.depth.items()},
            "non_zero_exits": [asdict(e) for e in tally.exits],
            "invariant_violations": tally.violations,
            "kill_loop_s": round(loop_s, 1),
            "s_per_kill": round(loop_s / max(sum(tally.kills.values()), 1), 2),
            "median_kill_moment_s": round(sorted(tally.kill_seconds)[len(tally.kill_seconds) // 2], 2)
            if tally.kill_seconds
            else None,
            "session_wait_s": round(tally.session_wait_s, 1),
            "statement_wait_s": round(tally.statement_wait_s, 1),
            "workload": workload.stats.line(),
            "typed_ops": typed.ops,
            "final_sync": {"exit": final.returncode, "seconds": round(final_s, 1)},
        }
        if final.returncode != 0:
            failures.append(f"the final sync exited {final.returncode}:\n{without_traces(final.stderr)}")
        else:
            summary |= verify(bench, config, address, schemas)
            if summary["mismatches"]:
                failures.append(f"{summary['mismatches']} mismatches:\n{summary['report']}")
            for what in ("lost", "duplicated", "changed"):
                if summary[what]:
                    failures.append(f"{summary[what]} rows {what}")
            if summary["retyped"]:
                failures.append(f"retyped: {summary['retyped']}")
            if summary["applied_lsn_not_checkpoint"]:
                failures.append(
                    f"applied LSN not the checkpoint {summary['checkpoint']}: {summary['applied_lsn_not_checkpoint']}"
                )
        workload.close()
        typed.close()
        if tally.violations:
            failures.append(f"{len(tally.violations)} invariant violations after kills: {tally.violations[:5]}")
        if sum(tally.kills.values()) < args.kills:
            failures.append(f"{sum(tally.kills.values())} kills of {args.kills}")
        unexplained = [e for e in tally.exits if not e.remedy]
        if unexplained:
            failures.append(
                f"{len(unexplained)} exits without a remedy, the first: run {unexplained[0].number} {unexplained[0].command} ({unexplained[0].code}): {unexplained[0].message}"
            )
    except Exception as error:  # noqa: BLE001 — reported in the summary
        failures.append(f"aborted: {type(error).__name__}: {error}")
    finally:
        if server is not None:
            common.stop(server)
        cluster.stop()
        summary |= {
            "elapsed_s": round(time.monotonic() - started, 1),
            "failures": failures,
            "ok": not failures,
            "code": code,
            "code_at_end": common.code_version(),
            "machine": common.machine(),
            "work": str(work) if args.keep or failures else None,
        }
        if not (args.keep or failures):
            shutil.rmtree(work, ignore_errors=True)
    shown = {k: v for k, v in summary.items() if k not in ("tables", "report", "machine", "delta_schemas")}
    print(json.dumps(shown, indent=2, default=str))
    common.write_json(str(out / "crash_kills.json"), summary)
    print(common.describe_code(code, summary["code_at_end"]))
    print("CRASH KILLS: " + ("OK" if not failures else "FAILED\n" + "\n".join(failures)), flush=True)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
