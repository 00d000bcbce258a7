"""The pgoutput decoder against real servers (PostgreSQL 15, 16 and 18), every message type.

Each test runs SQL that makes messages appear, reads the slot's pending messages over the
replication stream with options that match the server version (``tests/support/peek.py``: a new
decoding session each time, nothing confirmed), decodes every message with a fresh
:class:`PgoutputDecoder` per session and checks every decoded field against what the server
knows: each message's LSN and the xid of the transaction it belongs to,
``pg_current_wal_lsn()`` taken around the transaction, ``txid_current()`` and row ``xmin``s taken
inside it, the wall clock, the catalogs, and the stored values (each column through its type's
output function under fixed session settings for text mode, ``<typsend>(col)`` for binary mode).

Server behaviour these tests pin down, beyond what the protocol documentation says:

* A domain column's Type message carries the domain's OID but its base type's namespace and name.
* UPDATE/DELETE on a REPLICA IDENTITY NOTHING table are refused while a publication publishes them.
* Every TRUNCATE re-sends R for the truncated relations, even later in the same session.
* Only flushed WAL is decoded: a non-transactional message or a rollback waits for the WAL writer.
* Of a rolled-back subtransaction, only the changes streamed before ``ROLLBACK TO`` appear.
* After a subtransaction's Stream Abort, Y/R come again, tagged with the next change's xid.
* A rolled-back streamed transaction first met with cold caches gives an empty S/E block, then A;
  PostgreSQL 18 skips an already-aborted transaction entirely (unless streaming is ``immediate``).
* A streamed transaction's Origin comes after the first Stream Start, with LSN 0; over the stream,
  Relation and Type messages have LSN 0 too.
* An origin's ``xact_setup`` timestamp becomes the commit time of Begin/Commit/Stream Commit.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest

from cdc_assets.pgoutput.messages import (
    BeginMessage,
    BeginPrepareMessage,
    CommitMessage,
    CommitPreparedMessage,
    DeleteMessage,
    InsertMessage,
    LogicalDecodingMessage,
    OriginMessage,
    PrepareMessage,
    RelationMessage,
    RollbackPreparedMessage,
    StreamAbortMessage,
    StreamCommitMessage,
    StreamPrepareMessage,
    StreamStartMessage,
    TruncateMessage,
    TupleData,
    TypeMessage,
    UpdateMessage,
)
from tests.support.peek import (
    CatalogRelation,
    Decoded,
    Streaming,
    TxnWindow,
    apply_session_settings,
    captured_transaction,
    catalog_relation,
    create_slot,
    current_wal_insert_lsn,
    current_wal_lsn,
    kinds,
    max_proto_version,
    peek_decoded,
    pgoutput_options,
    row_xmin,
    send_values,
    split_transactions,
    streaming_modes,
    text_values,
    wait_for_flush,
    wall_clock,
)

PUB = "pub"
SLOT = "slot"
FIRST_GENBKI_OBJECT_ID = 10000  # pgoutput sends a Type message only for OIDs at or above this


# -- fixtures and shared checks -----------------------------------------------------------------


@pytest.fixture
def conn(pg_any: Any) -> Any:
    """An autocommit connection to ``pg_any`` with the deterministic session settings applied;
    it both writes and peeks (peeking never needs a separate session)."""
    with pg_any.connect() as connection:
        apply_session_settings(connection)
        yield connection


def prepare(conn: psycopg.Connection[Any], ddl: str, publication: str = "FOR ALL TABLES") -> None:
    """Run the test's DDL, create the publication, then the slot (so only later changes show)."""
    conn.execute(ddl)
    conn.execute(f"CREATE PUBLICATION {PUB} {publication}")
    create_slot(conn, SLOT)


def assert_relation(message: RelationMessage, expected: CatalogRelation) -> None:
    """Every field of a Relation message equals the catalog's view of the table."""
    assert message.relation_oid == expected.oid
    assert message.namespace == expected.namespace
    assert message.relation_name == expected.name
    assert message.replica_identity == expected.replica_identity
    assert [(c.name, c.type_oid, c.type_modifier, c.flags) for c in message.columns] == [
        (c.name, c.type_oid, c.type_modifier, 1 if c.is_key else 0) for c in expected.columns
    ]


def assert_tuple(tuple_data: TupleData, expected: Sequence[bytes | None], kind: str = "t") -> None:
    """A tuple whose columns are ``kind`` with ``expected`` bytes, or ``'n'`` where None."""
    assert tuple_data.kinds == "".join("n" if value is None else kind for value in expected)
    assert tuple_data.values == tuple(expected)


def assert_plain_transaction(group: list[Decoded], window: TxnWindow) -> tuple[BeginMessage, CommitMessage]:
    """Begin/Commit of a non-streamed transaction agree with each other, with the peek's
    ``lsn``/``xid`` columns, with the xid and WAL/time window captured around it; the messages in
    between carry no xid and LSNs inside (begin row, commit)."""
    begin, commit = group[0].message, group[-1].message
    assert isinstance(begin, BeginMessage) and isinstance(commit, CommitMessage)
    assert begin.xid == window.xid
    assert all(item.row.xid == window.xid for item in group)
    assert begin.final_lsn == commit.commit_lsn
    assert commit.flags == 0
    assert commit.end_lsn == group[-1].row.lsn
    assert window.lsn_before <= group[0].row.lsn <= commit.commit_lsn < commit.end_lsn <= window.lsn_after
    # Over the stream, Relation and Type messages are sent at LSN 0 (the server sets no position
    # for them); PostgreSQL 15+ writes Begin lazily at the first published change, so it shares
    # that change's LSN.
    assert all(item.row.lsn == 0 for item in group if item.kind in "RY")
    inner = [item for item in group[1:-1] if item.kind not in "RY"]
    assert not inner or group[0].row.lsn == inner[0].row.lsn
    # A change's row lsn is its record's start; a Message's is its record's end, which can be
    # exactly where the commit record starts.
    lsns = [item.row.lsn for item in inner]
    assert lsns == sorted(lsns) and all(group[0].row.lsn <= lsn <= commit.commit_lsn for lsn in lsns)
    assert all(item.row.lsn < commit.commit_lsn for item in inner if item.kind != "M")
    assert begin.commit_time == commit.commit_time
    assert window.contains_time(commit.commit_time)
    assert commit.commit_time.tzinfo is not None
    for item in group[1:-1]:
        assert getattr(item.message, "xid", None) is None, "no xid prefix outside a stream block"
        assert not item.in_stream_after
    return begin, commit


def by_xid(groups: list[list[Decoded]], window: TxnWindow) -> list[Decoded]:
    """The one group belonging to ``window``'s transaction."""
    matches = [group for group in groups if group[0].row.xid == window.xid]
    assert len(matches) == 1, f"expected one transaction with xid {window.xid}, got {len(matches)}"
    return matches[0]


def fetch_text(conn: psycopg.Connection[Any], table: str, key: str, value: Any) -> tuple[bytes | None, ...]:
    """One row's published columns as output-function text bytes (see ``text_values``)."""
    names = [c.name for c in catalog_relation(conn, table).columns]
    (row,) = text_values(conn, table, names, f"{key} = {value!r}" if isinstance(value, str) else f"{key} = {value}")
    return row


# -- 1. inserts, Type and Relation messages ------------------------------------------------------

