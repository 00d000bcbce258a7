"""DDL in the stream (docs/architecture.md, "DDL in the stream"), against real PostgreSQL and the
real drain: setup installs the capture's event triggers; each ALTER TABLE of a published table
reaches the change log as a schema-change message with the table's columns, key and rewrite, in
order with the rows of its transaction; an unpublished table's DDL does not; a role that may not
create event triggers gets a warning and a working setup; ``ddl_capture: false`` removes the
triggers; a malformed message stops the drain with nothing advanced; a drain killed around a DDL
loses and duplicates no message."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from cdc_assets.changelog.schema_changes import TableDdl
from cdc_assets.errors import CdcError
from cdc_assets.faults import ENV as FAULT_ENV
from cdc_assets.source import DDL_PREFIX, DdlCapture
from tests.support.database import Database
from tests.support.pipeline import Pipeline

TRIGGERS = "SELECT evtname::text, evtevent::text FROM pg_event_trigger ORDER BY 1"
FUNCTIONS = "SELECT proname::text FROM pg_proc WHERE proname LIKE 'cdc_assets_%' ORDER BY 1"
INSTALLED = [("cdc_assets_ddl_cdc_slot", "ddl_command_end"), ("cdc_assets_rewrite_cdc_slot", "table_rewrite")]
INT4, INT8, TEXT, FLOAT8 = 23, 20, 25, 701


def _columns(ddl: TableDdl) -> list[tuple[int, str, int, bool, str | None]]:
    return [(c.attnum, c.name, c.type_oid, c.has_missing, c.missing) for c in ddl.message.columns]


def _ddl_messages(pipe: Pipeline) -> list[dict[str, object]]:
    return [m for m in pipe.reader.messages().to_pylist() if m["prefix"] == DDL_PREFIX]


def test_each_alter_table_reaches_the_log_in_order_with_the_rows(pg_any: Database, tmp_path: Path) -> None:
    """ADD COLUMN … DEFAULT between two inserts of one transaction, RENAME COLUMN, ALTER TYPE …
    USING (a rewrite), DROP COLUMN and a volatile default (a rewrite): one message each, with the
    columns by attnum after the command, ``attmissingval`` for the constant default, the key and
    the rewrite's reason, in LSN order with the table's changes. The unpublished table's DDL
    leaves nothing."""
    pg = pg_any
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, a int, b text, c text); CREATE TABLE other (id int PRIMARY KEY);"
        " INSERT INTO t SELECT g, g, 'b', 'c' FROM generate_series(1, 3) g"
    )
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    assert pipe.setup().ddl_capture == DdlCapture("installed")
    assert pg.execute(TRIGGERS) == INSTALLED
    with pg.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO t VALUES (10, 10, 'x', 'y')")
        conn.execute("ALTER TABLE t ADD COLUMN e int DEFAULT 7")
        conn.execute("INSERT INTO t VALUES (11, 11, 'x', 'y', 8)")
    pg.execute("ALTER TABLE t RENAME COLUMN b TO b2")
    pg.execute("ALTER TABLE other ADD COLUMN z int DEFAULT 1")
    pg.execute("ALTER TABLE t ALTER COLUMN a TYPE bigint USING a * 1000 + 1")
    pg.execute("ALTER TABLE t DROP COLUMN c")
    pg.execute("ALTER TABLE t ADD COLUMN g float8 DEFAULT random()")
    pg.execute("UPDATE t SET e = 9 WHERE id = 1")
    pipe.drain()

    changes = pipe.reader.schema_changes("public.t")
    assert [(d.message.command_tag, d.message.rewrite_reasons()) for d in changes] == [
        ("ALTER TABLE", []),
        ("ALTER TABLE", []),
        ("ALTER TABLE", ["column type"]),
        ("ALTER TABLE", []),
        ("ALTER TABLE", ["default value"]),
    ]
    added = [(1, "id", INT4, False, None), (2, "a", INT4, False, None), (3, "b", TEXT, False, None)]
    tail = [(4, "c", TEXT, False, None), (5, "e", INT4, True, "{7}")]
    retyped = [(1, "id", INT4, False, None), (2, "a", INT8, False, None), (3, "b2", TEXT, False, None)]
    dropped = [*retyped, (5, "e", INT4, False, None)]  # the rewrite wrote the default into every row
    assert [_columns(d) for d in changes] == [
        added + tail,
        [*added[:2], (3, "b2", TEXT, False, None), *tail],
        [*retyped, (4, "c", TEXT, False, None), (5, "e", INT4, False, None)],
        dropped,
        [*dropped, (6, "g", FLOAT8, False, None)],
    ]
    oid = pg.execute("SELECT 'public.t'::regclass::oid::int8")[0][0]
    assert {(d.message.relation_oid, d.message.qualified_name, d.message.key, d.message.slot) for d in changes} == {
        (oid, "public.t", (1,), "cdc_slot")
    }

    # In LSN order with the rows: the first between the two inserts of its transaction, the
    # others each in a transaction of its own, before the update.
    rows = [
        r
        for chunk in pipe.reader.read_changes("public.t", after=pipe.checkpoint().snapshot_lsn)
        for r in chunk.records.to_pylist()
    ]
    first, second, update = rows
    assert first["_cdc_commit_lsn"] == second["_cdc_commit_lsn"] == changes[0].commit_lsn
    assert first["_cdc_position"] < changes[0].position < second["_cdc_position"]
    ends = [d.end_lsn for d in changes]
    assert second["_cdc_end_lsn"] == ends[0] < ends[1] < ends[2] < ends[3] < ends[4] < update["_cdc_end_lsn"]
    assert all(d.lsn <= d.commit_lsn < d.end_lsn for d in changes)  # a message's LSN is its record's end
    assert pipe.checkpoint().tables["public.t"].last_ddl_lsn == ends[-1]
    assert pipe.reader.schema_changes("public.t", after=ends[1], upto=ends[3]) == changes[2:4]
    assert pipe.reader.schema_changes("public.t", after=ends[-1]) == []
    assert len(_ddl_messages(pipe)) == 5  # nothing for public.other


def test_a_key_and_replica_identity_changes(pg: Database, tmp_path: Path) -> None:
    """The key follows the replica identity: the primary key, a unique index, every column."""
    pg.execute("CREATE TABLE k (a int NOT NULL, b int NOT NULL, c text, PRIMARY KEY (b, a))")
    pipe = Pipeline(pg, tmp_path, ["public.k"])
    pipe.setup()
    pg.execute("CREATE UNIQUE INDEX k_c ON k (c, a); ALTER TABLE k ALTER COLUMN c SET NOT NULL")
    pg.execute("ALTER TABLE k REPLICA IDENTITY USING INDEX k_c")
    pg.execute("ALTER TABLE k REPLICA IDENTITY FULL")
    pipe.drain()
    assert [(d.message.replica_identity, d.message.key) for d in pipe.reader.schema_changes("public.k")] == [
        ("d", (2, 1)),
        ("i", (3, 1)),
        ("f", (1, 2, 3)),
    ]


def test_without_the_privilege_setup_warns_and_goes_on(
    pg: Database, tmp_path: Path, make_role: Callable[..., str]
) -> None:
    """A role with REPLICATION that owns the table but is no superuser: setup prints a warning
    naming what to grant, creates nothing of the capture, and sets up the rest; DDL then reaches
    the log only as the next changes' column lists."""
    role = make_role("cdc", "REPLICATION")
    pg.execute(f'CREATE TABLE t (id int PRIMARY KEY); ALTER TABLE t OWNER TO "{role}"')
    # the publication and the function could be created: the event trigger is what is refused
    pg.execute(f'GRANT CREATE ON DATABASE "{pg.name}" TO "{role}"; GRANT CREATE ON SCHEMA public TO "{role}"')
    pipe = Pipeline(pg, tmp_path, ["public.t"], dsn=pg.cluster.dsn(pg.name, user=role))
    done = pipe.cli("setup")
    assert done.returncode == 0, done.stderr
    (warning,) = [line for line in done.stdout.splitlines() if line.startswith("WARNING:")]
    assert warning.startswith(
        'WARNING: DDL capture not installed: permission denied to create event trigger "cdc_assets_ddl_cdc_slot".'
        f" Role {role} may not create event triggers: that takes a superuser on self-hosted PostgreSQL, a member of"
        " rds_superuser on Amazon RDS and Aurora"
    ), warning
    assert "source.ddl_capture: false" in warning
    assert pg.execute(TRIGGERS) == [] and pg.execute(FUNCTIONS) == []
    assert pipe.checkpoint() is not None
    pg.execute("ALTER TABLE t ADD COLUMN v text DEFAULT 'x'; INSERT INTO t VALUES (1)")
    pipe.drain()
    assert _ddl_messages(pipe) == [] and pipe.reader.schema_changes("public.t") == []


