"""The publication: created for the configured tables when missing, verified when present.

An existing publication is never altered: it may belong to someone else.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import errors

from cdc_assets.config import Config, TableName, quote_identifier
from cdc_assets.errors import PublicationMismatchError, SourcePermissionError
from cdc_assets.source.connection import one_row


def publication_exists(conn: psycopg.Connection[Any], name: str) -> bool:
    return bool(one_row(conn.execute("SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = %s)", (name,)))[0])


def published_tables(conn: psycopg.Connection[Any], name: str) -> set[TableName]:
    """The tables a publication publishes (``pg_publication_tables``: FOR ALL TABLES, schemas too)."""
    rows = conn.execute(
        "SELECT schemaname::text, tablename::text FROM pg_publication_tables WHERE pubname = %s", (name,)
    ).fetchall()
    return {TableName(schema, table) for schema, table in rows}


def ensure_publication(conn: psycopg.Connection[Any], config: Config) -> bool:
    """Create the publication ``FOR TABLE`` the configured tables if missing (True when created) —
    ``WITH (publish_via_partition_root = true)`` when one of them is partitioned, so that its changes
    arrive under its own name; then raise :class:`PublicationMismatchError` unless the publication
    publishes every configured table under that table's own name (``pg_publication_tables``)."""
    name = config.source.publication
    wanted = [t.name for t in config.tables]
    created = False
    if not publication_exists(conn, name):
        tables = ", ".join(t.sql for t in wanted)
        via_root = " WITH (publish_via_partition_root = true)" if any(is_partitioned(conn, t) for t in wanted) else ""
        try:
            conn.execute(f"CREATE PUBLICATION {quote_identifier(name)} FOR TABLE {tables}{via_root}")
        except errors.InsufficientPrivilege as error:
            raise SourcePermissionError(
                f"cannot create publication {name}: {error.diag.message_primary}; a table's owner or a "
                "superuser must create it"
            ) from None
        created = True
    published = published_tables(conn, name)
    missing = [t for t in wanted if t not in published]
    if missing:
        raise PublicationMismatchError(
            f"publication {name} does not publish {', '.join(_why_missing(conn, name, t) for t in missing)}"
            + (
                ""
                if created
                else f": add the missing tables with ALTER PUBLICATION {quote_identifier(name)} ADD TABLE ..., or set"
                " source.publication to another name (cdc-assets does not alter an existing publication)"
            )
        )
    return created


def is_partitioned(conn: psycopg.Connection[Any], table: TableName) -> bool:
    """Whether ``table`` is a partitioned table (False for a plain one, or one that does not exist)."""
    row = conn.execute("SELECT relkind = 'p' FROM pg_class WHERE oid = to_regclass(%s)", (table.sql,)).fetchone()
    return bool(row and row[0])


def _why_missing(conn: psycopg.Connection[Any], publication: str, table: TableName) -> str:
    """``table``, and why a partition or a partitioned table is published under another name."""
    row = conn.execute(
        "SELECT c.relkind = 'p', c.relispartition, p.pubviaroot,"
        " (SELECT a::regclass::text FROM pg_partition_ancestors(c.oid) a"
        "   WHERE a IN (SELECT relid FROM pg_publication_rel WHERE prpubid = p.oid) ORDER BY"
        "   (SELECT count(*) FROM pg_partition_ancestors(a)) LIMIT 1)"
        " FROM pg_class c, pg_publication p WHERE c.oid = to_regclass(%s) AND p.pubname = %s",
        (table.sql, publication),
    ).fetchone()
    if row is None:
        return str(table)
    partitioned, partition, via_root, published_ancestor = row
    if partitioned and not via_root:
        return (
            f"{table} (a partitioned table whose changes the publication sends under its leaf partitions: configure"
            " the leaves, or publish with publish_via_partition_root = true)"
        )
    if partition and via_root and published_ancestor:
        return f"{table} (a partition whose changes the publication sends under {published_ancestor}: configure that)"
    return str(table)