MULTI_TYPE_DDL = """
CREATE SCHEMA app;
CREATE SCHEMA typ;
CREATE TYPE typ.mood AS ENUM ('sad', 'ok', 'happy');
CREATE DOMAIN typ.posint AS int CHECK (VALUE > 0);
CREATE TABLE app.things (
    id int PRIMARY KEY,
    label text,
    price numeric(10,2),
    at timestamptz,
    flag bool,
    blob bytea,
    doc jsonb,
    gone int,
    feeling typ.mood,
    qty typ.posint,
    nums int[],
    moods typ.mood[],
    doubled int GENERATED ALWAYS AS (id * 2) STORED
);
ALTER TABLE app.things DROP COLUMN gone;
"""

MULTI_TYPE_INSERT = """
INSERT INTO app.things (id, label, price, at, flag, blob, doc, feeling, qty, nums, moods) VALUES
 (1, 'héllo, "world" \\ ''q''', 12345678.9, '2024-02-29 23:59:59.123456+05:30', true, '\\x00ff10',
  '{"b": 1, "a": [1, 2.50]}', 'happy', 7, '{1,NULL,3}', '{sad,happy}'),
 (2, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL),
 (3, '', -0.5, '-infinity', false, '\\x', 'null', 'sad', 1, '{}', '{}')
"""


def expected_types(conn: psycopg.Connection[Any], table: str) -> list[tuple[int, str, str]]:
    """The Type messages pgoutput sends before ``table``'s Relation, in column order: one per
    published column whose type OID is >= FirstGenbkiObjectId, carrying that OID but the name and
    namespace of its *base* type (a domain is resolved through every level; ``logicalrep_write_typ``
    uses ``getBaseType``), with ``""`` for pg_catalog."""
    out = []
    for (type_oid,) in conn.execute(
        "SELECT atttypid::int8 FROM pg_attribute WHERE attrelid = %s::regclass AND attnum > 0"
        " AND NOT attisdropped AND attgenerated = '' AND atttypid >= %s ORDER BY attnum",
        (table, FIRST_GENBKI_OBJECT_ID),
    ).fetchall():
        base = int(type_oid)
        while True:
            nspname, typname, typbasetype = conn.execute(
                "SELECT n.nspname, t.typname, t.typbasetype::int8 FROM pg_type t"
                " JOIN pg_namespace n ON n.oid = t.typnamespace WHERE t.oid = %s",
                (base,),
            ).fetchone()
            if not typbasetype:
                break
            base = int(typbasetype)
        out.append((int(type_oid), "" if nspname == "pg_catalog" else nspname, typname))
    return out


def test_inserts_of_every_type_with_type_and_relation_messages(pg_any: Any, conn: Any) -> None:
    """B, Y×3 (enum, domain — named after its base type —, array of enum, in column order, before
    R), R matching pg_attribute (dropped and generated columns omitted, domain type OID, numeric
    typmod, pk key flag), one I per row whose text values equal the stored values' output text
    (NULLs as 'n'), C — for every protocol version the server accepts."""
    prepare(conn, MULTI_TYPE_DDL)
    with captured_transaction(conn) as window:
        conn.execute(MULTI_TYPE_INSERT)

    relation = catalog_relation(conn, "app.things")
    assert [c.name for c in relation.columns] == [
        "id",
        "label",
        "price",
        "at",
        "flag",
        "blob",
        "doc",
        "feeling",
        "qty",
        "nums",
        "moods",
    ]
    types = expected_types(conn, "app.things")
    (mood, posint, mood_array) = (
        int(conn.execute("SELECT %s::regtype::oid::int8", (name,)).fetchone()[0])
        for name in ("typ.mood", "typ.posint", "typ.mood[]")
    )
    # The domain's Type message names its base type int4 (in pg_catalog, sent as "").
    assert types == [(mood, "typ", "mood"), (posint, "", "int4"), (mood_array, "typ", "_mood")]
    assert next(c for c in relation.columns if c.name == "qty").type_oid == posint
    price = next(c for c in relation.columns if c.name == "price")
    assert price.type_modifier == (10 << 16 | 2) + 4
    rows = text_values(conn, "app.things", [c.name for c in relation.columns], "true")
    assert rows[0][1] == "héllo, \"world\" \\ 'q'".encode() and rows[0][3] == b"2024-02-29 18:29:59.123456+00"

    for proto in range(1, max_proto_version(pg_any.version) + 1):
        decoded = peek_decoded(conn, SLOT, pgoutput_options(pg_any.version, PUB, proto_version=proto))
        assert kinds(decoded) == "BYYYRIIIC", f"proto {proto}"
        assert_plain_transaction(decoded, window)
        type_messages = [item.message for item in decoded[1:4]]
        assert all(isinstance(m, TypeMessage) and m.xid is None for m in type_messages)
        assert [(m.type_oid, m.namespace, m.name) for m in type_messages] == types
        assert_relation(decoded[4].message, relation)
        for item, expected in zip(decoded[5:8], rows):
            message = item.message
            assert isinstance(message, InsertMessage)
            assert message.xid is None
            assert message.relation_oid == relation.oid
            assert_tuple(message.new_tuple, expected)


# -- 2. replica identities ------------------------------------------------------------------------

RI_DDL = """
CREATE TABLE ri_default (id int PRIMARY KEY, code text NOT NULL, note text);
CREATE TABLE ri_full (id int PRIMARY KEY, code text NOT NULL, note text);
ALTER TABLE ri_full REPLICA IDENTITY FULL;
CREATE TABLE ri_index (id int PRIMARY KEY, code text NOT NULL, note text);
CREATE UNIQUE INDEX ri_index_code ON ri_index (code);
ALTER TABLE ri_index REPLICA IDENTITY USING INDEX ri_index_code;
CREATE TABLE ri_nothing (id int PRIMARY KEY, code text NOT NULL, note text);
ALTER TABLE ri_nothing REPLICA IDENTITY NOTHING;
INSERT INTO ri_default VALUES (1, 'a', 'n1');
INSERT INTO ri_full VALUES (1, 'a', NULL);
INSERT INTO ri_index VALUES (1, 'a', 'n1');
INSERT INTO ri_nothing VALUES (1, 'a', 'n1');
"""
# The server refuses UPDATE/DELETE on a REPLICA IDENTITY NOTHING table whose publications publish
# them, so ri_nothing sits in a publication of its own that publishes inserts only.
RI_PUBLICATIONS = """
CREATE PUBLICATION pub_nothing FOR TABLE ri_nothing WITH (publish = 'insert');
CREATE PUBLICATION pub_nothing_all FOR TABLE ri_nothing;
"""


def run_update_cases(conn: Any, table: str, key_change: str) -> dict[str, tuple[TxnWindow, Any, Any]]:
    """Three transactions on ``table``: update ``note``; ``key_change``; delete the row. Returns,
    per step, its window and the row's text image before and after."""
    steps = {
        "note": "UPDATE {t} SET note = 'changed' WHERE true",
        "key": key_change,
        "delete": "DELETE FROM {t} WHERE true",
    }
    out = {}
    for step, sql in steps.items():
        (before,) = text_values(conn, table, ["id", "code", "note"], "true")
        with captured_transaction(conn) as window:
            conn.execute(sql.format(t=table))
        after = text_values(conn, table, ["id", "code", "note"], "true")
        out[step] = (window, before, after[0] if after else None)
    return out


def key_only(row: tuple[bytes | None, ...], key_mask: list[bool]) -> list[bytes | None]:
    """``row`` with the columns outside the key as None (what an old key carries)."""
    return [value if is_key else None for value, is_key in zip(row, key_mask)]


