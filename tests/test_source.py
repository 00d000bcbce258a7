"""cdc_assets.source against real PostgreSQL servers: checks, publication, slots, snapshot, catalog,
pgoutput's options, heartbeat, drain lock (the slot's stream is tests/test_stream.py's)."""

from __future__ import annotations

import dataclasses
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil  # type: ignore[import-untyped]
import psycopg
import pytest

from cdc_assets.config import ChangelogConfig, Config, SourceConfig, TableConfig, WarehouseConfig
from cdc_assets.errors import (
    ConfigError,
    DrainLockedError,
    PublicationMismatchError,
    PublicationMissingError,
    SlotInvalidatedError,
    SlotMismatchError,
    SlotMissingError,
    SourceError,
    SourcePermissionError,
    TableMissingError,
)
from cdc_assets.names import TableName
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.decoder import PgoutputDecoder
from cdc_assets.pgoutput.messages import (
    BeginMessage,
    CommitMessage,
    InsertMessage,
    LogicalDecodingMessage,
    Message,
    RelationMessage,
)
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pgoutput.types import CATEGORY_DOMAIN, CATEGORY_ENUM, TypeCatalog
from cdc_assets.source import (
    HEARTBEAT_PREFIX,
    PINNED_SETTINGS,
    DrainLock,
    SnapshotReader,
    apply_pinned_settings,
    check_source,
    column_ndims,
    connect,
    create_slot_command,
    create_slot_with_snapshot,
    describe_table,
    drain_lock_key,
    drop_slot,
    emit_heartbeat,
    ensure_publication,
    load_type_catalog,
    prune_publication,
    published_tables,
    read_server_settings,
    read_slot,
    require_replication_role,
    require_server_settings,
    require_tables,
    require_usable_slot,
)
from cdc_assets.source.connection import one_row
from cdc_assets.stream.options import pgoutput_options
from cdc_assets.stream.reader import SlotStream
from tests.support.copied import sent_rows, typed_rows
from tests.support.database import Database, as_role
from tests.support.peek import peek
from tests.support.pipeline import invalidate_slot, wait_until

# Session settings under which text output differs from the pinned settings in every respect.
NEW_YORK = (
    "-c TimeZone=America/New_York -c DateStyle=SQL,DMY -c IntervalStyle=iso_8601 -c bytea_output=escape"
    " -c extra_float_digits=0"
)


# --- helpers -------------------------------------------------------------------------------


def source_of(db: Database, **settings: Any) -> SourceConfig:
    settings.setdefault("slot", f"s_{db.name}")
    return SourceConfig(dsn=db.dsn, **settings)


def config_of(db: Database, tables: list[str], **settings: Any) -> Config:
    return Config(
        source=source_of(db, **settings),
        changelog=ChangelogConfig(path="/tmp/unused"),
        warehouse=WarehouseConfig(path="/tmp/unused"),
        tables=tuple(TableConfig(TableName.parse(t)) for t in tables),
    )


def peek_messages(
    conn: psycopg.Connection[Any], source: SourceConfig, version: int, *, two_phase: bool = False
) -> list[tuple[int, Message]]:
    """Every message the slot holds, read over the replication stream (the slot does not move) under
    the pinned settings, as the drain reads it, whatever ``conn``'s session settings are."""
    options = [value for pair in pgoutput_options(source, version, two_phase=two_phase) for value in pair]
    decoder = PgoutputDecoder(streaming=source.streaming)
    with conn.transaction():
        apply_pinned_settings(conn)  # the peek's stream takes over the connection's settings
        rows = peek(conn, source.slot, options)
    return [(row.lsn, decoder.decode(row.data)) for row in rows]


def first_int(message: InsertMessage) -> int:
    """The inserted row's first column, an int sent as text."""
    value = message.new_tuple.values[0]
    assert isinstance(value, bytes), value
    return int(value)


def create_sql_slot(db: Database, slot: str, two_phase: bool = False) -> None:
    """A pgoutput slot without a snapshot (``two_phase``: the SQL function's 4th argument)."""
    db.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)", (slot, two_phase))


# --- connections -----------------------------------------------------------------------------


def test_connect_names_the_session_and_opens_replication_connections(pg: Database) -> None:
    with connect(source_of(pg), purpose="drain") as conn:
        assert conn.autocommit
        assert one_row(conn.execute("SELECT current_setting('application_name')"))[0] == "cdc-assets:drain"
    with connect(source_of(pg), purpose="walsender", replication=True) as conn:
        assert one_row(conn.execute("IDENTIFY_SYSTEM"))[3] == pg.name


