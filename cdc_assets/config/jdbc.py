"""The JDBC URL of a libpq connection string: how Java (a Hive metastore's JDBC driver) reaches the
same PostgreSQL database as ``psql``."""

from __future__ import annotations

from urllib.parse import quote

import psycopg
from psycopg.conninfo import conninfo_to_dict

_PASSED_ON = ("sslmode", "sslrootcert", "sslcert", "sslkey")  # the same names in libpq and the JDBC driver
_READ = {"host", "port", "dbname", "user", "password", *_PASSED_ON}


def jdbc_url(dsn: str) -> str:
    """The JDBC URL of a libpq connection string or URI (without its user and password); ValueError
    says why there is none."""
    try:
        parts = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:  # libpq's reason may quote the password
        raise ValueError("not a PostgreSQL connection string or URI (libpq cannot parse it)") from None
    unknown = sorted(set(parts) - _READ)
    if unknown:
        raise ValueError(
            f"{unknown[0]} has no JDBC equivalent here (it takes host, port, dbname,"
            f" user, password and {', '.join(_PASSED_ON)})"
        )
    host = str(parts.get("host") or "")
    if not host or host.startswith("/") or "," in host:
        raise ValueError(f"needs one TCP host name or address (JDBC has no Unix sockets), got {host or 'none'}")
    if "dbname" not in parts:
        raise ValueError("names no database (dbname)")
    query = "&".join(f"{key}={quote(str(parts[key]), safe='/')}" for key in _PASSED_ON if key in parts)
    address = f"[{host}]" if ":" in host else host
    return f"jdbc:postgresql://{address}:{parts.get('port') or 5432}/{quote(str(parts['dbname']))}" + (
        f"?{query}" if query else ""
    )
