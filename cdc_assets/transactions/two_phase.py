"""Two-phase transactions (two-phase slots, protocol 3+). A transaction sent at PREPARE —
Begin Prepare … Prepare, or a streamed one ended by Stream Prepare — is buffered on its own and
handed to the sink whole as a :class:`~cdc_assets.transactions.sink.PreparedTransaction`; a later
Commit Prepared or Rollback Prepared names it by its GID.
"""

from __future__ import annotations

from collections.abc import Callable

from cdc_assets.pgoutput.messages import (
    BeginPrepareMessage,
    CommitPreparedMessage,
    PrepareMessage,
    RollbackPreparedMessage,
    StreamPrepareMessage,
)
from cdc_assets.transactions.buffers import Buffers, OwnTransaction, RecordBuilders
from cdc_assets.transactions.sink import CommitInfo, Output, PreparedTransaction


class TwoPhaseTransactions:
    """The transaction between Begin Prepare and Prepare (``current``), and the messages that end
    prepared transactions. ``write_earlier`` writes the changes of plain transactions committed
    before a Commit Prepared, so that the prepared transaction's records follow theirs."""

    __slots__ = ("_builders", "_output", "_spill_dir", "_write_earlier", "current")

    def __init__(
        self, output: Output, builders: RecordBuilders, spill_dir: str | None, write_earlier: Callable[[], None]
    ) -> None:
        self._output = output
        self._builders = builders
        self._spill_dir = spill_dir
        self._write_earlier = write_earlier
        self.current: OwnTransaction | None = None

    def begin(self, message: BeginPrepareMessage) -> None:
        self.current = OwnTransaction(message.xid, Buffers(self._builders, False, self._spill_dir))

    def prepare(self, message: PrepareMessage) -> None:
        """Prepare: the transaction since Begin Prepare is prepared."""
        txn = self.current
        assert txn is not None, "the assembler passes a Prepare only after a Begin Prepare"
        self.current = None
        self.prepared(txn, message)

    def prepared(self, txn: OwnTransaction, message: PrepareMessage | StreamPrepareMessage) -> None:
        """``txn`` is prepared: hand it to the sink, unless the change log has it already."""
        if not self._output.ended(message.end_lsn):
            txn.buffers.discard()
            return
        prepared = PreparedTransaction(
            message.gid,
            message.xid,
            message.prepare_lsn,
            message.end_lsn,
            message.prepare_time_us,
            txn.origin,
            txn.origin_lsn,
            list(txn.chunks()),
            txn.messages,
        )
        self._output.sink.prepared(prepared)

    def commit(self, message: CommitPreparedMessage) -> None:
        info = CommitInfo(message.xid, message.commit_lsn, message.end_lsn, message.commit_time_us, gid=message.gid)
        if self._output.ended(info.end_lsn):
            self._write_earlier()
            self._output.sink.commit_prepared(message.gid, info)

    def rollback(self, message: RollbackPreparedMessage) -> None:
        if self._output.ended(message.rollback_end_lsn):
            self._output.sink.rollback_prepared(message.gid, message.rollback_end_lsn)
