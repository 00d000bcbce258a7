"""Building blocks for the drain crash tests (``tests/test_drain_crash.py``).

* :func:`write_ledger_config` / :func:`run_cli` / :func:`start_drain`: the real ``cdc-assets`` command as a
  subprocess, configured by a YAML file and ``CDC_SOURCE_DSN``.
* :class:`LedgerWorkload`: one connection that commits transactions touching two tables (and sometimes
  logical decoding messages). Being a single connection, the order in which its COMMITs return is
  the server's commit order; every transaction records its xid, so the change log's transactions
  can be matched to the writer's one by one. :class:`WriterThread` runs it continuously.
* :class:`DrainMonitor`: sees a drain's sessions on the source (the drain lock granted, every
  ``cdc-assets:*`` session gone), so tests wait on conditions instead of sleeping.
* :func:`log_state` (what a killed drain left behind) and :func:`verify_log` (the full exactly-once,
  order and replay check against the writer and the source).
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from cdc_assets.changelog.layout import (
    CHECKPOINT,
    MESSAGES,
    TABLES,
    TRANSACTIONS,
    SegmentName,
)
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import LogStore, changelog_store
from cdc_assets.config import load_config
from cdc_assets.lsn import format_lsn
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.pipeline import wait_until
from tests.support.processes import cdc_sessions

EVENTS = "public.events"
LEDGER = "public.ledger"
INITIAL_ROWS = 200
BATCH_FILES = "batch files being written"

SCHEMA_SQL = (
    (
        "CREATE TABLE events (id bigint PRIMARY KEY, seq bigint NOT NULL, payload text NOT NULL,"
        " version int NOT NULL DEFAULT 0)"
    ),
    "CREATE TABLE ledger (seq bigint PRIMARY KEY, xid bigint NOT NULL, changes int NOT NULL)",
    f"INSERT INTO events (id, seq, payload) SELECT g, 0, 'initial ' || g FROM generate_series(1, {INITIAL_ROWS}) g",
)


# -- the command line --------------------------------------------------------------------------


def write_ledger_config(
    directory: Path,
    slot: str,
    *,
    batch_changes: int = 50,
    streaming: str = "off",
    changelog: str = "./changelog",
    storage: dict[str, Any] | None = None,
    commit_seconds: float | None = None,
) -> Path:
    """The crash tests' ``cdc.yaml``; ``storage``: its ``storage`` section (``Bucket.section``);
    ``commit_seconds``: ``drain.commit_seconds``."""
    return write_config(
        directory,
        [EVENTS, LEDGER],
        source={"publication": f"{slot}_pub", "slot": slot, "batch_changes": batch_changes, "streaming": streaming},
        changelog={"path": changelog},
        storage=storage,
        drain=None if commit_seconds is None else {"commit_seconds": commit_seconds},
    )


def _env(dsn: str, fault: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CDC_ASSETS_FAULT", "CDC_CONFIG")}
    env[DSN_VARIABLE] = dsn
    if fault:
        env["CDC_ASSETS_FAULT"] = fault
    return env


def run_cli(
    config: Path, dsn: str, *args: str, fault: str | None = None, timeout: float = 180
) -> subprocess.CompletedProcess[str]:
    """``python -m cdc_assets <args> -c <config>`` to its end."""
    return subprocess.run(
        [sys.executable, "-m", "cdc_assets", *args, "-c", str(config)],
        check=False,
        env=_env(dsn, fault),
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def drain_to_end(config: Path, dsn: str, slot: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """A drain that must finish by itself (they take seconds here): a clear failure if it does not."""
    try:
        result = run_cli(config, dsn, "drain", timeout=timeout)
    except subprocess.TimeoutExpired as error:
        progress = error.stderr.decode() if isinstance(error.stderr, bytes) else (error.stderr or "")
        checkpoint = ChangeLogReader(changelog_store(load_config(config, environ=_env(dsn, None)))).checkpoint()
        with psycopg.connect(dsn, autocommit=True) as conn:
            deadline = time.monotonic() + 30
            while conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'cdc-assets:%'"
            ).fetchone()[0]:
                if time.monotonic() > deadline:
                    break
                time.sleep(0.05)
            row = conn.execute(
                "SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s", (slot,)
            ).fetchone()
        raise AssertionError(
            f"a drain did not finish in {timeout:.0f} s (killed): livelock? checkpoint"
            f" {format_lsn(checkpoint.lsn) if checkpoint else None}, slot confirmed"
            f" {format_lsn(row[0]) if row else None}; its last progress lines:\n{progress[-600:]}"
        ) from None
    assert result.returncode == 0, describe(result)
    return result


def start_drain(config: Path, dsn: str, fault: str | None = None, *args: str) -> subprocess.Popen[str]:
    """``cdc-assets drain`` (with ``args``, e.g. ``--follow 30``), started."""
    return subprocess.Popen(
        [sys.executable, "-m", "cdc_assets", "drain", *args, "-c", str(config)],
        env=_env(dsn, fault),
        cwd=config.parent,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def describe(result: subprocess.CompletedProcess[str] | tuple[int | None, str, str]) -> str:
    if isinstance(result, tuple):
        code, out, err = result
    else:
        code, out, err = result.returncode, result.stdout, result.stderr
    return f"exit {code}\n--- stdout\n{out[-3000:]}\n--- stderr\n{err[-3000:]}"


_DRAINED = re.compile(r"drained ([\d,]+) transactions.*\(([\d.]+) s\)")


def drained_numbers(stdout: str) -> tuple[int, float] | None:
    """``(transactions, seconds)`` from a finished drain's summary line."""
    match = _DRAINED.search(stdout)
    return (int(match.group(1).replace(",", "")), float(match.group(2))) if match else None