def test_connection_errors_never_show_the_password(pg: Database, make_role: Callable[..., str]) -> None:
    secret = "s3cr%ZZet-pw"
    port = pg.cluster.port
    role = make_role("pw", "PASSWORD 'the-right-one'")
    hba = Path(pg.execute("SHOW hba_file")[0][0])
    original = hba.read_text()
    hba.write_text(f"host all {role} 127.0.0.1/32 scram-sha-256\n{original}")
    pg.execute("SELECT pg_reload_conf()")
    wrong = f"host=127.0.0.1 port={port} dbname={pg.name} user={role} password={secret}"

    def refused() -> bool:
        try:
            psycopg.connect(wrong).close()
            return False
        except psycopg.OperationalError:
            return True

    try:
        wait_until(refused)  # the postmaster has reloaded pg_hba.conf
        failures = {
            "bad URI escape": f"postgresql://postgres:{secret}@127.0.0.1:{port}/{pg.name}",
            "unterminated quote": f"host=127.0.0.1 port={port} password='{secret}",
            "nobody listening": f"host=127.0.0.1 port=1 dbname=x password={secret}",
            "wrong password": wrong,
            "wrong password, URI": f"postgresql://{role}:{secret.replace('%', '%25')}@127.0.0.1:{port}/{pg.name}",
        }
        for case, dsn in failures.items():
            with pytest.raises(SourceError) as caught:
                connect(SourceConfig(dsn=dsn), purpose="drain")
            shown = "".join(traceback.format_exception(caught.value))
            assert secret not in shown and "ZZet" not in shown, case
            assert "password=" not in shown, case
        assert "password authentication failed" in str(caught.value)
        assert "127.0.0.1" in str(caught.value)
        with connect(SourceConfig(dsn=wrong.replace(secret, "the-right-one")), purpose="drain") as conn:
            assert one_row(conn.execute("SELECT current_user"))[0] == role
    finally:
        hba.write_text(original)
        pg.execute("SELECT pg_reload_conf()")


def test_pinned_settings_are_local_to_the_transaction(pg: Database) -> None:
    with pg.connect() as conn:
        conn.execute("SET TimeZone = 'America/New_York'")
        with pytest.raises(ValueError):
            apply_pinned_settings(conn)  # autocommit, no transaction: SET LOCAL would do nothing
        with conn.transaction():
            apply_pinned_settings(conn)
            for name, value in PINNED_SETTINGS.items():
                assert one_row(conn.execute(f"SHOW {name}"))[0].split(",")[0] == value  # DateStyle: ISO, MDY
            assert one_row(conn.execute("SELECT '2024-06-01 12:00Z'::timestamptz::text"))[0] == "2024-06-01 12:00:00+00"
        assert one_row(conn.execute("SHOW TimeZone"))[0] == "America/New_York"


# --- checks ----------------------------------------------------------------------------------


def test_server_settings_check(pg_any: Database) -> None:
    with pg_any.connect() as conn:
        settings = read_server_settings(conn)
    assert settings.major == pg_any.version
    assert (settings.wal_level, settings.server_encoding) == ("logical", "UTF8")
    require_server_settings(settings)
    with pytest.raises(
        SourceError, match=r"wal_level = replica; logical decoding needs wal_level = logical.*ALTER SYSTEM"
    ):
        require_server_settings(dataclasses.replace(settings, wal_level="replica"))
    with pytest.raises(SourceError, match=r"PostgreSQL 13\.9; cdc-assets needs PostgreSQL 14"):
        require_server_settings(dataclasses.replace(settings, version_num=130009))
    with pytest.raises(SourceError, match="server_encoding LATIN1"):
        require_server_settings(dataclasses.replace(settings, server_encoding="LATIN1"))


def test_replication_privilege_check(pg: Database, make_role: Callable[..., str]) -> None:
    plain = make_role("plain")
    replicator = make_role("repl", "REPLICATION")
    denied = rf"role {plain} cannot use replication slots: it needs the REPLICATION attribute"
    with connect(as_role(pg, plain), purpose="check") as conn, pytest.raises(SourcePermissionError, match=denied):
        require_replication_role(conn)
    with connect(as_role(pg, replicator), purpose="check") as conn:
        require_replication_role(conn)


