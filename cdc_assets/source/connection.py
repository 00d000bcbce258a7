"""Connections to the source database: naming, error hygiene and the pinned text-output settings.

Connection failures never show the DSN or its password: libpq's message is kept (host, port,
database, user are useful) with every password-like fragment removed.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.pq import TransactionStatus

from cdc_assets.config import SourceConfig
from cdc_assets.errors import SourceError, SourceUnavailableError
from cdc_assets.source.reconnect import CONNECTION_LOST_SQLSTATES

PINNED_SETTINGS: dict[str, str] = {
    "TimeZone": "UTC",
    "DateStyle": "ISO",
    "IntervalStyle": "postgres",
    "extra_float_digits": "3",
    "bytea_output": "hex",
    "client_encoding": "UTF8",
}
"""Settings under which value text is deterministic (invariant 5); applied with ``SET LOCAL``."""

_PASSWORD_OPTION = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)
_URI_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")
_REDACTED = "***"

_Row = TypeVar("_Row")


def connect(
    source: SourceConfig, *, purpose: str, autocommit: bool = True, replication: bool = False
) -> psycopg.Connection[Any]:
    """Connect as ``application_name=cdc-assets:<purpose>``; ``replication`` opens a walsender
    connection (``replication=database``) for replication commands."""
    info = conninfo(source, purpose=purpose, replication=replication)
    try:
        return psycopg.connect(info, autocommit=autocommit)
    except psycopg.Error as error:
        raise connect_failure(source, purpose, str(error), error.sqlstate) from None


def one_row(cursor: psycopg.Cursor[_Row]) -> _Row:
    """The row of a statement that always returns exactly one (a SELECT without FROM, a function)."""
    row = cursor.fetchone()
    assert row is not None, "the statement returned no row"
    return row


def conninfo(source: SourceConfig, *, purpose: str, replication: bool = False) -> str:
    """The connection string :func:`connect` uses (it holds the DSN's password: never show it)."""
    try:
        conninfo_to_dict(source.dsn)
    except psycopg.Error:
        # libpq's parse errors quote fragments of the string, which may be the password.
        raise SourceError(
            "source.dsn is not a valid libpq connection string or URI (not shown: it may hold a password)"
        ) from None
    extra = {"application_name": f"cdc-assets:{purpose}"}
    if replication:
        extra["replication"] = "database"
    return make_conninfo(source.dsn, **extra)


def connect_failure(source: SourceConfig, purpose: str, message: str, sqlstate: str | None) -> SourceError:
    """The error for a failed connection attempt: libpq's ``message`` with every password removed;
    a :class:`~cdc_assets.errors.SourceUnavailableError` when the server was not there to answer
    (no ``sqlstate``) or is shutting down or starting up, else a refusal (authentication, a missing
    database)."""
    password = conninfo_to_dict(source.dsn).get("password")
    reason = redact(" ".join(message.split()), [str(password)] if password else [])
    unavailable = sqlstate is None or sqlstate in CONNECTION_LOST_SQLSTATES
    return (SourceUnavailableError if unavailable else SourceError)(
        f"cannot connect to the source database ({purpose}): {reason}"
    )


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    """``text`` without the given secrets, ``password=…`` values or URI passwords."""
    for secret in secrets:
        text = text.replace(secret, _REDACTED)
    text = _PASSWORD_OPTION.sub(rf"\g<1>{_REDACTED}", text)
    return _URI_PASSWORD.sub(rf"\g<1>{_REDACTED}@", text)


def apply_pinned_settings(conn: psycopg.Connection[Any]) -> None:
    """``SET LOCAL`` every :data:`PINNED_SETTINGS` in the connection's current transaction."""
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        raise ValueError("pinned settings are SET LOCAL: open a transaction first")
    conn.execute(*pinned_settings_statement())


def pinned_settings_statement() -> tuple[str, tuple[list[str], list[str]]]:
    """The statement (SQL and parameters) that sets every :data:`PINNED_SETTINGS` with ``SET LOCAL``."""
    return (
        "SELECT set_config(name, value, true) FROM unnest(%s::text[], %s::text[]) AS s(name, value)",
        (list(PINNED_SETTINGS), list(PINNED_SETTINGS.values())),
    )


def server_major(conn: psycopg.Connection[Any]) -> int:
    """The server's major version (14, 15, 16, …)."""
    return conn.info.server_version // 10000
