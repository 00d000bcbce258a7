"""`cdc-assets setup` against real PostgreSQL: the initial snapshot (also under concurrent writes, and
with a transaction committed at its consistent point), rerunning, resuming a killed setup,
refusals, and `status --json` (Python API and command line)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cdc_assets.errors import (
    CdcError,
    ConfigError,
    SourcePermissionError,
    TableMissingError,
)
from cdc_assets.lsn import format_lsn
from tests.support.commit_at_point import setup_committing_at_point
from tests.support.database import Database
from tests.support.pipeline import Pipeline, wait_until

XID = "SELECT pg_current_xact_id()::text::int8"


@pytest.fixture
def role(pg: Database) -> Iterator[str]:
    """A LOGIN role without REPLICATION that owns nothing (roles are cluster-wide: unique name)."""
    name = f"r_{pg.name}_plain"
    pg.execute(f'CREATE ROLE "{name}" LOGIN')
    yield name
    pg.execute(f'DROP OWNED BY "{name}"')
    pg.execute(f'DROP ROLE "{name}"')


def test_snapshot_under_concurrent_writes(pg: Database, tmp_path: Path) -> None:
    """A writer commits inserts, updates, key moves and deletes to two tables throughout setup.
    Setup is held after copying the first table until the writer has committed more transactions;
    the second table is copied afterwards, so a copy outside the exported snapshot would hold
    those writes and the slot would deliver them again (the oracle reports an insert of an
    existing key, an update or delete of a missing one, or differs from the source)."""
    pg.execute(
        "CREATE TABLE acct (id int PRIMARY KEY, v int NOT NULL, note text);"
        " CREATE TABLE ledger (id bigint PRIMARY KEY, acct int, amount numeric(12,2));"
        " INSERT INTO acct SELECT g, g, 'n' || g FROM generate_series(1, 400) g;"
        " INSERT INTO ledger SELECT g, g % 400, g / 7.0 FROM generate_series(1, 400) g"
    )
    pipe = Pipeline(pg, tmp_path, ["public.acct", "public.ledger"])
    committed: list[int] = []  # xids in commit order
    stop = threading.Event()
    failure: list[BaseException] = []

    def writer() -> None:
        try:
            with pg.connect() as conn:
                n = 1000
                while not stop.is_set():
                    n += 1
                    with conn.transaction():
                        (xid,) = conn.execute(XID).fetchone()
                        conn.execute("INSERT INTO acct VALUES (%s, 0, 'new')", (n,))
                        conn.execute("UPDATE acct SET v = v + 1 WHERE id = %s", (n % 400 + 1,))
                        conn.execute(
                            "UPDATE acct SET id = id + 100000 WHERE id = (SELECT min(id) FROM acct WHERE id < 100000)"
                        )
                        conn.execute("DELETE FROM acct WHERE id = (SELECT max(id) FROM acct WHERE id < 1000)")
                        conn.execute("INSERT INTO ledger VALUES (%s, %s, %s)", (n, n % 400, n / 3))
                        conn.execute(
                            "UPDATE ledger SET id = id + 100000 WHERE id = (SELECT min(id) FROM ledger WHERE id < 100000)"
                        )
                        conn.execute("UPDATE ledger SET amount = amount + 1 WHERE id = (SELECT max(id) FROM ledger)")
                        conn.execute("DELETE FROM ledger WHERE id = (SELECT max(id) FROM ledger WHERE id < 1000)")
                    committed.append(xid)
        except BaseException as error:  # noqa: BLE001 - reported by the test
            failure.append(error)

    during_copy: list[int] = []

    def progress(table: str, rows: int) -> None:
        if table == "public.acct" and not during_copy:
            start = len(committed)
            wait_until(lambda: len(committed) >= start + 15 or failure, what="writes during the copy")
            during_copy.extend(committed[start:])

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        wait_until(lambda: len(committed) >= 10 or failure, what="writes before setup")
        before_setup = list(committed)
        result = pipe.setup(progress=progress)
        after_setup = len(committed)
        wait_until(lambda: len(committed) >= after_setup + 10 or failure, what="writes after setup")
    finally:
        stop.set()
        thread.join()
    assert not failure, failure
    assert result.created_slot and result.snapshot_lsn is not None

    drained = pipe.drain()
    replica = pipe.assert_mirrors()
    logged = pipe.reader.transactions()
    xids = logged.column("xid").to_pylist()
    # The log holds exactly the writer's transactions after the consistent point, in commit order.
    first = committed.index(xids[0])
    assert xids == committed[first:]
    assert drained.transactions == len(xids)
    assert all(lsn > result.snapshot_lsn for lsn in logged.column("commit_lsn").to_pylist())
    # Some of them committed while the tables were being copied, all of those after the snapshot…
    assert len(during_copy) >= 15 and set(during_copy) <= set(xids)
    # … and everything committed before setup started is in the snapshot, not in the log.
    assert not set(before_setup) & set(xids)
    assert first >= len(before_setup)
    snapshot_rows = sum(
        1
        for chunk in pipe.reader.read_changes("public.acct")
        for op in chunk.records.column("_cdc_op").to_pylist()
        if op == "snapshot"
    )
    assert snapshot_rows == result.rows["public.acct"] >= 400
    assert len(replica["public.acct"]) == pg.execute("SELECT count(*) FROM acct")[0][0]


def test_a_transaction_committed_at_the_consistent_point_follows_the_copy(pg: Database, tmp_path: Path) -> None:
    """A transaction whose commit is the WAL record right after the one that made the slot
    consistent commits at the consistent point — the copy's commit LSN — and is not in the copy:
    the log orders the copy's records before its changes, none at the same (commit LSN, position),
    and replays to the source."""
    pg.execute(
        "CREATE TABLE acct (id int PRIMARY KEY, v int NOT NULL) WITH (autovacuum_enabled = false);"
        " INSERT INTO acct SELECT g, g FROM generate_series(1, 400) g"
    )
    pipe = Pipeline(pg, tmp_path, ["public.acct"])
    committed = setup_committing_at_point(
        pg, pipe.setup, ["INSERT INTO acct VALUES (5000, 0)", "UPDATE acct SET v = -1 WHERE id = 3"]
    )
    pipe.drain()
    assert committed.commit_lsn(pipe.reader) == committed.setup.snapshot_lsn, "another WAL record came first"
    order = [
        (lsn, position)
        for chunk in pipe.reader.read_changes("public.acct")
        for lsn, position in zip(
            chunk.records.column("_cdc_commit_lsn").to_pylist(), chunk.records.column("_cdc_position").to_pylist()
        )
    ]
    assert len(order) == 402 and order == sorted(set(order))
    replica = pipe.assert_mirrors()
    assert replica["public.acct"].keyed[(3,)]["v"] == -1 and (5000,) in replica["public.acct"].keyed


@pytest.mark.slow
def test_setup_cli_status_and_rerun(pg: Database, tmp_path: Path) -> None:
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, v text); CREATE TABLE empty (id int PRIMARY KEY, x numeric(5,1));"
        " INSERT INTO t VALUES (1, 'a'), (2, NULL), (3, 'c')"
    )
    pipe = Pipeline(pg, tmp_path, ["public.t", "public.empty"])

    before = pipe.cli("status", "--json")
    assert before.returncode == 0, before.stderr
    assert before.json["slot"]["exists"] is False and before.json["checkpoint_lsn"] is None
    assert before.json["source_error"] is None

    done = pipe.cli("setup")
    assert done.returncode == 0, done.stderr
    checkpoint = pipe.checkpoint()
    assert checkpoint is not None and checkpoint.snapshot_lsn == checkpoint.lsn
    assert done.stdout.splitlines()[:4] == [
        "created publication cdc_pub",
        f"created slot cdc_slot; snapshot at LSN {format_lsn(checkpoint.lsn)}",
        "  public.t: 3 rows",
        "  public.empty: 0 rows",
    ]
    assert pipe.confirmed_flush() == checkpoint.lsn
    assert pg.execute("SELECT two_phase FROM pg_replication_slots WHERE slot_name = 'cdc_slot'") == [(False,)]
    assert {t: (s.schema_version, s.last_change_lsn) for t, s in checkpoint.tables.items()} == {
        "public.t": (1, checkpoint.lsn),
        "public.empty": (1, 0),
    }
    assert pipe.batch_starts() == []  # the snapshot is a batch of table segments only
    assert sorted(p.name for p in Path(pipe.changelog, "tables", "public.t").iterdir()) == [
        "0000000000000000-0000.parquet"
    ]
    assert not Path(pipe.changelog, "_setup.json").exists()
    replica = pipe.assert_mirrors()
    assert replica["public.empty"].columns == ("id", "x") and len(replica["public.empty"]) == 0

    status = pipe.cli("status", "--json")
    assert status.returncode == 0, status.stderr
    lsn = format_lsn(checkpoint.lsn)
    assert status.json["checkpoint_lsn"] == status.json["snapshot_lsn"] == lsn
    slot = status.json["slot"]
    assert slot["exists"] and slot["name"] == "cdc_slot" and slot["confirmed_flush_lsn"] == lsn
    assert slot["wal_status"] == "reserved" and slot["two_phase"] is False and slot["active_pid"] is None
    assert slot["lag_bytes"] >= 0
    tables = {
        name: {k: v for k, v in t.items() if k in ("last_change_lsn", "schema_version", "applied_lsn", "behind")}
        for name, t in status.json["tables"].items()
    }
    assert tables == {  # nothing applied to Delta yet: both tables are behind their snapshot
        "public.t": {"last_change_lsn": lsn, "schema_version": 1, "applied_lsn": None, "behind": True},
        "public.empty": {"last_change_lsn": "0/0", "schema_version": 1, "applied_lsn": None, "behind": True},
    }

    # Rerunning changes nothing.
    snapshot_bytes = pipe.checkpoint_bytes()
    again = pipe.cli("setup")
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("already set up: slot cdc_slot and the change log at")
    assert pipe.checkpoint_bytes() == snapshot_bytes and pipe.setup().created_slot is False

    # Changes, a drain on the command line, and the status after it.
    pg.execute("INSERT INTO empty VALUES (1, 2.5); UPDATE t SET v = 'b' WHERE id = 2")
    pg.execute("DELETE FROM t WHERE id = 1")
    drained = pipe.cli("drain")
    assert drained.returncode == 0, drained.stderr
    after = pipe.checkpoint()
    assert after is not None and after.lsn > checkpoint.lsn
    assert drained.stdout.splitlines()[0].startswith("drained 2 transactions, 3 changes in 1 batches")
    assert f"checkpoint {lsn} -> {format_lsn(after.lsn)}" in drained.stdout
    assert "  public.empty: 1 changes" in drained.stdout.splitlines()
    assert "  public.t: 2 changes" in drained.stdout.splitlines()
    pipe.assert_mirrors()
    status = pipe.cli("status", "--json").json
    ends = pipe.reader.transactions().column("end_lsn").to_pylist()
    assert status["checkpoint_lsn"] == status["slot"]["confirmed_flush_lsn"] == format_lsn(after.lsn)
    assert after.lsn >= ends[-1]  # the last transaction's end, or a later position the server reported
    assert status["snapshot_lsn"] == lsn
    assert {n: (t["last_change_lsn"], t["schema_version"]) for n, t in status["tables"].items()} == {
        "public.t": (format_lsn(ends[1]), 1),
        "public.empty": (format_lsn(ends[0]), 1),
    }
    text = pipe.cli("status")
    assert text.returncode == 0 and f"change log: checkpoint {format_lsn(after.lsn)} (snapshot at {lsn})" in text.stdout

    # The source unreachable: status still reports the change log, and says why.
    unreachable = pipe.cli(
        "status", "--json", env={**pipe.environ, "CDC_SOURCE_DSN": "host=127.0.0.1 port=1 dbname=x connect_timeout=5"}
    )
    assert unreachable.returncode == 0, unreachable.stderr
    assert unreachable.json["source_error"].startswith("cannot connect to the source database (status)")
    assert unreachable.json["slot"]["exists"] is False and unreachable.json["checkpoint_lsn"] == format_lsn(after.lsn)


def test_setup_resumes_after_a_killed_setup(pg: Database, tmp_path: Path) -> None:
    """A setup that died after creating the slot left `_setup.json` and maybe segments; the next
    setup drops that slot, deletes the leftovers and snapshots again. A slot the log does not
    know is never dropped."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text); INSERT INTO t VALUES (1, 'a')")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pg.execute("SELECT pg_create_logical_replication_slot('cdc_slot', 'pgoutput')")

    foreign = pipe.cli("setup")
    assert foreign.returncode == 1
    assert re.fullmatch(
        r"cdc-assets: replication slot cdc_slot already exists but the change log at \S+ is empty: it was not"
        r" created by cdc-assets .*\n",
        foreign.stderr,
    ), foreign.stderr
    assert pipe.confirmed_flush() is not None and pipe.checkpoint() is None  # the slot is still there

    old_confirmed = pipe.confirmed_flush()
    leftover = Path(pipe.changelog, "tables", "public.t", "0000000000000000-0000.parquet")
    leftover.parent.mkdir(parents=True)
    leftover.write_bytes(b"half-written")
    stray = Path(pipe.changelog, "transactions", "0000000000000000-0000.parquet")
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"half-written")
    Path(pipe.changelog, "_setup.json").write_text('{"slot": "cdc_slot"}')
    pg.execute("INSERT INTO t VALUES (2, 'b')")
    result = pipe.setup()
    # A new slot (its consistent point is past the insert) and a new snapshot that holds the insert.
    assert result.created_slot and result.rows == {"public.t": 2}
    assert pipe.confirmed_flush() == result.snapshot_lsn == pipe.checkpoint().lsn > old_confirmed
    assert pq.read_table(leftover).num_rows == 2 and not stray.exists()
    assert not Path(pipe.changelog, "_setup.json").exists()
    pg.execute("UPDATE t SET v = 'c' WHERE id = 2")
    pipe.drain()
    pipe.assert_mirrors()