def test_updates_and_deletes_under_each_replica_identity(pg_any: Any, conn: Any) -> None:
    """DEFAULT: no old tuple unless the pk changed, then 'K' with the key and 'n' (not sent, not
    NULL) elsewhere; FULL: 'O' with the whole old row on update and delete; USING INDEX: 'K'
    carries the index column only when it changed (a pk change sends none). NOTHING: R says 'n'
    with no key column; the server refuses UPDATE/DELETE while a publication publishes them, and
    where allowed (insert-only publication) the UPDATE and DELETE produce nothing at all."""
    prepare(conn, RI_DDL, "FOR TABLE ri_default, ri_full, ri_index")
    conn.execute(RI_PUBLICATIONS)
    for statement in ("UPDATE ri_nothing SET note = 'x'", "DELETE FROM ri_nothing"):
        with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState, match="does not have a replica identity"):
            conn.execute(statement)
    conn.execute("DROP PUBLICATION pub_nothing_all")
    cases = {
        "ri_default": run_update_cases(conn, "ri_default", "UPDATE {t} SET id = 10"),
        "ri_full": run_update_cases(conn, "ri_full", "UPDATE {t} SET id = 10, code = 'b'"),
        "ri_index": run_update_cases(conn, "ri_index", "UPDATE {t} SET code = 'b'"),
    }
    with captured_transaction(conn) as index_pk_change:
        conn.execute("INSERT INTO ri_index VALUES (5, 'z', NULL); UPDATE ri_index SET id = 6 WHERE id = 5")
    nothing_steps = run_update_cases(conn, "ri_nothing", "UPDATE {t} SET id = 10")
    with captured_transaction(conn) as nothing_insert:
        conn.execute("INSERT INTO ri_nothing VALUES (2, 'b', NULL)")

    options = pgoutput_options(pg_any.version, f"{PUB},pub_nothing")
    decoded = peek_decoded(conn, SLOT, options)
    groups = split_transactions(decoded)
    assert all(kinds(g)[0] == "B" and kinds(g)[-1] == "C" for g in groups)
    assert len(groups) == 3 * 3 + 1 + 1, "3 tables × 3 steps, the pk change, the NOTHING insert"

    expect_identity = {"ri_default": "d", "ri_full": "f", "ri_index": "i", "ri_nothing": "n"}
    expect_keys = {"ri_default": {"id"}, "ri_full": {"id", "code", "note"}, "ri_index": {"code"}, "ri_nothing": set()}
    for table, steps in cases.items():
        relation = catalog_relation(conn, table)
        assert relation.replica_identity == expect_identity[table]
        assert {c.name for c in relation.columns if c.is_key} == expect_keys[table]
        key_mask = [c.is_key for c in relation.columns]

        window, before, after = steps["note"]
        group = by_xid(groups, window)
        assert kinds(group) == "BRUC"
        assert_plain_transaction(group, window)
        assert_relation(group[1].message, relation)
        update = group[2].message
        assert isinstance(update, UpdateMessage) and update.relation_oid == relation.oid
        if table == "ri_full":
            assert update.old_key is None
            assert_tuple(update.old_tuple, before)
        else:
            assert update.old_key is None and update.old_tuple is None
        assert_tuple(update.new_tuple, after)

        window, before, after = steps["key"]
        group = by_xid(groups, window)
        assert kinds(group) == "BUC", "R is sent once per session"
        assert_plain_transaction(group, window)
        update = group[1].message
        assert isinstance(update, UpdateMessage) and update.relation_oid == relation.oid
        if table == "ri_full":
            assert update.old_key is None
            assert_tuple(update.old_tuple, before)
        else:
            assert update.old_tuple is None
            assert before[2] is not None  # so the 'n' below means "not a key column", not NULL
            assert_tuple(update.old_key, key_only(before, key_mask))
            assert update.old_key.kinds.count("t") == 1
        assert_tuple(update.new_tuple, after)

        window, before, _ = steps["delete"]
        group = by_xid(groups, window)
        assert kinds(group) == "BDC"
        assert_plain_transaction(group, window)
        delete = group[1].message
        assert isinstance(delete, DeleteMessage) and delete.relation_oid == relation.oid
        if table == "ri_full":
            assert delete.old_key is None
            assert_tuple(delete.old_tuple, before)
        else:
            assert delete.old_tuple is None
            assert_tuple(delete.old_key, key_only(before, key_mask))

    group = by_xid(groups, index_pk_change)
    assert kinds(group) == "BIUC"
    assert_plain_transaction(group, index_pk_change)
    update = group[2].message
    assert update.old_key is None and update.old_tuple is None, "pk change is not a USING INDEX key change"
    assert_tuple(update.new_tuple, [b"6", b"z", None])

    nothing = catalog_relation(conn, "ri_nothing")
    assert nothing.replica_identity == "n" and not any(c.is_key for c in nothing.columns)
    group = by_xid(groups, nothing_insert)
    assert kinds(group) == "BRIC"
    assert_plain_transaction(group, nothing_insert)
    assert_relation(group[1].message, nothing)
    assert_tuple(group[2].message.new_tuple, [b"2", b"b", None])
    for step in ("note", "key", "delete"):
        window = nothing_steps[step][0]
        assert not [g for g in groups if g[0].row.xid == window.xid], f"{step} on ri_nothing is not sent"
    assert not any(
        isinstance(item.message, (UpdateMessage, DeleteMessage)) and item.message.relation_oid == nothing.oid
        for item in decoded
    )


# -- 3. unchanged TOAST ---------------------------------------------------------------------------

TOAST_DDL = """
CREATE TABLE toasty (id int PRIMARY KEY, big text, n int);
ALTER TABLE toasty ALTER COLUMN big SET STORAGE EXTERNAL;
CREATE TABLE toasty_full (id int PRIMARY KEY, big text, n int);
ALTER TABLE toasty_full ALTER COLUMN big SET STORAGE EXTERNAL;
ALTER TABLE toasty_full REPLICA IDENTITY FULL;
"""
BIG_TEXT = "(SELECT string_agg(md5(i::text), '') FROM generate_series(1, 640) i)"  # 20,480 random-ish chars


def test_update_leaving_out_of_line_toast_unchanged_sends_u(pg_any: Any, conn: Any) -> None:
    """A 20 kB incompressible text stored EXTERNAL: the insert sends it as 't'; an update of
    another column sends it as 'u' with no value (also in the new tuple under FULL, whose 'O' old
    tuple carries the value in full); an update of the column itself sends 't' again."""
    prepare(conn, TOAST_DDL)
    with captured_transaction(conn) as insert:
        conn.execute(f"INSERT INTO toasty VALUES (1, {BIG_TEXT}, 1); INSERT INTO toasty_full VALUES (1, {BIG_TEXT}, 1)")
    big = fetch_text(conn, "toasty", "id", 1)[1]
    assert big is not None and len(big) == 20480
    with captured_transaction(conn) as update_other:
        conn.execute("UPDATE toasty SET n = 2; UPDATE toasty_full SET n = 2")
    with captured_transaction(conn) as update_big:
        conn.execute("UPDATE toasty SET big = big || 'x', n = 3")
    new_big = fetch_text(conn, "toasty", "id", 1)[1]

    decoded = peek_decoded(conn, SLOT, pgoutput_options(pg_any.version, PUB))
    groups = split_transactions(decoded)
    assert [kinds(g) for g in groups] == ["BRIRIC", "BUUC", "BUC"]
    plain, full = catalog_relation(conn, "toasty"), catalog_relation(conn, "toasty_full")

    group = by_xid(groups, insert)
    assert_plain_transaction(group, insert)
    assert_relation(group[1].message, plain)
    assert_relation(group[3].message, full)
    assert_tuple(group[2].message.new_tuple, [b"1", big, b"1"])
    assert_tuple(group[4].message.new_tuple, [b"1", big, b"1"])

    group = by_xid(groups, update_other)
    assert_plain_transaction(group, update_other)
    on_plain, on_full = group[1].message, group[2].message
    assert on_plain.relation_oid == plain.oid and on_full.relation_oid == full.oid
    assert on_plain.old_key is None and on_plain.old_tuple is None
    assert on_plain.new_tuple.kinds == "tut"
    assert on_plain.new_tuple.values == (b"1", None, b"2")
    assert on_full.old_key is None
    assert_tuple(on_full.old_tuple, [b"1", big, b"1"])
    assert on_full.new_tuple.kinds == "tut"
    assert on_full.new_tuple.values == (b"1", None, b"2")

    group = by_xid(groups, update_big)
    assert_plain_transaction(group, update_big)
    assert_tuple(group[1].message.new_tuple, [b"1", new_big, b"3"])
    assert new_big == big + b"x"