def test_table_checks(pg: Database, make_role: Callable[..., str]) -> None:
    pg.execute("CREATE TABLE orders (id int PRIMARY KEY); CREATE VIEW orders_view AS SELECT * FROM orders")
    reader = make_role("reader", "REPLICATION")
    owner = make_role("owner", "REPLICATION")
    pg.execute(f'CREATE TABLE owned (id int PRIMARY KEY); ALTER TABLE owned OWNER TO "{owner}"')
    orders, owned = TableName("public", "orders"), TableName("public", "owned")
    with pg.connect() as conn:
        require_tables(conn, [orders, owned], publication="p")
        with pytest.raises(TableMissingError, match=rf"public\.nope, public\.gone do not exist in database {pg.name}"):
            require_tables(conn, [TableName("public", "nope"), orders, TableName("public", "gone")])
        with pytest.raises(TableMissingError, match=r"public\.orders_view .* is a view, not a table"):
            require_tables(conn, [TableName("public", "orders_view")])
    with connect(as_role(pg, reader), purpose="check") as conn:
        cannot_read = rf"role {reader} cannot read table public\.orders .*GRANT SELECT"
        with pytest.raises(SourcePermissionError, match=cannot_read):
            require_tables(conn, [orders])
        pg.execute(f'GRANT SELECT ON orders TO "{reader}"')
        require_tables(conn, [orders])
        pg.execute(f'GRANT CREATE ON DATABASE "{pg.name}" TO "{reader}"')
        with pytest.raises(
            SourcePermissionError, match=r"cannot create publication p for table public\.orders, owned by postgres"
        ):
            require_tables(conn, [orders], publication="p")
    with connect(as_role(pg, owner), purpose="check") as conn:
        with pytest.raises(SourcePermissionError, match=rf"lacks CREATE on database {pg.name}"):
            require_tables(conn, [owned], publication="p")
        pg.execute(f'GRANT CREATE ON DATABASE "{pg.name}" TO "{owner}"')
        require_tables(conn, [owned], publication="p")
        config = dataclasses.replace(config_of(pg, ["owned"]), source=as_role(pg, owner))
        assert check_source(conn, config).major == pg.version
        assert ensure_publication(conn, config).created  # what the check allowed really works


# --- publication -----------------------------------------------------------------------------


def test_ensure_publication_creates_then_verifies(pg: Database) -> None:
    pg.execute('CREATE SCHEMA "Odd Schema"; CREATE TABLE "Odd Schema"."Mixed.Case" (id int PRIMARY KEY)')
    pg.execute("CREATE TABLE plain (id int PRIMARY KEY); CREATE TABLE extra (id int PRIMARY KEY)")
    config = config_of(pg, ['"Odd Schema"."Mixed.Case"', "plain"], publication="Pub Lic")
    with pg.connect() as conn:
        assert ensure_publication(conn, config).created
        assert published_tables(conn, "Pub Lic") == {
            TableName("Odd Schema", "Mixed.Case"),
            TableName("public", "plain"),
        }
        again = ensure_publication(conn, config)
        assert not again.created and not again.added
        wider = config_of(pg, ["plain", "extra", '"Odd Schema"."Mixed.Case"'], publication="Pub Lic")
        assert ensure_publication(conn, wider).added == [TableName("public", "extra")]  # the role owns it
        assert TableName("public", "extra") in published_tables(conn, "Pub Lic")
        assert prune_publication(conn, config) == [TableName("public", "extra")]
        assert TableName("public", "extra") not in published_tables(conn, "Pub Lic")
        assert prune_publication(conn, config) == []


def test_a_publication_of_another_role_is_never_altered(pg: Database) -> None:
    owner, mirror = f"owner_{pg.name}", f"mirror_{pg.name}"
    pg.execute(f'CREATE ROLE "{owner}"; CREATE TABLE plain (id int PRIMARY KEY); CREATE TABLE extra (id int)')
    pg.execute(f'CREATE PUBLICATION theirs FOR TABLE plain; ALTER PUBLICATION theirs OWNER TO "{owner}"')
    pg.execute(f'CREATE ROLE "{mirror}" LOGIN REPLICATION; GRANT SELECT ON plain, extra TO "{mirror}"')
    source = dataclasses.replace(as_role(pg, mirror), publication="theirs")
    wider = dataclasses.replace(config_of(pg, ["plain", "extra"]), source=source)
    with connect(wider.source, purpose="check") as conn:
        with pytest.raises(
            PublicationMismatchError,
            match=r'does not publish public\.extra: its owner can add them \(ALTER PUBLICATION "theirs" ADD TABLE'
            r' "public"\."extra"\)',
        ):
            ensure_publication(conn, wider)
        narrower = dataclasses.replace(wider, tables=())
        with pytest.raises(
            SourcePermissionError, match=r'its owner can run ALTER PUBLICATION "theirs" DROP TABLE "public"\."plain"'
        ):
            prune_publication(conn, narrower)
    with pg.connect() as conn:
        assert published_tables(conn, "theirs") == {TableName("public", "plain")}  # not altered


# --- slots -----------------------------------------------------------------------------------


def test_slot_lifecycle(pg: Database) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source = source_of(pg)
    with pg.connect() as conn:
        with pytest.raises(
            SlotMissingError,
            match=rf"replication slot {source.slot} does not exist: .* else run `cdc-assets recover`: it creates a new slot",
        ):
            require_usable_slot(read_slot(conn, source.slot), source)
        with create_slot_with_snapshot(source) as snapshot:
            assert snapshot.slot == source.slot and snapshot.snapshot_name
        state = require_usable_slot(read_slot(conn, source.slot), source)
        assert (state.plugin, state.slot_type, state.database, state.two_phase) == (
            "pgoutput",
            "logical",
            pg.name,
            False,
        )
        assert state.confirmed_flush_lsn == snapshot.consistent_point
        assert state.wal_status == "reserved" and state.active_pid is None
        assert state.restart_lsn is not None and state.restart_lsn <= snapshot.consistent_point
        pg.execute("INSERT INTO t VALUES (1)")
        lagging = read_slot(conn, source.slot)
        assert lagging is not None and (lagging.lag_bytes or 0) > 0
        exists = rf"replication slot {source.slot} already exists"
        with pytest.raises(SourceError, match=exists), create_slot_with_snapshot(source):
            pass
        assert drop_slot(conn, source.slot)
        assert not drop_slot(conn, source.slot)
        assert read_slot(conn, source.slot) is None


