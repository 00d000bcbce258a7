"""Catalog look-ups: a table as pgoutput would describe it now, array dimensions, user types."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import psycopg

from cdc_assets.errors import PublicationMismatchError, TableMissingError
from cdc_assets.names import TableName
from cdc_assets.pgoutput.messages import RelationMessage
from cdc_assets.pgoutput.schema import ColumnSchema, RelationSchema
from cdc_assets.pgoutput.types import FIRST_GENBKI_OID, PgTypeInfo, TypeCatalog
from cdc_assets.source.connection import server_major
from cdc_assets.source.failures import publication_missing_error
from cdc_assets.source.publication import publication_exists

# pg_attribute.attndims is 0 for arrays declared without dimensions (CREATE TABLE AS, domains);
# a domain's typndims holds its declared dimensions, and domains over arrays (at any depth) keep
# the array category. int2vector and oidvector are category 'A' too, but not array_in arrays.
_NDIMS = (
    "CASE WHEN a.attndims > 0 THEN a.attndims WHEN t.typndims > 0 THEN t.typndims"
    " WHEN t.typinput = 'array_in'::regproc OR (t.typtype = 'd' AND t.typcategory = 'A') THEN 1 ELSE 0 END"
)

# Key flags as pgoutput sets them: every column under FULL, else the columns of the identity
# index, which relcache accepts only if live, valid, unique, immediate and not partial.
_COLUMNS = f"""
WITH identity_key AS (
    SELECT unnest(i.indkey::int2[]) AS attnum FROM pg_index i
    WHERE i.indrelid = %(oid)s AND i.indislive AND i.indisvalid AND i.indisunique AND i.indimmediate
      AND i.indpred IS NULL
      AND CASE %(ident)s WHEN 'd' THEN i.indisprimary WHEN 'i' THEN i.indisreplident ELSE false END
)
SELECT a.attname::text, a.atttypid::int8, a.atttypmod, a.attgenerated <> '', {_NDIMS},
       %(ident)s = 'f' OR a.attnum IN (SELECT attnum FROM identity_key), a.attnum::int
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = %(oid)s AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY a.attnum
"""

_TYPES = """
WITH RECURSIVE wanted(oid) AS (
    SELECT unnest(%s::int8[]::oid[])
  UNION
    SELECT d.oid FROM wanted w JOIN pg_type t ON t.oid = w.oid
    CROSS JOIN LATERAL (VALUES (t.typbasetype), (t.typelem)) AS d(oid)
    WHERE d.oid <> 0
)
SELECT t.oid::int8, n.nspname::text, t.typname::text, t.typtype::text, t.typbasetype::int8, t.typtypmod,
       CASE WHEN t.typlen = -1 AND t.typsubscript = 'array_subscript_handler'::regproc
            THEN t.typelem ELSE 0 END::int8
FROM wanted w JOIN pg_type t ON t.oid = w.oid JOIN pg_namespace n ON n.oid = t.typnamespace
WHERE t.oid >= %s
ORDER BY t.oid
"""


def describe_table(conn: psycopg.Connection[Any], table: TableName, publication: str) -> RelationSchema:
    """What pgoutput's Relation message for ``table`` would say now under ``publication``.

    Published columns: live ones in attnum order, within the publication's column list
    (``pg_publication_tables.attnames``, PostgreSQL 15+); generated columns only on 18+, where
    ``attnames`` already reflects ``publish_generated_columns`` and generated columns named in a
    column list (15 lists generated columns in ``attnames`` but never publishes them).
    """
    row = conn.execute(
        "SELECT c.oid::int8, n.nspname::text, c.relname::text, c.relreplident::text"
        " FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace WHERE c.oid = to_regclass(%s)",
        (table.sql,),
    ).fetchone()
    if row is None:
        raise TableMissingError(
            f"table {table} does not exist in database {conn.info.dbname}: create it, or remove it from "
            "`tables` in the configuration"
        )
    oid, namespace, name, ident = row
    published = conn.execute(
        "SELECT to_jsonb(p) -> 'attnames' FROM pg_publication_tables p"
        " WHERE p.pubname = %s AND p.schemaname = %s AND p.tablename = %s",
        (publication, namespace, name),
    ).fetchone()
    if published is None:
        if not publication_exists(conn, publication):
            raise publication_missing_error(publication)
        raise PublicationMismatchError(
            f"table {table} is not in publication {publication}: add it with ALTER PUBLICATION ... ADD TABLE, "
            "or remove it from `tables` in the configuration"
        )
    attnames: list[str] | None = published[0]
    generated_published = server_major(conn) >= 18
    columns = tuple(
        ColumnSchema(attname, type_oid, typmod, key, ndims, attnum)
        for attname, type_oid, typmod, generated, ndims, key, attnum in conn.execute(
            _COLUMNS, {"oid": oid, "ident": ident}
        ).fetchall()
        if (attnames is None or attname in attnames) and (not generated or generated_published)
    )
    return RelationSchema(oid, namespace, name, ident, columns)


def column_ndims(conn: psycopg.Connection[Any], relation_oid: int) -> dict[str, int]:
    """Array dimensions of every live column of a relation (0 for non-arrays)."""
    rows = conn.execute(
        f"SELECT a.attname::text, {_NDIMS} FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid"
        " WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped",
        (relation_oid,),
    ).fetchall()
    return dict(rows)


def load_type_catalog(conn: psycopg.Connection[Any], oids: Iterable[int]) -> list[PgTypeInfo]:
    """``pg_type`` entries of the user types among ``oids`` and of the types they are built on
    (domain bases, array elements, recursively); built-in types are left out."""
    rows = conn.execute(_TYPES, (sorted(set(oids)), FIRST_GENBKI_OID)).fetchall()
    return [PgTypeInfo(*row) for row in rows]


def relation_describer(
    conn: psycopg.Connection[Any], catalog: TypeCatalog, known: dict[str, RelationSchema]
) -> Callable[[RelationMessage], RelationSchema]:
    """Relation messages → schemas with array dimensions, loading user types into ``catalog``.

    pgoutput does not send array dimensions, and the catalog only knows today's columns: a column
    dropped since the change was made has none there. So a column the relation's last known schema
    version (``known``: the checkpoint's, then each one described here) has with the same name, type
    and typmod keeps its dimensions; only new or changed columns are looked up in the catalog.
    Look-ups are cached: the server re-sends every Relation message in every call.
    """
    cache: dict[tuple[object, ...], RelationSchema] = {}

    def describe(message: RelationMessage) -> RelationSchema:
        key = (
            message.relation_oid,
            message.namespace,
            message.relation_name,
            message.replica_identity,
            tuple((c.flags, c.name, c.type_oid, c.type_modifier) for c in message.columns),
        )
        missing = catalog.unresolved(c.type_oid for c in message.columns if c.type_oid >= FIRST_GENBKI_OID)
        if missing:  # looked at for every message: a column's type always comes from pg_type
            for info in load_type_catalog(conn, missing):
                catalog.add(info)
        schema = cache.get(key)
        if schema is None:
            ndims = column_ndims(conn, message.relation_oid)
            schema = RelationSchema.from_message(message, ndims)
            previous = known.get(schema.qualified_name)
            if previous is not None and previous.relation_oid == schema.relation_oid:
                before = {(c.name, c.type_oid, c.type_modifier): c.ndims for c in previous.columns}
                for c in schema.columns:
                    ndims[c.name] = before.get((c.name, c.type_oid, c.type_modifier), ndims.get(c.name, 0))
                schema = RelationSchema.from_message(message, ndims)
            cache[key] = known[schema.qualified_name] = schema
        return schema

    return describe
