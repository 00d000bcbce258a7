"""Consistent points: which Delta versions of every table belong together (docs/architecture.md,
"Consistent points")."""

from __future__ import annotations

import itertools
import json
import random
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest
from deltalake import DeltaTable as RustDeltaTable
from deltalake import QueryBuilder

from cdc_assets.apply import consistent_points
from cdc_assets.apply.consistent_points import (
    ConsistentPoint,
    PointGoneError,
    PointLog,
    point_files_since,
    point_frames,
    point_query,
    point_tables,
    publish_point,
)
from cdc_assets.apply.maintenance import maintain_tables, vacuum_hours
from cdc_assets.apply.runner import apply_tables
from cdc_assets.apply.target import delta_table_exists
from cdc_assets.config import load_config
from cdc_assets.lsn import format_lsn
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.database import Database
from tests.support.mirror import Mirror

TABLES = ("public.ka", "public.kb")


def _mirror(pg: Database, spark: Any, tmp_path: Path) -> Mirror:
    mirror = Mirror(pg, tmp_path / "mirror", {t: {} for t in TABLES}, spark)
    mirror.sql("CREATE TABLE ka (id int PRIMARY KEY, v text)", "CREATE TABLE kb (id int PRIMARY KEY, v text)")
    mirror.setup()
    return mirror


def _contents(spark: Any, mirror: Mirror, point: ConsistentPoint) -> dict[str, set[tuple[int, str]]]:
    """Each table of ``point`` read with Spark and with delta-rs (asserted equal)."""
    frames = point_frames(spark, mirror.config(), point)
    read = {name: {(r["id"], r["v"]) for r in frame.select("id", "v").collect()} for name, frame in frames.items()}
    query = point_query(mirror.config(), point)
    rust = {name: {(r["id"], r["v"]) for r in _rows(query, name, "id, v")} for name in frames}
    assert read == rust
    return read


def _rows(query: QueryBuilder, table: str, columns: str) -> list[dict[str, Any]]:
    """``table`` of a point read with delta-rs (its query engine, as :func:`point_query` registers it)."""
    batches = query.execute(f"SELECT {columns} FROM {table.replace('.', '_')}")
    return pa.RecordBatchReader.from_stream(batches).read_all().to_pylist()


