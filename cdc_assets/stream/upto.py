"""Where a drain up to an LSN stops in the stream (cdc/verify drains the log up to a
temporary slot's snapshot point)."""

from __future__ import annotations

from cdc_assets.pgoutput.decoder import PgoutputDecoder
from cdc_assets.pgoutput.messages import (
    BeginMessage,
    BeginPrepareMessage,
    CommitPreparedMessage,
    LogicalDecodingMessage,
    RollbackPreparedMessage,
    StreamCommitMessage,
    StreamPrepareMessage,
)
from cdc_assets.pgoutput.protocol import (
    MSG_BEGIN,
    MSG_BEGIN_PREPARE,
    MSG_COMMIT_PREPARED,
    MSG_MESSAGE,
    MSG_ROLLBACK_PREPARED,
    MSG_STREAM_COMMIT,
    MSG_STREAM_PREPARE,
    MSG_STREAM_START,
    MSG_STREAM_STOP,
)
from cdc_assets.stream.blocks import MessageBlock

_DECODED = frozenset(
    (
        MSG_BEGIN,
        MSG_BEGIN_PREPARE,
        MSG_STREAM_COMMIT,
        MSG_STREAM_PREPARE,
        MSG_COMMIT_PREPARED,
        MSG_ROLLBACK_PREPARED,
        MSG_MESSAGE,
        MSG_STREAM_START,  # Stream Start and Stop: the decoder tracks stream blocks
        MSG_STREAM_STOP,
    )
)
"""The messages that may place the cut, and those the decoder must see to read them."""


class UptoCut:
    """Where a drain up to ``upto`` stops: before the first transaction that ends after it (a
    Begin whose commit record starts at or after ``upto``, or a transaction end past it), or before
    a non-transactional message written at or after it. It decodes no Stream Abort, the one
    message whose layout depends on the slot's ``streaming`` option."""

    def __init__(self, upto: int) -> None:
        self._decoder = PgoutputDecoder()
        self._upto = upto

    def head(self, block: MessageBlock) -> tuple[MessageBlock, bool]:
        """The part of ``block`` before the cut, and whether the cut is in it."""
        upto = self._upto
        for index, (_, data) in enumerate(block.rows()):
            if not data or data[0] not in _DECODED:
                continue
            message = self._decoder.decode(data)
            match message:
                case BeginMessage():
                    past = message.final_lsn >= upto
                case LogicalDecodingMessage():
                    past = not message.transactional and message.lsn >= upto
                case BeginPrepareMessage() | StreamCommitMessage() | StreamPrepareMessage() | CommitPreparedMessage():
                    past = message.end_lsn > upto
                case RollbackPreparedMessage():
                    past = message.rollback_end_lsn > upto
                case _:
                    past = False
            if past:
                return block.head(index), True
        return block, False
