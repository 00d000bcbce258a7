"""`cdc-assets drain` against real PostgreSQL: every operation and column kind, streaming and
spilled transactions, two-phase, schema changes, small batches, replays after a crash, every
refusal, and concurrent drains — checked with the oracle (`tests/support/oracle.py`) after each
drain and with the transactions log (each committed transaction exactly once, in commit order)."""

from __future__ import annotations

import json
import re
import signal
import threading
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import psycopg
import pyarrow.parquet as pq
import pytest

from cdc_assets.changelog.segment_file import RELATION_KEY
from cdc_assets.changelog.stream_writer import DrainProgress
from cdc_assets.errors import (
    CdcError,
    DrainLockedError,
    NotSetUpError,
    PublicationMissingError,
    SlotGapError,
    SlotInvalidatedError,
    SlotMissingError,
    SourcePermissionError,
)
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline import drain as drain_module
from cdc_assets.stream.blocks import MessageBlock
from cdc_assets.stream.options import max_proto_version
from cdc_assets.stream.upto import UptoCut
from tests.support.database import Database
from tests.support.oracle import replay
from tests.support.pipeline import Pipeline, invalidate_slot, wait_until
from tests.support.rows import to_python

XID = "SELECT pg_current_xact_id()::text::int8"
RANDOM_20K = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 640))"


class XidRecorder:
    """Commits transactions on one connection and remembers, in commit order, the xid of each one
    the slot must deliver (it changes a published table or emits a transactional message)."""

    def __init__(self, db: Database) -> None:
        self.db = db
        self.conn = db.connect()
        self.xids: list[int] = []

    def close(self) -> None:
        self.conn.close()

    def tx(self, *statements: str) -> int:
        with self.conn.transaction():
            (xid,) = self.conn.execute(XID).fetchone()
            for statement in statements:
                self.conn.execute(statement)
        self.xids.append(xid)
        return xid

    def prepare(self, gid: str, *statements: str) -> int:
        self.conn.execute("BEGIN")
        (xid,) = self.conn.execute(XID).fetchone()
        for statement in statements:
            self.conn.execute(statement)
        self.conn.execute(f"PREPARE TRANSACTION '{gid}'")
        return xid

    def commit_prepared(self, gid: str, xid: int) -> None:
        self.conn.execute(f"COMMIT PREPARED '{gid}'")
        self.xids.append(xid)


@pytest.fixture
def workload(pg: Database) -> Iterator[XidRecorder]:
    w = XidRecorder(pg)
    yield w
    w.close()


def assert_transactions_log(pipe: Pipeline, xids: list[int]) -> Any:
    """The transactions log lists exactly ``xids``, once each, in commit order."""
    log = pipe.reader.transactions()
    assert log.column("xid").to_pylist() == xids
    commits, ends = log.column("commit_lsn").to_pylist(), log.column("end_lsn").to_pylist()
    assert all(a < b for a, b in pairwise(commits)), "commit LSNs must increase strictly"
    assert all(a < b for a, b in pairwise(ends)) and all(c < e for c, e in zip(commits, ends))
    assert ends[-1] <= pipe.checkpoint().lsn == pipe.confirmed_flush()
    return log


def batch_chain(pipe: Pipeline) -> list[tuple[int, list[int]]]:
    """Per batch in log order: its start and the xids of its transactions. Asserts the batches
    form one chain: each starts at or after the end LSN of the previous one's last transaction
    (the checkpoint it started from), so no two drains ever wrote batches from the same position."""
    batches = []
    previous_end = None
    for path in sorted(Path(pipe.changelog, "transactions").glob("*.parquet")):
        start = int(path.name.split("-")[0], 16)
        table = pq.read_table(path)
        ends = table.column("end_lsn").to_pylist()
        assert ends and all(start < end for end in ends)
        if previous_end is not None:  # a batch ends at its last transaction, or at a later position of the server
            assert start >= previous_end, f"batch {path.name} starts before the previous batch ended"
        previous_end = ends[-1]
        batches.append((start, table.column("xid").to_pylist()))
    return batches


def stream_starts(db: Database, streaming: str) -> int:
    """Stream Start messages in a peek of the slot's pending changes with ``streaming`` (a guard
    that a test really produces a streamed transaction; a peek moves nothing)."""
    value = streaming if db.version >= 16 else "true"
    return db.execute(
        "SELECT count(*) FROM pg_logical_slot_peek_binary_changes('cdc_slot', NULL, NULL, 'proto_version', %s,"
        " 'publication_names', 'cdc_pub', 'streaming', %s) WHERE get_byte(data, 0) = ascii('S')",
        (str(max_proto_version(db.version)), value),
    )[0][0]


def records(pipe: Pipeline, table: str) -> list[dict[str, Any]]:
    """The table's change records as dicts (dates and timestamps out of Python's range as
    :class:`~tests.support.rows.OutOfRange`)."""
    out: list[dict[str, Any]] = []
    for chunk in pipe.reader.read_changes(table):
        columns = {name: to_python(chunk.records.column(name)) for name in chunk.records.column_names}
        out.extend(dict(zip(columns, values)) for values in zip(*columns.values()))
    return out


def big_transaction(table: str, first: int, rows: int) -> list[str]:
    """Statements of a transaction far larger than logical_decoding_work_mem (64 kB in the test
    clusters): it spills, or streams when streaming is on, with a rolled-back subtransaction."""
    last = first + rows - 1
    return [
        f"INSERT INTO {table} SELECT g, g, repeat('v', 30) FROM generate_series({first}, {last}) g",
        "SAVEPOINT s1",
        f"INSERT INTO {table} SELECT g, g, 'rolled back' FROM generate_series({last + 1}, {last + rows}) g",
        f"UPDATE {table} SET v = 'rolled back' WHERE a BETWEEN {first} AND {first + 100}",
        "ROLLBACK TO SAVEPOINT s1",
        "SAVEPOINT s2",
        f"UPDATE {table} SET v = 'kept' WHERE a BETWEEN {first} AND {first + 50}",
        "SAVEPOINT s3",
        f"DELETE FROM {table} WHERE a BETWEEN {first + 10} AND {first + 20}",
        "ROLLBACK TO SAVEPOINT s3",
        "RELEASE SAVEPOINT s2",
        f"UPDATE {table} SET b = -b WHERE a BETWEEN {first + 60} AND {first + 70}",
        f"DELETE FROM {table} WHERE a BETWEEN {last - 10} AND {last}",
    ]


# --- mixed workload on every server version ----------------------------------------------------

