"""cdc_assets.stream against real PostgreSQL servers: the slot's replication stream (``SlotStream``),
its receiving child process, confirming positions, and the errors a stream can end with."""

from __future__ import annotations

import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import psutil  # type: ignore[import-untyped]
import psycopg
import pytest

from cdc_assets.config import SourceConfig
from cdc_assets.errors import (
    PublicationMissingError,
    SlotActiveError,
    SlotMissingError,
    SourceError,
    SourcePermissionError,
)
from cdc_assets.lsn import format_lsn
from cdc_assets.pgoutput.decoder import PgoutputDecoder
from cdc_assets.pgoutput.messages import BeginMessage, CommitMessage, InsertMessage, Message
from cdc_assets.source import connect, drop_slot, read_slot
from cdc_assets.source.connection import one_row
from cdc_assets.stream.blocks import MessageBlock, StreamPosition
from cdc_assets.stream.options import pgoutput_options
from cdc_assets.stream.process import POOL
from cdc_assets.stream.reader import SlotStream, StreamLostError
from tests.support.database import Database, as_role
from tests.support.peek import create_slot, current_wal_lsn
from tests.support.pipeline import wait_until

# Session settings under which text output differs from the pinned settings in every respect.
NEW_YORK = (
    "-c TimeZone=America/New_York -c DateStyle=SQL,DMY -c IntervalStyle=iso_8601 -c bytea_output=escape"
    " -c extra_float_digits=0"
)
FRAME_TIMEOUT_S = 60.0


# --- helpers -------------------------------------------------------------------------------


def source_of(db: Database, **settings: Any) -> SourceConfig:
    settings.setdefault("slot", f"s_{db.name}")
    return SourceConfig(dsn=db.dsn, **settings)


def options_of(db: Database, source: SourceConfig) -> list[tuple[str, str]]:
    return pgoutput_options(source, db.version, two_phase=False)


def next_frame(stream: SlotStream) -> MessageBlock | StreamPosition:
    """The stream's next frame; a stream that sends nothing for a minute fails the test."""
    frame = stream.next(timeout=FRAME_TIMEOUT_S)
    if frame is None:
        raise TimeoutError(f"nothing from the stream within {FRAME_TIMEOUT_S} s")
    return frame


def next_block(stream: SlotStream) -> MessageBlock:
    """The stream's next block (positions before it are skipped)."""
    while not isinstance(frame := next_frame(stream), MessageBlock):
        pass
    return frame


def read_blocks(stream: SlotStream, target: int) -> list[MessageBlock]:
    """Every block until the server's position reaches ``target`` (asked for with pings)."""
    blocks: list[MessageBlock] = []
    stream.ping()
    while True:
        frame = next_frame(stream)
        if isinstance(frame, MessageBlock):
            blocks.append(frame)
        elif frame.lsn >= target:
            return blocks
        else:
            stream.ping()


def read_rows(stream: SlotStream, conn: psycopg.Connection[Any]) -> list[tuple[int, bytes]]:
    """``(lsn, data)`` of every message up to the current WAL position."""
    return [row for block in read_blocks(stream, current_wal_lsn(conn)) for row in block.rows()]


def decoded(rows: list[tuple[int, bytes]]) -> list[Message]:
    decoder = PgoutputDecoder()
    return [decoder.decode(data) for _, data in rows]


def confirmed_flush(conn: psycopg.Connection[Any], slot: str) -> int:
    state = read_slot(conn, slot)
    assert state is not None and state.confirmed_flush_lsn is not None
    return state.confirmed_flush_lsn


def active_pid(conn: psycopg.Connection[Any], slot: str) -> int | None:
    state = read_slot(conn, slot)
    assert state is not None
    return state.active_pid


def walsender(conn: psycopg.Connection[Any], stream: SlotStream) -> tuple[int, int, datetime]:
    """The stream's walsender: how far it has sent, the flushed position the client last reported
    and when the client sent that report (``pg_stat_replication``)."""
    row = conn.execute(
        "SELECT (sent_lsn - '0/0')::int8, (flush_lsn - '0/0')::int8, reply_time FROM pg_stat_replication"
        " WHERE pid = %s",
        (stream.backend_pid,),
    ).fetchone()
    assert row is not None and None not in row, row
    return int(row[0]), int(row[1]), row[2]


def stream_sessions(conn: psycopg.Connection[Any]) -> int:
    """Connections of this database named as the stream's (its walsenders)."""
    (count,) = one_row(
        conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE application_name = 'cdc-assets:stream' AND datname = current_database()"
        )
    )
    return int(count)


