"""A transaction left open for long holds the slot's ``restart_lsn``, and every new decoding session
re-reads all WAL since it began. A drain that follows the stream reads each WAL record once: its
confirmed position keeps up with the writes while ``restart_lsn`` stays pinned, and once the old
transaction ends — committed, rolled back, or left PREPAREd on a two-phase slot — every Delta
table equals its source (docs/architecture.md, "The drain, step by step")."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from cdc_assets.source import read_slot
from cdc_assets.source.slot_holders import read_held_wal
from tests.support.database import Database
from tests.support.mirror import DSN_VARIABLE, ROOT, Mirror
from tests.support.pipeline import wait_until

TABLES = {"public.acct": {}, "public.ledger": {}}
CREATE = (
    "CREATE TABLE acct (id int PRIMARY KEY, balance bigint NOT NULL)",
    "CREATE TABLE ledger (id bigserial PRIMARY KEY, acct int NOT NULL, amount bigint NOT NULL)",
    "CREATE TABLE noise (id bigserial, pad text)",  # not published: WAL the slot must read past
    "INSERT INTO acct SELECT g, 1000 FROM generate_series(1, 21) g",  # 21: the old transaction's alone
)


def _write(mirror: Mirror, rounds: int, start: int) -> None:
    """Transfers between accounts, each with its ledger lines, and bulk writes outside the publication."""
    for i in range(start, start + rounds):
        a, b = i % 20 + 1, (i * 7) % 20 + 1
        mirror.sql(
            f"UPDATE acct SET balance = balance - 5 WHERE id = {a}",
            f"UPDATE acct SET balance = balance + 5 WHERE id = {b}",
            f"INSERT INTO ledger (acct, amount) VALUES ({a}, -5), ({b}, 5)",
        )
        mirror.sql("INSERT INTO noise (pad) SELECT repeat('x', 500) FROM generate_series(1, 200)")


def _wal(mirror: Mirror) -> int:
    with mirror.db.connect() as conn:
        (lsn,) = conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0')::int8").fetchone()  # type: ignore[misc]
    return int(lsn)


def _slot(mirror: Mirror) -> Any:
    with mirror.db.connect() as conn:
        return read_slot(conn, "cdc_slot")


@pytest.mark.slow
@pytest.mark.parametrize("pg_any", [15, 18], ids=["pg15", "pg18"], indirect=True)  # the oldest and the newest
@pytest.mark.parametrize("ending", ["commit", "rollback", "prepared"])
def test_a_following_drain_is_not_held_back_by_a_long_transaction(
    pg_any: Database, spark: Any, tmp_path: Path, ending: str
) -> None:
    pg = pg_any
    source = {"two_phase": True} if ending == "prepared" else {}
    mirror = Mirror(pg, tmp_path / "mirror", TABLES, spark, source=source)
    mirror.sql(*CREATE)
    mirror.setup()
    old = pg.connect()
    old.execute("BEGIN")
    old.execute("UPDATE acct SET balance = balance + 100 WHERE id = 21")
    old.execute("INSERT INTO ledger (acct, amount) VALUES (21, 100)")
    if ending == "prepared":
        old.execute("PREPARE TRANSACTION 'old_transfer'")
    pinned = _wal(mirror)
    follower = subprocess.Popen(
        [sys.executable, "-m", "cdc_assets", "drain", "--follow", "600", "-c", str(mirror.config_path)],
        cwd=ROOT,
        env={**_environ(), DSN_VARIABLE: pg.dsn},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        _write(mirror, 30, 0)
        written = _wal(mirror)
        # The follower confirms past all that WAL while the old transaction pins restart_lsn behind it.
        wait_until(lambda: follower.poll() is not None or _slot(mirror).confirmed_flush_lsn >= written, 60, "feedback")
        slot = _slot(mirror)
        assert slot.restart_lsn is not None and slot.restart_lsn <= pinned < written <= slot.confirmed_flush_lsn
        with pg.connect() as conn:
            held = read_held_wal(conn, "cdc_slot")
        assert held is not None and held.pinned_by is not None
        if ending == "prepared":
            assert held.pinned_by.gid == "old_transfer"
        else:
            assert held.pinned_by.pid == old.info.backend_pid

        if ending == "commit":
            old.execute("COMMIT")
        elif ending == "rollback":
            old.execute("ROLLBACK")
        _write(mirror, 10, 30)
        written = _wal(mirror)
        wait_until(lambda: follower.poll() is not None or _slot(mirror).confirmed_flush_lsn >= written, 60, "feedback")
        follower.send_signal(signal.SIGTERM)  # ends with a last durable batch and its feedback
        out, err = follower.communicate(timeout=60)
        assert follower.returncode == 130, (out, err)
        assert _slot(mirror).confirmed_flush_lsn == mirror.checkpoint_lsn()
    finally:
        follower.kill()
        follower.wait()
    mirror.apply()
    for table in TABLES:
        mirror.check(table)  # the prepared transfer is not in the source's tables, nor in Delta
    if ending == "prepared":
        old.execute("COMMIT PREPARED 'old_transfer'")
        mirror.sync()
        rows = mirror.check("public.acct")
        assert sum(r["balance"] for r in rows) == 21 * 1000 + 100
        mirror.check("public.ledger")
    old.close()


def _environ() -> dict[str, str]:
    import os

    return dict(os.environ)