SCHEMA = """
CREATE TYPE mood AS ENUM ('sad', 'ok', 'happy');
CREATE TABLE kinds (
    id int PRIMARY KEY, m mood, ms mood[], a int[], grid int[][], tags text[], j json, jb jsonb,
    n numeric(12,3), nu numeric, ts timestamptz, d date, iv interval, b bytea, f float8, flag bool, u uuid,
    tt timetz, big text);
ALTER TABLE kinds ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE full_t (id int, v text, big text);
ALTER TABLE full_t REPLICA IDENTITY FULL;
ALTER TABLE full_t ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE idx_t (a int NOT NULL, b int NOT NULL, v text);
CREATE UNIQUE INDEX idx_t_ab ON idx_t (a, b);
ALTER TABLE idx_t REPLICA IDENTITY USING INDEX idx_t_ab;
CREATE TABLE keyless (v text, n int);
CREATE TABLE parent (id int PRIMARY KEY, v text);
CREATE TABLE child (id int PRIMARY KEY, parent_id int REFERENCES parent, v text);
CREATE TABLE serial_t (id serial PRIMARY KEY, v text);
INSERT INTO kinds (id, m, a, j, n, big) VALUES (1, 'ok', '{1}', '[]', 1.5, 'snap'), (2, NULL, NULL, NULL, NULL, NULL);
INSERT INTO full_t VALUES (1, 'dup', NULL), (1, 'dup', NULL), (2, 'x', 'y');
INSERT INTO idx_t SELECT g, g, 'snap' FROM generate_series(1, 5) g;
INSERT INTO keyless VALUES ('k', 1), ('k', 1);
INSERT INTO parent VALUES (1, 'p1'), (2, 'p2');
INSERT INTO child VALUES (1, 1, 'c1'), (2, 2, 'c2');
INSERT INTO serial_t (v) VALUES ('s1'), ('s2');
"""
TABLES = [
    "public.kinds",
    "public.full_t",
    "public.idx_t",
    "public.keyless",
    "public.parent",
    "public.child",
    "public.serial_t",
]

KINDS_ROW = (
    "INSERT INTO kinds VALUES (10, 'happy', '{sad,ok}', '{1,NULL,3}', '{{1,2},{3,4}}', '{\"a b\",\"c,d\",NULL,\"NULL\"}',"
    ' \'{"b": 1, "a": [2]}\', \'{"b": 1, "a": [2]}\', 12.345, 123456789.000000001, \'2024-06-01 12:00:00.5+02\','
    " '2024-02-29', '1 year 2 mons -3 days 04:05:06.5', '\\x00ff10', 0.1, true, 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11',"
    " '12:34:56.789+05:30', 'small')"
)


def test_mixed_workload(pg_any: Database, tmp_path: Path) -> None:
    db = pg_any
    db.execute(SCHEMA)
    pipe = Pipeline(db, tmp_path, TABLES)
    pipe.setup()
    w = XidRecorder(db)
    try:
        _mixed_workload(db, pipe, w)
    finally:
        w.close()


