"""Property and fuzz tests: whatever the bytes, the decoders return a message or raise DecodeError.

Real messages come from a live server (every message type, text and binary tuples, streamed and
two-phase transactions); hypothesis mutates them, builds random ones, and round-trips random
typed messages through the test writer.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.columnar import extract_changes
from cdc_assets.pgoutput.decoder import PgoutputDecoder
from cdc_assets.pgoutput.messages import (
    BeginMessage,
    BeginPrepareMessage,
    CommitMessage,
    CommitPreparedMessage,
    DeleteMessage,
    InsertMessage,
    LogicalDecodingMessage,
    Message,
    OriginMessage,
    PrepareMessage,
    RelationColumn,
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
from tests.support.database import Database
from tests.support.peek import peek
from tests.support.pgoutput_writer import encode

FUZZ = settings(max_examples=1500, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(slots=True, frozen=True)
class Captured:
    """A real message and the decoder state it was sent in."""

    data: bytes
    in_stream: bool
    streaming: str


def _peek(conn: Any, slot: str, options: list[str]) -> Iterator[bytes]:
    return (row.data for row in peek(conn, slot, options))


def capture_corpus(db: Database) -> list[Captured]:
    """Make the server send every message type; return the messages with their stream state."""
    proto = "4" if db.version >= 16 else "3"
    streaming = "parallel" if db.version >= 16 else "on"
    with db.connect() as conn:
        conn.execute("CREATE TYPE mood AS ENUM ('sad', 'ok')")
        conn.execute(
            "CREATE TABLE kinds (id int PRIMARY KEY, t text, n numeric(8,2), ts timestamptz, b bytea,"
            " m mood, a int[], big text)"
        )
        conn.execute("ALTER TABLE kinds ALTER COLUMN big SET STORAGE EXTERNAL")
        conn.execute("CREATE TABLE full_ri (k int, v text)")
        conn.execute("ALTER TABLE full_ri REPLICA IDENTITY FULL")
        conn.execute("CREATE TABLE parent (id int PRIMARY KEY)")
        conn.execute("CREATE TABLE child (id serial, parent int REFERENCES parent)")
        conn.execute("CREATE PUBLICATION fuzz FOR ALL TABLES")
        conn.execute("SELECT pg_create_logical_replication_slot('fuzz', 'pgoutput')")
        conn.execute("SELECT pg_create_logical_replication_slot('fuzz2pc', 'pgoutput', false, true)")
        conn.execute(
            "INSERT INTO kinds SELECT i, 'row ' || i, i / 3.0, now(), '\\x00ff'::bytea, 'ok', ARRAY[i, NULL],"
            " (SELECT string_agg(md5(j::text), '') FROM generate_series(1, 700) j) FROM generate_series(1, 5) i"
        )
        conn.execute("UPDATE kinds SET t = 'changed' WHERE id = 1")
        conn.execute("UPDATE kinds SET id = 10 WHERE id = 2")
        conn.execute("DELETE FROM kinds WHERE id = 3")
        conn.execute("INSERT INTO full_ri VALUES (1, 'a'), (NULL, NULL)")
        conn.execute("UPDATE full_ri SET v = 'b'")
        conn.execute("DELETE FROM full_ri WHERE k = 1")
        conn.execute("INSERT INTO parent VALUES (1)")
        conn.execute("INSERT INTO child (parent) VALUES (1)")
        conn.execute("TRUNCATE parent, child RESTART IDENTITY CASCADE")
        conn.execute("SELECT pg_logical_emit_message(true, 'fuzz', 'transactional')")
        conn.execute("SELECT pg_logical_emit_message(false, 'fuzz', '\\x00ff'::bytea)")
        conn.execute("SELECT pg_replication_origin_create(%s)", (f"fuzz_{db.name}",))
        with conn.transaction():
            conn.execute("SELECT pg_replication_origin_session_setup(%s)", (f"fuzz_{db.name}",))
            conn.execute("SELECT pg_replication_origin_xact_setup('0/ABCDEF', now())")
            conn.execute("INSERT INTO parent VALUES (2)")
        conn.execute("SELECT pg_replication_origin_session_reset()")
        with conn.transaction():
            conn.execute("INSERT INTO full_ri SELECT i, repeat('x', 200) FROM generate_series(1, 1500) i")
            with pytest.raises(RuntimeError), conn.transaction():
                conn.execute("INSERT INTO full_ri SELECT i, repeat('y', 200) FROM generate_series(1, 800) i")
                raise RuntimeError("roll back the savepoint")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO parent VALUES (3)")
        conn.execute("PREPARE TRANSACTION 'fuzz_gid'")
        conn.execute("COMMIT PREPARED 'fuzz_gid'")
        conn.execute("BEGIN")
        conn.execute("INSERT INTO parent VALUES (4)")
        conn.execute("PREPARE TRANSACTION 'fuzz_gid2'")
        conn.execute("ROLLBACK PREPARED 'fuzz_gid2'")
        base = ["proto_version", proto, "publication_names", "fuzz", "messages", "true"]
        streams = {
            "off": list(_peek(conn, "fuzz", base)),
            streaming: list(_peek(conn, "fuzz", [*base, "streaming", "on" if streaming == "parallel" else "true"]))
            if streaming == "on"
            else list(_peek(conn, "fuzz", [*base, "streaming", "parallel"])),
        }
        binary = list(_peek(conn, "fuzz", [*base, "binary", "true"]))
        two_phase = list(
            _peek(conn, "fuzz2pc", [*base, "two_phase", "on", "streaming", "on" if db.version >= 16 else "true"])
        )
    corpus: list[Captured] = []
    for mode, messages in [*streams.items(), ("off", binary), ("on", two_phase)]:
        decoder = PgoutputDecoder(streaming=mode)  # type: ignore[arg-type]
        for data in messages:
            corpus.append(Captured(data, decoder.in_stream, mode))
            decoder.decode(data)
    return corpus


@pytest.fixture(scope="module")
def corpus(pg_module: Database) -> list[Captured]:
    captured = capture_corpus(pg_module)
    types = {chr(c.data[0]) for c in captured}
    assert set("BCORYIUDTMSEcAbPKr") <= types, f"corpus lacks message types: {set('BCORYIUDTMSEcAbPKr') - types}"
    return captured


def _decode(captured: Captured, data: bytes) -> Message | None:
    """Decode ``data`` in ``captured``'s stream state; None if it raised DecodeError."""
    decoder = PgoutputDecoder(streaming=captured.streaming)  # type: ignore[arg-type]
    decoder.in_stream = captured.in_stream
    try:
        return decoder.decode(data)
    except DecodeError:
        return None


