"""The transaction assembler: the messages of a replication session → committed transactions,
written to a sink.

:class:`TransactionAssembler` is fed the ``(lsn, data)`` messages of a slot's stream in order, a
block at a time. It keeps only what the protocol needs between messages — the Relation and Type
messages of the current session (the server sends them again in every session) and the open
transactions — and routes each message to the part that handles
its kind of transaction: :mod:`~cdc_assets.transactions.plain`, :mod:`~cdc_assets.transactions.streamed`
or :mod:`~cdc_assets.transactions.two_phase`. Those hand the sink the change records of committed
transactions, per table in commit order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from struct import Struct

import numpy as np

from cdc_assets.errors import DecodeError
from cdc_assets.pgoutput.decoder import PgoutputDecoder, Streaming, message_name
from cdc_assets.pgoutput.messages import (
    BeginMessage,
    BeginPrepareMessage,
    CommitMessage,
    CommitPreparedMessage,
    LogicalDecodingMessage,
    OriginMessage,
    PrepareMessage,
    RelationMessage,
    RollbackPreparedMessage,
    StreamAbortMessage,
    StreamCommitMessage,
    StreamPrepareMessage,
    StreamStartMessage,
    StreamStopMessage,
    TruncateMessage,
    TypeMessage,
)
from cdc_assets.pgoutput.protocol import MSG_COMMIT, MSG_DELETE, MSG_INSERT, MSG_UPDATE
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.stream.blocks import MessageBlock
from cdc_assets.transactions.buffers import OwnTransaction, RecordBuilders
from cdc_assets.transactions.plain import PLAIN_TYPES, BlockView, PlainTransactions
from cdc_assets.transactions.sink import ChangeSink, Output
from cdc_assets.transactions.streamed import StreamedTransactions
from cdc_assets.transactions.two_phase import TwoPhaseTransactions

_OID = Struct(">I").unpack_from
_XID_AND_OID = Struct(">II").unpack_from
_CHANGE_TYPES = frozenset((MSG_INSERT, MSG_UPDATE, MSG_DELETE))

DescribeRelation = Callable[[RelationMessage], RelationSchema]
Target = PlainTransactions | OwnTransaction  # what takes the changes, messages and origin of the open transaction


class TransactionAssembler:
    """Turns the messages of replication sessions into committed transactions; see the module
    docstring.

    Transactions whose end LSN is at or below the batch's ``checkpoint_lsn`` are dropped: the slot
    re-sends them after a rewind (invariant 3)."""

    def __init__(
        self,
        *,
        streaming: Streaming = "off",
        catalog: TypeCatalog | None = None,
        describe: DescribeRelation | None = None,
        slot: str | None = None,
        spill_dir: str | None = None,
    ) -> None:
        self.streaming: Streaming = streaming
        self.catalog = catalog if catalog is not None else TypeCatalog()
        self.slot = slot
        self._describe = describe or RelationSchema.from_message
        self._output = Output()
        builders = RecordBuilders(self.catalog)
        self._plain = PlainTransactions(self._output, builders, spill_dir)
        self._streams = StreamedTransactions(self._output, builders, spill_dir, self._plain.write)
        self._two_phase = TwoPhaseTransactions(self._output, builders, spill_dir, self._plain.write)
        self._decoder = PgoutputDecoder(streaming)
        self._relations: dict[int, RelationSchema] = {}
        self._lsn = 0

    @property
    def checkpoint_lsn(self) -> int:
        return self._output.checkpoint_lsn

    @property
    def last_end_lsn(self) -> int:
        """The highest end LSN of the transactions ended so far (at least the checkpoint)."""
        return self._output.last_end_lsn

    @property
    def completed(self) -> int:
        """Transactions ended in the current batch (committed, prepared or rolled back)."""
        return self._output.completed

    @property
    def open_streams(self) -> int:
        """Streamed transactions begun in this session and not yet committed or aborted."""
        return len(self._streams)

    @property
    def between_transactions(self) -> bool:
        """No transaction is open between its Begin (or Begin Prepare) and its end: a batch may end
        here. (Streamed transactions may be open: they are buffered on their own.)"""
        return self._plain.current is None and self._two_phase.current is None

    # -- per session and batch -----------------------------------------------------------------

    def start_session(self, sink: ChangeSink, checkpoint_lsn: int) -> None:
        """Begin a replication session whose transactions go to ``sink``; those ending at or before
        ``checkpoint_lsn`` are dropped. Forgets what the previous session sent: Relation and Type
        messages and partial streams."""
        self._output.start(sink, checkpoint_lsn)
        self._decoder = PgoutputDecoder(self.streaming)
        self._relations.clear()
        self._plain.start_session()
        self._streams.discard()
        self._two_phase.current = None

    def flush(self) -> None:
        """Write every committed change buffered so far to the sink; only between transactions."""
        txn = self._plain.current or self._two_phase.current
        if txn is not None:
            raise DecodeError(
                f"the batch ended inside transaction {txn.xid} (no Commit)", message_type=None, offset=0
            ).at(lsn=self._lsn, slot=self.slot)
        self._plain.write()

    def next_batch(self, sink: ChangeSink, checkpoint_lsn: int) -> None:
        """Go on in the same session with a new batch (after :meth:`flush`), written to ``sink``."""
        self._output.start(sink, checkpoint_lsn)

    def discard(self) -> None:
        """Forget everything buffered, committed or not, spill files included (a session that was
        lost: the next one sends it all again)."""
        self._plain.discard()
        self._streams.discard()
        if self._two_phase.current is not None:
            self._two_phase.current.buffers.discard()
            self._two_phase.current = None

    def end_session(self) -> None:
        """:meth:`flush`, then forget the streamed transactions still open: the next session sends
        them again whole."""
        self.flush()
        self._streams.discard()

    # -- blocks --------------------------------------------------------------------------------

    def feed_blocks(self, blocks: Iterable[MessageBlock]) -> int:
        """Consume blocks of the stream; return how many messages there were.

        In each block, runs of plain transactions (Begin, Insert, Update, Delete, Commit) are
        handled with numpy for the whole run — boundaries, commit fields, relations, positions —
        and every other message goes through :meth:`feed`.
        """
        count = 0
        for block in blocks:
            self._feed_block(block)
            count += len(block)
        return count

    def _feed_block(self, block: MessageBlock) -> None:
        ends = block.ends
        starts = block.starts()
        view = BlockView(block.data)
        types = np.where(ends > starts, view.u8[starts], 0)
        plain = np.isin(types, PLAIN_TYPES)
        first = 0
        for stop in [*np.flatnonzero(~plain).tolist(), len(block)]:
            if stop > first:
                self._plain_run(view, starts[first:stop], ends[first:stop], types[first:stop], block, first)
            if stop < len(block):
                self._one_by_one(block, stop, stop + 1)
            first = stop + 1

    def _plain_run(
        self, view: BlockView, starts: np.ndarray, ends: np.ndarray, types: np.ndarray, block: MessageBlock, offset: int
    ) -> None:
        """Rows ``offset…`` of a block, all Begin/Commit/Insert/Update/Delete: to the plain
        transactions whole when they are plain transactions of relations this session described;
        else message by message (so errors are exact)."""
        count = len(starts)
        if self._streams.active is not None or self._decoder.in_stream or self._two_phase.current is not None:
            return self._one_by_one(block, offset, offset + count)
        done = 0
        if self._plain.current is not None:  # finish the transaction the run starts inside, one by one
            commits = np.flatnonzero(types == MSG_COMMIT)
            done = int(commits[0]) + 1 if len(commits) else count
            self._one_by_one(block, offset, offset + done)
        if done < count:
            if self._plain.add_run(view, starts[done:], ends[done:], types[done:]):
                self._lsn = int(block.lsns[offset + done])
            else:
                self._one_by_one(block, offset + done, offset + count)

    def _one_by_one(self, block: MessageBlock, start: int, stop: int) -> None:
        for lsn, data in block.rows(start, stop):
            self.feed(lsn, data)

    # -- rows ----------------------------------------------------------------------------------

    def feed(self, lsn: int, data: bytes) -> None:
        """Consume one message of the stream."""
        self._lsn = lsn
        try:
            if data and data[0] in _CHANGE_TYPES:
                self._change(data)
            else:
                self._control(data)
        except DecodeError as error:
            raise error.at(lsn=lsn, slot=self.slot) from None

    def _change(self, data: bytes) -> None:
        decoder = self._decoder
        if len(data) < (9 if decoder.in_stream else 5):
            decoder.decode(data)  # raises the precise DecodeError
        if decoder.in_stream:
            subxid, relation_oid = _XID_AND_OID(data, 1)
            stream = self._streams.active
            assert stream is not None  # the decoder is inside a block only after Stream Start
            schema = self._relations.get(relation_oid)
            if schema is None:
                raise self._unknown_relation(relation_oid, data)
            stream.add_streamed_change(subxid, schema, data)
            return
        (relation_oid,) = _OID(data, 1)
        target = self._bracket(data[0])
        schema = self._relations.get(relation_oid)
        if schema is None:
            raise self._unknown_relation(relation_oid, data)
        target.add_change(schema, data)

    def _control(self, data: bytes) -> None:
        message = self._decoder.decode(data)
        match message:
            case BeginMessage() | BeginPrepareMessage():
                txn = self._plain.current or self._two_phase.current
                if txn is not None:
                    raise DecodeError(
                        f"transaction {message.xid} begins while {txn.xid} is still open",
                        message_type=message_name(data[0]),
                        offset=0,
                    )
                if isinstance(message, BeginMessage):
                    self._plain.begin(message.xid)
                else:
                    self._two_phase.begin(message)
            case CommitMessage():
                self._check_end(data[0], prepared=False)
                self._plain.commit(message)
            case PrepareMessage():
                self._check_end(data[0], prepared=True)
                self._two_phase.prepare(message)
            case OriginMessage():
                self._target(data[0]).set_origin(message.name, message.commit_lsn)
            case RelationMessage():
                schema = self._relations[message.relation_oid] = self._describe(message)
                self._plain.add_relation(message.relation_oid, schema)
            case TypeMessage():
                self.catalog.note_type_message(message.type_oid, message.namespace, message.name)
            case TruncateMessage():
                schemas = [self._truncated(oid) for oid in message.relation_oids]
                self._target(data[0]).add_truncate(schemas, message)
            case LogicalDecodingMessage():
                if message.transactional:
                    self._target(data[0]).add_message(message)
                else:
                    self._output.sink.standalone_message(self._lsn, message)
            case StreamStartMessage():
                self._streams.start(message)
            case StreamStopMessage():
                self._streams.stop()
            case StreamAbortMessage():
                self._streams.abort(message)
            case StreamCommitMessage():
                self._streams.commit(message)
            case StreamPrepareMessage():
                self._two_phase.prepared(self._streams.pop(message.xid, "Stream Prepare"), message)
            case CommitPreparedMessage():
                self._two_phase.commit(message)
            case RollbackPreparedMessage():
                self._two_phase.rollback(message)

    # -- routing -------------------------------------------------------------------------------

    def _target(self, type_byte: int) -> Target:
        """What takes a message of the open transaction: the streamed one whose block is open, else
        the one between Begin (or Begin Prepare) and its end."""
        return self._streams.active or self._bracket(type_byte)

    def _bracket(self, type_byte: int) -> Target:
        """What takes the changes of the transaction between Begin (or Begin Prepare) and its end."""
        if self._plain.current is not None:
            return self._plain
        if self._two_phase.current is not None:
            return self._two_phase.current
        raise _outside(type_byte)

    def _check_end(self, type_byte: int, *, prepared: bool) -> None:
        """A Commit (a Prepare, if ``prepared``) must end a transaction begun by Begin (Begin Prepare)."""
        txn = self._plain.current or self._two_phase.current
        if txn is None:
            raise _outside(type_byte)
        if (self._two_phase.current is not None) != prepared:
            raise DecodeError(
                f"{message_name(type_byte)} ends transaction {txn.xid}, which began with"
                f" {'Begin' if prepared else 'Begin Prepare'}",
                message_type=message_name(type_byte),
                offset=0,
            )

    def _unknown_relation(self, relation_oid: int, data: bytes) -> DecodeError:
        return DecodeError(
            f"change for unknown relation OID {relation_oid}: no Relation message preceded it in this session",
            message_type=message_name(data[0]),
            offset=1 + 4 * self._decoder.in_stream,
        )

    def _truncated(self, relation_oid: int) -> RelationSchema:
        schema = self._relations.get(relation_oid)
        if schema is None:
            raise DecodeError(
                f"Truncate lists unknown relation OID {relation_oid}: no Relation message preceded it in this session",
                message_type="Truncate",
                offset=0,
            )
        return schema


def _outside(type_byte: int) -> DecodeError:
    return DecodeError(
        "message outside a transaction (no Begin before it)", message_type=message_name(type_byte), offset=0
    )