def _mixed_workload(db: Database, pipe: Pipeline, w: XidRecorder) -> None:
    # Round 1, streaming off: every operation and column kind, TOAST, savepoints, a spilled
    # transaction, prepared transactions, messages, an origin.
    w.tx(KINDS_ROW, "INSERT INTO kinds (id) VALUES (11)")
    w.tx(
        "INSERT INTO kinds (id, n, f, nu) VALUES (12, 'NaN', 'NaN', 'NaN'), (13, -0.001, '-Infinity', '-1e-20')",
        "UPDATE kinds SET m = 'sad', a = '{}', tags = '{}' WHERE id = 11",
        "UPDATE kinds SET id = 110 WHERE id = 10",  # key change
        "DELETE FROM kinds WHERE id = 2",
    )
    toast_xid = w.tx(f"INSERT INTO kinds (id, flag, big) VALUES (20, false, {RANDOM_20K}), (21, true, {RANDOM_20K})")
    w.tx("UPDATE kinds SET flag = NOT flag WHERE id = 20")  # big stays out of line: 'u'
    w.tx("UPDATE kinds SET id = 22, flag = true WHERE id = 21")  # key change with unchanged TOAST
    w.tx(
        f"INSERT INTO full_t VALUES (3, 'toast', {RANDOM_20K})",
        "UPDATE full_t SET v = 'one of two' WHERE ctid = (SELECT min(ctid) FROM full_t WHERE v = 'dup')",
        "DELETE FROM full_t WHERE id = 2",
    )
    w.tx("UPDATE full_t SET v = 'toast kept' WHERE id = 3")  # 'O' old row + 'u' new column
    w.tx(
        "INSERT INTO idx_t VALUES (100, 1, 'i'), (101, 1, NULL)",
        "UPDATE idx_t SET v = 'upd' WHERE a = 1",
        "UPDATE idx_t SET b = 2 WHERE a = 100",  # key change through the identity index
        "DELETE FROM idx_t WHERE a = 2",
        "INSERT INTO keyless VALUES ('k', 1), (NULL, NULL)",
    )
    w.tx(
        "INSERT INTO idx_t VALUES (200, 0, 'kept')",
        "SAVEPOINT a",
        "INSERT INTO idx_t VALUES (201, 0, 'rolled back')",
        "UPDATE idx_t SET v = 'rolled back' WHERE a = 200",
        "ROLLBACK TO SAVEPOINT a",
        "INSERT INTO idx_t VALUES (202, 0, 'kept')",
    )
    spilled_xid = w.tx(*big_transaction("idx_t", 10_000, 3000))  # spilled (streaming off)
    p1 = w.prepare("p1", "INSERT INTO parent VALUES (3, 'prepared')", "UPDATE child SET v = 'prep' WHERE id = 1")
    w.prepare("p2", "INSERT INTO parent VALUES (4, 'rolled back prepared')")
    w.tx("INSERT INTO serial_t (v) VALUES ('between')")
    w.commit_prepared("p1", p1)
    db.execute("ROLLBACK PREPARED 'p2'")
    message_xid = w.tx("SELECT pg_logical_emit_message(true, 'wl', 'tx-1')", "INSERT INTO keyless VALUES ('m', 2)")
    db.execute("SELECT pg_logical_emit_message(false, 'wl', 'nontx-1')")
    only_message_xid = w.tx("SELECT pg_logical_emit_message(true, 'wl', 'tx-only')")
    db.execute("SELECT pg_replication_origin_create('wl_origin')")
    w.conn.execute("SELECT pg_replication_origin_session_setup('wl_origin')")
    with w.conn.transaction():
        (origin_xid,) = w.conn.execute(XID).fetchone()
        w.conn.execute("SELECT pg_replication_origin_xact_setup('0/ABCDEF', now())")
        w.conn.execute("INSERT INTO serial_t (v) VALUES ('from origin')")
    w.xids.append(origin_xid)
    w.conn.execute("SELECT pg_replication_origin_session_reset()")
    first = pipe.drain()
    assert first.transactions == len(w.xids) and first.batches == 1
    wait_until(  # the server's statistics confirm the big transaction was spilled to disk
        lambda: db.execute("SELECT spill_txns FROM pg_stat_replication_slots WHERE slot_name = 'cdc_slot'")[0][0] > 0,
        what="spill statistics",
    )
    pipe.assert_mirrors()
    log = assert_transactions_log(pipe, w.xids)

    kinds = records(pipe, "public.kinds")
    unchanged = {(r["new"]["id"], r["_cdc_old_kind"]): r["_cdc_unchanged"] for r in kinds if r["_cdc_op"] == "update"}
    assert unchanged[(20, None)] == ["big"] and unchanged[(22, "K")] == ["big"]
    assert next(r for r in kinds if r["_cdc_op"] == "update" and r["new"]["id"] == 22)["old"]["id"] == 21
    special = next(r for r in kinds if r["_cdc_op"] == "insert" and r["new"]["id"] == 12)
    assert dict(special["_cdc_special"]) == {"new.n": "NaN"} and special["new"]["nu"] == "NaN"
    full = records(pipe, "public.full_t")
    toast_update = next(r for r in full if r["_cdc_op"] == "update" and r["new"]["id"] == 3)
    assert toast_update["_cdc_old_kind"] == "O" and toast_update["_cdc_unchanged"] == ["big"]
    assert len(toast_update["old"]["big"]) == 20480
    rows = log.to_pylist()
    by_xid = {r["xid"]: r for r in rows}
    assert by_xid[origin_xid]["origin"] == "wl_origin" and by_xid[origin_xid]["origin_lsn"] == 0xABCDEF
    assert [r["origin"] for r in rows].count("wl_origin") == 1
    assert by_xid[toast_xid]["changes"] == 2 and by_xid[only_message_xid]["changes"] == 0
    assert by_xid[spilled_xid]["changes"] == 3000 + 73  # what survives its rolled-back subtransactions
    assert by_xid[p1]["gid"] is None  # two-phase off: COMMIT PREPARED arrives as a plain commit
    messages = pipe.reader.messages().to_pylist()
    assert [(m["prefix"], m["content"], m["transactional"], m["xid"]) for m in messages] == [
        ("wl", b"tx-1", True, message_xid),
        ("wl", b"nontx-1", False, None),
        ("wl", b"tx-only", True, only_message_xid),
    ]
    assert messages[0]["end_lsn"] == by_xid[message_xid]["end_lsn"] and messages[0]["position"] == 0

    # Round 2, streaming on, drained on the command line: a streamed transaction with
    # subtransaction aborts stays open across a drain while other transactions commit; TRUNCATE.
    pipe.update_source(streaming="on")
    other = db.connect()
    try:
        other.execute("BEGIN")
        (streamed_xid,) = other.execute(XID).fetchone()
        for statement in big_transaction("idx_t", 20_000, 3000):
            other.execute(statement)
        w.tx("INSERT INTO parent VALUES (10, 'while streaming')")  # its commit flushes the open one's WAL
        assert stream_starts(db, "on") >= 1
        drained = pipe.cli("drain")  # the checkpoint moves past the start of the open transaction
        assert drained.returncode == 0, drained.stderr
        assert drained.stdout.startswith("drained 1 transactions, 1 changes in 1 batches")
        pipe.assert_mirrors()
        for statement in big_transaction("idx_t", 30_000, 2000):
            other.execute(statement)
        w.tx("TRUNCATE parent CASCADE")
        w.tx("INSERT INTO parent VALUES (20, 'after truncate')", "INSERT INTO child VALUES (20, 20, 'c')")
        other.execute("COMMIT")
        w.xids.append(streamed_xid)
    finally:
        other.close()
    with db.connect() as aborted:
        aborted.execute("BEGIN")
        aborted.execute("INSERT INTO idx_t SELECT g, g, 'aborted' FROM generate_series(60000, 63000) g")
        w.tx("INSERT INTO parent VALUES (21, 'while another streams')")
        aborted.execute("ROLLBACK")  # streamed, then Stream Abort of the top-level transaction
    w.tx("TRUNCATE serial_t, keyless RESTART IDENTITY")
    w.tx("INSERT INTO serial_t (v) VALUES ('restarted')", "INSERT INTO keyless VALUES ('again', 3)")
    assert stream_starts(db, "on") >= 1
    drained = pipe.cli("drain")
    assert drained.returncode == 0, drained.stderr
    pipe.assert_mirrors()
    log = assert_transactions_log(pipe, w.xids)
    # Each big_transaction() makes rows + 73 changes that survive its rolled-back subtransactions.
    assert (log.to_pylist()[-4]["xid"], log.to_pylist()[-4]["changes"]) == (streamed_xid, 3000 + 73 + 2000 + 73)
    truncates = [r for r in records(pipe, "public.child") if r["_cdc_op"] == "truncate"]
    assert [t["_cdc_truncate"] for t in truncates] == [
        {"relations": ["public.parent", "public.child"], "cascade": True, "restart_identity": False}
    ]
    serial_truncate = next(r for r in records(pipe, "public.serial_t") if r["_cdc_op"] == "truncate")
    assert serial_truncate["_cdc_truncate"]["restart_identity"] and not serial_truncate["_cdc_truncate"]["cascade"]
    assert db.execute("SELECT id FROM serial_t") == [(1,)]

    # Round 3: parallel streaming on 16+ (on again on 15), a big prepared transaction, more writes
    # between drains.
    mode = "parallel" if db.version >= 16 else "on"
    pipe.update_source(streaming=mode)
    big = w.prepare("p3", *big_transaction("idx_t", 40_000, 3000))
    w.tx("UPDATE kinds SET big = 'now inline' WHERE id = 20", "DELETE FROM kinds WHERE id = 22")
    pipe.drain()
    pipe.assert_mirrors()
    w.commit_prepared("p3", big)
    with db.connect() as aborted:
        aborted.execute("BEGIN")
        aborted.execute("INSERT INTO idx_t SELECT g, g, 'aborted' FROM generate_series(70000, 73000) g")
        w.tx(*big_transaction("idx_t", 50_000, 2000))
        aborted.execute("ROLLBACK")
    assert stream_starts(db, mode) >= 1
    w.tx("UPDATE full_t SET v = 'last' WHERE v = 'dup'", "DELETE FROM idx_t WHERE a >= 40000 AND a % 7 = 0")
    third = pipe.drain()
    assert third.transactions == 3
    assert not any(r["new"] and r["new"]["v"] == "aborted" for r in records(pipe, "public.idx_t"))
    replica = pipe.assert_mirrors()
    assert_transactions_log(pipe, w.xids)
    assert len(replica["public.idx_t"]) == db.execute("SELECT count(*) FROM idx_t")[0][0] > 9000
    # Round 4, binary format: the same kinds of values as send-function bytes.
    pipe.update_source(streaming="off", binary=True)
    w.tx(KINDS_ROW.replace("(10,", "(30,"), "INSERT INTO kinds (id, n, f, nu) VALUES (31, 'NaN', 'Infinity', 'NaN')")
    w.tx(
        "UPDATE kinds SET ts = '-infinity', d = '0044-03-15 BC', iv = '-1 days +02:03:04', tt = '24:00:00+01',"
        " grid = '{{5,NULL},{7,8}}', ms = '{happy,NULL}', jb = 'null', b = '' WHERE id = 30",
        "UPDATE kinds SET flag = false WHERE id = 20",
        "UPDATE kinds SET id = 32 WHERE id = 31",
    )
    pipe.drain()
    pipe.assert_mirrors()
    assert_transactions_log(pipe, w.xids)
    # The snapshot's schemas (from the catalog) and the drained ones (from Relation messages) are
    # the same versions: no table got a second schema version.
    assert {t: s.schema_version for t, s in pipe.checkpoint().tables.items()} == dict.fromkeys(TABLES, 1)
    # Prepared transactions were drained, yet the slot is still not two-phase (invariant 6).
    assert db.execute("SELECT two_phase FROM pg_replication_slots WHERE slot_name = 'cdc_slot'") == [(False,)]