def exited(pid: int) -> bool:
    """Our child process ``pid`` has exited (not reaped, so that its pid is not reused)."""
    return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None


def gone(pid: int) -> bool:
    """Process ``pid`` (not ours) no longer runs."""
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


@pytest.fixture
def table_t(pg: Database) -> SourceConfig:
    """Table ``t (id int PRIMARY KEY)``, published by ``cdc_pub``, and a slot: the source."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION cdc_pub FOR TABLE t")
    source = source_of(pg)
    with pg.connect() as conn:
        create_slot(conn, source.slot)
    return source


# --- blocks and settings -------------------------------------------------------------------


def test_stream_pins_settings_and_sends_blocks_in_lsn_order(pg: Database) -> None:
    """The walsender session runs under the pinned settings, whatever the DSN's and the checking
    connection's are; blocks come in LSN order (Relation messages carry LSN 0 on the stream) and
    ``rows()`` gives ``(int, bytes)``."""
    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, at timestamptz, iv interval); CREATE PUBLICATION cdc_pub FOR TABLE t"
    )
    source = dataclasses.replace(source_of(pg), dsn=f"{pg.dsn} options='{NEW_YORK}'")
    with connect(source, purpose="test") as conn:
        create_slot(conn, source.slot)
        conn.execute("BEGIN")
        (xid,) = one_row(conn.execute("SELECT txid_current()"))
        conn.execute(
            "INSERT INTO t SELECT i, '2024-01-02 03:04:05+00', '-1 day 02:03:04' FROM generate_series(1, 20000) i"
        )
        conn.execute("COMMIT")
        text = one_row(conn.execute("SELECT at::text, iv::text FROM t WHERE id = 1"))
        assert text == ("01/01/2024 22:04:05 EST", "P-1DT2H3M4S")  # what the DSN's settings would send
        conn.execute("SET TimeZone = 'Asia/Kolkata'; SET IntervalStyle = 'sql_standard'")
        with SlotStream(conn, source, options_of(pg, source), 0) as stream:
            blocks = read_blocks(stream, current_wal_lsn(conn))
        assert one_row(conn.execute("SHOW TimeZone"))[0] == "Asia/Kolkata"  # the connection is not touched
    assert len(blocks) >= 3  # 20,003 messages, at most 8,192 a block
    lsn, data = next(blocks[0].rows())
    assert isinstance(lsn, int) and isinstance(data, bytes)
    for block in blocks:
        assert list(block.rows()) == list(zip(block.lsns.tolist(), block.messages()))
    lsns = np.concatenate([block.lsns for block in blocks])
    positioned = lsns[lsns != 0]
    assert (positioned[1:] >= positioned[:-1]).all()
    messages = decoded([row for block in blocks for row in block.rows()])
    assert [m.type_byte for m in messages[:2]] == ["B", "R"] and lsns[1] == 0
    assert isinstance(messages[0], BeginMessage) and messages[0].xid == xid
    inserts = [m for m in messages if isinstance(m, InsertMessage)]
    assert len(inserts) == 20000
    assert {m.new_tuple.values[1:] for m in inserts} == {(b"2024-01-02 03:04:05+00", b"-1 days +02:03:04")}
    commit = messages[-1]
    assert isinstance(commit, CommitMessage) and commit.end_lsn == int(lsns[-1]) == int(lsns.max())


def test_ping_is_answered_with_the_servers_position(pg: Database, table_t: SourceConfig) -> None:
    """After ``ping()`` a :class:`StreamPosition` arrives. The stream starts at the slot's confirmed
    position and reports it as flushed, and the child sends no status update of its own here, so
    the server has no reason to send a position unasked."""
    source = table_t
    with pg.connect() as conn:
        start = confirmed_flush(conn, source.slot)
        with SlotStream(conn, source, options_of(pg, source), start, status_seconds=3600) as stream:
            for _ in range(3):
                stream.ping()
                frame = stream.next(timeout=10)
                assert isinstance(frame, StreamPosition) and frame.lsn >= start
        assert confirmed_flush(conn, source.slot) == start


def test_a_gathering_block_holds_a_light_streams_transactions_until_its_time_or_a_request(
    pg: Database, table_t: SourceConfig
) -> None:
    """With ``gather_seconds`` a partial block stays open that long from its first message: the
    transactions of a light stream (the server sends a keepalive after each) join it. A request
    from the drain sends it at once. Without, a block is sent when nothing more has arrived."""
    source = table_t
    with pg.connect() as conn:
        conn.autocommit = True
        with SlotStream(conn, source, options_of(pg, source), 0, gather_seconds=5) as stream:
            started = time.monotonic()
            for i in range(20):
                conn.execute("INSERT INTO t VALUES (%s)", (i,))
            blocks = blocks_until_commits(stream, 20)
            assert time.monotonic() - started >= 5
        assert len(blocks) == 1

        with SlotStream(conn, source, options_of(pg, source), 0, gather_seconds=600) as stream:
            conn.execute("INSERT INTO t VALUES (20)")
            end = current_wal_lsn(conn)
            sent = "SELECT sent_lsn >= %s::pg_lsn FROM pg_stat_replication WHERE pid = %s"
            arguments = (format_lsn(end), stream.backend_pid)
            wait_until(
                lambda: one_row(conn.execute(sent, arguments))[0], timeout=FRAME_TIMEOUT_S, what="the insert sent"
            )
            while (frame := stream.next(timeout=1)) is not None:  # the block is held
                assert isinstance(frame, StreamPosition), frame
            stream.ping()
            blocks_until_commits(stream, 21)  # the 20 before are sent again: nothing was confirmed

        with SlotStream(conn, source, options_of(pg, source), 0) as stream:
            conn.execute("INSERT INTO t VALUES (22)")
            blocks_until_commits(stream, 22)  # nothing asked for them


def blocks_until_commits(stream: SlotStream, commits: int) -> list[MessageBlock]:
    """The stream's blocks until they hold ``commits`` Commit messages (positions are skipped)."""
    blocks: list[MessageBlock] = []
    received = 0
    while received < commits:
        blocks.append(block := next_block(stream))
        received += sum(isinstance(m, CommitMessage) for m in decoded(list(block.rows())))
    return blocks


