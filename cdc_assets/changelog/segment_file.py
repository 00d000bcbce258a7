"""One table segment of the change log being written: records gathered into row groups of a useful
size, encoded on a thread of their own, and the file made durable when it is finished.

A drain's :class:`~cdc_assets.changelog.writer.BatchWriter` writes its tables' segments this way,
and so does each worker of a copy (:mod:`cdc_assets.pipeline.snapshot_copy`), each writing files of its own.
"""

from __future__ import annotations

import contextlib
import json
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO

import pyarrow as pa
import pyarrow.parquet as pq

from cdc_assets.changelog.encoding import storage_schema, to_storage
from cdc_assets.changelog.store import LogStore
from cdc_assets.errors import CdcError
from cdc_assets.pgoutput.records import RecordColumn
from cdc_assets.pgoutput.schema import RelationSchema

ROW_GROUP_ROWS = 131_072
MAX_PENDING_ROW_GROUPS = 2
# zstd without dictionaries (but for the operation): about a third faster to write than with
# them, and smaller, for change records.
PARQUET_OPTIONS: dict[str, object] = {"compression": "zstd", "use_dictionary": [RecordColumn.OP, RecordColumn.OLD_KIND]}
# A copy's segments: lz4, and statistics only for the top-level columns (readers use the LSN and
# commit-time bounds, never those inside the row structs): encoded in about two thirds of the
# time, for files about twice the size (docs/architecture.md, "The initial snapshot").
COPY_PARQUET_OPTIONS: dict[str, object] = PARQUET_OPTIONS | {
    "compression": "lz4",
    "write_statistics": [
        RecordColumn.COMMIT_LSN,
        RecordColumn.END_LSN,
        RecordColumn.XID,
        RecordColumn.COMMIT_TIME,
        RecordColumn.POSITION,
        RecordColumn.OP,
    ],
}
RELATION_KEY = b"cdc_assets.relation"


def relation_metadata(relation: RelationSchema, version: int | None) -> dict[bytes, bytes]:
    """The schema metadata that names a file's table, its columns and schema version."""
    payload = relation.to_json() | ({"schema_version": version} if version is not None else {})
    return {RELATION_KEY: json.dumps(payload).encode()}


class RowGroupEncoder:
    """Encodes row groups on one thread of its own (pyarrow releases the GIL), so the next rows are
    assembled meanwhile; at most :data:`MAX_PENDING_ROW_GROUPS` wait, in order."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="cdc-parquet")
        self._pending: deque[tuple[str, Future[None]]] = deque()

    def submit(self, writer: pq.ParquetWriter, table: pa.Table, what: str) -> None:
        """Write ``table`` as one row group; ``what`` names the records in an error."""
        self._pending.append((what, self._executor.submit(writer.write_table, table, row_group_size=len(table))))
        while len(self._pending) > MAX_PENDING_ROW_GROUPS:
            self._settle(*self._pending.popleft())

    def wait(self) -> None:
        """Until every row group submitted is written (raising the first failure)."""
        while self._pending:
            self._settle(*self._pending.popleft())

    def shutdown(self, *, cancel: bool = False) -> None:
        self._executor.shutdown(wait=True, cancel_futures=cancel)
        if cancel:
            self._pending.clear()

    @staticmethod
    def _settle(what: str, write: Future[None]) -> None:
        try:
            write.result()
        except (pa.ArrowInvalid, pa.ArrowTypeError) as error:
            raise CdcError(f"cannot write change records of {what}: {error}") from None


class SegmentFile:
    """An open segment ``name`` of ``store`` holding records of ``schema`` (its metadata the
    relation's, see :func:`relation_metadata`)."""

    def __init__(
        self,
        store: LogStore,
        name: str,
        schema: pa.Schema,
        encoder: RowGroupEncoder,
        what: str,
        options: dict[str, object] = PARQUET_OPTIONS,
    ) -> None:
        self.store = store
        self.name = name
        self.what = what
        self.rows = 0
        self._encoder = encoder
        self._handle: IO[bytes] | pa.NativeFile = store.open_output(name)
        self._writer = pq.ParquetWriter(self._handle, storage_schema(schema), **options)
        self._buffered: list[pa.RecordBatch] = []
        self._buffered_rows = 0

    def add(self, records: pa.RecordBatch) -> None:
        """Buffer ``records``; a full row group goes to the encoder."""
        self._buffered.append(records)
        self._buffered_rows += records.num_rows
        if self._buffered_rows >= ROW_GROUP_ROWS:
            self.flush()

    def flush(self) -> None:
        """Send what is buffered to the encoder as a row group (nothing when nothing is)."""
        if not self._buffered:
            return
        table = to_storage(pa.Table.from_batches(self._buffered))
        self._encoder.submit(self._writer, table, self.what)
        self.rows += len(table)
        self._buffered, self._buffered_rows = [], 0

    def finish(self) -> None:
        """Write the rest and make the file durable (its row groups written: call after
        :meth:`RowGroupEncoder.wait`, or :meth:`close`, which waits)."""
        self._writer.close()
        self.store.finish_output(self._handle)

    def close(self) -> None:
        """Flush, wait for the encoder and finish: the file is whole and durable."""
        self.flush()
        self._encoder.wait()
        self.finish()

    def abandon(self) -> None:
        """Close the file after a failure, best effort; it stays invalid."""
        for close in (self._writer.close, self._handle.close):  # the handle even when the writer fails
            with contextlib.suppress(Exception):  # best effort after an earlier error
                close()
