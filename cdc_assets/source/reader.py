"""Reading a slot over SQL: pgoutput options, a bounded-memory peek, and advancing the slot.

A peek never moves the slot; :meth:`SlotReader.advance` does, once the caller has made the
peeked transactions durable (invariant 2).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Generator, Iterator, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass
from itertools import islice
from operator import itemgetter
from typing import Any, cast

import psycopg
from psycopg.pq import TransactionStatus

from cdc_assets.config import SourceConfig
from cdc_assets.errors import ConfigError, SlotGapError, SourceError
from cdc_assets.lsn import format_lsn
from cdc_assets.source.connection import apply_pinned_settings
from cdc_assets.source.failures import diagnose, publication_missing_error
from cdc_assets.source.publication import publication_exists
from cdc_assets.source.slots import read_slot, slot_invalidated, slot_missing

PeekedRow = tuple[int, bytes]
"""``(lsn, data)`` of one pgoutput message."""


@dataclass(slots=True, frozen=True)
class PeekBlock:
    """Consecutive rows of one peek call, as columns: each message's LSN and its bytes."""

    lsns: Sequence[int]
    datas: Sequence[bytes]

    def rows(self) -> Iterator[PeekedRow]:
        return zip(self.lsns, self.datas)


_LSN, _DATA = itemgetter(0), itemgetter(1)
FETCH_ROWS = 10_000
PREFETCH_ROWS = 8_192
PREFETCH_BLOCKS = 16

_PEEK = (
    "SELECT (lsn - '0/0')::int8, data"
    " FROM pg_logical_slot_peek_binary_changes(%s::name, %s::pg_lsn, %s::int4, VARIADIC %s::text[])"
)


def max_proto_version(major: int) -> int:
    """The highest pgoutput protocol a server speaks: 2 on 14, 3 on 15, 4 on 16+."""
    return 4 if major >= 16 else 3 if major == 15 else 2


def pgoutput_options(config: SourceConfig, major: int, *, two_phase: bool) -> list[str]:
    """The flat ``name, value, …`` pgoutput options for a server major version.

    ``two_phase`` is the slot's actual flag, never the configuration's wish: a single peek with
    ``two_phase 'on'`` turns a slot two-phase for good (invariant 6).
    """
    options = ["proto_version", str(max_proto_version(major)), "publication_names", config.publication]
    options += ["messages", "true"]
    if config.binary:
        options += ["binary", "true"]
    if config.streaming == "parallel" and major < 16:
        raise ConfigError(
            f"source.streaming: 'parallel' needs PostgreSQL 16 or later (the server is {major}); use 'on' or 'off'"
        )
    if config.streaming != "off":
        options += ["streaming", config.streaming if major >= 16 else "true"]  # 14/15 take a boolean
    if two_phase:
        if major < 15:
            raise ConfigError(f"two-phase decoding needs PostgreSQL 15 or later (the server is {major})")
        options += ["two_phase", "on"]
    return options