# --- the receiving child -------------------------------------------------------------------


def test_child_is_reused_between_streams_and_replaced_when_dead(pg: Database, table_t: SourceConfig) -> None:
    """A stream's connection lives in a child process that is kept, disconnected, for the next
    stream of this process; an idle child that died is replaced."""
    source = table_t
    options = options_of(pg, source)
    pg.execute("INSERT INTO t VALUES (1)")
    POOL.clear()  # idle children of earlier tests
    with pg.connect() as conn:
        with SlotStream(conn, source, options, 0) as first:
            assert len(read_rows(first, conn)) == 4
            child = first.receiver_pid
            assert child is not None and child != os.getpid()
            assert stream_sessions(conn) == 1
            assert active_pid(conn, source.slot) == first.backend_pid
        assert first.receiver_pid is None
        wait_until(lambda: stream_sessions(conn) == 0)
        assert psutil.Process(child).status() != psutil.STATUS_ZOMBIE  # kept for the next stream
        with SlotStream(conn, source, options, 0) as second:
            assert second.receiver_pid == child
            assert second.backend_pid != first.backend_pid  # a new connection
            assert len(read_rows(second, conn)) == 4
        os.kill(child, signal.SIGKILL)
        wait_until(lambda: exited(child))
        with SlotStream(conn, source, options, 0) as third:
            assert third.receiver_pid not in (None, child)
            assert len(read_rows(third, conn)) == 4


def test_child_killed_mid_stream_is_a_clear_error_and_releases_the_slot(pg: Database, table_t: SourceConfig) -> None:
    """A receiving process that dies is a :class:`SourceError` naming it; the walsender is ended
    by then (the slot is free), the slot did not move, and the next stream reads everything."""
    source = table_t
    options = options_of(pg, source)
    pg.execute("INSERT INTO t SELECT generate_series(1, 300000)")  # far more blocks than are queued
    with pg.connect() as conn:
        confirmed = confirmed_flush(conn, source.slot)
        with pytest.raises(SourceError) as failure, SlotStream(conn, source, options, 0) as stream:
            child = stream.receiver_pid
            assert child is not None
            next_block(stream)
            os.kill(child, signal.SIGKILL)
            while True:
                next_frame(stream)
        assert not isinstance(failure.value, StreamLostError)
        assert str(failure.value).startswith(
            f"the stream's receiving process (pid {child}) failed: it ended in the middle of an answer;"
            " it exited with code -9"
        )
        assert active_pid(conn, source.slot) is None  # no wait: the walsender was ended before the error
        with SlotStream(conn, source, options, 0) as again:
            assert again.receiver_pid not in (None, child)
            assert len(read_rows(again, conn)) == 300_003  # and Begin, Relation, Commit
        assert confirmed_flush(conn, source.slot) == confirmed


