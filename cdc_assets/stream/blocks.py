"""What the stream hands the drain: blocks of pgoutput messages, and the server's position."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

StreamedRow = tuple[int, bytes]
"""``(lsn, data)`` of one pgoutput message."""


@dataclass(slots=True, frozen=True)
class MessageBlock:
    """Consecutive messages of the stream: each message's LSN (int64), where it ends in ``data``
    (int64 offsets), and the messages joined."""

    lsns: np.ndarray
    ends: np.ndarray
    data: bytes

    def __len__(self) -> int:
        return len(self.lsns)

    def starts(self) -> np.ndarray:
        return np.concatenate((np.zeros(1, dtype=np.int64), self.ends[:-1]))

    def rows(self, start: int = 0, stop: int | None = None) -> Iterator[StreamedRow]:
        """``(lsn, data)`` of rows ``start…stop``."""
        stop = len(self) if stop is None else stop
        begin = int(self.ends[start - 1]) if start else 0
        for lsn, end in zip(self.lsns[start:stop].tolist(), self.ends[start:stop].tolist()):
            yield lsn, self.data[begin:end]
            begin = end

    def messages(self) -> list[bytes]:
        return [data for _, data in self.rows()]

    @staticmethod
    def joined(blocks: list[MessageBlock]) -> MessageBlock:
        """Consecutive blocks as one."""
        if len(blocks) == 1:
            return blocks[0]
        offsets = np.cumsum([0, *(len(b.data) for b in blocks[:-1])])
        return MessageBlock(
            np.concatenate([b.lsns for b in blocks]),
            np.concatenate([b.ends + offset for b, offset in zip(blocks, offsets.tolist())]),
            b"".join(b.data for b in blocks),
        )

    def head(self, stop: int) -> MessageBlock:
        """The first ``stop`` messages."""
        end = int(self.ends[stop - 1]) if stop else 0
        return MessageBlock(self.lsns[:stop], self.ends[:stop], self.data[:end])

    def split_after(self, types: bytes, at: int = 0) -> tuple[MessageBlock, MessageBlock | None]:
        """The messages up to the first one of the given types from message ``at`` on (all of them
        if there is none), and the rest (None if nothing is left)."""
        starts = self.starts()
        first = np.frombuffer(self.data, dtype=np.uint8)[np.minimum(starts, max(len(self.data) - 1, 0))]
        found = np.flatnonzero((self.ends > starts) & np.isin(first, np.frombuffer(types, dtype=np.uint8)))
        found = found[found >= at]
        if not len(found) or found[0] + 1 == len(self):
            return self, None
        stop = int(found[0]) + 1
        end = int(self.ends[stop - 1])
        rest = MessageBlock(self.lsns[stop:], self.ends[stop:] - end, self.data[end:])
        return self.head(stop), rest


@dataclass(slots=True, frozen=True)
class StreamPosition:
    """A keepalive's position: every transaction that committed before ``lsn`` was in the blocks
    before it."""

    lsn: int