def test_session_settings_do_not_change_values(pg: Database, tmp_path: Path, workload: XidRecorder) -> None:
    """The source DSN sets a time zone, date and interval styles, bytea output and float digits
    that would all change value text; setup and drain pin their own (invariant 5)."""
    options = (
        "-c TimeZone=America/New_York -c DateStyle=SQL,DMY -c IntervalStyle=iso_8601 -c bytea_output=escape"
        " -c extra_float_digits=-3"
    )
    pg.execute(
        "CREATE TABLE v (id int PRIMARY KEY, ts timestamptz, d date, iv interval, b bytea, f float8, r real, tt timetz);"
        " INSERT INTO v VALUES (1, '2024-06-01 12:00:00.123456+02', '2024-02-29', '1 year -2 days 03:04:05.5',"
        " '\\x00ff', 0.1, 1.1, '01:02:03+04')"
    )
    pipe = Pipeline(pg, tmp_path, ["public.v"], dsn=f"{pg.dsn} options='{options}'")
    pipe.setup()
    workload.tx(
        "INSERT INTO v VALUES (2, '1999-12-31 23:59:59.999999-08', '0001-01-01 BC', '-1 days +02:03:04', '\\xdeadbeef',"
        " 1e-300, 3.4e38, '23:59:59.999999-12')",
        "UPDATE v SET f = 0.30000000000000004 WHERE id = 1",
    )
    with psycopg.connect(pipe.dsn, autocommit=True) as conn:
        assert conn.execute("SELECT ts::text FROM v WHERE id = 1").fetchone()[0] == "01/06/2024 06:00:00.123456 EDT"
    pipe.drain()
    replica = pipe.assert_mirrors()
    assert replica["public.v"].keyed[(1,)]["f"] == 0.30000000000000004


# --- bounded memory ------------------------------------------------------------------------