@pytest.mark.slow
def test_a_point_is_published_only_for_a_position_every_table_holds_whole(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    """A table without changes since its merge holds later positions too; a table merged past a
    position counts through an older version; a table whose merge is behind holds no point."""
    mirror = _mirror(pg, spark, tmp_path)
    log = PointLog(mirror.config())
    mirror.sql("INSERT INTO ka VALUES (1, 'a1')", "INSERT INTO kb VALUES (1, 'b1')")
    mirror.sync()
    first = publish_point(mirror.config())
    assert isinstance(first, ConsistentPoint), first
    assert first.lsn == mirror.checkpoint_lsn() and log.latest() == first
    assert first.tables == {t: mirror.version(t) for t in TABLES}
    assert _contents(spark, mirror, first) == {"public.ka": {(1, "a1")}, "public.kb": {(1, "b1")}}
    assert publish_point(mirror.config()) == f"no position past {format_lsn(first.lsn)} to try"

    # kb merged at K2; then ka changes alone and is merged at K3: kb (nothing since K2) holds K3.
    mirror.sql("UPDATE ka SET v = 'a2' WHERE id = 1", "INSERT INTO kb VALUES (2, 'b2')")
    mirror.drain()
    mirror.apply(["public.kb"])
    kb_at_k2 = mirror.version("public.kb")
    mirror.sql("INSERT INTO ka VALUES (3, 'a3')")
    mirror.drain()
    mirror.apply(["public.ka"])
    second = publish_point(mirror.config())
    assert isinstance(second, ConsistentPoint), second
    assert second.lsn == mirror.checkpoint_lsn() == mirror.applied("public.ka") > mirror.applied("public.kb")
    assert second.tables == {"public.ka": mirror.version("public.ka"), "public.kb": kb_at_k2}
    assert _contents(spark, mirror, second) == {
        "public.ka": {(1, "a2"), (3, "a3")},
        "public.kb": {(1, "b1"), (2, "b2")},
    }

    # Both change, only ka is merged: kb holds none of the new position — no point.
    mirror.sql("DELETE FROM ka WHERE id = 1", "UPDATE kb SET v = 'b4' WHERE id = 1")
    mirror.drain()
    mirror.apply(["public.ka"])
    ka_at_k4 = mirror.version("public.ka")
    refused = publish_point(mirror.config())
    assert isinstance(refused, str) and "public.kb's merge has not brought its changes up to" in refused, refused
    assert log.latest() == second

    # ka changes again and is merged at K5, kb catches up to K5; then ka moves on to K6 alone:
    # the newest point every table holds is K5, ka through its older version.
    mirror.sql("INSERT INTO ka VALUES (5, 'a5')", "INSERT INTO kb VALUES (5, 'b5')")
    mirror.sync()
    k5 = {t: mirror.version(t) for t in TABLES}
    assert mirror.version("public.ka") > ka_at_k4
    mirror.sql("INSERT INTO ka VALUES (6, 'a6')", "INSERT INTO kb VALUES (6, 'b6')")
    mirror.drain()
    mirror.apply(["public.ka"])
    third = publish_point(mirror.config())
    assert isinstance(third, ConsistentPoint), third
    assert third.tables == k5 and third.lsn == mirror.applied("public.kb") < mirror.applied("public.ka")
    assert _contents(spark, mirror, third) == {
        "public.ka": {(3, "a3"), (5, "a5")},
        "public.kb": {(1, "b4"), (2, "b2"), (5, "b5")},
    }
    assert [p.lsn for p in log.points()] == [first.lsn, second.lsn, third.lsn]

    # Readers: the latest point, and the one at or before an LSN or a time; the command's JSON.
    assert log.at(lsn=third.lsn - 1) == second and log.at(lsn=first.lsn) == first and log.at(lsn=first.lsn - 1) is None
    assert second.commit_time is not None and log.at(when=second.commit_time) == second
    done = mirror.cli("consistent-point", "--json")
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == third.to_json()
    assert json.loads(done.stdout)["lsn"] == format_lsn(third.lsn)
    done = mirror.cli("consistent-point", "--at", format_lsn(second.lsn), "--json")
    assert done.returncode == 0 and json.loads(done.stdout) == second.to_json(), done.stderr


# -- a bank under load: points are the only reads that always balance --------------------------------

ACCOUNTS, OPENING = 20, 1_000
KILLS = 2  # SIGKILLs of `apply --consistent` that landed before it ended
BANK = ("public.accounts", "public.ledger", "public.side_a", "public.side_b")


class Transfers:
    """A writer moving money between accounts, each transfer with its two ledger lines, in one
    transaction; now and then the side tables change in the same transaction."""

    def __init__(self, db: Database, seed: int) -> None:
        self._conn = db.connect()
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="transfers", daemon=True)
        self.count = 0
        self.error: BaseException | None = None

    def __enter__(self) -> Transfers:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        self._conn.close()
        assert self.error is None, self.error

    def _run(self) -> None:
        try:
            while not self._stop.wait(0.05):
                a, b = self._rng.sample(range(1, ACCOUNTS + 1), 2)
                amount = self._rng.randint(1, 50)
                with self._conn.transaction():
                    self._conn.execute("UPDATE accounts SET balance = balance - %s WHERE id = %s", (amount, a))
                    self._conn.execute("UPDATE accounts SET balance = balance + %s WHERE id = %s", (amount, b))
                    self._conn.execute(
                        "INSERT INTO ledger (tx, account, amount) VALUES (%s, %s, %s), (%s, %s, %s)",
                        (self.count, a, -amount, self.count, b, amount),
                    )
                    if self._rng.random() < 0.2:
                        self._conn.execute(
                            "INSERT INTO side_a VALUES (%s, 'x') ON CONFLICT (id) DO UPDATE SET v = side_a.v || 'x'",
                            (self._rng.randint(1, 30),),
                        )
                    if self._rng.random() < 0.2:
                        self._conn.execute("UPDATE side_b SET v = v + 1 WHERE id = %s", (self._rng.randint(1, 10),))
                self.count += 1
        except BaseException as error:  # noqa: BLE001 - reported by __exit__
            self.error = error


def _bank_problems(accounts: list[dict[str, Any]], ledger: list[dict[str, Any]]) -> list[str]:
    """What breaks the bank's invariants: the total balance, and each account equal to its opening
    balance plus its ledger lines."""
    balances = {row["id"]: row["balance"] for row in accounts}
    moved: dict[int, int] = {}
    for line in ledger:
        moved[line["account"]] = moved.get(line["account"], 0) + line["amount"]
    problems = []
    if sum(balances.values()) != ACCOUNTS * OPENING:
        problems.append(f"total balance {sum(balances.values())}, not {ACCOUNTS * OPENING}")
    wrong = [a for a, balance in balances.items() if balance != OPENING + moved.get(a, 0)]
    if wrong:
        problems.append(f"{len(wrong)} accounts disagree with their ledger lines (e.g. account {wrong[0]})")
    return problems