def test_create_slot_command_per_version() -> None:
    assert create_slot_command("s", 14, False) == 'CREATE_REPLICATION_SLOT "s" LOGICAL pgoutput EXPORT_SNAPSHOT'
    assert create_slot_command("s", 15, False) == "CREATE_REPLICATION_SLOT \"s\" LOGICAL pgoutput (SNAPSHOT 'export')"
    assert create_slot_command("s", 18, True).endswith("(SNAPSHOT 'export', TWO_PHASE true)")
    with pytest.raises(ConfigError, match="two-phase decoding needs PostgreSQL 15"):
        create_slot_command("s", 14, True)


def test_create_two_phase_slot(pg_any: Database) -> None:
    """A slot created two-phase is usable with ``source.two_phase``, its stream asks for two-phase
    decoding, and it holds nothing yet (read until the server's position passes the current WAL)."""
    pg_any.execute("CREATE PUBLICATION cdc_pub")
    source = source_of(pg_any, two_phase=True)
    with create_slot_with_snapshot(source) as snapshot:
        assert snapshot.two_phase
    with pg_any.connect() as conn:
        state = require_usable_slot(read_slot(conn, source.slot), source)
        assert state.two_phase
        options = pgoutput_options(source, pg_any.version, two_phase=state.two_phase)
        origin = [("origin", "any")] if pg_any.version >= 16 else []
        assert options[-1 - len(origin) :] == [("two_phase", "on"), *origin]
        assert peek_messages(conn, source, pg_any.version, two_phase=state.two_phase) == []


def test_slot_mismatches(pg: Database) -> None:
    source = source_of(pg)
    other = f"o_{pg.name}"
    with pg.connect() as conn:
        create_sql_slot(pg, source.slot)
        # A real slot's state with another plugin: of our servers only 15 ships test_decoding.
        created = read_slot(conn, source.slot)
        assert created is not None
        other_plugin = dataclasses.replace(created, plugin="wal2json")
        with pytest.raises(SlotMismatchError, match=rf"{source.slot} uses output plugin wal2json, not pgoutput"):
            require_usable_slot(other_plugin, source)
        drop_slot(conn, source.slot)
        conn.execute("SELECT pg_create_physical_replication_slot(%s)", (source.slot,))
        with pytest.raises(SlotMismatchError, match=rf"{source.slot} is a physical slot"):
            require_usable_slot(read_slot(conn, source.slot), source)
        drop_slot(conn, source.slot)
        create_sql_slot(pg, source.slot, two_phase=True)
        with pytest.raises(SlotMismatchError, match=r"is two-phase .* created two-phase, or flipped to two-phase"):
            require_usable_slot(read_slot(conn, source.slot), source)
        require_usable_slot(read_slot(conn, source.slot), dataclasses.replace(source, two_phase=True))
        drop_slot(conn, source.slot)
        create_sql_slot(pg, source.slot)
        with pytest.raises(
            SlotMismatchError, match=r"source.two_phase is true but replication slot .* is not two-phase"
        ):
            require_usable_slot(read_slot(conn, source.slot), dataclasses.replace(source, two_phase=True))
        with psycopg.connect(pg.cluster.dsn("postgres"), autocommit=True) as elsewhere:
            elsewhere.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (other,))
            try:
                with pytest.raises(
                    SlotMismatchError,
                    match=rf"{other} decodes database postgres, but source.dsn connects to database {pg.name}",
                ):
                    require_usable_slot(read_slot(conn, other), dataclasses.replace(source, slot=other))
            finally:
                elsewhere.execute("SELECT pg_drop_replication_slot(%s)", (other,))


def test_invalidated_slot(pg: Database) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION cdc_pub FOR TABLE t")
    source = source_of(pg)
    create_sql_slot(pg, source.slot)
    invalidate_slot(pg, source.slot, "INSERT INTO t VALUES (1)")
    with pg.connect() as conn:
        state = read_slot(conn, source.slot)
        message = (
            rf"replication slot {source.slot} was invalidated by the server.*wal_status 'lost'.*gone"
            r".*Remedy: run `cdc-assets recover`"
        )
        with pytest.raises(SlotInvalidatedError, match=message):
            require_usable_slot(state, source)
        options = pgoutput_options(source, pg.version, two_phase=False)
        with pytest.raises(SlotInvalidatedError, match=message), SlotStream(conn, source, options, 0):
            pass  # the server refuses to start the stream


