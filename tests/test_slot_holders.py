"""What a slot holds back: the WAL behind its ``restart_lsn`` and the oldest running transaction
with an xid, which keeps ``restart_lsn`` from passing its first write (``source/slot_holders.py``),
shown by ``cdc-assets status`` and the drain's ``slot_held_wal`` check.

Each test pins a real slot and proves the pin: the slot is pushed as far as it can go (a
running-transactions record, a commit after it, the slot advanced to the flushed end) and its
``restart_lsn`` stays behind the pinning write; once the transaction ends it passes it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from cdc_assets.pipeline.status import Status
from cdc_assets.source import HELD_WAL_WARN_BYTES, HeldWal, PinningTransaction, read_held_wal, server_major
from dagster_project.assets import build_changelog_asset
from dagster_project.checks import build_held_wal_check
from dagster_project.factory import build_definitions
from dagster_project.naming import Naming
from dagster_project.settings import load_settings
from tests.support.dagster_env import DSN_VARIABLE, execute, write_dagster_config
from tests.support.database import Database
from tests.support.pipeline import Pipeline, wait_until

CHANGELOG_KEY = Naming().changelog

SLOT = "cdc_slot"
HOLDER_INSERT = "INSERT INTO held VALUES (1) RETURNING xmin::text::int8"
CHECK_KEY = dg.AssetCheckKey(CHANGELOG_KEY, "slot_held_wal")


def create_slot(db: Database) -> None:
    db.execute("CREATE TABLE held (n int); CREATE TABLE pad (n int)")
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))


def push(conn: psycopg.Connection[Any]) -> HeldWal:
    """Give the slot every chance to move ``restart_lsn`` on; what it holds afterwards."""
    conn.execute("SELECT pg_log_standby_snapshot()" if server_major(conn) >= 16 else "CHECKPOINT")
    conn.execute("INSERT INTO pad VALUES (1)")  # a commit after the record: the WAL flushed past it
    conn.execute("SELECT pg_replication_slot_advance(%s, pg_current_wal_lsn())", (SLOT,))
    held = read_held_wal(conn, SLOT)
    assert held is not None
    return held


def pushed(conn: psycopg.Connection[Any], times: int = 3) -> HeldWal:
    for _ in range(times - 1):
        push(conn)
    return push(conn)


def insert_lsn(conn: psycopg.Connection[Any]) -> int:
    (lsn,) = conn.execute("SELECT (pg_current_wal_insert_lsn() - '0/0')::int8").fetchone() or (None,)
    assert isinstance(lsn, int)
    return lsn


def released(conn: psycopg.Connection[Any], written: int) -> HeldWal | None:
    """The slot once nothing pins it and its restart_lsn has passed ``written``, else None."""
    held = push(conn)
    assert held.restart_lsn is not None
    return held if held.pinned_by is None and held.restart_lsn > written else None


def pinned_by(held: HeldWal) -> PinningTransaction:
    assert held.pinned_by is not None, held
    return held.pinned_by


def pinned_of(conn: psycopg.Connection[Any]) -> PinningTransaction | None:
    held = read_held_wal(conn, SLOT)
    assert held is not None
    return held.pinned_by


def session_pinning(conn: psycopg.Connection[Any], session: psycopg.Connection[Any]) -> PinningTransaction | None:
    pinned = pinned_of(conn)
    return pinned if pinned is not None and pinned.pid == session.info.backend_pid else None


def test_an_idle_in_transaction_session_that_wrote_pins_the_slot_and_is_named(pg_any: Database) -> None:
    create_slot(pg_any)
    with (
        pg_any.connect() as observer,
        pg_any.connect(autocommit=False, application_name="held-test") as holder,
    ):
        wait_until(lambda: push(observer).pinned_by is None, what="no transaction holding an xid")
        (xid,) = holder.execute(HOLDER_INSERT).fetchone() or (None,)
        written = insert_lsn(observer)

        held = pushed(observer)
        assert held.restart_lsn is not None and held.restart_lsn < written  # the slot cannot pass the write
        assert held.held_bytes is not None and held.held_bytes >= held.current_wal_lsn - written > 0
        pinned = pinned_by(held)
        assert (pinned.pid, pinned.xid, pinned.gid, pinned.prepared) == (holder.info.backend_pid, xid, None, False)
        assert pinned.state == "idle in transaction" and pinned.query == HOLDER_INSERT
        assert (pinned.user, pinned.application_name, pinned.database) == ("postgres", "held-test", pg_any.name)
        assert pinned.started_at is not None and pinned.query_start is not None
        assert pinned.started_at <= pinned.query_start <= datetime.now(UTC)
        assert pinned.age_seconds is not None and pinned.age_seconds >= 0 and pinned.xid_age >= 1
        assert not held.over() and held.warning() is None  # a few kB: under the 1 GiB threshold
        assert held.over(bound=1) and f"pid {pinned.pid}" in (held.warning(bound=1) or "")

        holder.rollback()
        wait_until(lambda: released(observer, written), what="restart_lsn past the ended transaction's write")

        # The connection asking is never its own answer, whatever it holds.
        with pg_any.connect(autocommit=False) as own:
            own.execute("INSERT INTO held VALUES (2)")
            assert own.execute(
                "SELECT backend_xid IS NOT NULL FROM pg_stat_activity WHERE pid = pg_backend_pid()"
            ).fetchone() == (True,)
            wait_until(lambda: pinned_of(own) is None, what="own transaction not reported")


def test_a_prepared_transaction_is_named_by_gid_and_the_oldest_transaction_is_the_one_reported(
    pg_any: Database,
) -> None:
    create_slot(pg_any)
    gid = f"held_{pg_any.name}"
    with pg_any.connect() as observer, pg_any.connect() as preparer, pg_any.connect(autocommit=False) as session:
        preparer.execute("BEGIN")
        (prepared_xid,) = preparer.execute(HOLDER_INSERT).fetchone() or (None,)
        preparer.execute(f"PREPARE TRANSACTION '{gid}'")
        written = insert_lsn(observer)
        (session_xid,) = session.execute(HOLDER_INSERT).fetchone() or (None,)  # younger

        held = pushed(observer)
        assert held.restart_lsn is not None and held.restart_lsn < written
        pinned = pinned_by(held)
        assert (pinned.gid, pinned.xid, pinned.pid, pinned.prepared) == (gid, prepared_xid, None, True)
        assert (pinned.state, pinned.query, pinned.query_start) == ("prepared", None, None)
        assert (pinned.user, pinned.database) == ("postgres", pg_any.name)
        assert pinned.started_at is not None and pinned.age_seconds is not None and pinned.age_seconds >= 0
        assert f"prepared transaction '{gid}'" in pinned.describe()
        assert f"ROLLBACK PREPARED '{gid}' in database {pg_any.name}" in pinned.remedy()

        # The prepared one ends: the session, next oldest, is what pins the slot now.
        observer.execute(f"ROLLBACK PREPARED '{gid}'")
        pinned = wait_until(lambda: session_pinning(observer, session), what="the session reported")
        assert (pinned.xid, pinned.gid, pinned.state) == (session_xid, None, "idle in transaction")

        session.rollback()
        wait_until(lambda: released(observer, written), what="nothing pinning the slot")


def test_a_transaction_in_another_database_pins_the_slot_and_a_plain_role_sees_who(pg: Database) -> None:
    """Logical decoding reads the whole cluster's WAL: a writer in another database pins the slot
    too. A role without pg_read_all_stats sees its pid and xid but not its query or state."""
    create_slot(pg)
    role = f"{pg.name}_plain"
    pg.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        with pg.connect() as observer, psycopg.connect(pg.cluster.dsn("postgres")) as elsewhere:
            elsewhere.execute("CREATE TEMP TABLE held_elsewhere (n int)")
            written = insert_lsn(observer)
            held = pushed(observer)
            assert held.restart_lsn is not None and held.restart_lsn < written
            pinned = pinned_by(held)
            assert (pinned.pid, pinned.database, pinned.state) == (
                elsewhere.info.backend_pid,
                "postgres",
                "idle in transaction",
            )
            with psycopg.connect(pg.cluster.dsn(pg.name, user=role), autocommit=True) as plain:
                seen = pinned_of(plain)
                assert seen is not None and (seen.pid, seen.xid, seen.user) == (pinned.pid, pinned.xid, "postgres")
                assert (seen.state, seen.started_at, seen.age_seconds, seen.query_start) == (None, None, None, None)
                assert seen.query == "<insufficient privilege>"
            elsewhere.rollback()
            wait_until(lambda: released(observer, written), what="restart_lsn past the other database's write")
    finally:
        pg.execute(f'DROP ROLE "{role}"')


def test_status_shows_the_held_wal_and_the_pinning_transaction(pg: Database, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE held (n int)")
    pipe = Pipeline(pg, tmp_path, ["public.held"])
    assert pipe.cli("status", "--json").json["held_wal"] is None  # no slot yet

    pg.execute("CREATE TABLE pad (n int)")
    pg.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (SLOT,))
    with pg.connect(autocommit=False) as holder:
        (xid,) = holder.execute(HOLDER_INSERT).fetchone() or (None,)
        status = pipe.cli("status", "--json")
        assert status.returncode == 0, status.stderr
        held = status.json["held_wal"]
        assert held["bytes"] > 0 and held["restart_lsn"] == status.json["slot"]["restart_lsn"]
        assert (held["warn_bytes"], held["warning"]) == (HELD_WAL_WARN_BYTES, False)
        pinned = held["pinned_by"]
        assert (pinned["pid"], pinned["gid"], pinned["xid"]) == (holder.info.backend_pid, None, xid)
        assert (pinned["state"], pinned["query"], pinned["user"]) == ("idle in transaction", HOLDER_INSERT, "postgres")
        assert pinned["age_seconds"] >= 0 and pinned["xid_age"] >= 1
        assert datetime.fromisoformat(pinned["started_at"]) <= datetime.fromisoformat(pinned["query_start"])

        text = pipe.cli("status")
        assert text.returncode == 0, text.stderr
        [line] = [line for line in text.stdout.splitlines() if line.startswith("  held WAL:")]
        assert f"pid {holder.info.backend_pid} (xid {xid}, idle in transaction, started" in line
        assert line.endswith(f": {HOLDER_INSERT}") and "WARNING" not in text.stdout
        holder.rollback()
    wait_until(
        lambda: "oldest transaction: none holds an xid" in pipe.cli("status").stdout, timeout=60, what="no pin shown"
    )


def test_status_warns_above_the_threshold_and_says_what_to_end() -> None:
    session = PinningTransaction(
        xid=812, xid_age=40, age_seconds=7200.4, started_at=datetime(2026, 1, 5, 10, tzinfo=UTC), pid=4242,
        state="idle in transaction", query="UPDATE big SET x = 1", query_start=datetime(2026, 1, 5, 10, 1, tzinfo=UTC),
        user="app", application_name="batch", database="shop",
    )  # fmt: skip
    held = HeldWal(SLOT, restart_lsn=0, confirmed_flush_lsn=2 << 30, current_wal_lsn=2 << 30, pinned_by=session)
    status = Status(SLOT, None, None, None, held_wal=held)
    lines = status.lines()[1:]  # after the slot's line
    assert lines[0] == (
        "  held WAL: 2,147,483,648 bytes behind restart LSN 0/0; oldest transaction with an xid: pid 4242 (xid 812,"
        " idle in transaction, started 7,200 s ago, query started 2026-01-05T10:01:00+00:00, user app,"
        " application batch, database shop): UPDATE big SET x = 1"
    )
    assert lines[1].startswith("WARNING: slot cdc_slot holds 2,147,483,648 bytes of WAL (over 1,073,741,824);")
    assert lines[1].endswith("draining does not release it: end its transaction, or SELECT pg_terminate_backend(4242)")
    shown = status.to_json()["held_wal"]
    assert (shown["bytes"], shown["warning"], shown["pinned_by"]["pid"]) == (2 << 30, True, 4242)
    assert (
        shown["pinned_by"]["query_start"] == "2026-01-05T10:01:00+00:00" and shown["pinned_by"]["age_seconds"] == 7200.4
    )

    unpinned = HeldWal(SLOT, restart_lsn=0, confirmed_flush_lsn=0, current_wal_lsn=2 << 30, pinned_by=None)
    assert (unpinned.warning() or "").endswith("no running transaction holds an xid: drain the slot")
    assert HeldWal(SLOT, None, None, 2 << 30, None).held_bytes is None  # an invalidated slot reserves nothing


def test_the_drain_check_warns_with_the_pinning_transaction(
    pg: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    create_slot(pg)
    path = write_dagster_config(tmp_path, source={"slot": SLOT})
    monkeypatch.setenv(DSN_VARIABLE, pg.dsn)
    settings = load_settings(str(path))
    defs = build_definitions(settings)
    assert CHECK_KEY in defs.resolve_job_def("cdc_drain").asset_layer.asset_graph.asset_check_keys  # after each drain
    strict = dg.Definitions(  # the same check with a 1-byte bound
        assets=[build_changelog_asset(settings)],
        asset_checks=[build_held_wal_check(settings, bound=1)],
        resources=defs.resources,
    )

    def evaluate(definitions: dg.Definitions, name: str) -> Any:
        result = execute(definitions, instance, dg.AssetSelection.checks(CHECK_KEY), name=name)
        [evaluation] = result.get_asset_check_evaluations()
        return evaluation

    with dg.instance_for_test() as instance, pg.connect(autocommit=False) as holder:
        (xid,) = holder.execute(HOLDER_INSERT).fetchone() or (None,)
        for definitions, name, passed in ((defs, "held_default", True), (strict, "held_strict", False)):
            evaluation = evaluate(definitions, name)
            assert evaluation.passed is passed and evaluation.severity == dg.AssetCheckSeverity.WARN
            metadata = {k: v.value for k, v in evaluation.metadata.items()}
            assert metadata["held_bytes"] > 0 and metadata["held_mb"] == round(metadata["held_bytes"] / 1e6, 3)
            assert metadata["warn_bytes"] == (HELD_WAL_WARN_BYTES if passed else 1)
            assert metadata["restart_lsn"].count("/") == 1
            assert (metadata["pinned_pid"], metadata["pinned_xid"]) == (holder.info.backend_pid, xid)
            assert metadata["pinned_state"] == "idle in transaction" and metadata["pinned_age_s"] >= 0
            assert metadata["pinned_query_start"] > 0 and metadata["pinned_query"] == HOLDER_INSERT
            assert "pinned_gid" not in metadata
            if not passed:
                assert f"pid {holder.info.backend_pid} (xid {xid}" in (evaluation.description or "")
        holder.rollback()
        with pg.connect() as observer:
            wait_until(lambda: pinned_of(observer) is None, what="no transaction holding an xid")
        evaluation = evaluate(defs, "held_released")
        assert evaluation.passed and evaluation.metadata["pinned_by"].value == "none"