def test_child_exits_with_its_parent(pg: Database, table_t: SourceConfig) -> None:
    """A process killed while it streams leaves no receiving process and no walsender behind, even
    when a process it forked keeps the child's standard input open: the child watches its parent."""
    source = table_t
    script = (
        "import os, sys, psycopg\n"
        "from cdc_assets.config import SourceConfig\n"
        "from cdc_assets.stream.options import pgoutput_options\n"
        "from cdc_assets.stream.reader import SlotStream\n"
        "source = SourceConfig(dsn=sys.argv[1], slot=sys.argv[2])\n"
        "options = pgoutput_options(source, int(sys.argv[3]), two_phase=False)\n"
        "stream = SlotStream(psycopg.connect(sys.argv[1], autocommit=True), source, options, 0)\n"
        "worker = os.fork()\n"
        "if worker == 0:  # holds every pipe of the parent's until the test closes its standard input\n"
        "    sys.stdin.read()\n"
        "    os._exit(0)\n"
        "print(stream.receiver_pid, stream.backend_pid, worker, flush=True)\n"
        "sys.stdin.read()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script, pg.dsn, source.slot, str(pg.version)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert parent.stdin is not None and parent.stdout is not None
    try:
        child, walsender, worker = map(int, parent.stdout.readline().split())
        with pg.connect() as conn:
            assert stream_sessions(conn) == 1 and active_pid(conn, source.slot) == walsender
            parent.kill()
            parent.wait()
            assert not gone(worker)
            wait_until(lambda: gone(child))
            wait_until(lambda: stream_sessions(conn) == 0 and gone(walsender))
            assert active_pid(conn, source.slot) is None
    finally:
        parent.kill()
        parent.wait()
        parent.stdin.close()  # the worker reads to the end and exits
        parent.stdout.close()
    wait_until(lambda: gone(worker))


def test_child_outlives_the_thread_that_started_it(pg: Database, table_t: SourceConfig) -> None:
    """Dagster runs drains on threads that end; a stream started on one stays usable, and its
    child is kept for the next stream."""
    source = table_t
    options = options_of(pg, source)
    pg.execute("INSERT INTO t VALUES (1)")
    POOL.clear()  # the child must be started on the thread
    with pg.connect() as conn:
        streams: list[SlotStream] = []
        thread = threading.Thread(target=lambda: streams.append(SlotStream(conn, source, options, 0)))
        thread.start()
        thread.join()
        assert thread.native_id is not None
        wait_until(lambda: not Path(f"/proc/self/task/{thread.native_id}").exists())
        with streams[0] as stream:
            child = stream.receiver_pid
            assert len(read_rows(stream, conn)) == 4
        assert child is not None and psutil.Process(child).status() != psutil.STATUS_ZOMBIE
        with SlotStream(conn, source, options, 0) as again:
            assert again.receiver_pid == child
            assert len(read_rows(again, conn)) == 4


def test_connection_failure_names_no_password(pg: Database) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY); CREATE PUBLICATION cdc_pub FOR TABLE t")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again below: nothing listens there
    unreachable = SourceConfig(dsn=f"host=127.0.0.1 port={port} dbname=x user=x password=hunter2", slot="s_x")
    with (
        pg.connect() as conn,
        pytest.raises(SourceError, match=r"cannot connect to the source database \(stream\): ") as failure,
        SlotStream(conn, unreachable, options_of(pg, unreachable), 0),
    ):
        pass
    shown = "".join(traceback.format_exception(failure.value))
    assert "hunter2" not in shown and "password=" not in shown
    assert str(port) in str(failure.value)


# --- confirming ----------------------------------------------------------------------------


def test_confirm_moves_the_slot_exactly_there(pg: Database, table_t: SourceConfig) -> None:
    """``confirm(lsn)`` makes the slot's ``confirmed_flush_lsn`` exactly ``lsn`` once the server has
    read the status update; later status updates (every 50 ms here) never move it past what was
    confirmed, however far the server has sent; confirming backwards does nothing; a new stream
    starts after the confirmed position."""
    source = table_t
    options = options_of(pg, source)
    pg.execute("INSERT INTO t VALUES (1)")
    pg.execute("INSERT INTO t VALUES (2)")
    with pg.connect() as conn:
        before = confirmed_flush(conn, source.slot)
        with SlotStream(conn, source, options, 0, status_seconds=0.05) as stream:
            ends = [m.end_lsn for m in decoded(read_rows(stream, conn)) if isinstance(m, CommitMessage)]
            assert len(ends) == 2 and before < ends[0] < ends[1]
            assert confirmed_flush(conn, source.slot) == before  # reading alone moves nothing
            stream.confirm(ends[0])
            wait_until(lambda: confirmed_flush(conn, source.slot) >= ends[0])
            assert confirmed_flush(conn, source.slot) == ends[0]
            confirmed_at = datetime.now(UTC)
            wait_until(lambda: walsender(conn, stream)[2] > confirmed_at)  # a later status update was read
            sent, flushed, _ = walsender(conn, stream)
            assert sent >= ends[1] and flushed == ends[0]
            assert confirmed_flush(conn, source.slot) == ends[0]  # sent past it, confirmed only to it
            stream.confirm(before)
            assert stream.confirmed == ends[0]
        assert confirmed_flush(conn, source.slot) == ends[0]
        with SlotStream(conn, source, options, 0) as again:
            inserts = [m for m in decoded(read_rows(again, conn)) if isinstance(m, InsertMessage)]
            assert [m.new_tuple.values[0] for m in inserts] == [b"2"]
            again.confirm(ends[1])
            wait_until(lambda: confirmed_flush(conn, source.slot) >= ends[1])
        assert confirmed_flush(conn, source.slot) == ends[1]


