"""Peek a pgoutput slot over the replication stream and decode what comes back.

Small building blocks for tests that drive a real server: the pgoutput options a server version
accepts, the session settings that make text output deterministic, a peek (every pending message,
read over the streaming replication protocol without moving the slot) that returns integer LSNs
and the transaction of each message, and a few catalog/xid look-ups to compare decoded messages
with.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Literal

import psycopg

from cdc_assets.config import SourceConfig
from cdc_assets.pgoutput.decoder import PgoutputDecoder
from cdc_assets.pgoutput.messages import Message
from cdc_assets.stream.blocks import MessageBlock
from cdc_assets.stream.reader import SlotStream

Streaming = Literal["off", "on", "parallel"]

SESSION_SETTINGS: tuple[str, ...] = (
    "SET TimeZone = 'UTC'",
    "SET DateStyle = 'ISO'",
    "SET IntervalStyle = 'postgres'",
    "SET extra_float_digits = 3",
    "SET bytea_output = 'hex'",
    "SET client_encoding = 'UTF8'",
)
"""Settings under which pgoutput's text output (and ``col::text``) is deterministic."""


def max_proto_version(server_version: int) -> int:
    """The highest pgoutput protocol version a server major version accepts (3 on 15, 4 on 16+)."""
    if server_version >= 16:
        return 4
    if server_version == 15:
        return 3
    return 2 if server_version == 14 else 1


def streaming_modes(server_version: int) -> tuple[Streaming, ...]:
    """The streaming modes worth testing: ``on`` everywhere, plus ``parallel`` on 16+."""
    return ("on", "parallel") if server_version >= 16 else ("on",)


def pgoutput_options(
    server_version: int,
    publication: str,
    *,
    proto_version: int | None = None,
    streaming: Streaming = "off",
    binary: bool = False,
    messages: bool = True,
    two_phase: bool = False,
) -> list[str]:
    """The flat ``name, value, ...`` option list for ``pg_logical_slot_peek_binary_changes``.

    ``proto_version`` defaults to the server's maximum. ``streaming='on'`` is sent as ``'true'``
    before PostgreSQL 16 (14/15 accept only a boolean). Never pass ``two_phase=True`` for a slot that
    was not created two-phase: one such peek makes the slot two-phase for good.
    """
    proto = max_proto_version(server_version) if proto_version is None else proto_version
    options = ["proto_version", str(proto), "publication_names", publication]
    if messages:
        options += ["messages", "true"]
    if binary:
        options += ["binary", "true"]
    if streaming != "off":
        if streaming == "parallel" and server_version < 16:
            raise ValueError("streaming 'parallel' needs PostgreSQL 16 or later")
        options += ["streaming", streaming if server_version >= 16 else "true"]
    if two_phase:
        options += ["two_phase", "on"]
    return options


def apply_session_settings(conn: psycopg.Connection[Any]) -> None:
    """Apply :data:`SESSION_SETTINGS` to an autocommit connection (session-wide)."""
    for statement in SESSION_SETTINGS:
        conn.execute(statement)


@dataclass(frozen=True, slots=True)
class PeekedRow:
    """One message of the stream: its LSN, the xid of the transaction it belongs to (0 outside
    one; a Stream Abort's is the aborted subtransaction's) and its bytes."""

    lsn: int
    xid: int
    data: bytes


@dataclass(frozen=True, slots=True)
class Decoded:
    """A peeked row, its decoded message and the decoder's ``in_stream`` flag after decoding it."""

    row: PeekedRow
    message: Message
    in_stream_after: bool

    @property
    def kind(self) -> str:
        return self.message.type_byte


SESSION_GUCS = ("debug_logical_replication_streaming", "logical_decoding_work_mem")
"""Settings of the test's connection that the decoding session takes over (16+ for the first)."""


def peek(conn: psycopg.Connection[Any], slot: str, options: Sequence[str]) -> list[PeekedRow]:
    """Every message ``slot`` holds up to the current WAL position, read over the replication
    stream (the slot does not move), decoded under ``conn``'s session settings."""
    pairs = list(zip(options[::2], options[1::2]))
    publication = dict(pairs)["publication_names"]
    source = SourceConfig(dsn=conn.info.dsn, slot=slot, publication=publication)
    settings = {name: str(current) for name, current in _session_settings(conn)}
    target = current_wal_lsn(conn)
    rows: list[tuple[int, bytes]] = []
    with SlotStream(conn, source, pairs, 0, settings=settings) as stream:
        stream.ping()
        deadline = time.monotonic() + 60
        while True:
            frame = stream.next(timeout=max(0.0, deadline - time.monotonic()))
            if frame is None:
                raise TimeoutError(f"slot {slot} did not reach {target:#x} within 60 s")
            if isinstance(frame, MessageBlock):
                rows.extend(frame.rows())
            elif frame.lsn >= target:
                break
            else:
                stream.ping()
    streaming = dict(pairs).get("streaming", "off")
    mode: Streaming = "parallel" if streaming == "parallel" else "off" if streaming == "off" else "on"
    return [PeekedRow(lsn, xid, data) for (lsn, data), xid in zip(rows, _xids(rows, mode))]