# --- exported snapshot -----------------------------------------------------------------------


def test_slot_creation_waits_for_running_transactions(pg: Database) -> None:
    source = source_of(pg)
    created: list[int] = []
    with pg.connect() as blocker:
        blocker.execute("BEGIN")
        blocker.execute("SELECT txid_current()")  # a running transaction with an xid
        creator = threading.Thread(target=lambda: created.append(_create(source)))
        creator.start()
        wait_until(
            lambda: pg.execute(
                "SELECT 1 FROM pg_stat_activity WHERE application_name = 'cdc-assets:create-slot'"
                " AND wait_event_type = 'Lock' AND wait_event = 'transactionid'"
            )
        )
        assert creator.is_alive() and not created
        blocker.execute("COMMIT")
        creator.join(timeout=20)
    assert created


def _create(source: SourceConfig) -> int:
    with create_slot_with_snapshot(source) as snapshot:
        return snapshot.consistent_point


def test_exported_snapshot_is_consistent(pg: Database) -> None:
    """Create the slot while another session commits one transaction after another: the snapshot
    holds exactly the transactions whose commit record precedes the consistent point, and the
    slot decodes exactly the others — an observer slot created beforehand gives every
    transaction's commit LSN."""
    pg.execute("CREATE TABLE seq (id int PRIMARY KEY, txn int NOT NULL); CREATE PUBLICATION cdc_pub FOR TABLE seq")
    source = source_of(pg)
    observer = dataclasses.replace(source, slot=f"obs_{pg.name}")
    create_sql_slot(pg, observer.slot)
    committed: list[int] = []
    stop = threading.Event()

    def insert_loop() -> None:
        with pg.connect() as conn:
            next_id = 0
            while not stop.is_set():
                txn = len(committed)
                with conn.transaction():
                    for _ in range(1 + txn % 3):
                        conn.execute("INSERT INTO seq VALUES (%s, %s)", (next_id, txn))
                        next_id += 1
                committed.append(next_id)

    inserter = threading.Thread(target=insert_loop)
    inserter.start()
    try:
        wait_until(lambda: len(committed) >= 20)
        with create_slot_with_snapshot(source) as snapshot, SnapshotReader(source, snapshot.snapshot_name) as reader:
            relation = reader.describe(TableName("public", "seq"))
            text = [False] * len(relation.columns)  # the ids as text, to read them back with int()
            in_snapshot = [int(v) for chunk in reader.chunks(relation, text) for v in chunk[0].to_pylist()]
        enough = len(committed) + 20
        wait_until(lambda: len(committed) >= enough)
    finally:
        stop.set()
        inserter.join()

    with pg.connect() as conn:
        transactions = []  # (commit_lsn, end_lsn, ids) per transaction, from the observer
        for _, message in peek_messages(conn, observer, pg.version):
            if isinstance(message, BeginMessage):
                ids: set[int] = set()
            elif isinstance(message, InsertMessage):
                ids.add(first_int(message))
            elif isinstance(message, CommitMessage):
                transactions.append((message.commit_lsn, message.end_lsn, ids))
        in_slot = [first_int(m) for _, m in peek_messages(conn, source, pg.version) if isinstance(m, InsertMessage)]
    point = snapshot.consistent_point
    before = set().union(*(ids for _, end, ids in transactions if end <= point))
    after = set().union(*(ids for commit, _, ids in transactions if commit >= point))
    assert len(transactions) == len(committed)
    assert all(end <= point or commit >= point for commit, end, _ in transactions)  # none straddles it
    assert before and after, "the inserter must have committed on both sides of the consistent point"
    assert sorted(in_snapshot) == sorted(before)
    assert sorted(in_slot) == sorted(after)
    assert before | after == set(range(committed[-1]))


