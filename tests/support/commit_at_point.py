"""A transaction that commits exactly at a new slot's consistent point, on a real server.

PostgreSQL makes a new logical slot consistent at the end of a running-transactions record
(``xl_running_xacts``), and that end is the slot's consistent point ``C``: where the next WAL record
starts. When that record is a transaction's commit, the transaction commits at ``C`` — the commit
LSN of the copy made as of the slot's snapshot — yet it is not in the snapshot, and the slot sends
it. :func:`setup_committing_at_point` makes it so: while the slot is created, the walsender waits
for ``T``, running at its first record, then for ``U``, running at its second; ``V`` starts after
that one, so the third (``U`` committed) finds only ``V`` running and makes the slot consistent;
``V`` commits as the slot is created, before anything else of the test writes WAL.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from unittest import mock

import psycopg
import pyarrow.compute as pc

import cdc_assets.pipeline.setup as setup_module
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.pipeline.setup import SetupResult
from cdc_assets.source import create_slot_with_snapshot
from tests.support.database import Database
from tests.support.pipeline import wait_until

XID = "SELECT pg_current_xact_id()::text::int8"
WALSENDER_WAITS_FOR = (
    "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
    " WHERE l.locktype = 'transactionid' AND NOT l.granted AND l.transactionid::text::int8 = %s"
    " AND a.backend_type = 'walsender'"
)


@dataclass(slots=True, frozen=True)
class CommittedAtPoint:
    """The setup, and the xid of the transaction that committed right after its consistent point."""

    setup: SetupResult
    xid: int

    def commit_lsn(self, reader: ChangeLogReader) -> int:
        """The transaction's commit LSN in the change log (once drained)."""
        logged = reader.transactions()
        (lsn,) = logged.filter(pc.equal(logged.column("xid"), self.xid)).column("commit_lsn").to_pylist()
        return int(lsn)


def setup_committing_at_point(
    db: Database, setup: Callable[[], SetupResult], writes: Sequence[str]
) -> CommittedAtPoint:
    """Run ``setup`` (which creates the slot) while a transaction of ``writes`` commits at the slot's
    consistent point (unless another WAL record comes first: the caller checks the commit LSN)."""
    connections = [db.connect(autocommit=False) for _ in range(3)]
    t, u, v = connections

    @contextmanager
    def then_commit_v(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with create_slot_with_snapshot(*args, **kwargs) as exported:
            v.commit()  # the first WAL record after the consistent point
            yield exported

    with ThreadPoolExecutor(1) as pool, mock.patch.object(setup_module, "create_slot_with_snapshot", then_commit_v):
        try:
            xt = _xid(t)
            running = pool.submit(setup)
            _walsender_waits_for(db, xt, running)
            xu = _xid(u)
            t.commit()
            _walsender_waits_for(db, xu, running)
            xv = _xid(v)
            for statement in writes:
                v.execute(statement)
            u.commit()
            return CommittedAtPoint(running.result(timeout=120), xv)
        finally:
            for conn in connections:
                conn.close()


def _xid(conn: psycopg.Connection[Any]) -> int:
    """The xid of the connection's transaction, which this assigns (its commit is then logged)."""
    row = conn.execute(XID).fetchone()
    assert row is not None
    return int(row[0])


def _walsender_waits_for(db: Database, xid: int, running: Future[SetupResult]) -> None:
    """Wait until the walsender creating the slot waits for transaction ``xid`` (or setup ended)."""
    wait_until(
        lambda: running.done() or db.execute(WALSENDER_WAITS_FOR, (xid,))[0][0],
        what=f"the walsender waiting for transaction {xid}",
    )
    if running.done():
        running.result()  # raises what ended it
        raise AssertionError("setup ended before its slot was consistent")