def test_bounded_memory_paths(
    pg: Database, tmp_path: Path, workload: XidRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tiny row blocks and conversion chunks and a spill budget of one byte, every buffered chunk of every
    transaction is converted early and spilled to a temporary Arrow file, also inside streamed
    transactions whose subtransactions abort after earlier chunks were spilled: the log is the same."""
    from cdc_assets.stream import reader
    from cdc_assets.transactions import spill as transactions

    monkeypatch.setattr(transactions, "CHUNK_ROWS", 40)
    monkeypatch.setattr(reader, "BLOCK_ROWS", 16)
    monkeypatch.setattr(transactions, "SPILL_BYTES", 1)
    spilled: list[str] = []
    mkstemp = transactions.tempfile.mkstemp

    def counting_mkstemp(*args: Any, **kwargs: Any) -> Any:
        handle, path = mkstemp(*args, **kwargs)
        spilled.append(path)
        return handle, path

    monkeypatch.setattr(transactions.tempfile, "mkstemp", counting_mkstemp)
    pg.execute("CREATE TABLE idx_t (a int PRIMARY KEY, b int, v text); CREATE TABLE other (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.idx_t", "public.other"], source={"streaming": "on"})
    pipe.setup()
    w = workload
    for i in range(30):
        w.tx(f"INSERT INTO other VALUES ({i}, 'x')", f"INSERT INTO idx_t VALUES ({i}, {i}, 'small')")
    w.tx(*big_transaction("idx_t", 1000, 1500))
    w.tx("TRUNCATE other", "INSERT INTO other SELECT g, 'y' FROM generate_series(1, 200) g")
    pipe.update_source(streaming="off")
    w.tx(*big_transaction("idx_t", 5000, 1500))
    w.tx("UPDATE other SET v = 'z' WHERE id % 3 = 0", "DELETE FROM idx_t WHERE a % 5 = 0")
    pipe.drain(spill_dir=str(tmp_path))
    assert len(spilled) > 100 and not any(Path(p).exists() for p in spilled)
    pipe.assert_mirrors()
    assert_transactions_log(pipe, w.xids)


# --- two-phase slot -------------------------------------------------------------------------


def test_two_phase_slot(pg: Database, tmp_path: Path, workload: XidRecorder) -> None:
    pg.execute("CREATE TABLE t (a int PRIMARY KEY, b int, v text); INSERT INTO t VALUES (1, 1, 'snap')")
    pipe = Pipeline(pg, tmp_path, ["public.t"], source={"two_phase": True})
    pipe.setup()
    assert pg.execute("SELECT two_phase FROM pg_replication_slots WHERE slot_name = 'cdc_slot'") == [(True,)]
    w = workload
    prepared = Path(pipe.changelog, "prepared")

    g1 = w.prepare(
        "g1",
        "INSERT INTO t VALUES (2, 2, 'g1'), (3, 3, 'g1')",
        "SELECT pg_logical_emit_message(true, 'g', 'in g1')",
        "UPDATE t SET v = 'g1 upd' WHERE a = 1",
    )
    w.tx("INSERT INTO t VALUES (4, 4, 'plain')")
    first = pipe.drain()
    assert first.transactions == 1
    checkpoint = pipe.checkpoint()
    assert list(checkpoint.prepared) == ["g1"] and checkpoint.prepared["g1"].xid == g1
    folder = Path(pipe.changelog, checkpoint.prepared["g1"].folder)
    assert folder.is_dir() and sum(pq.read_table(p).num_rows for p in folder.glob("0*.parquet")) == 3
    assert (folder / "messages.parquet").exists()
    assert pipe.confirmed_flush() == checkpoint.lsn > checkpoint.prepared["g1"].end_lsn
    pipe.assert_mirrors()  # prepared, not committed: the source does not show it either

    w.commit_prepared("g1", g1)
    w.prepare("g2", "INSERT INTO t VALUES (5, 5, 'g2 rolled back')", "DELETE FROM t WHERE a = 4")
    pipe.drain()
    replica = pipe.assert_mirrors()
    assert replica["public.t"].keyed[(2,)]["v"] == "g1"
    assert not folder.exists() and list(pipe.checkpoint().prepared) == ["g2"]
    log = pipe.reader.transactions().to_pylist()
    assert (log[-1]["xid"], log[-1]["gid"], log[-1]["changes"]) == (g1, "g1", 3)
    assert [(m["content"], m["xid"], m["end_lsn"]) for m in pipe.reader.messages().to_pylist()] == [
        (b"in g1", g1, log[-1]["end_lsn"])
    ]

    pg.execute("ROLLBACK PREPARED 'g2'")
    g3 = w.prepare("g3", "UPDATE t SET a = 30 WHERE a = 3")
    w.commit_prepared("g3", g3)  # prepared and committed within one drain
    pipe.update_source(streaming="on")
    g4 = w.prepare("g4", *big_transaction("t", 1000, 3000))  # streamed, then Stream Prepare
    assert stream_starts(pg, "on") >= 1
    pipe.drain()
    pipe.assert_mirrors()
    checkpoint = pipe.checkpoint()
    assert list(checkpoint.prepared) == ["g4"]
    assert [p.name for p in prepared.iterdir()] == [Path(checkpoint.prepared["g4"].folder).name]
    w.commit_prepared("g4", g4)
    w.prepare("g5", *big_transaction("t", 10_000, 3000))
    pg.execute("ROLLBACK PREPARED 'g5'")  # Stream Prepare, then Rollback Prepared in the same drain
    pipe.drain()
    pipe.assert_mirrors()
    assert not any(prepared.iterdir()) and pipe.checkpoint().prepared == {}
    log = assert_transactions_log(pipe, w.xids)
    assert log.column("gid").to_pylist() == [None, "g1", "g3", "g4"]
    assert not any(r["new"] and r["new"]["v"] == "g2 rolled back" for r in records(pipe, "public.t"))


# --- schema changes ---------------------------------------------------------------------------


def test_schema_changes(pg: Database, tmp_path: Path, workload: XidRecorder) -> None:
    pg.execute(
        "CREATE TABLE evo (id int PRIMARY KEY, a int, s varchar(20), gone text);"
        " INSERT INTO evo VALUES (1, 1, 'one', 'g1'), (2, 2, 'two', 'g2')"
    )
    pipe = Pipeline(pg, tmp_path, ["public.evo"])
    pipe.setup()
    w = workload
    w.tx("INSERT INTO evo VALUES (3, 3, 'three', 'g3')")
    w.tx("ALTER TABLE evo ADD COLUMN added text")  # between transactions (one of its own: DDL capture's message)
    w.tx("INSERT INTO evo VALUES (4, 4, 'four', 'g4', 'add4')", "UPDATE evo SET added = 'add1' WHERE id = 1")
    pipe.drain()
    pipe.assert_mirrors()
    w.tx("ALTER TABLE evo DROP COLUMN gone")
    w.tx("UPDATE evo SET s = 'deux' WHERE id = 2")
    w.tx(  # inside one transaction
        "INSERT INTO evo VALUES (5, 5, 'five', NULL)",
        "ALTER TABLE evo ALTER COLUMN a TYPE bigint",
        "INSERT INTO evo VALUES (6, 1099511627776, 'six', 'add6')",
        "ALTER TABLE evo ALTER COLUMN s TYPE text",
        "INSERT INTO evo VALUES (7, 7, 'a text longer than twenty characters', NULL)",
        "UPDATE evo SET id = 70 WHERE id = 7",
    )
    w.tx("UPDATE evo SET a = a * 1000000000000 WHERE id = 1", "DELETE FROM evo WHERE id = 3")
    pipe.drain()
    replica = pipe.assert_mirrors()
    assert replica["public.evo"].columns == ("id", "a", "s", "added")
    assert replica["public.evo"].schema_versions == [1, 2, 3, 4, 5]
    chunks = list(pipe.reader.read_changes("public.evo"))
    # One chunk per segment: the snapshot; drain 1 (before and after ADD COLUMN); drain 2 (after
    # DROP COLUMN, after each ALTER TYPE inside one transaction).
    assert [c.schema_version for c in chunks] == [1, 1, 2, 3, 4, 5]
    assert [[(col.name, col.type_oid) for col in c.relation.columns] for c in chunks[1:]] == [
        [("id", 23), ("a", 23), ("s", 1043), ("gone", 25)],
        [("id", 23), ("a", 23), ("s", 1043), ("gone", 25), ("added", 25)],
        [("id", 23), ("a", 23), ("s", 1043), ("added", 25)],
        [("id", 23), ("a", 20), ("s", 1043), ("added", 25)],
        [("id", 23), ("a", 20), ("s", 25), ("added", 25)],
    ]
    files = sorted(Path(pipe.changelog, "tables", "public.evo").glob("*.parquet"))
    metadata = [json.loads(pq.read_schema(f).metadata[RELATION_KEY]) for f in files]
    assert [m["schema_version"] for m in metadata] == [1, 1, 2, 3, 4, 5]
    assert [m["columns"] for m in metadata] == [c.relation.to_json()["columns"] for c in chunks]
    assert [f.name[17:] for f in files] == [f"{p:04d}.parquet" for p in (0, 0, 1, 0, 1, 2)]
    assert str(pq.read_schema(files[-1]).field("new").type.field("a").type) == "int64"
    state = pipe.checkpoint().tables["public.evo"]
    assert state.schema_version == 5 and [c.name for c in state.relation.columns] == ["id", "a", "s", "added"]
    # The next drain numbers on from the checkpoint.
    w.tx("ALTER TABLE evo ADD COLUMN grid int[][]")
    w.tx("UPDATE evo SET grid = '{{1,2},{3,4}}' WHERE id = 1")
    pipe.drain()
    # A 2-D array column dropped before the drain keeps its dimensions (and schema version) in the
    # changes made while it existed, although today's catalog no longer has the column.
    w.tx("UPDATE evo SET grid = '{{5,6},{7,8}}' WHERE id = 2")
    w.tx("ALTER TABLE evo DROP COLUMN grid")
    w.tx("UPDATE evo SET s = 'uno' WHERE id = 1")
    pipe.drain()
    chunks = list(pipe.reader.read_changes("public.evo"))[6:]
    assert [(c.schema_version, [(col.name, col.ndims) for col in c.relation.columns]) for c in chunks] == [
        (6, [("id", 0), ("a", 0), ("s", 0), ("added", 0), ("grid", 2)]),
        (6, [("id", 0), ("a", 0), ("s", 0), ("added", 0), ("grid", 2)]),
        (7, [("id", 0), ("a", 0), ("s", 0), ("added", 0)]),
    ]
    update = chunks[1].records.to_pylist()[0]
    assert update["new"]["grid"] == [[5, 6], [7, 8]] and update["_cdc_special"] is None
    assert replay(pipe.changelog)["public.evo"].schema_versions == [1, 2, 3, 4, 5, 6, 7]
    pipe.assert_mirrors()
    # Inside a streamed transaction.
    pipe.update_source(streaming="on")
    w.tx(
        "INSERT INTO evo (id, a, s) SELECT g, g, repeat('s', 40) FROM generate_series(100, 2099) g",
        "ALTER TABLE evo ADD COLUMN z int",
        "INSERT INTO evo (id, a, s, z) SELECT g, g, repeat('z', 40), -g FROM generate_series(3000, 4999) g",
        "UPDATE evo SET z = 0 WHERE id BETWEEN 100 AND 150",
    )
    assert stream_starts(pg, "on") >= 1
    pipe.drain()
    assert replay(pipe.changelog)["public.evo"].schema_versions == [1, 2, 3, 4, 5, 6, 7, 8]
    pipe.assert_mirrors()
    assert_transactions_log(pipe, w.xids)


@pytest.mark.slow
def test_a_domain_column_keeps_its_base_type_across_a_reconnect(pg: Database, tmp_path: Path) -> None:
    """A domain's Type message names its base type (``int4``), not the domain; after the walsender
    is ended, the following drain's new session receives it again with the Relation message. The
    column's type still comes from ``pg_type``: every segment has ``score`` as int32 (it used to
    turn into text after the reconnect, and the apply then rewrote the Delta column as a string)."""
    pg.execute("CREATE DOMAIN posint AS integer CHECK (value > 0)")
    pg.execute("CREATE TABLE scores (id int PRIMARY KEY, score posint, scores posint[])")
    pipe = Pipeline(pg, tmp_path, ["public.scores"])
    pipe.setup()
    follower = pipe.popen("drain", "--follow", "600")
    try:
        for n in range(3):  # the last two after a reconnect each
            pg.execute("INSERT INTO scores VALUES (%s, %s, ARRAY[%s]::posint[])", (n, n + 1, n + 1))
            flushed = pipe.flush_lsn()
            wait_until(
                lambda f=flushed: follower.poll() is not None or pipe.checkpoint().lsn >= f, 60, "a durable insert"
            )
            pid = wait_until(lambda: follower.poll() is not None or _walsender_pid(pg), 60, "a walsender")
            pg.execute("SELECT pg_terminate_backend(%s)", (pid,))
            wait_until(
                lambda p=pid: follower.poll() is not None or _walsender_pid(pg) not in (None, p), 60, "a reconnect"
            )
        follower.send_signal(signal.SIGTERM)  # ends with a last durable batch
        out, err = follower.communicate(timeout=60)
        assert follower.returncode == 130, (out, err)
        assert err.count("reconnecting") == 3, err
    finally:
        follower.kill()
        follower.wait()
    types = {str(pq.read_schema(path).field("new").type) for path in (tmp_path / "changelog").glob("tables/*/*")}
    assert types == {"struct<id: int32, score: int32, scores: list<element: int32>>"}, types
    pipe.assert_mirrors()


def _walsender_pid(pg: Database, slot: str = "cdc_slot") -> int | None:
    rows = pg.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    return rows[0][0] if rows else None


# --- small batches ----------------------------------------------------------------------------


def bounded_progress(limit: int) -> tuple[list[DrainProgress], Any]:
    seen: list[DrainProgress] = []

    def progress(p: DrainProgress) -> None:
        seen.append(p)
        assert len(seen) <= limit, f"the drain made {len(seen)} peek calls: livelocked?"

    return seen, progress


@pytest.mark.parametrize("streaming", ["off", "on"])
def test_small_batches(
    pg: Database, tmp_path: Path, workload: XidRecorder, monkeypatch: pytest.MonkeyPatch, streaming: str
) -> None:
    """``batch_changes: 7`` and blocks of 8 messages: many batches, each starting where the last
    one's checkpoint ended, each ended at the first transaction boundary after 7 messages; a
    transaction larger than the limit is drained whole."""
    from cdc_assets.stream import reader

    monkeypatch.setattr(reader, "BLOCK_ROWS", 8)
    pg.execute("CREATE TABLE idx_t (a int PRIMARY KEY, b int, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.idx_t"], source={"batch_changes": 7, "streaming": streaming})
    pipe.setup()
    w = workload
    for i in range(40):
        w.tx(*[f"INSERT INTO idx_t VALUES ({i * 10 + j}, {j}, 'x')" for j in range(1 + i % 3)])
        if i % 4 == 0:
            pg.execute("SELECT pg_logical_emit_message(false, 'between', %s)", (str(i),))
    w.tx(*big_transaction("idx_t", 10_000, 3000))
    w.tx("UPDATE idx_t SET v = 'after' WHERE a < 100")
    if streaming == "on":
        assert stream_starts(pg, "on") >= 1
    _, progress = bounded_progress(60)
    result = pipe.drain(progress=progress)
    assert result.transactions == 42
    batches = batch_chain(pipe)
    # (a batch may hold no transaction: the server's position moved past WAL with nothing to send)
    assert result.batches >= len(batches) >= 10 and batches[0][0] == result.start_lsn
    # A transaction is at least 4 messages (B R I C): a block of 8 holds at most two, plus the end
    # of one begun in the block before.
    assert max(len(xids) for _, xids in batches) <= 3
    # Each non-transactional message exactly once, in order, although batches end all around them.
    messages = pipe.reader.messages()
    assert messages.column("content").to_pylist() == [str(i).encode() for i in range(0, 40, 4)]
    pipe.assert_mirrors()
    assert_transactions_log(pipe, w.xids)


def test_thousands_of_transactions_in_one_batch(pg: Database, tmp_path: Path) -> None:
    """5,000 one-row transactions in one batch (the vectorized path, and the commit table grown
    past its first arrays): each change carries its own transaction's xid and commit LSN."""
    pg.execute("CREATE TABLE many (id int PRIMARY KEY, xid bigint NOT NULL)")
    pipe = Pipeline(pg, tmp_path, ["public.many"])
    pipe.setup()
    pg.execute(
        "DO $$ BEGIN FOR i IN 1..5000 LOOP"
        " INSERT INTO many VALUES (i, txid_current() % 4294967296); COMMIT; END LOOP; END $$"
    )
    result = pipe.drain()
    assert result.batches == 1 and result.transactions == 5000
    xids = [row[0] for row in pg.execute("SELECT xid FROM many ORDER BY id")]
    log = assert_transactions_log(pipe, xids)
    commit_of = dict(zip(log.column("xid").to_pylist(), log.column("commit_lsn").to_pylist()))
    changes = records(pipe, "public.many")
    assert [c["new"]["id"] for c in changes] == list(range(1, 5001))
    assert all(c["_cdc_xid"] == c["new"]["xid"] and c["_cdc_commit_lsn"] == commit_of[c["_cdc_xid"]] for c in changes)