# -- 4. TRUNCATE ----------------------------------------------------------------------------------

TRUNCATE_DDL = """
CREATE TABLE parent (id serial PRIMARY KEY);
CREATE TABLE child (id serial PRIMARY KEY, parent_id int REFERENCES parent);
CREATE TABLE other (id serial PRIMARY KEY);
CREATE TABLE unpublished (id int);
INSERT INTO parent DEFAULT VALUES;
INSERT INTO child (parent_id) VALUES (1);
INSERT INTO other DEFAULT VALUES;
"""


def test_truncate_lists_all_relations_and_options(pg_any: Any, conn: Any) -> None:
    """``TRUNCATE parent, other, unpublished RESTART IDENTITY CASCADE`` → one T with the three
    published OIDs (cascaded child included, unpublished table left out) and options 3 (cascade +
    restart identity), preceded by their R messages; then CASCADE alone (1), RESTART IDENTITY
    alone (2) and a plain TRUNCATE (0), each re-sending R for its relations."""
    prepare(conn, TRUNCATE_DDL, "FOR TABLE parent, child, other")
    oid = {name: catalog_relation(conn, name).oid for name in ("parent", "child", "other", "unpublished")}
    with captured_transaction(conn) as both:
        conn.execute("TRUNCATE parent, other, unpublished RESTART IDENTITY CASCADE")
    with captured_transaction(conn) as cascade:
        conn.execute("TRUNCATE parent CASCADE")
    with captured_transaction(conn) as restart:
        conn.execute("TRUNCATE other RESTART IDENTITY")
    with captured_transaction(conn) as plain:
        conn.execute("TRUNCATE other")

    decoded = peek_decoded(conn, SLOT, pgoutput_options(pg_any.version, PUB))
    groups = split_transactions(decoded)
    assert len(groups) == 4

    group = by_xid(groups, both)
    assert kinds(group) == "BRRRTC"
    assert_plain_transaction(group, both)
    assert {item.message.relation_oid for item in group[1:4]} == {oid["parent"], oid["child"], oid["other"]}
    for item in group[1:4]:
        name = item.message.relation_name
        assert_relation(item.message, catalog_relation(conn, name))
    truncate = group[4].message
    assert isinstance(truncate, TruncateMessage) and truncate.xid is None
    assert sorted(truncate.relation_oids) == sorted([oid["parent"], oid["child"], oid["other"]])
    assert len(truncate.relation_oids) == 3
    assert truncate.options == 3 and truncate.cascade and truncate.restart_identity
    # The order is the server's: R messages follow it.
    assert list(truncate.relation_oids) == [item.message.relation_oid for item in group[1:4]]

    for window, expected_oids, options in (
        (cascade, {oid["parent"], oid["child"]}, 1),
        (restart, {oid["other"]}, 2),
        (plain, {oid["other"]}, 0),
    ):
        group = by_xid(groups, window)
        # A TRUNCATE invalidates the relations, so their R messages come again.
        assert kinds(group) == "B" + "R" * len(expected_oids) + "TC"
        assert_plain_transaction(group, window)
        for item in group[1:-2]:
            assert_relation(item.message, catalog_relation(conn, item.message.relation_name))
        truncate = group[-2].message
        assert [item.message.relation_oid for item in group[1:-2]] == list(truncate.relation_oids)
        assert set(truncate.relation_oids) == expected_oids and len(truncate.relation_oids) == len(expected_oids)
        assert truncate.options == options
        assert truncate.cascade == bool(options & 1) and truncate.restart_identity == bool(options & 2)


# -- 5. logical decoding messages -----------------------------------------------------------------


def emit(conn: Any, transactional: bool, prefix: str, content: str | bytes) -> int:
    """``pg_logical_emit_message``; returns the LSN it reports (an int)."""
    cast = "bytea" if isinstance(content, bytes) else "text"
    (lsn,) = conn.execute(
        f"SELECT (pg_logical_emit_message(%s, %s, %s::{cast}) - '0/0'::pg_lsn)::int8", (transactional, prefix, content)
    ).fetchone()
    return int(lsn)


def test_transactional_and_non_transactional_messages(pg_any: Any, conn: Any) -> None:
    """Transactional M (flags 1) inside B…C with prefix, text and binary content, lsn == the
    value ``pg_logical_emit_message`` returned == the row's lsn; non-transactional M (flags 0)
    with no Begin, both in autocommit (row xid 0) and inside a transaction that then rolls back
    (still delivered, row xid = that transaction's). ``messages 'false'`` suppresses all of them."""
    prepare(conn, "CREATE TABLE t (id int PRIMARY KEY)")
    with captured_transaction(conn) as txn:
        conn.execute("INSERT INTO t VALUES (1)")
        text_lsn = emit(conn, True, "prefix", "content")
        binary_lsn = emit(conn, True, "bin/ä", b"\x00\xff\x01")
    before_plain = current_wal_lsn(conn)
    plain_lsn = emit(conn, False, "prefix", "nontransactional")
    with captured_transaction(conn, commit=False):
        conn.execute("INSERT INTO t VALUES (2)")
        aborted_lsn = emit(conn, False, "lost?", "survives the rollback")

    # Nothing flushes a non-transactional message or a rollback: wait for the WAL writer.
    wait_for_flush(conn, aborted_lsn)

    for proto in range(1, max_proto_version(pg_any.version) + 1):
        decoded = peek_decoded(conn, SLOT, pgoutput_options(pg_any.version, PUB, proto_version=proto))
        assert kinds(decoded) == "BRIMMCMM"
        group = decoded[:6]
        assert_plain_transaction(group, txn)
        expected = [
            (group[3], 1, text_lsn, "prefix", b"content"),
            (group[4], 1, binary_lsn, "bin/ä", b"\x00\xff\x01"),
            (decoded[6], 0, plain_lsn, "prefix", b"nontransactional"),
            (decoded[7], 0, aborted_lsn, "lost?", b"survives the rollback"),
        ]
        for item, flags, lsn, prefix, content in expected:
            message = item.message
            assert isinstance(message, LogicalDecodingMessage)
            assert (message.xid, message.flags, message.lsn, message.prefix, message.content) == (
                None,
                flags,
                lsn,
                prefix,
                content,
            )
            assert message.transactional == bool(flags)
            assert item.row.lsn == lsn
        assert group[2].row.lsn < text_lsn < binary_lsn <= group[5].message.commit_lsn
        assert before_plain < plain_lsn
        # A non-transactional message belongs to no transaction on the stream, whatever wrote it.
        assert decoded[6].row.xid == decoded[7].row.xid == 0

    silent = peek_decoded(conn, SLOT, pgoutput_options(pg_any.version, PUB, messages=False))
    assert kinds(silent) == "BRIC"