# -- the source's view of a drain --------------------------------------------------------------


class DrainMonitor:
    """Watches ``cdc-assets:*`` sessions of one database from a connection of its own."""

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True, application_name="crash-test-monitor")

    def close(self) -> None:
        self.conn.close()

    def sessions(self) -> list[tuple[Any, ...]]:
        return cdc_sessions(self.conn)

    def lock_granted(self) -> bool:
        """The drain lock is held: the drain is past start-up, about to reconcile and batch."""
        (held,) = self.conn.execute(
            "SELECT EXISTS (SELECT 1 FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE l.locktype = 'advisory' AND l.granted AND a.datname = current_database()"
            " AND a.application_name = 'cdc-assets:drain-lock')"
        ).fetchone()
        return bool(held)

    def wait_quiet(self, timeout: float = 60) -> None:
        """Wait until no session of a (killed) drain is left: the lock is free, the slot inactive."""
        wait_until(lambda: not self.sessions(), timeout, "the killed drain's sessions to end")

    def confirmed_flush(self, slot: str) -> int:
        (lsn,) = self.conn.execute(
            "SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        return int(lsn)


# -- the writer --------------------------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class Committed:
    """One transaction the writer committed, in commit order."""

    seq: int
    xid: int
    changes: int  # change records it produced (rows of events and ledger)
    large: bool


@dataclass(slots=True, frozen=True)
class _Pending:
    """A transaction written, not known to be committed yet: what the model takes once it is."""

    transaction: Committed
    inserted: list[int]
    deleted: list[int]
    rekeyed: tuple[int, int] | None
    transactional: bool
    plain: bool


class LedgerWorkload:
    """Transactions on one connection; keeps an exact model of what it committed.

    Each transaction ``seq`` inserts rows into ``events`` carrying ``seq``, updates and deletes
    earlier rows (sometimes changing a key), may emit a transactional and/or a non-transactional
    logical decoding message with content ``seq``, and last inserts its ``ledger`` row
    ``(seq, xid, changes)``.
    """

    def __init__(self, dsn: str, seed: int, *, large_share: float = 0.03, plain_share: float = 0.05) -> None:
        self.dsn = dsn
        self.conn = psycopg.connect(dsn, autocommit=False, application_name="crash-test-writer")
        self.rng = random.Random(seed)
        self.large_share = large_share
        self.plain_share = plain_share  # of transactions that also emit a non-transactional message
        self.committed: list[Committed] = []
        self.transactional_messages: dict[int, int] = {}  # seq → seq (content) of transactional messages
        self.plain_messages: list[int] = []  # contents of non-transactional messages
        self.seq = 0
        self.next_id = INITIAL_ROWS + 1
        self._live: list[int] = list(range(1, INITIAL_ROWS + 1))
        self._index: dict[int, int] = {i: n for n, i in enumerate(self._live)}
        self._pending: _Pending | None = None  # written, its COMMIT sent and not answered yet

    def close(self) -> None:
        self.conn.close()

    @property
    def count(self) -> int:
        return len(self.committed)

    def transact(self) -> Committed:
        pending = self._write()
        self._pending = pending
        self.conn.commit()
        return self._record(pending)

    def reconnect(self, timeout: float = 120) -> None:
        """After the server went away: a new connection once it answers. A transaction whose COMMIT
        got no answer is recorded if its ledger row is there (it committed), else dropped."""
        self.conn.close()
        self.conn = wait_until(self._connect, timeout, "the server to take connections again")
        pending, self._pending = self._pending, None
        if pending is not None:
            row = self.conn.execute("SELECT xid FROM ledger WHERE seq = %s", (pending.seq,)).fetchone()
            self.conn.rollback()
            if row is not None:
                assert row[0] == pending.xid, (row, pending)
                self._record(pending)

    def _connect(self) -> psycopg.Connection[Any] | None:
        try:
            return psycopg.connect(self.dsn, autocommit=False, application_name="crash-test-writer")
        except psycopg.OperationalError:
            return None

    def _write(self) -> _Pending:
        """One transaction's statements, not committed yet."""
        rng, cur = self.rng, self.conn.cursor()
        seq = self.seq + 1
        large = rng.random() < self.large_share
        (xid,) = cur.execute("SELECT pg_current_xact_id()::text::int8").fetchone()
        changes = 0
        inserted = list(range(self.next_id, self.next_id + (rng.randint(150, 400) if large else rng.randint(1, 3))))
        cur.execute(
            "INSERT INTO events (id, seq, payload) SELECT g, %s, 'row ' || g || ' of ' || %s"
            " FROM generate_series(%s::int8, %s::int8) g",
            (seq, seq, inserted[0], inserted[-1]),
        )
        changes += cur.rowcount
        updated = self._sample(rng.randint(20, 80) if large else rng.randint(0, 2))
        if updated:
            cur.execute(
                "UPDATE events SET version = version + 1, payload = %s WHERE id = ANY(%s)",
                (f"updated by {seq}", updated),
            )
            changes += cur.rowcount
        deleted = [i for i in self._sample(rng.randint(10, 40) if large else rng.randint(0, 1)) if i not in updated]
        if deleted:
            cur.execute("DELETE FROM events WHERE id = ANY(%s)", (deleted,))
            changes += cur.rowcount
        rekeyed: tuple[int, int] | None = None
        if rng.random() < 0.05:
            candidates = [i for i in self._sample(1) if i not in updated and i not in deleted]
            if candidates:
                rekeyed = (candidates[0], self.next_id + len(inserted))
                cur.execute("UPDATE events SET id = %s, version = version + 1 WHERE id = %s", (rekeyed[1], rekeyed[0]))
                changes += cur.rowcount
        transactional = rng.random() < 0.1
        if transactional:
            cur.execute("SELECT pg_logical_emit_message(true, 'crash-t', %s::text)", (str(seq),))
        plain = rng.random() < self.plain_share
        if plain:
            cur.execute("SELECT pg_logical_emit_message(false, 'crash-n', %s::text)", (str(seq),))
        changes += 1
        cur.execute("INSERT INTO ledger (seq, xid, changes) VALUES (%s, %s, %s)", (seq, xid, changes))
        return _Pending(Committed(seq, xid, changes, large), inserted, deleted, rekeyed, transactional, plain)

    def _record(self, pending: _Pending) -> Committed:
        """Committed: update the model (the server's commit order is this connection's order)."""
        done = pending.transaction
        self._pending = None
        self.seq = done.seq
        self.next_id = pending.inserted[-1] + 1 + (1 if pending.rekeyed else 0)
        for i in pending.inserted:
            self._add(i)
        for i in pending.deleted:
            self._remove(i)
        if pending.rekeyed:
            self._remove(pending.rekeyed[0])
            self._add(pending.rekeyed[1])
        if pending.transactional:
            self.transactional_messages[done.seq] = done.seq
        if pending.plain:
            self.plain_messages.append(done.seq)
        self.committed.append(done)
        return done

    def _sample(self, n: int) -> list[int]:
        n = min(n, len(self._live))
        return sorted(self.rng.sample(self._live, n)) if n else []

    def _add(self, i: int) -> None:
        self._index[i] = len(self._live)
        self._live.append(i)

    def _remove(self, i: int) -> None:
        n = self._index.pop(i)
        last = self._live.pop()
        if last != i:
            self._live[n] = last
            self._index[last] = n


class WriterThread(threading.Thread):
    """Runs a :class:`LedgerWorkload` at about ``rate`` transactions per second until stopped;
    :meth:`burst` asks for that many more transactions as fast as the server takes them. With
    ``restarts``, a lost connection is no failure: the writer reconnects and goes on (counted in
    :attr:`outages`)."""

    def __init__(self, workload: LedgerWorkload, rate: float, *, restarts: bool = False) -> None:
        super().__init__(name="crash-writer", daemon=True)
        self.workload = workload
        self.rate = rate
        self.restarts = restarts
        self.outages = 0
        self.stopping = threading.Event()
        self.error: BaseException | None = None
        self._credit = 0
        self._lock = threading.Lock()
        self._wake = threading.Event()

    def burst(self, n: int) -> None:
        with self._lock:
            self._credit += n
        self._wake.set()

    def run(self) -> None:
        next_at = time.monotonic()
        try:
            while not self.stopping.is_set():
                try:
                    self.workload.transact()
                except psycopg.OperationalError:
                    if not self.restarts:
                        raise
                    self.workload.reconnect()
                    self.outages += 1
                    next_at = time.monotonic()
                    continue
                with self._lock:
                    bursting = self._credit > 0
                    if bursting:
                        self._credit -= 1
                if bursting:
                    next_at = time.monotonic()
                    continue
                next_at += 1.0 / self.rate
                delay = next_at - time.monotonic()
                if delay > 0:
                    self._wake.clear()
                    if self._wake.wait(delay):  # pacing the workload, not synchronisation
                        next_at = time.monotonic()  # woken for a burst
                else:
                    next_at = time.monotonic()
        except BaseException as error:  # noqa: BLE001 - reported by stop()
            self.error = error

    def check(self) -> None:
        if self.error is not None:
            raise AssertionError(f"the writer failed: {self.error!r}") from self.error

    def stop(self) -> None:
        self.stopping.set()
        self._wake.set()
        self.join(timeout=60)
        assert not self.is_alive(), "the writer did not stop"
        self.check()


# -- the change log ----------------------------------------------------------------------------


@dataclass(slots=True)
class LogState:
    """What is in the change log folder, compared with its checkpoint and the slot."""

    checkpoint_lsn: int
    confirmed_flush: int
    orphans: list[str]  # segments not (yet) covered by the checkpoint: batch start >= checkpoint
    litter: list[str]  # any other file that is neither the checkpoint nor a segment
    last_batch_start: int  # start (the previous checkpoint) of the newest batch the checkpoint covers
    new_litter: list[str]  # litter not in the ``known_litter`` given to :func:`log_state`

    @property
    def where(self) -> str:
        """Where a kill landed, judged from what it left."""
        if self.confirmed_flush < self.checkpoint_lsn:
            return "checkpoint written, slot not advanced"
        if any(name.startswith(CHECKPOINT + ".tmp") for name in self.new_litter):
            return "checkpoint being replaced"
        if self.orphans:
            return BATCH_FILES
        return "peeking, or between batches (no batch file yet)"


def log_store(root: Path | LogStore) -> LogStore:
    """The change log at ``root``: a local folder, or a store (an object-store bucket)."""
    return root if isinstance(root, LogStore) else LogStore(str(root))


def log_files(root: Path | LogStore) -> list[str]:
    """Every file under the change log's root, relative to it."""
    store = log_store(root)
    selector = pafs.FileSelector(store.path(""), allow_not_found=True, recursive=True)
    prefix = store.path("") + "/"
    return sorted(i.path[len(prefix) :] for i in store.fs.get_file_info(selector) if i.type == pafs.FileType.File)


def log_state(
    root: Path | LogStore, confirmed_flush: int, known_litter: frozenset[str] | set[str] = frozenset()
) -> LogState:
    checkpoint = ChangeLogReader(log_store(root)).checkpoint()
    assert checkpoint is not None, f"{root} has no checkpoint"
    orphans, litter = [], []
    last_batch_start = -1
    for name in log_files(root):
        if name == CHECKPOINT:
            continue
        folder = name.rsplit("/", 1)[0]
        segment = SegmentName.parse(name)
        in_segment_folder = folder in (TRANSACTIONS, MESSAGES) or (
            folder.startswith(TABLES + "/") and folder.count("/") == 1
        )
        if segment is None or not in_segment_folder:
            litter.append(name)
        elif segment.batch_start >= checkpoint.lsn:
            orphans.append(name)
        elif folder == TRANSACTIONS:
            last_batch_start = max(last_batch_start, segment.batch_start)
    new_litter = [name for name in litter if name not in known_litter]
    return LogState(checkpoint.lsn, confirmed_flush, orphans, litter, last_batch_start, new_litter)


class LogTracker:
    """Reads, after each drain, the transactions that became valid since the last look, and
    checks that the log so far is exactly the writer's commit order from the start."""

    def __init__(self, root: Path | LogStore) -> None:
        self.reader = ChangeLogReader(log_store(root))
        self.seen: list[int] = []  # xids in log order
        self.last_end = -1
        self.position = 0  # checkpoint LSN up to which segments were read

    def update(self, committed: list[Committed]) -> int:
        """Read newly valid transactions; return how many there were."""
        checkpoint = self.reader.checkpoint()
        assert checkpoint is not None
        assert checkpoint.lsn >= self.position, (
            f"the checkpoint went back from {format_lsn(self.position)} to {format_lsn(checkpoint.lsn)}"
        )
        added = 0
        for segment in self.reader.segments(TRANSACTIONS, checkpoint.lsn):
            if segment.name.batch_start < self.position:
                continue
            table = pq.read_table(self.reader.store.path(segment.path), filesystem=self.reader.store.fs)
            for xid, end in zip(table.column("xid").to_pylist(), table.column("end_lsn").to_pylist()):
                assert end <= checkpoint.lsn, f"transaction {xid} ends at {format_lsn(end)}, past the checkpoint"
                assert end > self.last_end, (
                    f"transaction {xid} (end {format_lsn(end)}) is not after the previous one"
                    f" (end {format_lsn(self.last_end)}): duplicated or out of order"
                )
                self.last_end = end
                self.seen.append(xid)
                added += 1
        self.position = checkpoint.lsn
        known = [c.xid for c in committed[: len(self.seen)]]
        if self.seen[: len(known)] != known:
            first = next(i for i, (a, b) in enumerate(zip(self.seen, known)) if a != b)
            raise AssertionError(
                f"the change log diverges from the commit order at transaction #{first}: log xid {self.seen[first]},"
                f" writer xid {known[first]} (log {self.seen[max(0, first - 3) : first + 3]},"
                f" writer {known[max(0, first - 3) : first + 3]})"
            )
        return added


@dataclass(slots=True)
class Verified:
    transactions: int = 0
    changes: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    messages: int = 0
    litter: list[str] = field(default_factory=list)


def verify_log(root: Path | LogStore, dsn: str, slot: str, workload: LedgerWorkload) -> Verified:
    """Everything the writer committed is in the log exactly once, in commit order, nothing else
    is; each transaction is whole; replaying the log gives the source's tables; the slot is at
    the checkpoint; no file outside the checkpoint is left."""
    reader = ChangeLogReader(log_store(root))
    checkpoint = reader.checkpoint()
    assert checkpoint is not None
    committed = workload.committed
    verified = Verified()

    # The transactions log: exactly the writer's transactions, once each, in commit order.
    txns = reader.transactions()
    xids = txns.column("xid").to_pylist() if txns.num_rows else []
    ends = txns.column("end_lsn").to_pylist() if txns.num_rows else []
    commits = txns.column("commit_lsn").to_pylist() if txns.num_rows else []
    expected = [c.xid for c in committed]
    duplicated = {x: n for x, n in Counter(xids).items() if n > 1}
    assert not duplicated, (
        f"{len(duplicated)} transactions are in the log more than once, e.g. {list(duplicated.items())[:5]}"
    )
    missing = set(expected) - set(xids)
    assert not missing, f"{len(missing)} committed transactions are not in the log, e.g. xids {sorted(missing)[:10]}"
    extra = set(xids) - set(expected)
    assert not extra, f"{len(extra)} transactions in the log were not committed by the writer: {sorted(extra)[:10]}"
    assert xids == expected, "the log holds the writer's transactions, but not in commit order"
    bad = [i for i in range(1, len(ends)) if ends[i] <= ends[i - 1]]
    assert not bad, f"end LSNs are not strictly increasing in log order at positions {bad[:10]}"
    assert all(c < e for c, e in zip(commits, ends)), "a commit LSN is not before its end LSN"
    assert not ends or ends[-1] <= checkpoint.lsn
    by_xid = {c.xid: c for c in committed}
    seqs = [by_xid[x].seq for x in xids]
    assert seqs == list(range(1, len(committed) + 1)), "the writer's sequence numbers are not in log order"
    end_of = dict(zip(xids, ends))
    logged_changes = dict(zip(xids, txns.column("changes").to_pylist() if txns.num_rows else []))
    wrong = [(x, logged_changes[x], by_xid[x].changes) for x in xids if logged_changes[x] != by_xid[x].changes]
    assert not wrong, f"transactions with a wrong change count (xid, logged, committed): {wrong[:10]}"
    verified.transactions = len(xids)

    # Change records: in order, whole transactions, each ledger row tied to its transaction.
    per_xid: Counter[int] = Counter()
    replayed: dict[str, dict[Any, dict[str, Any]]] = {}
    for table in (EVENTS, LEDGER):
        rows: dict[Any, dict[str, Any]] = {}
        previous = (-1, -1)
        for chunk in reader.read_changes(table):
            records = chunk.records.select(
                ["_cdc_commit_lsn", "_cdc_end_lsn", "_cdc_xid", "_cdc_position", "_cdc_op", "new", "old"]
            )
            for r in records.to_pylist():
                order = (r["_cdc_commit_lsn"], r["_cdc_position"])
                assert order > previous, f"{table}: change records out of order: {previous} then {order}"
                previous = order
                op, new, old = r["_cdc_op"], r["new"], r["old"]
                if op != "snapshot":
                    xid = r["_cdc_xid"]
                    assert xid in end_of, (
                        f"{table}: a change of transaction {xid}, which is not in the transactions log"
                    )
                    assert r["_cdc_end_lsn"] == end_of[xid], f"{table}: change of {xid} with a different end LSN"
                    per_xid[xid] += 1
                key = "id" if table == EVENTS else "seq"
                if op in ("insert", "snapshot"):
                    assert new[key] not in rows or op == "snapshot", f"{table}: insert of an existing key {new[key]}"
                    rows[new[key]] = new
                elif op == "update":
                    if old is not None:
                        rows.pop(old[key], None)
                    rows[new[key]] = new
                elif op == "delete":
                    assert old[key] in rows, f"{table}: delete of a missing key {old[key]}"
                    del rows[old[key]]
                else:
                    raise AssertionError(f"{table}: unexpected change record {op}")
                if table == LEDGER and op == "insert":
                    assert by_xid[r["_cdc_xid"]].seq == new["seq"] and new["xid"] == r["_cdc_xid"], (
                        f"ledger row {new} arrived with transaction {r['_cdc_xid']}"
                    )
        replayed[table] = rows
    wrong = [(x, per_xid[x], by_xid[x].changes) for x in xids if per_xid[x] != by_xid[x].changes]
    assert not wrong, f"transactions whose change records are not whole (xid, records, committed): {wrong[:10]}"
    verified.changes = sum(per_xid.values())

    # Replaying the log gives the source's tables.
    with psycopg.connect(dsn, autocommit=True) as conn:
        for table, sql, columns in (
            (EVENTS, "SELECT id, seq, payload, version FROM events", ("id", "seq", "payload", "version")),
            (LEDGER, "SELECT seq, xid, changes FROM ledger", ("seq", "xid", "changes")),
        ):
            source = {row[0]: dict(zip(columns, row)) for row in conn.execute(sql).fetchall()}
            log = replayed[table]
            assert log.keys() == source.keys(), (
                f"{table}: replayed keys differ from the source: only in the log {sorted(log.keys() - source.keys())[:10]},"
                f" only in the source {sorted(source.keys() - log.keys())[:10]}"
            )
            different = [k for k in source if source[k] != log[k]]
            assert not different, f"{table}: rows differ, e.g. {[(source[k], log[k]) for k in different[:3]]}"
            verified.rows[table] = len(source)
        (confirmed,) = conn.execute(
            "SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
    assert confirmed == checkpoint.lsn, (
        f"the slot confirmed {format_lsn(confirmed)}, the checkpoint is {format_lsn(checkpoint.lsn)}"
    )

    # Logical decoding messages: each exactly once; transactional ones with their transaction.
    messages = reader.messages()
    rows = messages.to_pylist() if messages.num_rows else []
    transactional = [m for m in rows if m["transactional"]]
    plain = [m for m in rows if not m["transactional"]]
    got = Counter(int(m["content"]) for m in transactional)
    assert all(n == 1 for n in got.values()), (
        f"transactional messages logged twice: {[s for s, n in got.items() if n > 1][:10]}"
    )
    assert set(got) == set(workload.transactional_messages), (
        f"transactional messages: missing {sorted(set(workload.transactional_messages) - set(got))[:10]},"
        f" unexpected {sorted(set(got) - set(workload.transactional_messages))[:10]}"
    )
    for m in transactional:
        assert by_xid[m["xid"]].seq == int(m["content"]) and m["end_lsn"] == end_of[m["xid"]], m
    got_plain = Counter(int(m["content"]) for m in plain)
    assert all(n == 1 for n in got_plain.values()), (
        f"non-transactional messages logged twice: {[s for s, n in got_plain.items() if n > 1][:10]}"
    )
    assert sorted(got_plain) == sorted(workload.plain_messages), (
        f"non-transactional messages: missing {sorted(set(workload.plain_messages) - set(got_plain))[:10]},"
        f" unexpected {sorted(set(got_plain) - set(workload.plain_messages))[:10]}"
    )
    lsns = [m["lsn"] for m in plain]
    assert lsns == sorted(lsns), "non-transactional messages are not in LSN order"
    verified.messages = len(rows)

    # No segment left that the checkpoint does not cover, and nothing for remove_stale to do.
    state = log_state(root, confirmed)
    assert not state.orphans, f"segments not covered by the checkpoint remain: {state.orphans[:10]}"
    before = log_files(root)
    reader.remove_stale()
    assert log_files(root) == before, "remove_stale still found files to remove after the final drain"
    verified.litter = state.litter
    return verified


def assert_no_litter(verified: Verified) -> None:
    """No file in the change log but the checkpoint and covered segments (checked last, so that a
    test reports its other findings first)."""
    assert not verified.litter, (
        f"files that are neither the checkpoint nor segments remain after the final drain: {verified.litter[:10]}"
        " (a drain killed inside LogStore.replace leaves its temporary file; no later drain removes it)"
    )


def kill(process: subprocess.Popen[str]) -> tuple[bool, int, str, str]:
    """SIGKILL ``process`` if it is still running; ``(killed, exit code, stdout, stderr)``."""
    alive = process.poll() is None
    if alive:
        os.kill(process.pid, signal.SIGKILL)  # not reaped yet, so the pid is still this process
    out, err = process.communicate(timeout=60)
    return alive and process.returncode == -signal.SIGKILL, process.returncode, out, err


# A drain that SIGKILLs itself inside LogStore.replace, after the temporary checkpoint file is
# written and before it is renamed over the checkpoint (a moment random kills sometimes hit).
_KILL_IN_REPLACE = """
import os, signal, sys
real_replace, passes = os.replace, [0]
def replace(source, target, *args, **kwargs):
    if str(target).endswith("/_checkpoint.json"):
        passes[0] += 1
        if passes[0] == int(sys.argv[2]):
            os.kill(os.getpid(), signal.SIGKILL)
    return real_replace(source, target, *args, **kwargs)
os.replace = replace
from cdc_assets.cli import run
run(["drain", "-c", sys.argv[1]])
"""


def run_drain_killed_in_checkpoint_replace(config: Path, dsn: str, n: int) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _KILL_IN_REPLACE, str(config), str(n)],
        check=False,
        env=_env(dsn, None),
        cwd=config.parent,
        capture_output=True,
        text=True,
        timeout=180,
    )