def _session_settings(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    names = [name for name in SESSION_GUCS if conn.info.server_version >= 160000 or not name.startswith("debug")]
    names += [statement.split()[1] for statement in SESSION_SETTINGS]
    return conn.execute("SELECT name, current_setting(name) FROM unnest(%s::text[]) name", (names,)).fetchall()


def _xids(rows: Sequence[tuple[int, bytes]], streaming: Streaming) -> Iterator[int]:
    """The transaction of each message: Begin … Commit, Begin Prepare … Prepare and the single
    messages that end a prepared or streamed transaction carry it; a Stream Start opens a block of
    its transaction; a Stream Abort names the subtransaction it aborts."""
    decoder = PgoutputDecoder(streaming=streaming)
    current = 0
    for _, data in rows:
        message = decoder.decode(data)
        xid = getattr(message, "xid", None)
        kind = data[:1]
        if kind in (b"B", b"b", b"S"):
            current = xid or 0
            yield current
        elif kind in (b"C", b"P", b"E"):
            yield current
            current = 0
        elif kind == b"A":
            yield message.subtransaction_xid  # type: ignore[union-attr]
        elif kind in (b"c", b"p", b"K", b"r"):
            yield xid or 0
        else:
            yield current


def decode_rows(rows: Iterable[PeekedRow], streaming: Streaming = "off") -> list[Decoded]:
    """Decode rows with one fresh :class:`PgoutputDecoder`, as one peek call must be decoded."""
    decoder = PgoutputDecoder(streaming=streaming)
    out = []
    for row in rows:
        message = decoder.decode(row.data)
        out.append(Decoded(row, message, decoder.in_stream))
    return out


def peek_decoded(
    conn: psycopg.Connection[Any], slot: str, options: Sequence[str], streaming: Streaming = "off"
) -> list[Decoded]:
    """:func:`peek` then :func:`decode_rows`."""
    return decode_rows(peek(conn, slot, options), streaming)


def create_slot(conn: psycopg.Connection[Any], slot: str, *, two_phase: bool = False) -> None:
    """Create a pgoutput logical slot (``two_phase`` = the 4th argument of the SQL function)."""
    conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput', false, %s)", (slot, two_phase))


def current_wal_lsn(conn: psycopg.Connection[Any]) -> int:
    """``pg_current_wal_lsn()`` as an int."""
    return int(conn.execute("SELECT (pg_current_wal_lsn() - '0/0'::pg_lsn)::int8").fetchone()[0])


def current_wal_insert_lsn(conn: psycopg.Connection[Any]) -> int:
    """``pg_current_wal_insert_lsn()`` as an int: where the next WAL record will go."""
    return int(conn.execute("SELECT (pg_current_wal_insert_lsn() - '0/0'::pg_lsn)::int8").fetchone()[0])


def current_xid(conn: psycopg.Connection[Any]) -> int:
    """The top-level xid of the connection's open transaction (assigning one), epoch removed."""
    return int(conn.execute("SELECT txid_current()").fetchone()[0]) & 0xFFFFFFFF


def wait_for_flush(conn: psycopg.Connection[Any], lsn: int, timeout: float = 10.0) -> None:
    """Wait until the server has flushed WAL up to ``lsn``: a peek decodes only flushed WAL, and a
    record that no commit flushed (a non-transactional message, a rollback) waits for the WAL
    writer."""
    deadline = time.monotonic() + timeout
    while int(conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0'::pg_lsn)::int8").fetchone()[0]) < lsn:
        if time.monotonic() > deadline:
            raise TimeoutError(f"WAL not flushed up to {lsn:#x} within {timeout} s")
        time.sleep(0.005)


def row_xmin(conn: psycopg.Connection[Any], table: str, where: str) -> int:
    """``xmin`` of one row: the (sub)transaction xid that inserted it, e.g. a savepoint's xid."""
    return int(conn.execute(f"SELECT xmin::text::int8 FROM {table} WHERE {where}").fetchone()[0])


def wall_clock() -> datetime:
    """Now, timezone-aware UTC (same clock as a server on this machine)."""
    return datetime.now(UTC)


@dataclass(frozen=True, slots=True)
class CatalogColumn:
    """A published column as pg_attribute describes it."""

    name: str
    type_oid: int
    type_modifier: int
    is_key: bool


@dataclass(frozen=True, slots=True)
class CatalogRelation:
    """A table as the catalogs describe it, for comparison with a Relation message."""

    oid: int
    namespace: str
    name: str
    replica_identity: str
    columns: tuple[CatalogColumn, ...]


def catalog_relation(conn: psycopg.Connection[Any], table: str) -> CatalogRelation:
    """The published shape of ``table``: live, non-generated columns in attnum order, with key
    flags derived from the replica identity (primary key, the REPLICA IDENTITY index, or every
    column under FULL)."""
    oid, namespace, name, ident = conn.execute(
        "SELECT c.oid::int8, n.nspname, c.relname, c.relreplident::text"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = %s::regclass",
        (table,),
    ).fetchone()
    keys = {
        attnum
        for (attnum,) in conn.execute(
            "SELECT unnest(i.indkey::int2[]) FROM pg_index i WHERE i.indrelid = %s"
            " AND CASE %s WHEN 'd' THEN i.indisprimary WHEN 'i' THEN i.indisreplident ELSE false END",
            (oid, ident),
        ).fetchall()
    }
    columns = tuple(
        CatalogColumn(attname, int(atttypid), int(atttypmod), ident == "f" or attnum in keys)
        for attnum, attname, atttypid, atttypmod in conn.execute(
            "SELECT attnum, attname, atttypid::int8, atttypmod FROM pg_attribute"
            " WHERE attrelid = %s AND attnum > 0 AND NOT attisdropped AND attgenerated = ''"
            " ORDER BY attnum",
            (oid,),
        ).fetchall()
    )
    return CatalogRelation(int(oid), namespace, name, ident, columns)


def text_values(
    conn: psycopg.Connection[Any], table: str, columns: Sequence[str], where: str
) -> list[tuple[bytes | None, ...]]:
    """Each column through its type's output function, as pgoutput's text mode sends it, as UTF-8
    bytes (None for NULL), under the session's settings; rows ordered by the first column.

    ``format('%s', col)`` calls the output function; ``col::text`` would not always (``true::text``
    is ``'true'`` but ``boolout`` gives ``'t'``)."""
    select = ", ".join(f"CASE WHEN {name} IS NULL THEN NULL ELSE format('%s', {name}) END" for name in columns)
    rows = conn.execute(f"SELECT {select} FROM {table} WHERE {where} ORDER BY 1").fetchall()
    return [tuple(None if v is None else v.encode() for v in row) for row in rows]


def send_values(conn: psycopg.Connection[Any], table: str, where: str, order_by: str) -> list[tuple[bytes | None, ...]]:
    """Each published column passed through its type's ``typsend`` (the bytes binary mode sends)."""
    rel = catalog_relation(conn, table)
    calls = []
    for column in rel.columns:
        (send,) = conn.execute(
            "SELECT typsend::regproc::text FROM pg_type WHERE oid = %s", (column.type_oid,)
        ).fetchone()
        calls.append(f"{send}({column.name})")
    rows = conn.execute(f"SELECT {', '.join(calls)} FROM {table} WHERE {where} ORDER BY {order_by}").fetchall()
    return [tuple(None if v is None else bytes(v) for v in row) for row in rows]


@dataclass(slots=True)
class TxnWindow:
    """What a test knows about a transaction it ran: its xid and the WAL position and wall-clock
    time just before it began and just after it ended."""

    xid: int = 0
    lsn_before: int = 0
    lsn_after: int = 0
    time_before: datetime = field(default_factory=wall_clock)
    time_after: datetime = field(default_factory=wall_clock)

    def contains_time(self, moment: datetime) -> bool:
        return self.time_before <= moment <= self.time_after


@contextmanager
def captured_transaction(conn: psycopg.Connection[Any], *, commit: bool = True) -> Iterator[TxnWindow]:
    """Run the body in one transaction on an autocommit connection and record its
    :class:`TxnWindow` (xid from ``txid_current()`` taken inside it). ``commit=False`` rolls back."""
    window = TxnWindow()
    window.lsn_before = current_wal_lsn(conn)
    window.time_before = wall_clock()
    conn.execute("BEGIN")
    try:
        window.xid = current_xid(conn)
        yield window
    except BaseException:
        conn.execute("ROLLBACK")
        raise
    conn.execute("COMMIT" if commit else "ROLLBACK")
    window.time_after = wall_clock()
    window.lsn_after = current_wal_lsn(conn)


def split_transactions(decoded: Sequence[Decoded]) -> list[list[Decoded]]:
    """Group a non-streamed peek into Begin…Commit runs; anything outside one is its own group."""
    groups: list[list[Decoded]] = []
    current: list[Decoded] | None = None
    for item in decoded:
        if current is None:
            if item.kind == "B":
                current = [item]
            else:
                groups.append([item])
            continue
        current.append(item)
        if item.kind == "C":
            groups.append(current)
            current = None
    if current is not None:
        groups.append(current)
    return groups


def kinds(decoded: Iterable[Decoded]) -> str:
    """The message type bytes of ``decoded`` as one string, e.g. ``"BRIC"``."""
    return "".join(item.kind for item in decoded)