# -- 6. replication origin ------------------------------------------------------------------------


def test_origin_message_follows_begin(pg_any: Any, conn: Any) -> None:
    """A transaction replayed under origin 'o1' with ``pg_replication_origin_xact_setup('0/ABCDEF',
    ts)`` → B, O(commit_lsn 0xABCDEF, name 'o1'), R, I, C; the commit time pgoutput reports is the
    origin timestamp ``ts``. A later transaction without the origin has no O. A large tagged
    transaction read with streaming gets O inside the first stream block only, with commit_lsn 0
    (pgoutput does not send the origin LSN for streamed transactions), and its Stream Commit carries
    the origin timestamp too. On 16+, ``origin 'none'`` drops the origin-tagged transactions."""
    prepare(conn, "CREATE TABLE t (id int PRIMARY KEY, v text)")
    origin_time = datetime(2001, 2, 3, 4, 5, 6, 789012, tzinfo=UTC)
    big_origin_time = datetime(2002, 1, 1, 0, 0, 0, 1, tzinfo=UTC)
    conn.execute("SELECT pg_replication_origin_drop('o1') FROM pg_replication_origin WHERE roname = 'o1'")
    conn.execute("SELECT pg_replication_origin_create('o1')")
    try:
        conn.execute("SELECT pg_replication_origin_session_setup('o1')")
        try:
            with captured_transaction(conn) as tagged:
                conn.execute("SELECT pg_replication_origin_xact_setup('0/ABCDEF', %s)", (origin_time,))
                conn.execute("INSERT INTO t VALUES (1, 'from o1')")
            conn.execute("SELECT pg_replication_origin_session_reset()")
            with captured_transaction(conn) as local:
                conn.execute("INSERT INTO t VALUES (2, 'local')")
            conn.execute("SELECT pg_replication_origin_session_setup('o1')")
            with captured_transaction(conn) as big:
                conn.execute("SELECT pg_replication_origin_xact_setup('0/BEEF', %s)", (big_origin_time,))
                conn.execute(f"INSERT INTO t SELECT g, {PAD} FROM generate_series(10, 2009) g")
        finally:
            conn.execute("SELECT pg_replication_origin_session_reset()")

        decoded = peek_decoded(conn, SLOT, pgoutput_options(pg_any.version, PUB))
        assert kinds(decoded) == "BORICBICBO" + "I" * 2000 + "C"
        begin, origin, relation, insert, commit = (item.message for item in decoded[:5])
        assert isinstance(origin, OriginMessage)
        assert (origin.commit_lsn, origin.name) == (0xABCDEF, "o1")
        assert decoded[1].row.xid == tagged.xid and not decoded[1].in_stream_after
        assert tagged.lsn_before <= decoded[1].row.lsn <= commit.commit_lsn
        assert isinstance(begin, BeginMessage) and begin.xid == tagged.xid
        assert begin.final_lsn == commit.commit_lsn and commit.end_lsn == decoded[4].row.lsn
        assert begin.commit_time == commit.commit_time == origin_time
        assert_relation(relation, catalog_relation(conn, "t"))
        assert_tuple(insert.new_tuple, [b"1", b"from o1"])
        assert_plain_transaction(decoded[5:8], local)
        assert_tuple(decoded[6].message.new_tuple, [b"2", b"local"])
        big_origin = decoded[9].message
        assert (big_origin.commit_lsn, big_origin.name) == (0xBEEF, "o1")
        assert decoded[8].message.xid == big.xid and decoded[8].message.commit_time == big_origin_time

        for mode in streaming_modes(pg_any.version):
            options = pgoutput_options(pg_any.version, PUB, streaming=mode)
            streamed = peek_decoded(conn, SLOT, options, mode)
            assert kinds(streamed[:8]) == "BORICBIC"
            tail = streamed[8:]
            assert_stream_structure(tail, big.xid)
            origins = [(i, item) for i, item in enumerate(tail) if item.kind == "O"]
            assert [i for i, _ in origins] == [1], "O right after the first Stream Start only"
            stream_origin = origins[0][1]
            assert stream_origin.message == OriginMessage(0, "o1")
            assert stream_origin.in_stream_after and stream_origin.row.xid == big.xid
            stream_commit = tail[-1].message
            assert isinstance(stream_commit, StreamCommitMessage) and stream_commit.xid == big.xid
            assert stream_commit.commit_time == big_origin_time
            assert stream_commit.end_lsn == tail[-1].row.lsn <= big.lsn_after

        if pg_any.version >= 16:
            options = [*pgoutput_options(pg_any.version, PUB), "origin", "none"]
            assert kinds(peek_decoded(conn, SLOT, options)) == "BRIC"
    finally:
        conn.execute("SELECT pg_replication_origin_drop('o1')")


# -- 7. streaming ---------------------------------------------------------------------------------

STREAM_DDL = """
CREATE TYPE mood AS ENUM ('sad', 'happy');
CREATE TABLE s (id int PRIMARY KEY, pad text, m mood);
CREATE TABLE side (id int);
"""
PAD = "repeat(md5(g::text), 3)"


def streaming_variants(version: int) -> list[tuple[int, Streaming]]:
    """(proto_version, streaming) pairs: proto 2 and the maximum with 'on', and 'parallel' on 16+."""
    variants: list[tuple[int, Streaming]] = [(2, "on"), (max_proto_version(version), "on")]
    if version >= 16:
        variants.append((4, "parallel"))
    return variants


def stream_blocks(decoded: list[Decoded]) -> list[list[Decoded]]:
    """The Stream Start … Stream Stop runs of a peek (both ends included)."""
    blocks, current = [], None
    for item in decoded:
        if item.kind == "S":
            assert current is None
            current = [item]
        elif current is not None:
            current.append(item)
            if item.kind == "E":
                blocks.append(current)
                current = None
    assert current is None
    return blocks


def assert_stream_structure(decoded: list[Decoded], top_xid: int) -> list[list[Decoded]]:
    """S/E alternate, the first S has first_segment True and later ones False, S carries the top
    xid, the decoder's ``in_stream`` is True from S up to (not including) E and False after, and
    every row's xid column is the top xid (Stream Abort rows excepted)."""
    blocks = stream_blocks(decoded)
    assert len(blocks) >= 3, "the transaction must have been streamed in several blocks"
    starts = [block[0].message for block in blocks]
    assert all(isinstance(m, StreamStartMessage) and m.xid == top_xid for m in starts)
    assert [m.first_segment for m in starts] == [True] + [False] * (len(starts) - 1)
    inside = False
    for item in decoded:
        if item.kind == "S":
            inside = True
        elif item.kind == "E":
            inside = False
        assert item.in_stream_after == inside, item
        if item.kind != "A":
            assert item.row.xid == top_xid
    assert not any(item.kind in "BC" for item in decoded), "a streamed transaction has no Begin/Commit"
    for block in blocks:
        for position, item in enumerate(block[1:-1]):
            assert item.kind not in "SEAc"
            if item.kind == "O":  # sent after the first Stream Start; the layout has no xid
                assert position == 0 and block[0].message.first_segment
                continue
            message = item.message
            assert message.xid is not None
            if item.kind in "RY":
                # Schema messages are tagged like the change that made them necessary.
                following = next(x for x in block[position + 2 :] if x.kind not in "RY")
                assert message.xid == following.message.xid
    return blocks