# --- ends and errors -----------------------------------------------------------------------


def test_stream_errors(pg: Database, make_role: Callable[..., str]) -> None:
    """A missing publication or slot, a slot another walsender holds and a role that may not
    replicate are each their own error, naming what to fix."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY)")
    source = source_of(pg)
    options = options_of(pg, source)
    with pg.connect() as conn:
        missing = rf"publication cdc_pub does not exist \(reading replication slot {source.slot} at LSN 0/0\)"
        with pytest.raises(PublicationMissingError, match=missing), SlotStream(conn, source, options, 0):
            pass
        conn.execute("CREATE PUBLICATION cdc_pub FOR TABLE t")
        missing = rf"replication slot {source.slot} does not exist \(at LSN 0/0\): .* run `cdc-assets recover`"
        with pytest.raises(SlotMissingError, match=missing), SlotStream(conn, source, options, 0):
            pass
        create_slot(conn, source.slot)
        with SlotStream(conn, source, options, 0) as holder:
            in_use = rf"replication slot {source.slot} is in use by process {holder.backend_pid}\b"
            with pytest.raises(SlotActiveError, match=in_use), SlotStream(conn, source, options, 0):
                pass
            with pytest.raises(SlotActiveError, match=in_use):
                drop_slot(conn, source.slot)
            assert read_rows(holder, conn) == []  # the holder streams on
        assert active_pid(conn, source.slot) is None
        assert conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE  # the diagnoses left nothing open
    plain = make_role("plain")
    with connect(as_role(pg, plain), purpose="drain") as conn:
        denied = rf"role {plain} cannot use replication slots: it needs the REPLICATION attribute"
        with pytest.raises(SourcePermissionError, match=denied), SlotStream(conn, as_role(pg, plain), options, 0):
            pass


def test_stop_leaves_the_slot_inactive(pg: Database, table_t: SourceConfig) -> None:
    """``stop()`` returns once the server has ended the copy (CopyDone, then CommandComplete after
    it released the slot): the slot is inactive at once, even when stopped in the middle of a
    transaction; the stream has ended and the slot did not move."""
    source = table_t
    pg.execute("INSERT INTO t SELECT generate_series(1, 50000)")
    with pg.connect() as conn:
        confirmed = confirmed_flush(conn, source.slot)
        with SlotStream(conn, source, options_of(pg, source), 0) as stream:
            assert active_pid(conn, source.slot) == stream.backend_pid
            next_block(stream)
            stream.stop()
            assert active_pid(conn, source.slot) is None
            assert stream.receiver_pid is None
            with pytest.raises(SourceError, match=rf"the stream of replication slot {source.slot} has ended"):
                stream.next(timeout=0)
        assert confirmed_flush(conn, source.slot) == confirmed


def test_terminated_walsender_is_a_lost_stream(pg: Database, table_t: SourceConfig) -> None:
    """A walsender ended on the server (``pg_terminate_backend``) surfaces from ``next()`` as
    :class:`StreamLostError`, the one error worth reconnecting for; the slot is free by then and a
    new stream works."""
    source = table_t
    options = options_of(pg, source)
    pg.execute("INSERT INTO t VALUES (1)")
    with pg.connect() as conn:
        with SlotStream(conn, source, options, 0) as stream:
            assert one_row(conn.execute("SELECT pg_terminate_backend(%s)", (stream.backend_pid,)))[0]
            lost = rf"the replication connection of slot {source.slot} ended at LSN "
            with pytest.raises(StreamLostError, match=lost):
                while True:
                    next_frame(stream)
        assert active_pid(conn, source.slot) is None
        with SlotStream(conn, source, options, 0) as again:
            assert len(read_rows(again, conn)) == 4
