"""Names of the change log's files (see ``docs/architecture.md``, "The change log").

A segment is ``<folder>/<batch start: 16 hex digits>-<part: at least 4 digits>.parquet``;
:class:`SegmentName` sorts them in log order. A batch's segments are valid once the checkpoint has
moved past its start.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import quote, unquote

CHECKPOINT = "_checkpoint.json"
TABLES = "tables"
TRANSACTIONS = "transactions"
MESSAGES = "messages"
PREPARED = "prepared"
COPY_BATCH = 0  # a copy of whole tables (initial snapshot, online run, compacted base) is its log's batch 0

_SEGMENT = re.compile(r"^([0-9A-F]{16})-(\d{4,})\.parquet$")


@dataclass(slots=True, frozen=True, order=True)
class SegmentName:
    """A segment file: the batch it belongs to and its part number within the batch."""

    batch_start: int
    part: int

    @property
    def file(self) -> str:
        return f"{self.batch_start:016X}-{self.part:04d}.parquet"

    @classmethod
    def parse(cls, file: str) -> SegmentName | None:
        match = _SEGMENT.match(file.rsplit("/", 1)[-1])
        return cls(int(match.group(1), 16), int(match.group(2))) if match else None


def table_folder(table: str) -> str:
    """The folder of a table's segments; ``table`` is ``schema.name`` (escaped for filesystems)."""
    return f"{TABLES}/{quote(table, safe='.')}"


def table_of_folder(folder: str) -> str:
    return unquote(folder.rsplit("/", 1)[-1])


def prepared_folder(end_lsn: int, gid: str) -> str:
    """The folder of a prepared transaction (unique even if a gid is reused later)."""
    return f"{PREPARED}/{end_lsn:016X}-{gid.encode().hex()}"