@pytest.mark.slow
def test_snapshot_values_match_pgoutput(pg_any: Database) -> None:
    """Snapshot values convert exactly as what pgoutput sends for the same rows, although the
    session's own settings (in the DSN) would format the text ones differently; in binary where the
    type converts from binary, else as the output function's text."""
    pg_any.execute(
        "CREATE TYPE mood AS ENUM ('sad', 'happy'); CREATE TYPE pair AS (x int, y text);"
        " CREATE DOMAIN posint AS int CHECK (VALUE > 0); CREATE DOMAIN small AS posint CHECK (VALUE < 100);"
        " CREATE TABLE typed (id int PRIMARY KEY, b bool, c char(4), ip inet, ts timestamptz, iv interval, by bytea,"
        " arr int[], grid int[][], m mood, moods mood[], d small, p pair, f float8, n numeric(12,3), j jsonb, t text,"
        " dt date);"
        " CREATE PUBLICATION cdc_pub FOR TABLE typed"
    )
    source = dataclasses.replace(source_of(pg_any), dsn=f"{pg_any.dsn} options='{NEW_YORK}'")
    observer = dataclasses.replace(source, slot=f"obs_{pg_any.name}")
    create_sql_slot(pg_any, observer.slot)
    pg_any.execute(
        "INSERT INTO typed VALUES"
        " (1, true, 'ab', '10.0.0.1', '2024-06-01 12:00:00.5+02', '-1 day 02:03:04', '\\x00ff', '{1,NULL}',"
        "  '{{1,2},{3,4}}', 'happy', '{sad,happy}', 42, ROW(1, 'a \"b\"'), 0.1, 12.5, '{\"b\": 1, \"a\": [2]}',"
        "  'ünï\tcode', '2024-02-29'),"
        " (2, false, NULL, '::1/128', '-infinity', '1 year 2 mons', '', '{}', NULL, NULL, '{}', NULL, ROW(NULL, NULL),"
        "  'NaN', 'NaN', 'null', '', '0044-03-15 BC'),"
        " (3, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL)"
    )
    with (
        create_slot_with_snapshot(source) as snapshot,
        SnapshotReader(source, snapshot.snapshot_name, chunk_rows=2) as reader,
    ):
        relation = reader.describe(TableName("public", "typed"))
        catalog = TypeCatalog.of(load_type_catalog(reader.connection, [c.type_oid for c in relation.columns]))
        builder = ChangeRecordBuilder(relation, catalog)
        chunks = list(reader.chunks(relation, builder.binary_supported))
        as_text = list(reader.chunks(relation, [False] * len(relation.columns)))
    assert [len(chunk[0]) for chunk in chunks] == [2, 1]
    with connect(source, purpose="test") as conn:
        assert one_row(conn.execute("SELECT ts::text FROM typed WHERE id = 1"))[0] == "01/06/2024 06:00:00.5 EDT"
        sent = [
            m.new_tuple.values for _, m in peek_messages(conn, observer, pg_any.version) if isinstance(m, InsertMessage)
        ]
    binary = builder.binary_supported
    names = [c.name for c in relation.columns]
    assert not binary[names.index("ip")] and not binary[names.index("p")]
    assert sum(binary) == len(binary) - 2
    assert typed_rows(builder, chunks, binary) == sent_rows(builder, sent)
    text_rows = sorted(row for chunk in as_text for row in zip(*(column.to_pylist() for column in chunk)))
    assert text_rows == sorted(sent)  # as text: byte for byte what pgoutput sends
    assert text_rows[0][1:5] == (b"t", b"ab  ", b"10.0.0.1", b"2024-06-01 10:00:00.5+00")
    assert text_rows[1][12] == b"(,)"  # a row of nulls is a value, not NULL


def test_snapshot_copy_memory_is_bounded(pg: Database) -> None:
    rows = 2_000_000
    pg.execute(
        "CREATE TABLE big (id int8, pad text);"
        f" INSERT INTO big SELECT i, repeat('x', 100) FROM generate_series(1, {rows}) i"
    )
    pg.execute("CREATE PUBLICATION cdc_pub FOR TABLE big")
    source = source_of(pg)
    process = psutil.Process()
    with create_slot_with_snapshot(source) as snapshot, SnapshotReader(source, snapshot.snapshot_name) as reader:
        relation = reader.describe(TableName("public", "big"))
        baseline = process.memory_info().rss
        peak, copied, chunks = baseline, 0, 0
        for chunk in reader.chunks(relation, (True, True)):
            copied += len(chunk[0])
            chunks += 1
            peak = max(peak, process.memory_info().rss)
    assert copied == rows and chunks == rows // 50_000
    grown = (peak - baseline) >> 20
    assert grown < 120, f"client memory grew by {grown} MiB while copying a ~250 MiB table"


# --- catalog ---------------------------------------------------------------------------------