@pytest.mark.slow
def test_real_messages_decode_and_every_proper_prefix_is_rejected(corpus: list[Captured]) -> None:
    """A well-formed message is self-delimiting: each of its proper prefixes is a DecodeError."""
    for captured in corpus:
        assert _decode(captured, captured.data) is not None
        size = len(captured.data)
        cuts = range(size) if size <= 600 else [*range(300), *range(300, size, 37), size - 1]
        for cut in cuts:
            assert _decode(captured, captured.data[:cut]) is None, (captured, cut)


def test_mutated_real_messages_raise_only_decode_error(corpus: list[Captured]) -> None:
    @FUZZ
    @given(st.data())
    def mutate(data: st.DataObject) -> None:
        captured = data.draw(st.sampled_from(corpus))
        raw = bytearray(captured.data)
        for _ in range(data.draw(st.integers(1, 4))):
            action = data.draw(st.sampled_from(["flip", "set", "insert", "delete", "extend"]))
            at = data.draw(st.integers(0, max(len(raw) - 1, 0)))
            if action == "flip" and raw:
                raw[at] ^= 1 << data.draw(st.integers(0, 7))
            elif action == "set" and raw:
                raw[at] = data.draw(st.sampled_from([0, 0xFF, 0x7F, 0x80, ord("t"), ord("n"), ord("u")]))
            elif action == "insert":
                raw[at:at] = data.draw(st.binary(min_size=1, max_size=8))
            elif action == "delete" and raw:
                del raw[at : at + data.draw(st.integers(1, 8))]
            elif action == "extend":
                raw += data.draw(st.binary(min_size=1, max_size=8))
        _decode(captured, bytes(raw))  # anything but DecodeError propagates and fails

    mutate()