def test_streamed_transaction_with_savepoints(pg_any: Any, conn: Any) -> None:
    """A 4,500-row transaction (well over logical_decoding_work_mem=64kB): S/E blocks, changes
    tagged with the xid of the (sub)transaction that made them (top: txid_current(); savepoints:
    row xmin), a transactional M, U/D/T with the top xid, one A(top, rolled-back subxid) right
    after that subxact's last change (abort_lsn/abort_time only with 'parallel'), one final
    c(top, commit_lsn, end_lsn = row lsn, commit_time); applying the A by truncation leaves
    exactly the committed rows, whose values equal the table's."""
    prepare(conn, STREAM_DDL)
    with captured_transaction(conn) as window:
        conn.execute(f"INSERT INTO s SELECT g, {PAD}, 'happy' FROM generate_series(1, 1500) g")
        message_lsn = emit(conn, True, "stream", "inside")
        conn.execute("SAVEPOINT a")
        conn.execute(f"INSERT INTO s SELECT g, {PAD} FROM generate_series(1501, 3000) g")
        sub_a = row_xmin(conn, "s", "id = 1501")
        abort_before = wall_clock()
        conn.execute("ROLLBACK TO SAVEPOINT a")
        abort_after = wall_clock()
        conn.execute("RELEASE SAVEPOINT a")
        conn.execute("SAVEPOINT b")
        conn.execute(f"INSERT INTO s SELECT g, {PAD} FROM generate_series(3001, 3500) g")
        sub_b = row_xmin(conn, "s", "id = 3001")
        conn.execute("SAVEPOINT c")
        conn.execute(f"INSERT INTO s SELECT g, {PAD} FROM generate_series(3501, 4500) g")
        sub_c = row_xmin(conn, "s", "id = 3501")
        conn.execute("RELEASE SAVEPOINT c")
        conn.execute("RELEASE SAVEPOINT b")
        conn.execute("UPDATE s SET pad = 'updated' WHERE id = 1; DELETE FROM s WHERE id = 2; TRUNCATE side")
    top = window.xid
    assert len({top, sub_a, sub_b, sub_c}) == 4
    relation = catalog_relation(conn, "s")
    names = [c.name for c in relation.columns]
    stored = {int(row[0]): row for row in text_values(conn, "s", names, "true")}
    assert len(stored) == 2999
    (mood_oid,) = conn.execute("SELECT 'mood'::regtype::oid::int8").fetchone()

    def owner(row_id: int) -> int:
        return top if row_id <= 1500 else sub_a if row_id <= 3000 else sub_b if row_id <= 3500 else sub_c

    for proto, mode in streaming_variants(pg_any.version):
        options = pgoutput_options(pg_any.version, PUB, proto_version=proto, streaming=mode)
        decoded = peek_decoded(conn, SLOT, options, mode)
        blocks = assert_stream_structure(decoded, top)

        aborts = [i for i, item in enumerate(decoded) if item.kind == "A"]
        commits = [i for i, item in enumerate(decoded) if item.kind == "c"]
        assert len(aborts) == 1 and commits == [len(decoded) - 1]
        abort_item = decoded[aborts[0]]
        abort = abort_item.message
        assert isinstance(abort, StreamAbortMessage)
        assert (abort.xid, abort.subtransaction_xid) == (top, sub_a)
        assert abort_item.row.xid == sub_a, "the xid column shows the subxid on a subxact abort"
        if mode == "parallel":
            assert abort.abort_lsn == abort_item.row.lsn
            assert window.lsn_before < abort.abort_lsn < window.lsn_after
            assert abort_before <= abort.abort_time <= abort_after
        else:
            assert abort.abort_lsn is None and abort.abort_time is None

        commit_item = decoded[-1]
        commit = commit_item.message
        assert isinstance(commit, StreamCommitMessage)
        assert (commit.xid, commit.flags) == (top, 0)
        assert commit.end_lsn == commit_item.row.lsn <= window.lsn_after
        assert commit.commit_lsn < commit.end_lsn
        assert window.contains_time(commit.commit_time)

        # Every change, in order, with the xid of its (sub)transaction.
        changes = [item for block in blocks for item in block[1:-1] if item.kind not in "RY"]
        assert all(item.row.lsn < commit.commit_lsn for item in changes)
        inserts = [item for item in changes if item.kind == "I"]
        ids = [int(item.message.new_tuple.values[0]) for item in inserts]
        # Only what was streamed before ROLLBACK TO appears of the aborted subxact; the rest was
        # still in memory and is discarded unsent.
        last_streamed_a = max(i for i in ids if 1500 < i <= 3000)
        assert ids == list(range(1, last_streamed_a + 1)) + list(range(3001, 4501))
        assert [item.message.xid for item in inserts] == [owner(i) for i in ids]
        assert all(item.message.relation_oid == relation.oid for item in inserts)
        position = {id(item): i for i, item in enumerate(decoded)}
        last_a = max(position[id(item)] for item in inserts if item.message.xid == sub_a)
        first_b = min(position[id(item)] for item in inserts if item.message.xid == sub_b)
        assert last_a < aborts[0] < first_b

        (message_item,) = [item for item in changes if item.kind == "M"]
        message = message_item.message
        assert (message.xid, message.flags, message.lsn, message.prefix, message.content) == (
            top,
            1,
            message_lsn,
            "stream",
            b"inside",
        )
        tail = [item.kind for item in changes[-3:]]
        assert tail == ["U", "D", "T"]
        update, delete, truncate = (item.message for item in changes[-3:])
        assert update.xid == delete.xid == truncate.xid == top
        assert update.old_key is None and update.old_tuple is None
        assert_tuple(update.new_tuple, stored[1])
        assert_tuple(delete.old_key, [b"2", None, None])
        assert truncate.relation_oids == (catalog_relation(conn, "side").oid,) and truncate.options == 0

        schema = [item.message for block in blocks for item in block if item.kind in "RY"]
        for message in schema:
            if isinstance(message, RelationMessage):
                assert_relation(message, catalog_relation(conn, message.relation_name))
            elif isinstance(message, TypeMessage):
                assert (message.type_oid, message.namespace, message.name) == (mood_oid, "public", "mood")
        assert blocks[0][1].kind == "Y" and blocks[0][2].kind == "R", "Y, R start the first block"

        # Apply the abort the way the apply worker does: drop the subxact's changes and later ones.
        survivors: list[int] = []
        for item in decoded:
            if item.kind == "I":
                survivors.append(int(item.message.new_tuple.values[0]))
            elif item.kind == "A":
                survivors = [i for i in survivors if owner(i) != item.message.subtransaction_xid]
        survivors.remove(2)  # deleted in the same transaction
        assert sorted(survivors) == sorted(stored)
        for item in inserts:
            row_id = int(item.message.new_tuple.values[0])
            if row_id in stored and row_id != 1:
                assert_tuple(item.message.new_tuple, stored[row_id])


COLD_SLOT = "slot_cold"


def only_transactions(decoded: list[Decoded], xids: set[int]) -> list[Decoded]:
    """The rows of the transactions ``xids``. Another transaction of the database was once decoded in
    between on a loaded machine (105 rows; which one was not identified: a manual ANALYZE of the
    table decodes to nothing); it may only be streamed blocks without a change or a relation of a
    published table — else the rows of the others are shown."""
    others = [item for item in decoded if item.row.xid not in xids]
    assert set(kinds(others)) <= set("SEcA"), [(i.row.xid, i.kind, i.row.lsn) for i in others[:20]]
    return [item for item in decoded if item.row.xid in xids]