def test_setup_refusals(pg: Database, tmp_path: Path, role: str) -> None:
    """Each refusal: one clear line, a non-zero exit, and nothing created."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    pipe = Pipeline(pg, tmp_path / "ok", ["public.t"])

    def nothing_created() -> None:
        assert pg.execute("SELECT count(*) FROM pg_replication_slots")[0][0] == 0
        assert pipe.checkpoint() is None

    # A role without REPLICATION.
    plain = {**pipe.environ, "CDC_SOURCE_DSN": pg.cluster.dsn(pg.name, user=role)}
    refused = pipe.cli("setup", env=plain)
    assert refused.returncode == 1
    assert refused.stderr == (
        f"cdc-assets: role {role} cannot use replication slots: it needs the REPLICATION attribute"
        f" (ALTER ROLE {role} REPLICATION) or superuser\n"
    )
    with pytest.raises(SourcePermissionError, match="cannot use replication slots"):
        from cdc_assets.config import load_config
        from cdc_assets.pipeline.setup import setup

        setup(load_config(pipe.config_path, environ={"CDC_SOURCE_DSN": pg.cluster.dsn(pg.name, user=role)}))
    nothing_created()
    assert pg.execute("SELECT count(*) FROM pg_publication") == [(0,)]

    # A configured table that does not exist.
    missing = Pipeline(pg, tmp_path / "missing", ["public.t", "public.nope"])
    with pytest.raises(TableMissingError, match=r"configured table\(s\) public.nope do not exist"):
        missing.setup()
    cli = missing.cli("setup")
    assert cli.returncode == 1 and cli.stderr.startswith("cdc-assets: configured table(s) public.nope do not exist")
    nothing_created()

    # Configuration errors exit 2 and name the problem.
    no_env = {k: v for k, v in pipe.environ.items() if k != "CDC_SOURCE_DSN"}
    unset = pipe.cli("setup", env=no_env)
    assert unset.returncode == 2
    assert unset.stderr == (
        f"cdc-assets: configuration error: {pipe.config_path}, line 2: environment variable CDC_SOURCE_DSN is not set\n"
    )
    pipe.update_source(bogus=1)
    unknown = pipe.cli("setup")
    assert unknown.returncode == 2
    assert unknown.stderr == f"cdc-assets: configuration error: {pipe.config_path}: source.bogus: unknown setting\n"
    with pytest.raises(ConfigError, match=r"source\.bogus: unknown setting"):
        pipe.config()
    nothing_created()
    assert "Traceback" not in refused.stderr + cli.stderr + unset.stderr + unknown.stderr


def test_setup_with_the_slot_gone(pg: Database, tmp_path: Path) -> None:
    """A set-up change log whose slot was dropped: setup refuses (changes since are lost)."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pipe.setup()
    pg.execute("SELECT pg_drop_replication_slot('cdc_slot')")
    before = pipe.checkpoint_bytes()
    with pytest.raises(
        CdcError, match=r"replication slot cdc_slot does not exist, but the change log at .* was set up"
    ):
        pipe.setup()
    assert pipe.checkpoint_bytes() == before and pipe.confirmed_flush() is None
    assert json.loads(before)["lsn"] == pipe.checkpoint().lsn