def test_an_idle_slot_moves_past_unpublished_wal(pg: Database, tmp_path: Path) -> None:
    """WAL written elsewhere does not hold an idle slot back: the server's position (a keepalive)
    becomes the checkpoint and the confirmed position, with nothing logged. With ``heartbeat:
    true`` each drain also commits a heartbeat message and logs it."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE TABLE unpublished (id int)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pipe.setup()
    pg.execute("INSERT INTO unpublished SELECT generate_series(1, 1000)")
    written = pipe.flush_lsn()
    idle = pipe.drain()
    assert idle.transactions == 0 and idle.checkpoint_lsn >= written > idle.start_lsn
    assert pipe.confirmed_flush() == idle.checkpoint_lsn == pipe.checkpoint().lsn
    assert not list(Path(pipe.changelog, "transactions").glob("*.parquet"))
    pipe.update_source(heartbeat=True)
    beat = pipe.drain()
    assert beat.transactions == 1 and beat.checkpoint_lsn > written and pipe.confirmed_flush() == beat.checkpoint_lsn
    (message,) = pipe.reader.messages().to_pylist()
    assert message["prefix"] == "cdc_assets.heartbeat" and message["transactional"]
    assert pipe.reader.transactions().column("changes").to_pylist() == [0]


# --- replays ----------------------------------------------------------------------------------


def spy_replays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Collects the end LSN of every Commit a peek hands the drain at or below its checkpoint."""
    replayed: list[int] = []
    original = drain_module.TransactionAssembler.feed_blocks

    def feed_blocks(self: Any, blocks: Any) -> int:
        def spy() -> Iterator[MessageBlock]:
            for block in blocks:
                replayed.extend(lsn for lsn, data in block.rows() if data[:1] == b"C" and lsn <= self.checkpoint_lsn)
                yield block

        return original(self, spy())

    monkeypatch.setattr(drain_module.TransactionAssembler, "feed_blocks", feed_blocks)
    return replayed