def test_random_bytes_raise_only_decode_error() -> None:
    @FUZZ
    @given(st.sampled_from(list(b"BCORYIUDTMSEcAbPKrpZ")), st.binary(max_size=64), st.booleans())
    def random_body(type_byte: int, body: bytes, in_stream: bool) -> None:
        _decode(Captured(b"", in_stream, "parallel"), bytes([type_byte]) + body)

    random_body()


def test_columnar_extraction_agrees_with_decoder_or_raises_decode_error(corpus: list[Captured]) -> None:
    """Batches of (possibly mutated) change messages: the vectorized extractor returns exactly what
    message-at-a-time decoding gives, or a DecodeError."""
    changes = [c for c in corpus if c.data[0] in b"IUD"]
    by_relation: dict[tuple[int, bool], list[Captured]] = {}
    for captured in changes:
        message = _decode(captured, captured.data)
        assert isinstance(message, InsertMessage | UpdateMessage | DeleteMessage)
        by_relation.setdefault((message.relation_oid, captured.in_stream), []).append(captured)
    groups = list(by_relation.values())

    @FUZZ
    @given(st.data())
    def batch(data: st.DataObject) -> None:
        group = data.draw(st.sampled_from(groups))
        picked = data.draw(st.lists(st.sampled_from(group), min_size=1, max_size=12))
        raw = [bytearray(c.data) for c in picked]
        if data.draw(st.booleans()):
            victim = raw[data.draw(st.integers(0, len(raw) - 1))]
            at = data.draw(st.integers(0, len(victim) - 1))
            victim[at] = data.draw(st.integers(0, 255))
        messages = [bytes(r) for r in raw]
        decoded = [_decode(picked[0], m) for m in messages]
        ncols = _column_count(decoded)
        try:
            columns = extract_changes(messages, ncols, xid_prefixed=picked[0].in_stream)
        except DecodeError:
            assert (
                any(
                    d is None
                    or not isinstance(d, InsertMessage | UpdateMessage | DeleteMessage)
                    or _ncols_of(d) != ncols
                    for d in decoded
                )
                or len({m[1 + 4 * picked[0].in_stream :][:4] for m in messages}) > 1
            )
            return
        for row, message in enumerate(decoded):
            assert isinstance(message, InsertMessage | UpdateMessage | DeleteMessage)
            assert columns.ops[row] == ord(message.type_byte)
            new, old = _images(message)
            for part, image in ((columns.new, new), (columns.old, old)):
                assert bool(part.present[row]) == (image is not None)
                if image is not None:
                    assert bytes(part.kinds[row]).decode() == image.kinds
                    assert [raw_column[row].as_py() for raw_column in part.raw] == list(image.values)

    batch()


def _images(message: InsertMessage | UpdateMessage | DeleteMessage) -> tuple[TupleData | None, TupleData | None]:
    """The new and old tuple of a change message (either may be absent)."""
    old = getattr(message, "old_key", None) or getattr(message, "old_tuple", None)
    return getattr(message, "new_tuple", None), old


def _ncols_of(message: InsertMessage | UpdateMessage | DeleteMessage) -> int:
    new, old = _images(message)
    image = new or old
    assert image is not None
    return len(image.kinds)