@pytest.mark.slow
def test_every_point_balances_under_load_and_kills_while_the_latest_versions_do_not(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    """Transfers commit all along; rounds of a drain, then in turn: every table merged and the
    point published; one table merged alone; ``cdc-assets apply --consistent`` SIGKILLed at a
    random moment (or left to finish). Every point
    published, read with Spark and with delta-rs, balances: the total, and every account against its
    ledger lines; the tables' latest versions, read without a point, do not at least once."""
    rng = random.Random(20261128)
    # own_spark: the command's kill takes its merges down with it (a Spark Connect server would finish them)
    mirror = Mirror(pg, tmp_path / "bank", {t: {} for t in BANK}, spark, own_spark=True)
    mirror.sql(
        "CREATE TABLE accounts (id int PRIMARY KEY, balance bigint NOT NULL)",
        "CREATE TABLE ledger (id bigserial PRIMARY KEY, tx int NOT NULL, account int NOT NULL, amount bigint NOT NULL)",
        "CREATE TABLE side_a (id int PRIMARY KEY, v text)",
        "CREATE TABLE side_b (id int PRIMARY KEY, v int)",
        f"INSERT INTO accounts SELECT g, {OPENING} FROM generate_series(1, {ACCOUNTS}) g",
        "INSERT INTO side_b SELECT g, 0 FROM generate_series(1, 10) g",
    )
    mirror.setup()
    config = mirror.config()
    log = PointLog(config)
    checked: set[int] = set()
    unbalanced_latest = kills = 0

    def check_points() -> None:
        for point in log.points():
            if point.lsn in checked:
                continue
            frames = point_frames(spark, config, point)
            query = point_query(config, point)
            reads = {
                "Spark": [[r.asDict() for r in frames[t].collect()] for t in ("public.accounts", "public.ledger")],
                "delta-rs": [_rows(query, t, "*") for t in ("public.accounts", "public.ledger")],
            }
            for reader, (accounts, ledger) in reads.items():
                problems = _bank_problems(accounts, ledger)
                assert not problems, f"the point at {format_lsn(point.lsn)} read by {reader}: {problems}"
            checked.add(point.lsn)

    deadline = time.monotonic() + 900
    with Transfers(pg, seed=7) as transfers:
        for round_ in itertools.count():
            if kills >= KILLS and len(checked) >= 2 and unbalanced_latest:
                break
            assert time.monotonic() < deadline, f"after {round_} rounds: {kills} kills, {len(checked)} points"
            mirror.drain()
            if round_ % 3 == 0:  # every table to the same checkpoint, then the point (in this process)
                apply_tables(config, spark)
                assert isinstance(publish_point(config), ConsistentPoint)
            elif round_ % 3 == 1:  # one table merged alone: its latest version runs ahead of the other's
                mirror.apply([rng.choice(["public.accounts", "public.ledger"])])
            else:  # the command, SIGKILLed at a random moment of its merges or its point, or not
                kills += _killed_in_its_merges(mirror.popen("apply", "--consistent"), rng)
            if all(delta_table_exists(mirror.path(t)) for t in ("public.accounts", "public.ledger")):
                latest = {t: mirror.delta(t) for t in ("public.accounts", "public.ledger")}
                unbalanced_latest += bool(_bank_problems(latest["public.accounts"], latest["public.ledger"]))
            check_points()
        assert transfers.count > 100
    mirror.drain()
    done = mirror.cli("apply", "--consistent")
    assert done.returncode == 0, done.stderr
    assert "consistent point " in done.stdout, done.stdout
    check_points()
    final = log.latest()
    assert final is not None and final.lsn == mirror.checkpoint_lsn()
    assert _contents_equal_source(spark, mirror, final)
    assert len(checked) >= 3 and unbalanced_latest >= 1  # the loop's end: a point the latest versions missed


def _killed_in_its_merges(running: subprocess.Popen[str], rng: random.Random) -> bool:
    """SIGKILL ``running`` (``apply --consistent``) at a random moment from the first table it
    reports merged — during its other merges or its point — or let it end; whether it was killed.
    (From its start, a kill would mostly land in Spark's start: a small table's merge takes a
    fraction of a second.)"""
    assert running.stdout is not None and running.stderr is not None
    reported = threading.Event()

    def read(stream: Any, says: bool) -> None:  # stdout's first line is the first table's; stderr only drained
        for _ in stream:
            if says:
                reported.set()
        reported.set()

    streams = ((running.stdout, True), (running.stderr, False))
    readers = [threading.Thread(target=read, args=stream, daemon=True) for stream in streams]
    for reader in readers:
        reader.start()
    assert reported.wait(300), "apply --consistent reported nothing in 300 s"
    try:
        running.wait(timeout=rng.uniform(0.0, 1.0))
        killed = False
    except subprocess.TimeoutExpired:
        running.kill()
        killed = True
    running.wait()
    for reader in readers:
        reader.join()
    return killed


def _contents_equal_source(spark: Any, mirror: Mirror, point: ConsistentPoint) -> bool:
    """The point's tables equal the source (nothing writes any more)."""
    frames = point_frames(spark, mirror.config(), point)
    for table, frame in frames.items():
        rows = sorted(tuple(r) for r in frame.drop("_cdc_lsn", "_cdc_commit_time").collect())
        source = sorted(tuple(r) for r in mirror.db.execute(f"SELECT * FROM {table}"))
        assert rows == source, f"{table}: {len(rows)} rows in the point, {len(source)} in the source"
    return True


@pytest.mark.slow
def test_vacuum_keeps_the_latest_point_and_an_older_vacuumed_point_says_it_is_gone(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    mirror = _mirror(pg, spark, tmp_path)
    config = mirror.config()
    mirror.sql("INSERT INTO ka SELECT g, 'a' FROM generate_series(1, 20) g", "INSERT INTO kb VALUES (1, 'b')")
    mirror.sync()
    first = publish_point(config)
    mirror.sql("UPDATE ka SET v = 'a2'", "UPDATE kb SET v = 'b2'")
    mirror.sync()
    latest = publish_point(config)
    assert isinstance(first, ConsistentPoint) and isinstance(latest, ConsistentPoint)
    # ka moves on alone: the latest point reads an older version of ka than its latest.
    mirror.sql("DELETE FROM ka WHERE id > 10")
    mirror.drain()
    mirror.apply(["public.ka"])
    ka = RustDeltaTable(mirror.path("public.ka"))
    (following,) = [c for c in ka.history() if c["version"] == latest.tables["public.ka"] + 1]
    assert point_files_since(config, "public.ka") == following["timestamp"]
    assert point_files_since(config, "public.kb") is None  # the point reads kb's latest version
    # the retention reaches back to that commit, whatever is configured
    day = 24 * 3_600_000
    assert vacuum_hours(168, None, following["timestamp"] + 30 * day) == 168
    assert vacuum_hours(168, following["timestamp"], following["timestamp"] + 30 * day) == 30 * 24 + 1
    assert vacuum_hours(168, following["timestamp"], following["timestamp"] + 2 * day) == 168

    maintained = maintain_tables(config, spark)
    assert all("VACUUM" in " ".join(m.steps) for m in maintained), [m.summary() for m in maintained]
    assert _contents(spark, mirror, latest) == {
        "public.ka": {(i, "a2") for i in range(1, 21)},
        "public.kb": {(1, "b2")},
    }

    # A VACUUM with no retention at all (Delta's check turned off) removes what older versions read:
    # reading the first point says so, and names the table and the version.
    spark.conf.set("spark.databricks.delta.retentionDurationCheck.enabled", "false")
    try:
        spark.sql(f"VACUUM delta.`{mirror.path('public.ka')}` RETAIN 0 HOURS").collect()
    finally:
        spark.conf.unset("spark.databricks.delta.retentionDurationCheck.enabled")
    gone = f"the consistent point at {format_lsn(first.lsn)} can no longer be read: public.ka version"
    with pytest.raises(PointGoneError, match=gone):
        point_tables(config, first)
    with pytest.raises(PointGoneError, match=gone):
        point_frames(spark, config, first)


def test_the_points_table_is_tidied_as_it_grows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A point every few seconds must not leave a file each: past ``TIDY_FILES`` files, the points
    older than the retention go (never the latest) and the rest is rewritten into one file."""
    config = load_config(write_config(tmp_path, ["public.t"]), environ={DSN_VARIABLE: "dbname=unused"})
    log = PointLog(config)
    hour_us = 3_600_000_000
    now_us = int(time.time() * 1_000_000)
    for i in range(4):  # published 10.5, 9.5, 8.5 and 7.5 hours ago
        age = (21 - 2 * i) * hour_us // 2
        log.append(ConsistentPoint(100 + i, now_us - age, {"public.t": i}, now_us - age))
    assert not log.append(ConsistentPoint(101, None, {"public.t": 9}, now_us))  # not past the latest: skipped
    log.append(ConsistentPoint(200, now_us, {"public.t": 7}, now_us))
    log.append(ConsistentPoint(201, now_us, {"public.t": 8}, now_us))
    monkeypatch.setattr(consistent_points, "TIDY_FILES", 6)
    log.tidy(keep_hours=8)
    assert [p.lsn for p in log.points()] == [103, 200, 201]  # 7.5 hours old, and the recent ones
    assert len(RustDeltaTable(log.path).file_uris()) == 1
    log.tidy(keep_hours=1)  # below TIDY_FILES files: nothing to do
    assert [p.lsn for p in log.points()] == [103, 200, 201]
    monkeypatch.setattr(consistent_points, "TIDY_FILES", 1)
    log.tidy(keep_hours=1)
    assert [p.lsn for p in log.points()] == [200, 201] and log.latest() == ConsistentPoint(
        201, now_us, {"public.t": 8}, now_us
    )
    log.tidy(keep_hours=0)
    assert [p.lsn for p in log.points()] == [201]  # the latest point stays, whatever its age