class SlotReader:
    """Peeks and advances the configured slot on an autocommit connection that it uses alone.

    ``server_version`` is the major version; ``two_phase`` the slot's ``two_phase`` flag as read
    from ``pg_replication_slots`` (see :func:`~cdc_assets.source.slots.require_usable_slot`).
    """

    def __init__(
        self,
        conn: psycopg.Connection[Any],
        config: SourceConfig,
        server_version: int,
        two_phase: bool,
        *,
        fetch_rows: int = FETCH_ROWS,
    ) -> None:
        if not conn.autocommit:
            raise ValueError("SlotReader needs an autocommit connection (it manages its own transactions)")
        self._conn = conn
        self._config = config
        self._fetch_rows = fetch_rows
        self.options: tuple[str, ...] = tuple(pgoutput_options(config, server_version, two_phase=two_phase))

    @contextmanager
    def peek(self, limit: int, upto_lsn: int | None = None) -> Iterator[Iterator[PeekBlock]]:
        """An iterator of :class:`PeekBlock` objects holding up to about ``limit`` messages in all (calls end
        on transaction boundaries) of transactions ending at or before ``upto_lsn`` (if given),
        inside one transaction with the pinned settings.

        The server builds the whole result first; the client receives it ``fetch_rows`` at a time
        and hands it on in blocks of ``PREFETCH_ROWS``.
        Server errors are raised as the :class:`~cdc_assets.errors.SourceError` subclass that
        explains them. Leaving the block early cancels the query.
        """
        conn = self._conn
        conn.execute("BEGIN")
        try:
            apply_pinned_settings(conn)
            # PostgreSQL 18 only warns about a missing publication and decodes nothing for it.
            if not publication_exists(conn, self._config.publication):
                raise publication_missing_error(self._config.publication, self._config.slot)
            blocks = self._blocks(limit, upto_lsn)
            with closing(blocks):
                yield blocks
        finally:
            if conn.info.transaction_status != TransactionStatus.IDLE:
                conn.execute("ROLLBACK")

    def _blocks(self, limit: int, upto_lsn: int | None) -> Generator[PeekBlock, None, None]:
        """The rows, received on a thread of their own a block at a time, so that the server
        sending the next rows overlaps the caller's work on the previous ones."""
        upto = None if upto_lsn is None else format_lsn(upto_lsn)
        params = (self._config.slot, upto, limit, list(self.options))
        blocks: queue.Queue[PeekBlock | BaseException | None] = queue.Queue(maxsize=PREFETCH_BLOCKS)
        stop = threading.Event()
        receiver = threading.Thread(target=self._receive, args=(params, blocks, stop), name="slot-peek", daemon=True)
        receiver.start()
        lsn: int | None = None
        try:
            while (block := blocks.get()) is not None:
                if isinstance(block, BaseException):
                    raise block
                lsn = block.lsns[-1]
                yield block
        except psycopg.Error as error:
            receiver.join()
            if self._conn.info.transaction_status == TransactionStatus.INERROR:
                self._conn.execute("ROLLBACK")
            raise self._diagnose(error, lsn) from None
        finally:
            stop.set()  # leaving early: the receiver stops, which cancels the query
            receiver.join()

    def _receive(self, params: tuple[Any, ...], blocks: queue.Queue[Any], stop: threading.Event) -> None:
        stream = cast(
            "Generator[PeekedRow, None, None]",
            self._conn.cursor(binary=True).stream(_PEEK, params, size=self._fetch_rows),
        )
        try:
            with closing(stream):  # closing before the end cancels the query
                while not stop.is_set() and (rows := list(islice(stream, PREFETCH_ROWS))):
                    _offer(blocks, PeekBlock(list(map(_LSN, rows)), list(map(_DATA, rows))), stop)
        except BaseException as error:  # noqa: BLE001 - handed to the consuming thread
            _offer(blocks, error, stop)
            return
        _offer(blocks, None, stop)

    def advance(self, lsn: int) -> int:
        """Confirm everything up to ``lsn``; returns the slot's new confirmed position.

        Equal to the confirmed position is a no-op; below it raises :class:`SlotGapError` (the
        slot is ahead of the caller's checkpoint); past the server's flush point it stops there.
        """
        slot = self._config.slot
        state = read_slot(self._conn, slot)
        if state is None:
            raise slot_missing(slot, lsn)
        if state.invalidated:
            raise slot_invalidated(state, lsn)
        confirmed = state.confirmed_flush_lsn or 0
        if lsn == confirmed:
            return confirmed
        if lsn < confirmed:
            raise SlotGapError(
                f"cannot move replication slot {slot} back to LSN {format_lsn(lsn)}: it has already confirmed "
                f"{format_lsn(confirmed)}, so the changes between the two are gone from the slot but not in "
                "the change log. Remedy: drop the slot and run `cdc-assets setup` again (re-snapshots)"
            )
        try:
            (end,) = self._conn.execute(
                "SELECT (end_lsn - '0/0')::int8 FROM pg_replication_slot_advance(%s, %s::pg_lsn)",
                (slot, format_lsn(lsn)),
            ).fetchone()
        except psycopg.Error as error:
            raise self._diagnose(error, lsn) from None
        return end

    def _diagnose(self, error: psycopg.Error, lsn: int | None) -> SourceError:
        return diagnose(self._conn, error, slot=self._config.slot, publication=self._config.publication, lsn=lsn)


def _offer(blocks: queue.Queue[Any], item: Any, stop: threading.Event) -> None:
    """Put ``item`` unless the consumer has stopped listening."""
    while not stop.is_set():
        try:
            blocks.put(item, timeout=0.1)
            return
        except queue.Full:
            continue
