"""Slot creation with an exported snapshot, and the initial copy of tables as of that snapshot.

``CREATE_REPLICATION_SLOT … (SNAPSHOT 'export')`` on a walsender connection returns the slot's
consistent point and the name of a snapshot that sees exactly the transactions committed before
it: the copy plus every change the slot decodes afterwards is each row exactly once. The SQL
function ``pg_create_logical_replication_slot`` exports no snapshot, and a REPEATABLE READ
transaction opened around it sees a different moment, so it cannot replace this.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import Any, TypeVar

import psycopg
import pyarrow as pa
from psycopg import errors, sql

from cdc_assets.config import SourceConfig
from cdc_assets.errors import ConfigError, SourceError, SourcePermissionError, TableRewrittenError
from cdc_assets.lsn import parse_lsn
from cdc_assets.names import TableName, quote_identifier
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.source.binary_copy import CopySelect, read_columns
from cdc_assets.source.catalog import describe_table
from cdc_assets.source.connection import apply_pinned_settings, connect, one_row, server_major
from cdc_assets.source.publication import is_partitioned
from cdc_assets.source.slots import require_failover_server

CHUNK_ROWS = 50_000
REWRITE_ATTEMPTS = 5
"""Snapshots a copy takes at most while the tables it copies are found truncated or rewritten."""

log = logging.getLogger(__name__)
T = TypeVar("T")

# The heaps a copy of the table reads (the table, or a partitioned table's leaves) whose file is no
# longer the one the snapshot's catalog names: a TRUNCATE or rewrite committed after the snapshot.
_REWRITTEN = """
SELECT c.oid::regclass::text FROM pg_class c
WHERE c.oid = ANY (array_append(ARRAY(SELECT relid FROM pg_partition_tree(%(oid)s::oid) WHERE isleaf), %(oid)s::oid))
  AND c.relkind <> 'p' AND c.relfilenode IS DISTINCT FROM pg_relation_filenode(c.oid)"""


@dataclass(slots=True, frozen=True)
class ExportedSnapshot:
    """A new slot and the snapshot it exported: ``snapshot_name`` sees exactly the transactions
    whose commit record precedes ``consistent_point``, where the slot starts decoding."""

    slot: str
    consistent_point: int
    snapshot_name: str
    two_phase: bool


def create_slot_command(
    slot: str, major: int, two_phase: bool, temporary: bool = False, *, failover: bool = False
) -> str:
    """The replication command creating ``slot`` with an exported snapshot on a server version
    (``temporary``: dropped when the creating connection closes; ``failover``: synced to standbys)."""
    kind = "TEMPORARY LOGICAL" if temporary else "LOGICAL"
    if failover:
        require_failover_server(major)
    if major >= 15:
        options = ["SNAPSHOT 'export'"] + ["TWO_PHASE true"] * two_phase + ["FAILOVER true"] * failover
        return f"CREATE_REPLICATION_SLOT {quote_identifier(slot)} {kind} pgoutput ({', '.join(options)})"
    if two_phase:
        raise ConfigError(f"source.two_phase: two-phase decoding needs PostgreSQL 15 or later (the server is {major})")
    return f"CREATE_REPLICATION_SLOT {quote_identifier(slot)} {kind} pgoutput EXPORT_SNAPSHOT"


@contextmanager
def create_slot_with_snapshot(config: SourceConfig, *, temporary: bool = False) -> Iterator[ExportedSnapshot]:
    """Create the slot; the exported snapshot stays importable while the context is open.

    A ``temporary`` slot (a consistent point and snapshot to compare against, nothing more) is
    dropped by the server when the context ends.

    Creating a logical slot waits until every transaction running at that moment has finished
    (a long-running or idle-in-transaction session blocks it). The walsender connection stays
    open and idle inside the context: any further command on it would end the snapshot.
    """
    with connect(config, purpose="create-slot", replication=True) as conn:
        command = create_slot_command(
            config.slot,
            server_major(conn),
            config.two_phase and not temporary,
            temporary,
            failover=config.failover and not temporary,
        )
        try:
            _, consistent_point, snapshot_name, _ = one_row(conn.execute(command))
        except errors.InsufficientPrivilege as error:
            raise SourcePermissionError(
                f"cannot create replication slot {config.slot}: {error.diag.message_primary}; the source role "
                "needs the REPLICATION attribute or superuser"
            ) from None
        except errors.DuplicateObject:
            raise SourceError(
                f"replication slot {config.slot} already exists: setup creates it only when missing; to start "
                f"over with a new snapshot, drop it first (SELECT pg_drop_replication_slot('{config.slot}'))"
            ) from None
        except psycopg.Error as error:
            raise SourceError(
                f"cannot create replication slot {config.slot}: {error.diag.message_primary or error}"
            ) from None
        yield ExportedSnapshot(config.slot, parse_lsn(consistent_point), snapshot_name, config.two_phase)


class SnapshotReader:
    """Reads tables as of an exported snapshot, in one REPEATABLE READ, READ ONLY transaction
    with the pinned settings, as per-column text in bounded memory.

    ``with SnapshotReader(source, snapshot.snapshot_name) as reader: …`` — import it while the
    :func:`create_slot_with_snapshot` context is still open.
    """

    def __init__(self, source: SourceConfig, snapshot_name: str, *, chunk_rows: int = CHUNK_ROWS) -> None:
        self._source = source
        self._snapshot_name = snapshot_name
        self._chunk_rows = chunk_rows
        self._conn: psycopg.Connection[Any] | None = None
        self._locked: dict[int, str] = {}  # relation oid -> what the copy reads

    def __enter__(self) -> SnapshotReader:
        conn = connect(self._source, purpose="snapshot", autocommit=False)
        conn.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
        conn.read_only = True
        try:
            conn.execute(sql.SQL("SET TRANSACTION SNAPSHOT {}").format(sql.Literal(self._snapshot_name)))
            apply_pinned_settings(conn)
        except psycopg.Error as error:
            conn.close()
            raise SourceError(
                f"cannot import snapshot {self._snapshot_name} of replication slot {self._source.slot}: "
                f"{error.diag.message_primary or error} (the connection that created the slot must stay open "
                "until the snapshot is imported)"
            ) from None
        self._conn = conn
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._conn is not None:
            self._conn.close()  # read only: nothing to commit
            self._conn = None

    @property
    def connection(self) -> psycopg.Connection[Any]:
        if self._conn is None:
            raise RuntimeError("SnapshotReader is not open (use it as a context manager)")
        return self._conn

    def describe(self, table: TableName) -> RelationSchema:
        """The table's published columns as of the snapshot."""
        return describe_table(self.connection, table, self._source.publication)

    def lock(self, relation: RelationSchema) -> str:
        """Lock what a copy of ``relation`` reads (:func:`copy_source`) for the rest of the
        transaction (once per reader) and return it. ACCESS SHARE: no TRUNCATE or table rewrite
        commits until this reader ends. One that committed after the snapshot and before the lock makes the snapshot
        read the table as empty (those commands are not MVCC-safe): :class:`TableRewrittenError`."""
        if relation.relation_oid in self._locked:
            return self._locked[relation.relation_oid]
        conn = self.connection
        source = copy_source(conn, relation.table)
        try:
            conn.execute(f"LOCK TABLE {source} IN ACCESS SHARE MODE")
            rewritten = [name for (name,) in conn.execute(_REWRITTEN, {"oid": relation.relation_oid})]
        except errors.InsufficientPrivilege as error:
            raise SourcePermissionError(
                f"cannot copy table {relation.qualified_name}: {error.diag.message_primary or error}"
            ) from None
        if rewritten:
            raise TableRewrittenError(
                f"table {relation.qualified_name} ({', '.join(rewritten)}) was truncated or rewritten (TRUNCATE,"
                f" VACUUM FULL, CLUSTER, a rewriting ALTER TABLE) after the snapshot of slot {self._source.slot}"
                " was taken and before the copy locked it: the snapshot no longer sees its rows"
            )
        self._locked[relation.relation_oid] = source
        return source

    def chunks(self, relation: RelationSchema, binary: Sequence[bool]) -> Iterator[list[pa.Array]]:
        """The table's rows as of the snapshot, ``chunk_rows`` at a time, one binary array per
        published column holding what pgoutput sends for each value (null for NULL): in binary
        format where ``binary`` says so, else as text (see :mod:`cdc_assets.source.binary_copy`).
        Consume the iterator fully: stopping early cancels the query and ends the transaction.
        """
        conn = self.connection
        query = CopySelect.of(conn, relation, binary).query(self.lock(relation))
        yield from read_columns(
            conn, query, len(relation.columns), block_rows=self._chunk_rows, block_bytes=sys.maxsize
        )