def test_checkpoint_behind_the_slot_is_refused(pg: Database, tmp_path: Path, workload: XidRecorder) -> None:
    """The change log restored to an older checkpoint while the slot moved on: the slot is ahead
    of the checkpoint, so the transactions in between would be lost — refuse, touch nothing."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pipe.setup()
    workload.tx("INSERT INTO t VALUES (1, 'a')")
    old = pipe.checkpoint_bytes()
    pipe.drain()
    workload.tx("INSERT INTO t VALUES (2, 'b')")
    Path(pipe.changelog, "_checkpoint.json").write_bytes(old)
    files = sorted(p for p in Path(pipe.changelog).rglob("*") if p.is_file())
    confirmed = pipe.confirmed_flush()
    message = (
        rf"replication slot cdc_slot has confirmed LSN {format_lsn(confirmed)}, past the change log's checkpoint"
        rf" {format_lsn(json.loads(old)['lsn'])}: transactions between the two were consumed by something else"
    )
    with pytest.raises(SlotGapError, match=message):
        pipe.drain()
    cli = pipe.cli("drain")
    assert cli.returncode == 1 and re.fullmatch(f"cdc-assets: {message}.*\n", cli.stderr), cli.stderr
    assert pipe.confirmed_flush() == confirmed and pipe.checkpoint_bytes() == old
    assert sorted(p for p in Path(pipe.changelog).rglob("*") if p.is_file()) == files  # nothing deleted


def test_killed_after_checkpoint_advances_first(
    pg: Database, tmp_path: Path, workload: XidRecorder, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A drain killed between checkpoint and slot advance: the slot is behind the checkpoint. The
    next drain advances it first and logs nothing twice."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t"], source={"batch_changes": 7})
    pipe.setup()
    for i in range(10):
        workload.tx(f"INSERT INTO t VALUES ({i}, 'a')", f"UPDATE t SET v = 'b' WHERE id = {i}")
    start = pipe.confirmed_flush()
    killed = pipe.cli("drain", env={**pipe.environ, "CDC_ASSETS_FAULT": "after-checkpoint:2"})
    assert killed.returncode == -signal.SIGKILL
    checkpoint = pipe.checkpoint()
    assert pipe.confirmed_flush() < checkpoint.lsn and pipe.confirmed_flush() > start  # batch 1 advanced, batch 2 not
    logged = len(pipe.reader.transactions())
    assert 0 < logged < 10
    workload.tx("DELETE FROM t WHERE id = 0")
    replayed = spy_replays(monkeypatch)
    result = pipe.drain()
    assert replayed == []  # advanced before the first peek: nothing the log holds was sent again
    assert result.start_lsn == checkpoint.lsn and result.transactions == 10 - logged + 1
    pipe.assert_mirrors()
    assert_transactions_log(pipe, workload.xids)


@pytest.mark.parametrize("batch_changes", [100_000, 7])
def test_rewound_slot_replays_are_skipped(
    pg: Database, tmp_path: Path, workload: XidRecorder, monkeypatch: pytest.MonkeyPatch, batch_changes: int
) -> None:
    """A stream that starts behind the checkpoint (as if the server had lost the confirmed position
    again) re-sends transactions the log holds: the drain skips every one at or below the
    checkpoint — also in a batch that mixes old and new ones — and logs the rest once. With small
    batches, batches that hold only re-sent transactions must not repeat forever."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t"], source={"batch_changes": batch_changes})
    pipe.setup()
    for i in range(5):
        workload.tx(f"INSERT INTO t VALUES ({i}, 'a')")
    killed = pipe.cli("drain", env={**pipe.environ, "CDC_ASSETS_FAULT": "after-checkpoint"})
    assert killed.returncode == -signal.SIGKILL
    checkpoint = pipe.checkpoint().lsn
    assert pipe.confirmed_flush() < checkpoint
    logged = len(pipe.reader.transactions())
    for i in range(5):
        workload.tx(f"UPDATE t SET v = 'b' WHERE id = {i}", f"INSERT INTO t VALUES ({i + 10}, 'c')")
    stream = drain_module.SlotStream
    # Start where the slot is, not at the checkpoint: as a server that lost its confirmed position would.
    monkeypatch.setattr(drain_module, "SlotStream", lambda *args, **kwargs: stream(*args[:3], 0, **kwargs))
    replayed = spy_replays(monkeypatch)
    _, progress = bounded_progress(40)
    result = pipe.drain(progress=progress)
    assert len(replayed) == logged >= 1  # the slot really re-sent the logged transactions
    assert result.transactions == 5 + 5 - logged and result.total_changes == 10 + 5 - logged
    pipe.assert_mirrors()
    assert_transactions_log(pipe, workload.xids)


# --- refusals ---------------------------------------------------------------------------------


def refused(pipe: Pipeline, error: type[CdcError], message: str) -> None:
    """Python and command-line drain both refuse with ``message``; nothing moves."""
    confirmed, checkpoint = pipe.confirmed_flush(), pipe.checkpoint_bytes()
    with pytest.raises(error, match=message):
        pipe.drain()
    cli = pipe.cli("drain")
    assert cli.returncode == 1, cli
    assert re.fullmatch(f"cdc-assets: {message}.*\n", cli.stderr, re.DOTALL) and cli.stderr.count("\n") == 1, cli.stderr
    assert pipe.confirmed_flush() == confirmed and pipe.checkpoint_bytes() == checkpoint