def test_ddl_capture_off_removes_the_triggers_and_on_installs_them_again(pg: Database, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    first = pipe.cli("setup")
    assert "installed DDL capture (event triggers on ddl_command_end and table_rewrite)" in first.stdout.splitlines()
    again = pipe.cli("setup")
    assert again.stdout.startswith("already set up"), again.stdout  # installed as this version writes it

    pipe.update_source(ddl_capture=False)
    off = pipe.cli("setup")
    assert off.returncode == 0, off.stderr
    assert off.stdout.splitlines()[0] == "removed DDL capture (source.ddl_capture is false)"
    assert pg.execute(TRIGGERS) == [] and pg.execute(FUNCTIONS) == []
    assert pipe.setup().ddl_capture == DdlCapture("absent")
    pg.execute("ALTER TABLE t ADD COLUMN v text")
    pipe.drain()
    assert _ddl_messages(pipe) == []

    pipe.update_source(ddl_capture=True)
    assert pipe.setup().ddl_capture == DdlCapture("installed")
    assert pg.execute(TRIGGERS) == INSTALLED and pg.execute(FUNCTIONS) == [("cdc_assets_ddl_cdc_slot",)]


def test_two_installations_each_keep_their_own_messages(pg: Database, tmp_path: Path) -> None:
    """Two slots publishing the same table: each capture writes its own message; each drain
    receives both and attaches only its own."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    one = Pipeline(pg, tmp_path / "one", ["public.t"])
    two = Pipeline(pg, tmp_path / "two", ["public.t"], source={"slot": "second", "publication": "second_pub"})
    one.setup()
    two.setup()
    assert len(pg.execute(TRIGGERS)) == 4
    pg.execute("ALTER TABLE t ADD COLUMN v int")
    for pipe, slot in ((one, "cdc_slot"), (two, "second")):
        pipe.drain()
        assert len(_ddl_messages(pipe)) == 2
        (change,) = pipe.reader.schema_changes("public.t")
        assert change.message.slot == slot


def test_a_malformed_message_stops_the_drain_with_nothing_advanced(pg: Database, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pipe.setup()
    before, confirmed = pipe.checkpoint_bytes(), pipe.confirmed_flush()
    (lsn,) = pg.execute(
        'SELECT pg_logical_emit_message(true, %s, \'{"format": 1, "schema": "public", "table": "t"}\')::text',
        (DDL_PREFIX,),
    )[0]
    with pytest.raises(
        CdcError, match=rf"^slot cdc_slot: malformed cdc_assets.ddl message at LSN {lsn} \(table public.t\): no '"
    ):
        pipe.drain()
    assert pipe.checkpoint_bytes() == before and pipe.confirmed_flush() == confirmed
    failed = pipe.cli("drain")
    assert failed.returncode == 1 and "malformed cdc_assets.ddl message" in failed.stderr


@pytest.mark.parametrize("point", ["mid-batch", "after-segments", "after-checkpoint", "after-advance"])
def test_a_drain_killed_around_a_ddl_loses_and_duplicates_no_message(pg: Database, tmp_path: Path, point: str) -> None:
    """The real drain SIGKILLed at a fault point while its batch holds a DDL between rows, then
    run again: each message once, in order, the slot at the checkpoint."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pipe.setup()
    for n in range(3):
        with pg.connect() as conn, conn.transaction():
            conn.execute("INSERT INTO t VALUES (%s, 'before')", (n,))
            conn.execute(f"ALTER TABLE t ADD COLUMN c{n} int DEFAULT {n}")
            conn.execute("UPDATE t SET v = 'after' WHERE id = %s", (n,))
    killed = pipe.cli("drain", env={**pipe.environ, FAULT_ENV: point})
    assert killed.returncode == -9, killed.stderr
    drained = pipe.cli("drain")
    assert drained.returncode == 0, drained.stderr
    changes = pipe.reader.schema_changes("public.t")
    assert [d.message.columns[-1].name for d in changes] == ["c0", "c1", "c2"]
    assert len(_ddl_messages(pipe)) == 3
    transactions = pipe.reader.transactions().column("end_lsn").to_pylist()
    assert [d.end_lsn for d in changes] == transactions
    assert pipe.confirmed_flush() == pipe.checkpoint().lsn
    rows = [
        r
        for c in pipe.reader.read_changes("public.t", after=pipe.checkpoint().snapshot_lsn)
        for r in c.records.to_pylist()
    ]
    assert [(r["_cdc_op"], r["new"]["id"]) for r in rows] == [(op, n) for n in range(3) for op in ("insert", "update")]