def test_rolled_back_streamed_transaction_ends_with_stream_abort(pg_any: Any, conn: Any) -> None:
    """A 3,000-row transaction that rolls back, peeked after the rollback.

    * Slot whose peek first decodes a committed change to the table (caches warm): S/E blocks
      with the changes streamed before the abort (a prefix of the rows), then one
      A(xid == subtransaction_xid == txid_current()), no c.
    * Slot created after that change (caches cold): building the relation entry scans the
      catalogs, the server notices the transaction aborted and sends an *empty* S/E, then A.
    * PostgreSQL 18 skips a transaction already known to be aborted: nothing at all, unless the
      peeking session sets ``debug_logical_replication_streaming = immediate`` (16+), under which
      every version behaves as above, streaming change by change.
    """
    prepare(conn, STREAM_DDL)
    with captured_transaction(conn) as warm:
        conn.execute("INSERT INTO s VALUES (0, 'warm', 'sad')")
    create_slot(conn, COLD_SLOT)
    with captured_transaction(conn, commit=False) as window:
        conn.execute(f"INSERT INTO s SELECT g, {PAD} FROM generate_series(1, 3000) g")
    rollback_done = wall_clock()
    # Nothing flushes an aborted transaction's WAL, and a peek sees only flushed WAL.
    wait_for_flush(conn, current_wal_insert_lsn(conn))
    relation = catalog_relation(conn, "s")
    (first_pad,) = conn.execute("SELECT repeat(md5('1'), 3)").fetchone()

    def check_abort(item: Decoded, mode: Streaming) -> None:
        abort = item.message
        assert isinstance(abort, StreamAbortMessage)
        assert (abort.xid, abort.subtransaction_xid) == (window.xid, window.xid)
        assert item.row.xid == window.xid and not item.in_stream_after
        if mode == "parallel":
            assert abort.abort_lsn == item.row.lsn
            assert window.lsn_before < abort.abort_lsn
            assert window.time_before <= abort.abort_time <= rollback_done
        else:
            assert abort.abort_lsn is None and abort.abort_time is None

    def check_streamed(decoded: list[Decoded], mode: Streaming) -> None:
        assert_stream_structure(decoded, window.xid)
        assert kinds(decoded).count("A") == 1 and decoded[-1].kind == "A" and "c" not in kinds(decoded)
        check_abort(decoded[-1], mode)
        inserts = [item.message for item in decoded if item.kind == "I"]
        assert [int(m.new_tuple.values[0]) for m in inserts] == list(range(1, len(inserts) + 1))
        assert len(inserts) >= 3 * 200
        assert all(m.xid == window.xid and m.relation_oid == relation.oid for m in inserts)
        assert_tuple(inserts[0].new_tuple, [b"1", first_pad.encode(), None])

    for immediate in [False] + ([True] if pg_any.version >= 16 else []):
        if pg_any.version >= 16:
            conn.execute(f"SET debug_logical_replication_streaming = {'immediate' if immediate else 'buffered'}")
        skipped = pg_any.version >= 18 and not immediate
        for proto, mode in streaming_variants(pg_any.version):
            options = pgoutput_options(pg_any.version, PUB, proto_version=proto, streaming=mode)
            decoded = only_transactions(peek_decoded(conn, SLOT, options, mode), {warm.xid, window.xid})
            earlier = [item for item in decoded if item.row.xid == warm.xid]
            aborted = [item for item in decoded if item.row.xid == window.xid]
            if immediate:
                assert kinds(earlier) == "SYRIEc"
                commit = earlier[-1].message
                assert isinstance(commit, StreamCommitMessage) and commit.xid == warm.xid
                assert commit.end_lsn == earlier[-1].row.lsn <= warm.lsn_after
                assert warm.contains_time(commit.commit_time)
            else:
                assert kinds(earlier) == "BYRIC"
                assert_plain_transaction(earlier, warm)
            if skipped:
                assert aborted == [], "PostgreSQL 18 does not decode an already-aborted transaction"
            else:
                check_streamed(aborted, mode)

            cold = only_transactions(peek_decoded(conn, COLD_SLOT, options, mode), {window.xid})
            if skipped:
                assert cold == []
                continue
            assert kinds(cold) == "SEA"
            start = cold[0].message
            assert isinstance(start, StreamStartMessage) and (start.xid, start.first_segment) == (window.xid, True)
            assert [item.in_stream_after for item in cold] == [True, False, False]
            assert all(item.row.xid == window.xid for item in cold)
            check_abort(cold[2], mode)


# -- 8. two-phase ---------------------------------------------------------------------------------

TWO_PHASE_SLOT = "slot_2pc"


def prepare_then(conn: Any, gid: str, sql: str, finish: str) -> tuple[TxnWindow, TxnWindow]:
    """Run ``sql`` then ``PREPARE TRANSACTION gid``; then ``finish`` (COMMIT/ROLLBACK PREPARED).
    Returns the window of the prepared transaction and that of the finishing statement."""
    prepared = TxnWindow(lsn_before=current_wal_lsn(conn), time_before=wall_clock())
    conn.execute("BEGIN")
    prepared.xid = int(conn.execute("SELECT txid_current()").fetchone()[0]) & 0xFFFFFFFF
    conn.execute(sql)
    conn.execute(f"PREPARE TRANSACTION '{gid}'")
    prepared.time_after, prepared.lsn_after = wall_clock(), current_wal_lsn(conn)
    finished = TxnWindow(xid=prepared.xid, lsn_before=current_wal_lsn(conn), time_before=wall_clock())
    conn.execute(f"{finish} '{gid}'")
    finished.time_after, finished.lsn_after = wall_clock(), current_wal_lsn(conn)
    return prepared, finished


def assert_prepare(item: Decoded, window: TxnWindow, gid: str) -> PrepareMessage | StreamPrepareMessage:
    prepare_message = item.message
    assert (prepare_message.flags, prepare_message.xid, prepare_message.gid) == (0, window.xid, gid)
    assert prepare_message.end_lsn == item.row.lsn
    assert window.lsn_before <= prepare_message.prepare_lsn < prepare_message.end_lsn <= window.lsn_after
    assert window.contains_time(prepare_message.prepare_time)
    assert item.row.xid == window.xid and not item.in_stream_after
    return prepare_message