def test_describe_table_matches_the_relation_message(pg_any: Database) -> None:
    version = pg_any.version
    virtual = ", v int GENERATED ALWAYS AS (a * 3) VIRTUAL" if version >= 18 else ""
    pg_any.execute(
        "CREATE DOMAIN ints_base AS int[]; CREATE DOMAIN ints AS ints_base;"
        " CREATE TABLE keyed (a int, b text, gone int, grid int[][], tags ints, name varchar(10),"
        f"  amount numeric(10,2), g int GENERATED ALWAYS AS (a * 2) STORED{virtual}, PRIMARY KEY (b, a));"
        " ALTER TABLE keyed DROP COLUMN gone;"
        " CREATE TABLE full_ident (id int PRIMARY KEY, x text); ALTER TABLE full_ident REPLICA IDENTITY FULL;"
        " CREATE TABLE by_index (id int PRIMARY KEY, u int NOT NULL, w int NOT NULL, x text);"
        " CREATE UNIQUE INDEX by_index_uw ON by_index (w, u);"
        " ALTER TABLE by_index REPLICA IDENTITY USING INDEX by_index_uw;"
        " CREATE TABLE no_ident (id int PRIMARY KEY, x text); ALTER TABLE no_ident REPLICA IDENTITY NOTHING;"
        " CREATE TABLE no_key (id int, x text);"
        " CREATE TABLE deferred_key (id int PRIMARY KEY DEFERRABLE, x text);"
        " CREATE PUBLICATION cdc_pub FOR TABLE keyed, full_ident, by_index, no_ident, no_key, deferred_key;"
        " CREATE PUBLICATION listed FOR TABLE keyed (a, b, tags, amount)"
    )
    publications = {
        "cdc_pub": ["keyed", "full_ident", "by_index", "no_ident", "no_key", "deferred_key"],
        "listed": ["keyed"],
    }
    if version >= 18:
        pg_any.execute(
            "CREATE PUBLICATION with_generated FOR TABLE keyed WITH (publish_generated_columns = stored);"
            " CREATE PUBLICATION listed_generated FOR TABLE keyed (a, b, g)"
        )
        publications |= {"with_generated": ["keyed"], "listed_generated": ["keyed"]}
    source = source_of(pg_any)
    create_sql_slot(pg_any, source.slot)
    pg_any.execute(
        "INSERT INTO keyed (a, b) VALUES (1, 'x'); INSERT INTO full_ident VALUES (1);"
        " INSERT INTO by_index VALUES (1, 2, 3); INSERT INTO no_ident VALUES (1); INSERT INTO no_key VALUES (1);"
        " INSERT INTO deferred_key VALUES (1)"
    )
    with pg_any.connect() as conn:
        described = 0
        for publication, tables in publications.items():
            messages = peek_messages(conn, dataclasses.replace(source, publication=publication), version)
            relations = {m.relation_name: m for _, m in messages if isinstance(m, RelationMessage)}
            assert sorted(relations) == sorted(tables)
            for table, message in relations.items():
                expected = RelationSchema.from_message(message, column_ndims(conn, message.relation_oid))
                actual = describe_table(conn, TableName("public", table), publication)
                assert actual == expected, (publication, table)
                assert (actual.relation_oid, actual.namespace, actual.name) == (message.relation_oid, "public", table)
                described += 1
        keyed = describe_table(conn, TableName("public", "keyed"), "cdc_pub")
        assert [(c.name, c.is_key, c.ndims) for c in keyed.columns] == [
            ("a", True, 0),
            ("b", True, 0),
            ("grid", False, 2),
            ("tags", False, 1),
            ("name", False, 0),
            ("amount", False, 0),
        ]
        by_index = describe_table(conn, TableName("public", "by_index"), "cdc_pub")
        assert [c.name for c in by_index.columns if c.is_key] == ["u", "w"]
        assert not any(c.is_key for c in describe_table(conn, TableName("public", "deferred_key"), "cdc_pub").columns)
        if version >= 18:
            generated = describe_table(conn, TableName("public", "keyed"), "with_generated")
            assert "g" in [c.name for c in generated.columns] and "v" not in [c.name for c in generated.columns]
        with pytest.raises(PublicationMismatchError, match=r"table public\.full_ident is not in publication listed"):
            describe_table(conn, TableName("public", "full_ident"), "listed")
        with pytest.raises(PublicationMissingError, match="publication nope does not exist: run `cdc-assets setup`"):
            describe_table(conn, TableName("public", "keyed"), "nope")
        with pytest.raises(TableMissingError, match=rf"table public\.nope does not exist in database {pg_any.name}"):
            describe_table(conn, TableName("public", "nope"), "cdc_pub")
    assert described == sum(len(t) for t in publications.values())


def test_schema_version_ignores_the_relation_oid() -> None:
    message = RelationMessage(None, 1, "public", "t", "d", ())
    base = RelationSchema.from_message(message, {})
    assert base.same_version(dataclasses.replace(base, relation_oid=2))
    assert not base.same_version(dataclasses.replace(base, replica_identity="f"))
    assert not base.same_version(dataclasses.replace(base, name="renamed"))


def test_load_type_catalog(pg: Database) -> None:
    pg.execute(
        "CREATE TYPE mood AS ENUM ('sad', 'happy'); CREATE DOMAIN posint AS int CHECK (VALUE > 0);"
        " CREATE DOMAIN small AS posint CHECK (VALUE < 100); CREATE DOMAIN moods AS mood[];"
        " CREATE TABLE t (a small, b small[], c moods, d int)"
    )
    with pg.connect() as conn:
        oids = dict(
            conn.execute("SELECT typname::text, oid::int8 FROM pg_type WHERE typnamespace = 'public'::regnamespace")
        )
        columns = [
            oid for (oid,) in conn.execute("SELECT atttypid::int8 FROM pg_attribute WHERE attrelid = 't'::regclass")
        ]
        catalog = {info.name: info for info in load_type_catalog(conn, columns)}
    assert sorted(catalog) == ["_mood", "_small", "mood", "moods", "posint", "small"]  # int4 is built in
    assert (catalog["small"].category, catalog["small"].base_oid) == (CATEGORY_DOMAIN, oids["posint"])
    assert (catalog["posint"].category, catalog["posint"].base_oid) == (CATEGORY_DOMAIN, 23)
    assert catalog["moods"].base_oid == oids["_mood"] and catalog["_mood"].element_oid == oids["mood"]
    assert catalog["_small"].element_oid == oids["small"] and catalog["mood"].category == CATEGORY_ENUM
    assert catalog["small"].qualified_name == "public.small"