@pytest.fixture
def ready(pg: Database, tmp_path: Path, workload: XidRecorder) -> Pipeline:
    """A set-up pipeline with one drained and one pending transaction."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pipe.setup()
    workload.tx("INSERT INTO t VALUES (1, 'a')")
    pipe.drain()
    workload.tx("INSERT INTO t VALUES (2, 'b')")
    return pipe


def test_refuses_a_missing_slot(ready: Pipeline) -> None:
    ready.db.execute("SELECT pg_drop_replication_slot('cdc_slot')")
    refused(
        ready,
        SlotMissingError,
        r"replication slot cdc_slot does not exist: the changes after the change log's checkpoint went with it"
        r" .* run `cdc-assets recover`",
    )


def test_refuses_a_missing_publication(ready: Pipeline) -> None:
    ready.db.execute("DROP PUBLICATION cdc_pub")
    refused(
        ready,
        PublicationMissingError,
        r"publication cdc_pub does not exist \(reading replication slot cdc_slot at LSN [0-9A-F]+/[0-9A-F]+\)",
    )


def test_refuses_a_slot_ahead_of_the_checkpoint(ready: Pipeline) -> None:
    checkpoint = ready.checkpoint().lsn
    ready.db.execute("SELECT pg_replication_slot_advance('cdc_slot', pg_current_wal_lsn())")
    ahead = ready.confirmed_flush()
    assert ahead > checkpoint
    refused(
        ready,
        SlotGapError,
        rf"replication slot cdc_slot has confirmed LSN {format_lsn(ahead)}, past the change log's checkpoint"
        rf" {format_lsn(checkpoint)}: .* Nothing was advanced. Remedy: run `cdc-assets recover`",
    )


def test_refuses_an_invalidated_slot(ready: Pipeline) -> None:
    invalidate_slot(ready.db, "cdc_slot", "INSERT INTO t VALUES (3, 'c')")
    refused(
        ready,
        SlotInvalidatedError,
        r"replication slot cdc_slot was invalidated by the server \(wal_status 'lost'.* Remedy: run `cdc-assets recover`",
    )


def test_refuses_a_role_without_replication(ready: Pipeline) -> None:
    db = ready.db
    role = f"r_{db.name}_norepl"
    db.execute(f'CREATE ROLE "{role}" LOGIN')
    try:
        ready.dsn = db.cluster.dsn(db.name, user=role)
        refused(
            ready,
            SourcePermissionError,
            rf"role {role} cannot use replication slots: it needs the REPLICATION attribute",
        )
    finally:
        db.execute(f'DROP OWNED BY "{role}"')
        db.execute(f'DROP ROLE "{role}"')


def test_refuses_bad_config_and_missing_setup(pg: Database, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    with pytest.raises(NotSetUpError, match=r"the change log at .* has no checkpoint: run `cdc-assets setup` first"):
        pipe.drain()
    cli = pipe.cli("drain")
    assert cli.returncode == 1 and "has no checkpoint: run `cdc-assets setup` first" in cli.stderr
    assert pipe.confirmed_flush() is None and not Path(pipe.changelog).exists()
    pipe.setup()
    checkpoint = pipe.checkpoint_bytes()
    unset = pipe.cli("drain", env={k: v for k, v in pipe.environ.items() if k != "CDC_SOURCE_DSN"})
    assert unset.returncode == 2 and unset.stderr.endswith("environment variable CDC_SOURCE_DSN is not set\n")
    pipe.update_source(batch_size=10)
    unknown = pipe.cli("drain")
    assert unknown.returncode == 2 and unknown.stderr.endswith("source.batch_size: unknown setting\n")
    assert pipe.checkpoint_bytes() == checkpoint


# --- concurrent drains ----------------------------------------------------------------------


@pytest.mark.slow
def test_two_drains_never_interleave(pg: Database, tmp_path: Path, workload: XidRecorder) -> None:
    """While a drain runs, a second one exits with the lock message; with ``--wait`` it runs
    after the first finished: its batches start where the first one's checkpoint ended."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t"], source={"batch_changes": 7})
    pipe.setup()
    for i in range(20):
        workload.tx(f"INSERT INTO t VALUES ({i}, 'first')")
    release = threading.Event()
    paused = threading.Event()
    outcome: list[Any] = []

    def progress(p: DrainProgress) -> None:
        if not paused.is_set():
            paused.set()
            assert release.wait(60), "never released"

    def first_drain() -> None:
        try:
            outcome.append(pipe.drain(progress=progress))
        except BaseException as error:  # noqa: BLE001
            outcome.append(error)

    thread = threading.Thread(target=first_drain)
    thread.start()
    try:
        assert paused.wait(60)
        holder = pg.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = 'cdc-assets:drain-lock' AND datname = current_database()"
        )[0][0]
        busy = pipe.cli("drain")
        assert busy.returncode == 1
        assert busy.stderr == (
            f"cdc-assets: slot cdc_slot is being drained by another process (pid {holder}): wait for it to finish,"
            " or run with --wait\n"
        )
        with pytest.raises(DrainLockedError):
            pipe.drain(wait=False)
        for i in range(20, 30):
            workload.tx(f"INSERT INTO t VALUES ({i}, 'second')")
        waiting = pipe.popen("drain", "--wait")
        wait_until(
            lambda: pg.execute("SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"),
            what="the second drain waiting for the lock",
        )
        assert waiting.poll() is None
    finally:
        release.set()
        thread.join()
    first = outcome[0]
    assert not isinstance(first, BaseException), first
    out, err = waiting.communicate(timeout=60)
    assert waiting.returncode == 0, err
    assert first.transactions == 20 and out.startswith("drained 10 transactions")
    match = re.search(r"checkpoint (\S+) -> (\S+)", out)
    assert match and match.group(1) == format_lsn(first.checkpoint_lsn)
    assert match.group(2) == format_lsn(pipe.checkpoint().lsn)
    batches = batch_chain(pipe)
    # The first drain's batches hold exactly the first 20 transactions, the second's the other 10.
    assert len(batches) == first.batches + len(batches[first.batches :]) and first.batches >= 3
    assert [x for _, xids in batches[: first.batches] for x in xids] == workload.xids[:20]
    assert [x for _, xids in batches[first.batches :] for x in xids] == workload.xids[20:]
    assert batches[first.batches][0] == first.checkpoint_lsn
    pipe.assert_mirrors()
    assert_transactions_log(pipe, workload.xids)


def test_a_drain_up_to_an_lsn_stops_before_the_first_transaction_ending_after_it() -> None:
    """``upto_lsn`` (the parity check's drain): the stream is cut at the Begin of the first
    transaction whose commit starts at or after it; a streamed block before it, with a
    transactional message inside, is read through (the cut tracks stream blocks to decode it)."""
    from cdc_assets.pgoutput.messages import BeginMessage, StreamStartMessage, StreamStopMessage
    from tests.support.assembly import LSN_STEP, T0_US, Rows, insert, message

    rows = Rows().relation()
    rows.add(StreamStartMessage(900, True), message(b"in a stream", xid=900), insert(1, "a", xid=900))
    rows.add(StreamStopMessage())
    rows.add(BeginMessage(final_lsn=rows.lsn + 2 * LSN_STEP, commit_time_us=T0_US, xid=700), insert(2, "b"))
    rows.commit(700)
    upto = rows.lsn
    cut_at = len(rows.rows)
    rows.add(BeginMessage(final_lsn=rows.lsn + 2 * LSN_STEP, commit_time_us=T0_US, xid=701), insert(3, "c"))
    rows.commit(701)
    (block,) = rows.blocks()
    head, reached = UptoCut(upto).head(block)
    assert reached and len(head) == cut_at
    head, reached = UptoCut(rows.lsn + 1).head(block)
    assert not reached and len(head) == len(block)
