"""The publication: created for the configured tables when missing, verified when present.

A publication the source role owns gets the configured tables it lacks added (``setup`` after a
table was added to the config) and, on request, the tables no longer configured dropped
(``setup --prune``). A publication someone else owns is never altered: the error names the
statement its owner would run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg import errors

from cdc_assets.config import Config
from cdc_assets.errors import PublicationMismatchError, SourcePermissionError
from cdc_assets.names import TableName, quote_identifier
from cdc_assets.source.connection import one_row


def publication_exists(conn: psycopg.Connection[Any], name: str) -> bool:
    return bool(one_row(conn.execute("SELECT EXISTS (SELECT FROM pg_publication WHERE pubname = %s)", (name,)))[0])


def published_tables(conn: psycopg.Connection[Any], name: str) -> set[TableName]:
    """The tables a publication publishes (``pg_publication_tables``: FOR ALL TABLES, schemas too)."""
    rows = conn.execute(
        "SELECT schemaname::text, tablename::text FROM pg_publication_tables WHERE pubname = %s", (name,)
    ).fetchall()
    return {TableName(schema, table) for schema, table in rows}


@dataclass(slots=True)
class PublicationChange:
    """What :func:`ensure_publication` did."""

    created: bool = False
    added: list[TableName] = field(default_factory=list)


def ensure_publication(conn: psycopg.Connection[Any], config: Config) -> PublicationChange:
    """Create the publication ``FOR TABLE`` the configured tables if missing — ``WITH
    (publish_via_partition_root = true)`` when one of them is partitioned, so that its changes
    arrive under its own name — or add the configured tables it lacks when the source role owns it;
    then raise :class:`PublicationMismatchError` unless the publication publishes every configured
    table under that table's own name (``pg_publication_tables``). A failed check alters nothing."""
    name = config.source.publication
    wanted = [t.name for t in config.tables]
    change = PublicationChange()
    with conn.transaction():
        if not publication_exists(conn, name):
            tables = ", ".join(t.sql for t in wanted)
            via_root = (
                " WITH (publish_via_partition_root = true)" if any(is_partitioned(conn, t) for t in wanted) else ""
            )
            _alter(conn, name, f"CREATE PUBLICATION {quote_identifier(name)} FOR TABLE {tables}{via_root}")
            change.created = True
        else:
            lacking = [t for t in wanted if t not in published_tables(conn, name) and not _listed(conn, name, t)]
            if lacking and publication_owned(conn, name):
                _alter(conn, name, _add_statement(name, lacking))
                change.added = lacking
        missing = [t for t in wanted if t not in published_tables(conn, name)]
        if missing:
            raise PublicationMismatchError(
                f"publication {name} does not publish {', '.join(_why_missing(conn, name, t) for t in missing)}"
                + (
                    ""
                    if change.created or change.added
                    else f": its owner can add them ({_add_statement(name, missing)}), or set source.publication to"
                    " another name (cdc-assets alters only a publication the source role owns)"
                )
            )
    return change


def prune_publication(conn: psycopg.Connection[Any], config: Config) -> list[TableName]:
    """Drop from the publication the tables it lists by name that are no longer configured (only a
    publication the source role owns; one ``FOR ALL TABLES`` or ``FOR TABLES IN SCHEMA`` keeps
    publishing them)."""
    name = config.source.publication
    configured = {t.name for t in config.tables}
    listed = {
        TableName(schema, table)
        for schema, table in conn.execute(
            "SELECT n.nspname::text, c.relname::text FROM pg_publication_rel r JOIN pg_publication p ON p.oid = r.prpubid"
            " JOIN pg_class c ON c.oid = r.prrelid JOIN pg_namespace n ON n.oid = c.relnamespace WHERE p.pubname = %s",
            (name,),
        ).fetchall()
    }
    extra = sorted(listed - configured, key=str)
    if not extra:
        return []
    statement = f"ALTER PUBLICATION {quote_identifier(name)} DROP TABLE {', '.join(t.sql for t in extra)}"
    if not publication_owned(conn, name):
        raise SourcePermissionError(
            f"publication {name} still publishes {', '.join(map(str, extra))}, which are no longer configured, but"
            f" the source role does not own it: its owner can run {statement}"
        )
    with conn.transaction():
        _alter(conn, name, statement)
    return extra


def publication_owned(conn: psycopg.Connection[Any], name: str) -> bool:
    """Whether the source role owns (or is a member of the role owning) the publication."""
    row = conn.execute(
        "SELECT pg_has_role(pubowner, 'USAGE') FROM pg_publication WHERE pubname = %s", (name,)
    ).fetchone()
    return bool(row and row[0])


def _listed(conn: psycopg.Connection[Any], publication: str, table: TableName) -> bool:
    """Whether adding ``table`` cannot help: the publication is ``FOR ALL TABLES``, or lists the
    table or one of its ancestors already (it publishes them under other names: see
    :func:`_why_missing`)."""
    row = conn.execute(
        "SELECT p.puballtables OR EXISTS (SELECT FROM pg_publication_rel r WHERE r.prpubid = p.oid AND r.prrelid IN"
        " (SELECT relid FROM pg_partition_ancestors(to_regclass(%s)))) FROM pg_publication p WHERE p.pubname = %s",
        (table.sql, publication),
    ).fetchone()
    return bool(row and row[0])


def _add_statement(name: str, tables: list[TableName]) -> str:
    return f"ALTER PUBLICATION {quote_identifier(name)} ADD TABLE {', '.join(t.sql for t in tables)}"


def _alter(conn: psycopg.Connection[Any], name: str, statement: str) -> None:
    try:
        conn.execute(statement)
    except errors.InsufficientPrivilege as error:
        raise SourcePermissionError(
            f"cannot change publication {name}: {error.diag.message_primary}; a table's owner or a superuser must"
            f" run {statement}"
        ) from None


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
