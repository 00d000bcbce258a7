"""Bounded memory. Buffered raw changes are converted to Arrow once a table has :data:`CHUNK_ROWS`
of them, and converted chunks beyond :data:`SPILL_BYTES` go to temporary Arrow files
(:class:`SpillQueue`), so a transaction of millions of rows drains in bounded memory.

Both limits are read where they are used (elsewhere as ``spill.CHUNK_ROWS``), not copied at
import, so a test can lower them here.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from cdc_assets.pgoutput.schema import RelationSchema

CHUNK_ROWS = 65_536
SPILL_BYTES = 64 << 20

Item = tuple[RelationSchema, pa.RecordBatch, np.ndarray]


class SpillQueue:
    """Converted record batches in order, each with an array of tags (one per row), kept in
    memory up to :data:`SPILL_BYTES`, then in temporary Arrow files in ``spill_dir``."""

    __slots__ = ("_items", "_memory", "_spill_dir")

    def __init__(self, spill_dir: str | None) -> None:
        self._items: list[tuple[RelationSchema, pa.RecordBatch | str, np.ndarray]] = []
        self._memory = 0
        self._spill_dir = spill_dir

    def __bool__(self) -> bool:
        return bool(self._items)

    def append(self, schema: RelationSchema, records: pa.RecordBatch, tags: np.ndarray) -> None:
        if self._memory + records.nbytes > SPILL_BYTES:
            handle, path = tempfile.mkstemp(prefix="cdc-spill-", suffix=".arrow", dir=self._spill_dir)
            with os.fdopen(handle, "wb") as sink, ipc.new_file(sink, records.schema) as writer:
                writer.write_batch(records)
            self._items.append((schema, path, tags))
        else:
            self._memory += records.nbytes
            self._items.append((schema, records, tags))

    def pop_all(self) -> Iterator[Item]:
        """Every item in order, removing it (spilled ones are read back and their files deleted)."""
        items, self._items, self._memory = self._items, [], 0
        for schema, records, tags in items:
            if isinstance(records, str):
                with pa.memory_map(records) as source:
                    batch = ipc.open_file(source).get_batch(0)
                os.unlink(records)
                yield schema, batch, tags
            else:
                yield schema, records, tags

    def discard(self) -> None:
        for _ in self.pop_all():
            pass