def _column_count(decoded: list[Message | None]) -> int:
    valid = [d for d in decoded if isinstance(d, InsertMessage | UpdateMessage | DeleteMessage)]
    return _ncols_of(valid[0]) if valid else 1


# -- round trips of random typed messages --------------------------------------------------------

_u32 = st.integers(0, 2**32 - 1)
_u64 = st.integers(0, 2**64 - 1)
_times = st.integers(-62_135_596_800_000_000, 253_402_300_799_999_999)  # µs since 1970, years 1-9999
_names = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\0"), max_size=12)
_tuples = st.lists(
    st.one_of(
        st.just(("n", None)),
        st.just(("u", None)),
        st.tuples(st.sampled_from("tb"), st.binary(max_size=40)),
    ),
    max_size=8,
).map(lambda cols: TupleData("".join(k for k, _ in cols), tuple(v for _, v in cols)))
_xids = st.one_of(st.none(), _u32)


def _messages() -> st.SearchStrategy[Message]:
    column = st.builds(RelationColumn, st.integers(0, 1), _names, _u32, st.integers(-(2**31), 2**31 - 1))
    return st.one_of(
        st.builds(BeginMessage, _u64, _times, _u32),
        st.builds(CommitMessage, st.just(0), _u64, _u64, _times),
        st.builds(OriginMessage, _u64, _names),
        st.builds(
            RelationMessage,
            _xids,
            _u32,
            _names,
            _names,
            st.sampled_from("dnfi"),
            st.lists(column, max_size=5).map(tuple),
        ),
        st.builds(TypeMessage, _xids, _u32, _names, _names),
        st.builds(InsertMessage, _xids, _u32, _tuples),
        st.builds(UpdateMessage, _xids, _u32, st.none(), st.none(), _tuples),
        st.builds(UpdateMessage, _xids, _u32, _tuples, st.none(), _tuples),
        st.builds(UpdateMessage, _xids, _u32, st.none(), _tuples, _tuples),
        st.builds(DeleteMessage, _xids, _u32, _tuples, st.none()),
        st.builds(DeleteMessage, _xids, _u32, st.none(), _tuples),
        st.builds(TruncateMessage, _xids, st.integers(0, 3), st.lists(_u32, max_size=6).map(tuple)),
        st.builds(LogicalDecodingMessage, _xids, st.integers(0, 1), _u64, _names, st.binary(max_size=40)),
        st.builds(StreamStartMessage, _u32, st.booleans()),
        st.builds(StreamCommitMessage, _u32, st.just(0), _u64, _u64, _times),
        st.builds(StreamAbortMessage, _u32, _u32, st.none(), st.none()),
        st.builds(StreamAbortMessage, _u32, _u32, _u64, _times),
        st.builds(BeginPrepareMessage, _u64, _u64, _times, _u32, _names),
        st.builds(PrepareMessage, st.just(0), _u64, _u64, _times, _u32, _names),
        st.builds(StreamPrepareMessage, st.just(0), _u64, _u64, _times, _u32, _names),
        st.builds(CommitPreparedMessage, st.just(0), _u64, _u64, _times, _u32, _names),
        st.builds(RollbackPreparedMessage, st.just(0), _u64, _u64, _times, _times, _u32, _names),
    )


@settings(max_examples=3000, deadline=None)
@given(_messages())
def test_every_message_round_trips(message: Message) -> None:
    parallel = isinstance(message, StreamAbortMessage) and message.abort_lsn is not None
    decoder = PgoutputDecoder(streaming="parallel" if parallel else "on")
    decoder.in_stream = getattr(message, "xid", None) is not None and not isinstance(
        message,
        (
            BeginMessage,
            StreamStartMessage,
            StreamCommitMessage,
            StreamAbortMessage,
            BeginPrepareMessage,
            PrepareMessage,
            StreamPrepareMessage,
            CommitPreparedMessage,
            RollbackPreparedMessage,
        ),
    )
    assert decoder.decode(encode(message)) == message
