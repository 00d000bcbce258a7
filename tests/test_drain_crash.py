"""Crash tests of the drain: ≥ 24 kill points (50 on demand), 0 lost, 0 duplicated, order kept (docs/architecture.md, "Invariants").

The drain runs as the real command (``python -m cdc_assets drain``) in a subprocess and dies by a
real SIGKILL: at the fault points of ``cdc_assets/faults.py`` (``CDC_ASSETS_FAULT=<point>:<n>``)
and at random moments while it holds the drain lock. A single-connection writer commits
transactions the whole time, so its own order is the commit order, and each transaction carries
its xid. At the end the change log must hold every committed transaction exactly once, in commit
order, whole, and nothing else (invariants 1-4); replaying it must give the source's tables; the
slot must sit at the checkpoint and no file outside the checkpoint may remain.

``CDC_CRASH_SEED`` fixes the random choices (the seed is printed); ``CDC_CRASH_KILLS`` sets the
main test's kill quota (default 24; the large variant: 50), which it keeps going until it
reaches — bounded by ``CDC_CRASH_DEADLINE`` seconds, past which it fails and says how far it got.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter
from pathlib import Path
from typing import Any

import psutil
import pytest

from cdc_assets.changelog.store import LogStore
from tests.support.bucket import Bucket
from tests.support.crash import (
    BATCH_FILES,
    SCHEMA_SQL,
    DrainMonitor,
    LedgerWorkload,
    LogState,
    LogTracker,
    WriterThread,
    assert_no_litter,
    describe,
    drain_to_end,
    drained_numbers,
    kill,
    log_state,
    run_cli,
    run_drain_killed_in_checkpoint_replace,
    start_drain,
    verify_log,
    write_ledger_config,
)
from tests.support.pipeline import wait_until

FAULT_POINTS = ("after-segments", "after-checkpoint", "after-advance", "mid-batch")
BATCH_CHANGES = 50
WRITER_RATE = 30.0  # transactions per second all along (bursts on top build a backlog quickly)
MAX_BACKLOG = 1000  # past this many undrained transactions, a catch-up drain runs to its end
MAX_DELAY = 1.5  # seconds: the longest random delay before a kill
STARTUP_S = 0.3  # seconds: a drain's start after taking its lock (its peek's receiving process starts)
KILL_QUOTA = 24  # kills of a running drain, by default: 3 at each fault point, 12 at random moments
BUCKET_KILL_QUOTA = 5  # with the change log in a bucket: 1 at each fault point, then a random one
MIN_LANDED_IN_BATCH = 3  # random kills that left a batch's segments without their checkpoint
DEADLINE_S = 1500.0  # the whole test; the quota takes ~1 minute on a quiet 2-core machine
VERBOSE = bool(os.environ.get("CDC_CRASH_VERBOSE"))


def _setup(pg, tmp_path: Path, **config: Any) -> tuple[Path, str]:
    """The schema, ``cdc.yaml`` (``config``: :func:`write_ledger_config`'s options) and setup."""
    with pg.connect() as conn:
        for sql in SCHEMA_SQL:
            conn.execute(sql)
    slot = f"crash_{pg.name}".lower()
    path = write_ledger_config(tmp_path, slot, batch_changes=BATCH_CHANGES, **config)
    result = run_cli(path, pg.dsn, "setup")
    assert result.returncode == 0, describe(result)
    return path, slot


def _expected_state(point: str, state: LogState) -> None:
    """What a kill at ``point`` leaves, by the drain's order: segments, checkpoint, advance."""
    if point == "after-segments":
        assert state.orphans, "killed after the segments were written, but there are no uncovered segments"
        assert all(f"{state.checkpoint_lsn:016X}-" in name for name in state.orphans), state.orphans
        assert state.confirmed_flush == state.checkpoint_lsn
    elif point == "after-checkpoint":
        assert not state.orphans, state.orphans
        assert state.confirmed_flush < state.checkpoint_lsn, "killed before the advance, yet the slot is advanced"
        assert state.confirmed_flush == state.last_batch_start, "the slot is not at the previous checkpoint"
    else:  # after-advance, mid-batch
        assert not state.orphans, state.orphans
        assert state.confirmed_flush == state.checkpoint_lsn
    assert not [name for name in state.litter if not name.startswith("_checkpoint.json.tmp-")], state.litter


def _kill_quota(kills: int, at_least: int = 3) -> dict[str, int]:
    """Kills of a running drain each kind must reach: ``at_least`` (or a twelfth of the kills) at
    every fault point, the rest random."""
    per_point = max(at_least, round(kills / 12))
    return dict.fromkeys(FAULT_POINTS, per_point) | {"random": max(1, kills - per_point * len(FAULT_POINTS))}


def _next_kill(kills: Counter[str], landed: Counter[str], quota: dict[str, int], rng: random.Random) -> str | None:
    """The kind of the next kill: one still short of its quota, drawn by how short; None when all are met."""
    short = {point: quota[point] - kills[point] for point in quota if kills[point] < quota[point]}
    if not short and landed[BATCH_FILES] < MIN_LANDED_IN_BATCH:
        short = {"random": 1}
    if not short:
        return None
    return rng.choices(list(short), weights=list(short.values()))[0]


@pytest.mark.slow
def test_many_kills_lose_and_duplicate_nothing(pg, tmp_path: Path) -> None:
    """Kills go on until every quota has landed (a drain that finishes first is a miss, not a
    kill), so the count never depends on the machine's speed; a deadline fails loudly."""
    config, slot = _setup(pg, tmp_path)
    _kill_until_quota(pg, config, slot, tmp_path / "changelog", int(os.environ.get("CDC_CRASH_KILLS", str(KILL_QUOTA))))


@pytest.mark.slow
def test_kills_with_the_change_log_in_a_bucket(
    pg, bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same with the change log in an S3 bucket (a real S3 API server): no rename there — the
    checkpoint is replaced by one PUT — and nothing is lost or duplicated either."""
    for variable, value in bucket.environ().items():
        monkeypatch.setenv(variable, value)
    changelog = f"{bucket.uri}/changelog"
    config, slot = _setup(pg, tmp_path, changelog=changelog, storage=bucket.section())
    _kill_until_quota(pg, config, slot, LogStore(changelog, bucket.storage), BUCKET_KILL_QUOTA, at_least=1)


def _kill_until_quota(pg, config: Path, slot: str, root: Path | LogStore, kill_quota: int, at_least: int = 3) -> None:
    """Drains killed until ``kill_quota`` kills have landed (spread over the fault points and random
    moments), then drained to the end: the log must hold every committed transaction once, in order."""
    started = time.monotonic()
    seed = int(os.environ.get("CDC_CRASH_SEED", random.randrange(1 << 30)))
    quota = _kill_quota(kill_quota, at_least)
    deadline = started + float(os.environ.get("CDC_CRASH_DEADLINE", str(DEADLINE_S)))
    print(f"\n[crash] seed {seed} (CDC_CRASH_SEED), quota {quota}", flush=True)
    rng = random.Random(seed)
    monitor = DrainMonitor(pg.dsn)
    workload = LedgerWorkload(pg.dsn, seed, large_share=0.02)
    writer = WriterThread(workload, WRITER_RATE)
    tracker = LogTracker(root)

    kills: Counter[str] = Counter()  # real kills of a running drain, by point
    misses: Counter[str] = Counter()  # the drain finished before the kill
    landed: Counter[str] = Counter()  # random kills, by what they left behind
    completed = 0
    cycles = 0
    spent: Counter[str] = Counter()  # seconds, by phase
    known_litter: set[str] = set()
    rate_estimate = 400.0  # transactions per second a drain gets through; refined from completed drains

    def backlog() -> int:
        return workload.count - len(tracker.seen)

    def wait_backlog(n: int) -> None:
        if backlog() < n:
            writer.burst(n - backlog())
        wait_until(lambda: writer.check() or backlog() >= n, 60, f"a backlog of {n} transactions")

    writer.start()
    try:
        while (point := _next_kill(kills, landed, quota, rng)) is not None:
            assert time.monotonic() < deadline, (
                f"seed {seed}: the kill quota {quota} was not reached in {deadline - started:.0f} s"
                f" (CDC_CRASH_DEADLINE): kills {dict(kills)}, misses {dict(misses)}, random kills landed {dict(landed)}"
            )
            cycles += 1
            phase = time.monotonic()
            if cycles % 10 == 0:  # every tenth cycle a drain that runs to its end
                wait_backlog(100)
                result = drain_to_end(config, pg.dsn, slot)
                numbers = drained_numbers(result.stdout)
                if VERBOSE:
                    print(f"[crash] {time.monotonic() - started:6.1f} s complete: {numbers}", flush=True)
                if numbers and numbers[0] > 100 and numbers[1] > 0:
                    rate_estimate = numbers[0] / numbers[1]
                completed += 1
                state = log_state(root, monitor.confirmed_flush(slot))
                assert not state.orphans and state.confirmed_flush == state.checkpoint_lsn, state
                tracker.update(workload.committed)
                spent["drains run to the end"] += time.monotonic() - phase
                continue
            if backlog() > MAX_BACKLOG:
                drain_to_end(config, pg.dsn, slot)  # keep drains short enough to kill mid-run
                completed += 1
                tracker.update(workload.committed)
            n = 0
            if point == "random":
                wait_backlog(rng.randint(80, 300))
                process = start_drain(config, pg.dsn)
                wait_until(
                    lambda p=process: p.poll() is not None or monitor.lock_granted(),
                    60,
                    "the drain to take its lock",
                    0.01,
                )
                # The experiment: a random moment within the drain's expected run time.
                time.sleep(rng.uniform(0.0, min(MAX_DELAY, 1.1 * (STARTUP_S + backlog() / rate_estimate))))
                killed, code, out, err = kill(process)
            else:
                n = rng.randint(1, 12)
                wait_backlog(12 * n + 100)  # enough work for the drain to pass the point n times
                process = start_drain(config, pg.dsn, fault=f"{point}:{n}")
                out, err = process.communicate(timeout=120)
                code = process.returncode
                killed = code == -9
            assert code in (0, -9), f"drain ({point}:{n}) failed\n" + describe((code, out, err))
            monitor.wait_quiet()
            state = log_state(root, monitor.confirmed_flush(slot), known_litter)
            known_litter.update(state.litter)
            assert state.confirmed_flush <= state.checkpoint_lsn, (
                f"invariant 2: after a kill ({point}) the slot confirmed {state.confirmed_flush:X}, past the"
                f" checkpoint {state.checkpoint_lsn:X}"
            )
            if killed:
                kills[point] += 1
                if point == "random":
                    landed[state.where] += 1
                else:
                    _expected_state(point, state)
            else:
                misses[point] += 1
            tracker.update(workload.committed)
            spent["kill cycles"] += time.monotonic() - phase
            if VERBOSE:
                print(
                    f"[crash] {time.monotonic() - started:6.1f} s {point}:{n} killed={killed} code={code}"
                    f" {state.where!r} log={len(tracker.seen)} writer={workload.count}",
                    flush=True,
                )
        # A last drain while the writer still runs, then stop it and drain to the end.
        drain_to_end(config, pg.dsn, slot)
    finally:
        writer.stop()
        monitor.close()
    drain_to_end(config, pg.dsn, slot)
    tracker.update(workload.committed)
    checking = time.monotonic()
    verified = verify_log(root, pg.dsn, slot, workload)
    checking = time.monotonic() - checking
    workload.close()

    total = sum(kills.values())
    print(
        f"\n[crash] seed {seed}: {total} SIGKILLs of a running drain ({sum(misses.values())} drains finished first:"
        f" {dict(misses)}), {completed + 2} drains run to the end"
        f"\n[crash] kills by point: {dict(sorted(kills.items()))}"
        f"\n[crash] random kills landed: {dict(landed)}"
        f"\n[crash] verified {verified.transactions} transactions"
        f" ({sum(c.large for c in workload.committed)} large), {verified.changes} change records,"
        f" {verified.messages} messages, rows {verified.rows}; {time.monotonic() - started:.0f} s"
        f" ({', '.join(f'{k} {v:.0f} s' for k, v in spent.items())}, final check {checking:.0f} s)"
    )
    assert total >= sum(quota.values()), f"only {total} kills hit a running drain (seed {seed})"
    assert all(kills[point] >= quota[point] for point in quota), (dict(kills), quota)
    assert landed[BATCH_FILES] >= MIN_LANDED_IN_BATCH, f"too few random kills landed inside a batch: {dict(landed)}"
    assert_no_litter(verified)


# -- one kill at each fault point, and what the next drain does --------------------------------


def _killed_at(pg, tmp_path: Path, point: str, n: int, transactions: int = 300):
    """Set up, commit ``transactions``, run a drain that dies at the n-th pass of ``point``."""
    config, slot = _setup(pg, tmp_path)
    workload = LedgerWorkload(pg.dsn, seed=n)
    for _ in range(transactions):
        workload.transact()
    result = run_cli(config, pg.dsn, "drain", fault=f"{point}:{n}")
    assert result.returncode == -9, f"the drain did not die at {point}:{n}\n" + describe(result)
    monitor = DrainMonitor(pg.dsn)
    monitor.wait_quiet()
    return config, slot, workload, monitor


def _logged_xids(root: Path) -> list[int]:
    from cdc_assets.changelog.reader import ChangeLogReader

    txns = ChangeLogReader(str(root)).transactions()
    return txns.column("xid").to_pylist() if txns.num_rows else []


def _finish(pg, config: Path, slot: str, workload: LedgerWorkload, root: Path) -> None:
    drain_to_end(config, pg.dsn, slot)
    verified = verify_log(root, pg.dsn, slot, workload)
    assert verified.transactions == workload.count
    workload.close()
    assert_no_litter(verified)


@pytest.mark.slow
def test_kill_after_segments_orphans_are_removed_not_read(pg, tmp_path: Path) -> None:
    config, slot, workload, monitor = _killed_at(pg, tmp_path, "after-segments", 3)
    root = tmp_path / "changelog"
    state = log_state(root, monitor.confirmed_flush(slot))
    _expected_state("after-segments", state)
    batch = f"{state.checkpoint_lsn:016X}"
    assert f"transactions/{batch}-0000.parquet" in state.orphans
    # Readers see only what the checkpoint covers: two whole batches, a prefix of the commits.
    logged = _logged_xids(root)
    assert 0 < len(logged) < workload.count
    assert logged == [c.xid for c in workload.committed[: len(logged)]]
    # Plant copies of the orphans under part numbers the next batch will not write: were they
    # not removed before that batch, the checkpoint would make them valid and duplicate it.
    decoys = []
    for name in state.orphans:
        decoy = name.replace(f"{batch}-0000", f"{batch}-0007")
        (root / decoy).write_bytes((root / name).read_bytes())
        decoys.append(decoy)
    monitor.close()
    _finish(pg, config, slot, workload, root)
    assert not [d for d in decoys if (root / d).exists()], "orphan segments survived the next drain"


@pytest.mark.slow
def test_kill_after_checkpoint_next_drain_advances_the_slot_first(pg, tmp_path: Path) -> None:
    config, slot, workload, monitor = _killed_at(pg, tmp_path, "after-checkpoint", 2)
    root = tmp_path / "changelog"
    state = log_state(root, monitor.confirmed_flush(slot))
    assert not state.orphans and not state.litter
    assert state.confirmed_flush < state.checkpoint_lsn, "the slot should be behind the checkpoint"
    logged = _logged_xids(root)
    assert logged == [c.xid for c in workload.committed[: len(logged)]] and logged
    # The next drain reconciles before its first peek: kill it there and look at the slot.
    result = run_cli(config, pg.dsn, "drain", fault="mid-batch:1")
    assert result.returncode == -9, describe(result)
    monitor.wait_quiet()
    after = log_state(root, monitor.confirmed_flush(slot))
    assert after.checkpoint_lsn == state.checkpoint_lsn
    assert after.confirmed_flush == state.checkpoint_lsn, (
        "the next drain did not advance the slot to the checkpoint first"
    )
    assert _logged_xids(root) == logged
    monitor.close()
    _finish(pg, config, slot, workload, root)


@pytest.mark.slow
def test_kill_after_advance_next_drain_continues(pg, tmp_path: Path) -> None:
    config, slot, workload, monitor = _killed_at(pg, tmp_path, "after-advance", 4)
    root = tmp_path / "changelog"
    state = log_state(root, monitor.confirmed_flush(slot))
    _expected_state("after-advance", state)
    logged = _logged_xids(root)
    assert 0 < len(logged) < workload.count
    assert logged == [c.xid for c in workload.committed[: len(logged)]]
    monitor.close()
    _finish(pg, config, slot, workload, root)


@pytest.mark.slow
def test_kill_mid_batch_leaves_the_last_checkpoint(pg, tmp_path: Path) -> None:
    # Killed while assembling the 25th block the stream handed over: a block is what arrived at
    # once, cut where a batch of 50 messages ends, so the 300 transactions make many more.
    config, slot, workload, monitor = _killed_at(pg, tmp_path, "mid-batch", 25)
    root = tmp_path / "changelog"
    state = log_state(root, monitor.confirmed_flush(slot))
    _expected_state("mid-batch", state)
    logged = _logged_xids(root)
    assert 0 < len(logged) < workload.count
    assert logged == [c.xid for c in workload.committed[: len(logged)]]
    # Whole batches went through before it, the checkpoint at the end of the last one.
    batches = {name.split("/")[-1][:16] for name in os.listdir(root / "transactions")}
    assert 1 <= len(batches) < 25, sorted(batches)
    monitor.close()
    _finish(pg, config, slot, workload, root)


@pytest.mark.slow
def test_kill_while_replacing_the_checkpoint_leaves_no_stale_file(pg, tmp_path: Path) -> None:
    """A kill between writing ``_checkpoint.json.tmp-<pid>`` and renaming it over the checkpoint
    (random kills land there now and then) must not leave that file behind for good."""
    config, slot = _setup(pg, tmp_path)
    root = tmp_path / "changelog"
    workload = LedgerWorkload(pg.dsn, seed=3)
    for _ in range(300):
        workload.transact()
    result = run_drain_killed_in_checkpoint_replace(config, pg.dsn, 3)
    assert result.returncode == -9, describe(result)
    monitor = DrainMonitor(pg.dsn)
    monitor.wait_quiet()
    state = log_state(root, monitor.confirmed_flush(slot))
    monitor.close()
    # The old checkpoint stands (the rename is atomic); the batch is uncovered; the slot is at the checkpoint.
    assert state.orphans and state.confirmed_flush == state.checkpoint_lsn, state
    assert [name for name in state.litter if name.startswith("_checkpoint.json.tmp-")], state.litter
    _finish(pg, config, slot, workload, root)


# -- a drain that follows the stream ----------------------------------------------------------

FOLLOW_KILLS = 16  # kills of following drains: 3 at each fault point, the rest at random moments
COMMIT_SECONDS = 0.3  # drain.commit_seconds of the following drains: many durable batches per run


@pytest.mark.slow
def test_kills_while_following_lose_and_duplicate_nothing(pg, tmp_path: Path) -> None:
    """Drains that follow the stream (``--follow``) while a writer commits, killed at random
    moments and at the fault points — after a durable batch's segments, between its checkpoint
    and its feedback to the server, after the feedback — all while following: the slot never
    passes the checkpoint, and the log holds every transaction once, in order."""
    config, slot = _setup(pg, tmp_path, commit_seconds=COMMIT_SECONDS)
    root = tmp_path / "changelog"
    seed = int(os.environ.get("CDC_CRASH_SEED", random.randrange(1 << 30)))
    print(f"\n[crash] following, seed {seed} (CDC_CRASH_SEED)", flush=True)
    rng = random.Random(seed)
    monitor = DrainMonitor(pg.dsn)
    workload = LedgerWorkload(pg.dsn, seed, large_share=0.02)
    writer = WriterThread(workload, WRITER_RATE)
    points = [p for p in FAULT_POINTS if p != "mid-batch"] * 3
    points += ["random"] * (FOLLOW_KILLS - len(points))
    rng.shuffle(points)
    kills: Counter[str] = Counter()
    writer.start()
    try:
        for point in points:
            if point == "random":
                before = monitor.confirmed_flush(slot)
                process = start_drain(config, pg.dsn, None, "--follow", "60")
                # Past its first batch: it follows, and durable batches go by every COMMIT_SECONDS.
                wait_until(
                    lambda p=process, b=before: p.poll() is not None or monitor.confirmed_flush(slot) > b, 60, "a batch"
                )
                time.sleep(rng.uniform(0.5, 3.0))
                killed, code, out, err = kill(process)
            else:
                # The n-th durable batch of the run: past the catch-up, while following.
                n = rng.randint(8, 20)
                process = start_drain(config, pg.dsn, f"{point}:{n}", "--follow", "60")
                out, err = process.communicate(timeout=120)
                code = process.returncode
                killed = code == -9
            assert killed, f"the following drain ({point}) was not killed\n" + describe((code, out, err))
            kills[point] += 1
            monitor.wait_quiet()
            state = log_state(root, monitor.confirmed_flush(slot))
            assert state.confirmed_flush <= state.checkpoint_lsn, (
                f"invariant 2: after a kill ({point}) the slot confirmed {state.confirmed_flush:X}, past the"
                f" checkpoint {state.checkpoint_lsn:X}"
            )
            if point != "random":
                _expected_state(point, state)
    finally:
        writer.stop()
        monitor.close()
    print(f"[crash] following drains killed: {dict(kills)}", flush=True)
    drain_to_end(config, pg.dsn, slot)
    verified = verify_log(root, pg.dsn, slot, workload)
    assert verified.transactions == workload.count
    workload.close()
    assert sum(kills.values()) == FOLLOW_KILLS
    assert_no_litter(verified)


@pytest.mark.slow
def test_a_stalled_drain_hit_by_wal_sender_timeout_reconnects_and_loses_nothing(pg, tmp_path: Path) -> None:
    """A following drain stopped (SIGSTOP, with its receiving process) for longer than
    ``wal_sender_timeout`` while a writer commits: the server ends its walsender; resumed, the drain
    reconnects from its checkpoint within the same run, follows on, and is then killed. Nothing is
    lost or duplicated."""
    config, slot = _setup(pg, tmp_path, commit_seconds=COMMIT_SECONDS)
    root = tmp_path / "changelog"
    monitor = DrainMonitor(pg.dsn)
    workload = LedgerWorkload(pg.dsn, 7, large_share=0.02)
    writer = WriterThread(workload, WRITER_RATE)
    pg.execute("ALTER SYSTEM SET wal_sender_timeout = '2s'")
    pg.execute("SELECT pg_reload_conf()")
    writer.start()
    try:
        before = monitor.confirmed_flush(slot)
        process = start_drain(config, pg.dsn, None, "--follow", "120")
        wait_until(lambda: process.poll() is not None or monitor.confirmed_flush(slot) > before, 60, "a first batch")
        walsender = _walsender_pid(pg, slot)
        assert walsender is not None
        stopped = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
        for each in stopped:
            each.suspend()
        try:  # the server gives up on the silent client after wal_sender_timeout
            wait_until(lambda: _walsender_pid(pg, slot) != walsender, 30, "the walsender to time out")
        finally:
            for each in stopped:
                each.resume()
        # Resumed: a new walsender streams to the same run, and its batches are confirmed.
        wait_until(lambda: process.poll() is not None or _walsender_pid(pg, slot) is not None, 60, "a reconnection")
        confirmed = monitor.confirmed_flush(slot)
        wait_until(lambda: process.poll() is not None or monitor.confirmed_flush(slot) > confirmed, 60, "a batch")
        killed, code, out, err = kill(process)
        assert killed, describe((code, out, err))
        assert "reconnecting" in err, err
        monitor.wait_quiet()
        state = log_state(root, monitor.confirmed_flush(slot))
        assert state.confirmed_flush <= state.checkpoint_lsn
    finally:
        writer.stop()
        monitor.close()
        pg.execute("ALTER SYSTEM RESET wal_sender_timeout")
        pg.execute("SELECT pg_reload_conf()")
    drain_to_end(config, pg.dsn, slot)
    verified = verify_log(root, pg.dsn, slot, workload)
    assert verified.transactions == workload.count
    workload.close()
    assert_no_litter(verified)


def _walsender_pid(pg, slot: str) -> int | None:
    (row,) = pg.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return row[0]