def test_setup_adds_a_configured_table_online_and_prune_drops_one(pg: Database, tmp_path: Path) -> None:
    """A table added under ``tables:`` becomes live with `cdc-assets setup`: added to the publication
    and copied online (a snapshot run the drain then records); no other table is copied again and
    the slot stays. `setup --prune` drops a table no longer configured from the publication."""
    pg.execute(
        "CREATE TABLE a (id int PRIMARY KEY, v text); INSERT INTO a SELECT g, 'a' || g FROM generate_series(1, 5) g"
    )
    pg.execute(
        "CREATE TABLE b (id int PRIMARY KEY, v text); INSERT INTO b SELECT g, 'b' || g FROM generate_series(1, 7) g"
    )
    pipe = Pipeline(pg, tmp_path, ["public.a"])
    pipe.setup()
    slots = "SELECT slot_name::text FROM pg_replication_slots"
    pg.execute("UPDATE a SET v = 'changed' WHERE id = 1; UPDATE b SET v = 'unpublished' WHERE id = 1")
    pipe.drain()

    pipe.tables.append("public.b")
    pipe.update_source()
    added = pipe.cli("setup")
    assert added.returncode == 0, added.stderr
    lines = added.stdout.splitlines()
    assert "added public.b to publication cdc_pub" in lines
    assert any(line.startswith("copied online: public.b: 7 rows in 1 chunks as of LSN") for line in lines), lines
    assert not any("public.a" in line for line in lines), lines  # nothing else copied again
    pg.execute("UPDATE b SET v = 'after' WHERE id = 2; DELETE FROM b WHERE id = 3; INSERT INTO b VALUES (8, 'new')")
    pipe.drain()
    checkpoint = pipe.checkpoint()
    run = checkpoint.tables["public.b"].snapshot_run if checkpoint else None
    assert run is not None
    shown = pipe.cli("status", "--json").json["tables"]["public.b"]
    assert shown["snapshot_run"] == {
        "run": run.run,
        "consistent_point": format_lsn(run.consistent_point),
        "announced_lsn": format_lsn(run.position),
    }
    assert shown["last_change_lsn"] == format_lsn(checkpoint.tables["public.b"].last_change_lsn)
    assert pg.execute(slots) == [("cdc_slot",)], "the copy's temporary slot is left"
    pipe.assert_mirrors(["public.a", "public.b"])  # the log replayed from the run equals the source
    again = pipe.cli("setup")
    assert again.stdout.startswith("already set up"), again.stdout  # the run counts as b's copy

    pipe.tables.remove("public.a")
    pipe.update_source()
    pruned = pipe.cli("setup", "--prune")
    assert pruned.returncode == 0, pruned.stderr
    assert "dropped public.a from publication cdc_pub (its Delta table stays)" in pruned.stdout.splitlines()
    published = pg.execute("SELECT tablename::text FROM pg_publication_tables WHERE pubname = 'cdc_pub'")
    assert published == [("b",)]
    assert checkpoint is not None
    last_a = checkpoint.tables["public.a"].last_change_lsn
    pg.execute("UPDATE a SET v = 'unmirrored' WHERE id = 2; UPDATE b SET v = 'mirrored' WHERE id = 4")
    pipe.drain()
    after = pipe.checkpoint()
    assert after is not None and after.tables["public.a"].last_change_lsn == last_a
    pipe.assert_mirrors(["public.b"])
