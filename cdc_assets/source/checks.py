"""Pre-flight checks of the source: server version and settings, role attributes, tables.

Each failure is one error that says what is wrong, where, and what to do.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from cdc_assets.config import Config
from cdc_assets.errors import SourceError, SourcePermissionError, TableMissingError
from cdc_assets.names import TableName
from cdc_assets.source.connection import one_row
from cdc_assets.source.publication import publication_exists
from cdc_assets.source.slots import require_failover_server

MIN_SERVER_MAJOR = 14  # pgoutput protocol 2 (streaming, messages); we decode protocols 1-4

_PUBLISHABLE = {"r": "table", "p": "partitioned table"}
_RELKINDS = {"v": "view", "m": "materialized view", "f": "foreign table", "S": "sequence", "i": "index"}


@dataclass(slots=True, frozen=True)
class ServerSettings:
    """What decides whether a server can be a source: ``server_version_num`` and two settings."""

    version_num: int
    wal_level: str
    server_encoding: str

    @property
    def major(self) -> int:
        return self.version_num // 10000


@dataclass(slots=True, frozen=True)
class _TableAccess:
    name: TableName
    relkind: str | None  # None: no such relation
    can_select: bool
    owned: bool
    owner: str


def read_server_settings(conn: psycopg.Connection[Any]) -> ServerSettings:
    wal_level, encoding = one_row(
        conn.execute("SELECT current_setting('wal_level'), current_setting('server_encoding')")
    )
    return ServerSettings(conn.info.server_version, wal_level, encoding)


def require_server_settings(settings: ServerSettings) -> None:
    """Raise :class:`SourceError` unless the server is ≥ 14 with ``wal_level=logical`` and UTF8."""
    if settings.major < MIN_SERVER_MAJOR:
        raise SourceError(
            f"the source server runs PostgreSQL {settings.major}.{settings.version_num % 10000}; "
            f"cdc-assets needs PostgreSQL {MIN_SERVER_MAJOR} or later (pgoutput protocol 2+): upgrade the server"
        )
    if settings.wal_level != "logical":
        raise SourceError(
            f"the source server has wal_level = {settings.wal_level}; logical decoding needs wal_level = logical: "
            "run ALTER SYSTEM SET wal_level = logical and restart the server"
        )
    if settings.server_encoding != "UTF8":
        raise SourceError(
            f"the source database has server_encoding {settings.server_encoding}; cdc-assets reads text as UTF-8: "
            "use a database created with ENCODING 'UTF8'"
        )


def require_replication_role(conn: psycopg.Connection[Any]) -> None:
    """The connected role can create and read replication slots (REPLICATION or superuser)."""
    user, superuser, replication = one_row(
        conn.execute("SELECT rolname, rolsuper, rolreplication FROM pg_roles WHERE rolname = current_user")
    )
    if not (superuser or replication):
        raise SourcePermissionError(
            f"role {user} cannot use replication slots: it needs the REPLICATION attribute "
            f"(ALTER ROLE {user} REPLICATION) or superuser"
        )


def require_tables(
    conn: psycopg.Connection[Any], tables: Sequence[TableName], *, publication: str | None = None
) -> None:
    """Every table exists, is a table and is readable; with ``publication`` (about to be created)
    also owned by the connected role and the database allows CREATE."""
    user, database, can_create = one_row(
        conn.execute("SELECT current_user, current_database(), has_database_privilege(current_database(), 'CREATE')")
    )
    access = _table_access(conn, tables)
    missing = [str(t.name) for t in access if t.relkind is None]
    if missing:
        raise TableMissingError(
            f"configured table(s) {', '.join(missing)} do not exist in database {database}: "
            "create them, or remove them from `tables` in the configuration"
        )
    for table in access:
        if table.relkind not in _PUBLISHABLE:
            kind = _RELKINDS.get(table.relkind or "", f"relation of kind {table.relkind!r}")
            raise TableMissingError(
                f"{table.name} in database {database} is a {kind}, not a table; only tables can be published"
            )
        if not table.can_select:
            raise SourcePermissionError(
                f"role {user} cannot read table {table.name} (no SELECT privilege), which the initial snapshot "
                f"needs: GRANT SELECT ON {table.name.sql} TO {user}"
            )
    if publication is None:
        return
    if not can_create:
        raise SourcePermissionError(
            f"role {user} cannot create publication {publication}: it lacks CREATE on database {database} "
            f"(GRANT CREATE ON DATABASE {database} TO {user}), or create the publication as another role"
        )
    for table in access:
        if not table.owned:
            raise SourcePermissionError(
                f"role {user} cannot create publication {publication} for table {table.name}, owned by "
                f"{table.owner}: only the table's owner or a superuser may publish it; create the publication "
                f"as {table.owner} (CREATE PUBLICATION ... FOR TABLE ...), or GRANT {table.owner} TO {user}"
            )


def check_source(conn: psycopg.Connection[Any], config: Config) -> ServerSettings:
    """Everything ``setup`` needs from the source, checked before anything is created."""
    settings = read_server_settings(conn)
    require_server_settings(settings)
    if config.source.failover:
        require_failover_server(settings.major)
    require_replication_role(conn)
    publication = config.source.publication
    require_tables(
        conn,
        [t.name for t in config.tables],
        publication=None if publication_exists(conn, publication) else publication,
    )
    return settings


def _table_access(conn: psycopg.Connection[Any], tables: Sequence[TableName]) -> list[_TableAccess]:
    rows = conn.execute(
        "SELECT c.relkind::text, has_table_privilege(c.oid, 'SELECT'), pg_has_role(c.relowner, 'USAGE'),"
        " pg_get_userbyid(c.relowner)::text"
        " FROM unnest(%s::text[]) WITH ORDINALITY AS t(name, position)"
        " LEFT JOIN pg_class c ON c.oid = to_regclass(t.name) ORDER BY t.position",
        ([t.sql for t in tables],),
    ).fetchall()
    return [
        _TableAccess(name, relkind, bool(select), bool(owned), owner)
        for name, (relkind, select, owned, owner) in zip(tables, rows)
    ]
