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
    """Create the publication ``FOR TABLE`` the configured tables if missing (True when created);
    if it exists, raise :class:`PublicationMismatchError` unless it publishes all of them."""
    name = config.source.publication
    wanted = [t.name for t in config.tables]
    if not publication_exists(conn, name):
        tables = ", ".join(t.sql for t in wanted)
        try:
            conn.execute(f"CREATE PUBLICATION {quote_identifier(name)} FOR TABLE {tables}")
        except errors.InsufficientPrivilege as error:
            raise SourcePermissionError(
                f"cannot create publication {name}: {error.diag.message_primary}; a table's owner or a "
                "superuser must create it"
            ) from None
        return True
    published = published_tables(conn, name)
    missing = [str(t) for t in wanted if t not in published]
    if missing:
        raise PublicationMismatchError(
            f"publication {name} exists but does not publish {', '.join(missing)}: add the missing tables with "
            f"ALTER PUBLICATION {quote_identifier(name)} ADD TABLE ..., or set source.publication to another "
            "name (cdc-assets does not alter an existing publication)"
        )
    return False