def test_two_phase_prepare_commit_rollback_and_stream_prepare(pg_any: Any, conn: Any) -> None:
    """On a slot created two-phase, read with ``two_phase 'on'``: g1 → b, R, I, P at PREPARE and K
    at COMMIT PREPARED; g2 → b, I, P then r (prepare_end_lsn == P.end_lsn, both times); a streamed
    g3 → S/E blocks, p (Stream Prepare), K. gid, xid and LSNs agree with each other, the rows'
    lsn/xid columns and the captured windows."""
    prepare(conn, "CREATE TABLE t (id int PRIMARY KEY, pad text)")
    create_slot(conn, TWO_PHASE_SLOT, two_phase=True)
    (two_phase,) = conn.execute(
        "SELECT two_phase FROM pg_replication_slots WHERE slot_name = %s", (TWO_PHASE_SLOT,)
    ).fetchone()
    assert two_phase is True
    g1, g1_commit = prepare_then(conn, "g1", "INSERT INTO t VALUES (1, 'one')", "COMMIT PREPARED")
    g2, g2_rollback = prepare_then(conn, "g2", "INSERT INTO t VALUES (2, 'two')", "ROLLBACK PREPARED")
    g3, g3_commit = prepare_then(
        conn, "g3", f"INSERT INTO t SELECT g, {PAD} FROM generate_series(100, 3099) g", "COMMIT PREPARED"
    )
    relation = catalog_relation(conn, "t")

    variants = [(3, "on")] + [(4, mode) for mode in streaming_modes(pg_any.version) if pg_any.version >= 16]
    for proto, mode in variants:
        options = pgoutput_options(pg_any.version, PUB, proto_version=proto, streaming=mode, two_phase=True)
        decoded = peek_decoded(conn, TWO_PHASE_SLOT, options, mode)
        text = kinds(decoded)
        assert text.startswith("bRIPKbIPrS") and text.endswith("EpK"), text
        assert text.count("p") == 1 and "B" not in text and "C" not in text

        # g1: b R I P … K
        begin_prepare, relation_message, insert, prepared, committed = decoded[:5]
        assert isinstance(begin_prepare.message, BeginPrepareMessage)
        assert (begin_prepare.message.xid, begin_prepare.message.gid) == (g1.xid, "g1")
        assert all(item.row.xid == g1.xid for item in decoded[:5])
        assert isinstance(prepared.message, PrepareMessage)
        p1 = assert_prepare(prepared, g1, "g1")
        assert (
            begin_prepare.message.prepare_lsn,
            begin_prepare.message.end_lsn,
            begin_prepare.message.prepare_time,
        ) == (
            p1.prepare_lsn,
            p1.end_lsn,
            p1.prepare_time,
        )
        assert g1.lsn_before <= begin_prepare.row.lsn == insert.row.lsn < p1.prepare_lsn
        assert_relation(relation_message.message, relation)
        assert insert.message.xid is None
        assert_tuple(insert.message.new_tuple, [b"1", b"one"])
        k1 = committed.message
        assert isinstance(k1, CommitPreparedMessage)
        assert (k1.flags, k1.xid, k1.gid) == (0, g1.xid, "g1")
        assert k1.end_lsn == committed.row.lsn
        assert p1.end_lsn <= g1_commit.lsn_before <= k1.commit_lsn < k1.end_lsn <= g1_commit.lsn_after
        assert g1_commit.contains_time(k1.commit_time)

        # g2: b I P … r
        begin_prepare, insert, prepared, rolled_back = decoded[5:9]
        assert (begin_prepare.message.xid, begin_prepare.message.gid) == (g2.xid, "g2")
        p2 = assert_prepare(prepared, g2, "g2")
        assert (begin_prepare.message.prepare_lsn, begin_prepare.message.end_lsn) == (p2.prepare_lsn, p2.end_lsn)
        assert_tuple(insert.message.new_tuple, [b"2", b"two"])
        r2 = rolled_back.message
        assert isinstance(r2, RollbackPreparedMessage)
        assert (r2.flags, r2.xid, r2.gid) == (0, g2.xid, "g2")
        assert r2.prepare_end_lsn == p2.end_lsn
        assert r2.rollback_end_lsn == rolled_back.row.lsn
        assert g2_rollback.lsn_before < r2.rollback_end_lsn <= g2_rollback.lsn_after
        assert r2.prepare_time == p2.prepare_time
        assert g2_rollback.contains_time(r2.rollback_time) and r2.rollback_time > r2.prepare_time
        assert rolled_back.row.xid == g2.xid

        # g3: streamed, then p and K
        streamed = decoded[9:-2]
        assert_stream_structure(streamed, g3.xid)
        inserts = [item.message for item in streamed if item.kind == "I"]
        assert [int(m.new_tuple.values[0]) for m in inserts] == list(range(100, 3100))
        assert all(m.xid == g3.xid for m in inserts)
        stream_prepare = decoded[-2]
        assert isinstance(stream_prepare.message, StreamPrepareMessage)
        p3 = assert_prepare(stream_prepare, g3, "g3")
        assert all(item.row.lsn < p3.prepare_lsn for item in streamed if item.kind == "I")
        k3 = decoded[-1].message
        assert isinstance(k3, CommitPreparedMessage)
        assert (k3.flags, k3.xid, k3.gid) == (0, g3.xid, "g3")
        assert p3.end_lsn <= g3_commit.lsn_before <= k3.commit_lsn < k3.end_lsn == decoded[-1].row.lsn
        assert g3_commit.contains_time(k3.commit_time)

    # The normal slot never saw two_phase: prepared transactions arrive as B…C at COMMIT PREPARED.
    normal = peek_decoded(conn, SLOT, pgoutput_options(pg_any.version, PUB))
    assert [kinds(g) for g in split_transactions(normal)] == ["BRIC", "B" + "I" * 3000 + "C"]
    (normal_two_phase,) = conn.execute(
        "SELECT two_phase FROM pg_replication_slots WHERE slot_name = %s", (SLOT,)
    ).fetchone()
    assert normal_two_phase is False


# -- 9. binary mode -------------------------------------------------------------------------------

BINARY_DDL = (
    MULTI_TYPE_DDL
    + """
ALTER TABLE app.things ADD COLUMN f8 float8, ADD COLUMN u uuid, ADD COLUMN iv interval, ADD COLUMN d date;
"""
)


def test_binary_mode_sends_typsend_bytes(pg_any: Any, conn: Any) -> None:
    """With ``binary 'true'`` every non-NULL column of every type (int, text, numeric, timestamptz,
    bool, bytea, jsonb, enum, domain, int[], enum[], float8, uuid, interval, date) arrives as 'b'
    with exactly the bytes of ``<typsend>(col)``; NULLs stay 'n'. Also for an UPDATE's old key."""
    prepare(conn, BINARY_DDL)
    with captured_transaction(conn) as inserts:
        conn.execute(MULTI_TYPE_INSERT)
        conn.execute(
            "UPDATE app.things SET f8 = 0.1 + 0.2, u = 'A0EEBC99-9C0B-4EF8-BB6D-6BB9BD380A11',"
            " iv = '-1 day 02:03:04.5', d = '2024-02-29' WHERE id = 1"
        )
    with captured_transaction(conn) as key_change:
        conn.execute("UPDATE app.things SET id = 4 WHERE id = 3")
    relation = catalog_relation(conn, "app.things")
    stored = send_values(conn, "app.things", "true", "id")
    assert stored[0][0] == b"\x00\x00\x00\x01" and stored[0][6][:1] == b"\x01"
    assert len(stored[0]) == len(relation.columns) == 15

    for proto in range(1, max_proto_version(pg_any.version) + 1):
        options = pgoutput_options(pg_any.version, PUB, proto_version=proto, binary=True)
        decoded = peek_decoded(conn, SLOT, options)
        assert [kinds(g) for g in split_transactions(decoded)] == ["BYYYRIIIUC", "BUC"], f"proto {proto}"
        first, second = split_transactions(decoded)
        assert_plain_transaction(first, inserts)
        assert_plain_transaction(second, key_change)
        assert_relation(first[4].message, relation)
        row1, row2, row4 = stored
        assert_tuple(first[5].message.new_tuple, row1[:11] + (None,) * 4, kind="b")
        assert_tuple(first[6].message.new_tuple, row2, kind="b")
        assert_tuple(first[8].message.new_tuple, row1, kind="b")
        update = second[1].message
        assert_tuple(update.old_key, [b"\x00\x00\x00\x03"] + [None] * 14, kind="b")
        assert_tuple(update.new_tuple, row4, kind="b")
        row3_insert = first[7].message.new_tuple
        assert row3_insert.values[1:] == row4[1:] and row3_insert.kinds == "b" * 11 + "n" * 4