def copy_source(conn: psycopg.Connection[Any], table: TableName) -> str:
    """What a copy of ``table`` reads: exactly the rows whose changes the slot sends under its name.

    A plain table is read ``ONLY``: an inheritance child's rows are published under the child's
    own name (PostgreSQL's own table sync reads ``FROM ONLY`` too). A partitioned table is read
    whole: it is published under its own name only with ``publish_via_partition_root``, and then
    every leaf's changes arrive under it (the publication check refuses the other cases).
    """
    return table.sql if is_partitioned(conn, table) else f"ONLY {table.sql}"


def copy_again_when_rewritten(
    copy: Callable[[], T], clean: Callable[[], None], *, attempts: int = REWRITE_ATTEMPTS
) -> T:
    """``copy()`` — which takes a snapshot and copies as of it — again with a new snapshot while it
    raises :class:`TableRewrittenError`, calling ``clean()`` in between; at most ``attempts`` times."""
    for attempt in range(1, attempts):
        try:
            return copy()
        except TableRewrittenError as error:
            log.warning("%s; copying again from a new snapshot (%d of %d)", error, attempt + 1, attempts)
            clean()
    try:
        return copy()
    except TableRewrittenError as error:
        raise TableRewrittenError(
            f"{error}; gave up after {attempts} snapshots (a table truncated or rewritten that often cannot"
            " be copied: pause what truncates it, then run again)"
        ) from None