# --- options, heartbeat ---------------------------------------------------------------------


def test_pgoutput_options_are_accepted(pg_any: Database) -> None:
    """pgoutput's options per server version, as (name, value) pairs, and every variant a server
    under test takes is accepted by a real stream of the slot without flipping it two-phase."""
    version = pg_any.version
    pg_any.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION cdc_pub FOR TABLE t")
    source = source_of(pg_any)
    create_sql_slot(pg_any, source.slot)
    pg_any.execute("INSERT INTO t VALUES (1)")
    proto = {15: "3", 16: "4", 18: "4"}[version]
    origin = [("origin", "any")] if version >= 16 else []
    streaming = dataclasses.replace(source, streaming="on")
    assert pgoutput_options(source, version, two_phase=False) == [
        ("proto_version", proto),
        ("publication_names", "cdc_pub"),
        ("messages", "true"),
        *origin,
    ]
    assert pgoutput_options(streaming, 16, two_phase=True)[-3:] == [
        ("streaming", "on"),
        ("two_phase", "on"),
        ("origin", "any"),  # 16+: changes of every origin, as before 16
    ]
    assert pgoutput_options(streaming, 15, two_phase=False)[-1] == ("streaming", "true")  # a boolean
    assert pgoutput_options(streaming, 14, two_phase=False)[0] == ("proto_version", "2")
    assert ("origin", "any") not in pgoutput_options(source, 15, two_phase=False)
    with pytest.raises(ConfigError, match=r"two-phase decoding needs PostgreSQL 15 or later \(the server is 14\)"):
        pgoutput_options(source, 14, two_phase=True)
    variants = [source, dataclasses.replace(source, binary=True), streaming]
    if version >= 16:
        variants.append(dataclasses.replace(source, streaming="parallel"))
    else:
        with pytest.raises(ConfigError, match=r"'parallel' needs PostgreSQL 16 or later \(the server is 15\)"):
            pgoutput_options(dataclasses.replace(source, streaming="parallel"), version, two_phase=False)
    with pg_any.connect() as conn:
        for variant in variants:
            kinds = "".join(m.type_byte for _, m in peek_messages(conn, variant, version))
            assert kinds == "BRIC", variant
        state = read_slot(conn, source.slot)
        assert state is not None and not state.two_phase  # never flipped by our streams


def test_heartbeat_is_a_decodable_transaction(pg: Database, make_role: Callable[..., str]) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION cdc_pub FOR TABLE t")
    source = source_of(pg)
    create_sql_slot(pg, source.slot)
    with connect(as_role(pg, make_role("plain")), purpose="heartbeat") as conn:  # no REPLICATION needed
        lsn = emit_heartbeat(conn)
    with pg.connect() as conn:
        messages = [m for _, m in peek_messages(conn, source, pg.version)]
    assert [m.type_byte for m in messages] == ["B", "M", "C"]
    heartbeat = messages[1]
    assert isinstance(heartbeat, LogicalDecodingMessage)
    assert heartbeat.transactional and heartbeat.prefix == HEARTBEAT_PREFIX and heartbeat.lsn == lsn


def test_drain_lock_excludes_a_second_holder(pg: Database) -> None:
    source = source_of(pg)
    assert drain_lock_key("cdc_slot") == drain_lock_key("cdc_slot") != drain_lock_key("cdc_slot2")
    assert drain_lock_key("cdc_slot") == -8788818689780781945  # stable across runs and releases
    with DrainLock(source, wait=False) as held:
        busy = rf"slot {source.slot} is being drained by another process \(pid {held.pid}\): wait for it"
        with pytest.raises(DrainLockedError, match=busy), DrainLock(source, wait=False):
            pass
        with DrainLock(dataclasses.replace(source, slot="another_slot"), wait=False):
            pass
        acquired = threading.Event()

        def waiter() -> None:
            with DrainLock(source, wait=True, poll_seconds=0.05):
                acquired.set()

        thread = threading.Thread(target=waiter)
        thread.start()
        wait_until(lambda: pg.execute("SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND NOT granted"))
        assert not acquired.is_set()
    thread.join(timeout=20)
    assert acquired.is_set()
    with DrainLock(source, wait=False):
        pass
