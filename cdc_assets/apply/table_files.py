"""What a Delta table's current version is made of — data files, bytes, deletion vectors — read
with delta-rs from the Delta log (no Spark; cheap enough for sensors and asset metadata)."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable as RustDeltaTable


@dataclass(slots=True, frozen=True)
class TableFiles:
    """One version of a Delta table: its data files and the deletion vectors on them."""

    version: int
    files: int
    bytes: int
    deletion_vectors: int  # data files that carry a deletion vector
    deleted_rows: int  # rows those deletion vectors mark deleted (still in the files)
    rows: int | None = None  # rows of the version, from the files' statistics (None: a file has none)

    def line(self) -> str:
        return (
            f"{self.files:,} files, {self.bytes / 1e6:,.1f} MB, {self.deletion_vectors:,} deletion vectors"
            f" ({self.deleted_rows:,} deleted rows), version {self.version}"
        )


def data_bytes(table: RustDeltaTable) -> int:
    """The bytes of ``table``'s data files as of its loaded version."""
    return pc.sum(_file_sizes(table)).as_py() or 0


def data_files(table: RustDeltaTable) -> int:
    """How many data files ``table``'s loaded version has."""
    return len(_file_sizes(table))


def _file_sizes(table: RustDeltaTable) -> pa.ChunkedArray:
    """The size of each of ``table``'s data files as of its loaded version."""
    return pa.table(table.get_add_actions(flatten=True).select(["size_bytes"])).column("size_bytes")


def table_files(path: str, storage_options: dict[str, str] | None = None) -> TableFiles:
    """The data files of the Delta table at ``path`` as of its latest version."""
    table = RustDeltaTable(path, storage_options=storage_options)
    files = pa.table(table.get_add_actions(flatten=True).select(["size_bytes", "num_records"]))
    vectors = deleted = 0
    for batch in pa.RecordBatchReader.from_stream(table.deletion_vectors()):
        keep = pa.record_batch(batch).column("selection_vector")  # per file, per row: kept?
        vectors += len(keep)
        deleted += len(keep.values) - (pc.sum(keep.values).as_py() or 0)
    return TableFiles(
        version=table.version(),
        files=files.num_rows,
        bytes=pc.sum(files.column("size_bytes")).as_py() or 0,
        deletion_vectors=vectors,
        deleted_rows=deleted,
        rows=None
        if files.column("num_records").null_count
        else (pc.sum(files.column("num_records")).as_py() or 0) - deleted,
    )
