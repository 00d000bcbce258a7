"""DDL capture: event triggers that put every DDL of a published table in the stream
(``docs/architecture.md``, "DDL in the stream").

One installation per slot: a function ``public.cdc_assets_ddl_<slot>()`` run by two event
triggers, on ``table_rewrite`` (it notes the table and the reason in a transaction-local setting)
and on ``ddl_command_end``. At the end of each command, for every table the command touched (the
tables it names, their inheritance children and partitions, and the tables it rewrote) that the
slot's publication publishes, the function writes a transactional logical decoding message
(prefix :data:`DDL_PREFIX`) with the table's columns and key as the catalog holds them after the
command, and the rewrite, if any. The message commits with the DDL, at its place among the
transaction's changes. Creating an event trigger needs a superuser (RDS: ``rds_superuser``); a
role without it gets a warning and setup goes on without capture.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg import errors, sql

from cdc_assets.config import SourceConfig
from cdc_assets.source.connection import PINNED_SETTINGS

DDL_PREFIX = "cdc_assets.ddl"
DDL_FORMAT = 1
MAX_NAME = 63  # NAMEDATALEN - 1
FUNCTION_SCHEMA = "public"

Outcome = Literal["installed", "present", "removed", "absent", "refused"]


@dataclass(slots=True, frozen=True)
class CaptureNames:
    """The installation's objects: the function (in :data:`FUNCTION_SCHEMA`), its two event
    triggers, and the transaction-local setting that carries rewrites to the end of the command."""

    function: str
    command_end_trigger: str
    rewrite_trigger: str
    rewrites_setting: str

    @classmethod
    def of(cls, slot: str) -> CaptureNames:
        return cls(
            _name("cdc_assets_ddl", slot),
            _name("cdc_assets_ddl", slot),
            _name("cdc_assets_rewrite", slot),
            f"cdc_assets.rewrites_{slot}",
        )

    @property
    def qualified_function(self) -> sql.Composed:
        return sql.SQL("{}.{}").format(sql.Identifier(FUNCTION_SCHEMA), sql.Identifier(self.function))


@dataclass(slots=True, frozen=True)
class DdlCapture:
    """What setup did with DDL capture; ``warning`` when it could not do what the config asks."""

    outcome: Outcome
    warning: str | None = None

    def line(self) -> str | None:
        """One line for the command's output (None: nothing changed)."""
        if self.warning is not None:
            return f"WARNING: {self.warning}"
        if self.outcome == "installed":
            return "installed DDL capture (event triggers on ddl_command_end and table_rewrite)"
        if self.outcome == "removed":
            return "removed DDL capture (source.ddl_capture is false)"
        return None


def apply_ddl_capture(conn: psycopg.Connection[Any], source: SourceConfig) -> DdlCapture:
    """Install DDL capture for ``source`` (``ddl_capture: true``) unless it is installed as this
    version writes it, or remove it (``false``). A role that may not do so gets a warning naming
    what to grant, never an error: setup goes on."""
    names = CaptureNames.of(source.slot)
    body = function_body(conn, source)
    if source.ddl_capture:
        if _installed_body(conn, names) == body:
            return DdlCapture("present")
        return _privileged(conn, names, "install", lambda: _install(conn, names, body), "installed")
    if not _any_object(conn, names):
        return DdlCapture("absent")
    return _privileged(conn, names, "remove", lambda: _remove(conn, names), "removed")


def function_body(conn: psycopg.Connection[Any], source: SourceConfig) -> str:
    """The PL/pgSQL body of the slot's capture function (its slot and publication written in)."""

    def literal(value: object) -> str:
        return sql.Literal(value).as_string(conn)

    names = CaptureNames.of(source.slot)
    return _BODY.format(
        format=DDL_FORMAT,
        slot=literal(source.slot),
        publication=literal(source.publication),
        prefix=literal(DDL_PREFIX),
        setting=literal(names.rewrites_setting),
    )


def _privileged(
    conn: psycopg.Connection[Any], names: CaptureNames, verb: str, change: Callable[[], None], outcome: Outcome
) -> DdlCapture:
    """Run ``change`` in a transaction; a role without the privilege gets a warning instead."""
    try:
        with conn.transaction():
            change()
    except errors.InsufficientPrivilege as error:
        return DdlCapture("refused", _refusal(conn, names, verb, error))
    return DdlCapture(outcome)


def _install(conn: psycopg.Connection[Any], names: CaptureNames, body: str) -> None:
    settings = sql.SQL(" ").join(
        sql.SQL("SET {} = {}").format(sql.Identifier(k), sql.Literal(v))
        for k, v in PINNED_SETTINGS.items()
        if k != "client_encoding"  # not settable in a function; the text is UTF-8 in any database cdc-assets reads
    )
    conn.execute(
        sql.SQL(
            "CREATE OR REPLACE FUNCTION {}() RETURNS event_trigger LANGUAGE plpgsql"
            " SET search_path = pg_catalog, pg_temp {} AS {}"
        ).format(names.qualified_function, settings, sql.Literal(body))
    )
    for trigger, event in ((names.command_end_trigger, "ddl_command_end"), (names.rewrite_trigger, "table_rewrite")):
        conn.execute(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(sql.Identifier(trigger)))
        conn.execute(
            sql.SQL("CREATE EVENT TRIGGER {} ON {} EXECUTE FUNCTION {}()").format(
                sql.Identifier(trigger), sql.SQL(event), names.qualified_function
            )
        )


def _remove(conn: psycopg.Connection[Any], names: CaptureNames) -> None:
    for trigger in (names.command_end_trigger, names.rewrite_trigger):
        conn.execute(sql.SQL("DROP EVENT TRIGGER IF EXISTS {}").format(sql.Identifier(trigger)))
    conn.execute(sql.SQL("DROP FUNCTION IF EXISTS {}()").format(names.qualified_function))


def _installed_body(conn: psycopg.Connection[Any], names: CaptureNames) -> str | None:
    """The capture function's body when it and both its triggers exist (None otherwise)."""
    row = conn.execute(
        "SELECT p.prosrc FROM pg_proc p WHERE p.oid = to_regprocedure(%s)"
        " AND (SELECT count(*) FROM pg_event_trigger e WHERE e.evtfoid = p.oid AND (e.evtname, e.evtevent)"
        "      IN ((%s, 'ddl_command_end'), (%s, 'table_rewrite'))) = 2",
        (_signature(conn, names), names.command_end_trigger, names.rewrite_trigger),
    ).fetchone()
    return None if row is None else str(row[0])


def _any_object(conn: psycopg.Connection[Any], names: CaptureNames) -> bool:
    """Whether the capture function or one of its triggers exists."""
    row = conn.execute(
        "SELECT to_regprocedure(%s) IS NOT NULL OR EXISTS (SELECT FROM pg_event_trigger WHERE evtname IN (%s, %s))",
        (_signature(conn, names), names.command_end_trigger, names.rewrite_trigger),
    ).fetchone()
    return bool(row and row[0])


def _signature(conn: psycopg.Connection[Any], names: CaptureNames) -> str:
    return f"{names.qualified_function.as_string(conn)}()"


def _refusal(conn: psycopg.Connection[Any], names: CaptureNames, verb: str, error: psycopg.Error) -> str:
    role = conn.info.parameter_status("session_authorization") or "the source role"
    if verb == "remove":
        return (
            f"cannot remove DDL capture ({error.diag.message_primary}): its owner or a superuser can run DROP EVENT"
            f" TRIGGER {names.command_end_trigger}; DROP EVENT TRIGGER {names.rewrite_trigger}; DROP FUNCTION"
            f" {FUNCTION_SCHEMA}.{names.function}()"
        )
    return (
        f"DDL capture not installed: {error.diag.message_primary}. Role {role} may not create event triggers:"
        " that takes a superuser on self-hosted PostgreSQL, a member of rds_superuser on Amazon RDS and Aurora"
        " (other managed services: their documentation). Run `cdc-assets setup` once as such a role, or set"
        " source.ddl_capture: false. Without it, schema changes reach the change log only as the column lists"
        ' of the next changes (docs/architecture.md, "DDL in the stream")'
    )


def _name(stem: str, slot: str) -> str:
    """``<stem>_<slot>``, or, past PostgreSQL's 63 bytes, a prefix of it and a hash of the slot."""
    name = f"{stem}_{slot}"
    if len(name) <= MAX_NAME:
        return name
    digest = hashlib.sha256(slot.encode()).hexdigest()[:8]
    return f"{name[: MAX_NAME - 9]}_{digest}"


_BODY = """
-- cdc-assets DDL capture, message format {format} (cdc_assets/source/ddl_capture.py)
DECLARE
  pending text := coalesce(current_setting({setting}, true), '');
  r record;
BEGIN
  IF current_setting('wal_level') <> 'logical' THEN
    RETURN;
  END IF;
  IF TG_EVENT = 'table_rewrite' THEN
    PERFORM set_config({setting}, pending || pg_event_trigger_table_rewrite_oid()::int8 || ':'
      || pg_event_trigger_table_rewrite_reason() || ',', true);
    RETURN;
  END IF;
  FOR r IN
    WITH RECURSIVE rewrites AS (
      SELECT split_part(x, ':', 1)::oid AS oid, bit_or(split_part(x, ':', 2)::int) AS reason
      FROM unnest(string_to_array(pending, ',')) x WHERE x <> '' GROUP BY 1
    ), touched(oid) AS (
      SELECT objid FROM pg_event_trigger_ddl_commands() WHERE classid = 'pg_class'::regclass
      UNION SELECT oid FROM rewrites
      UNION SELECT i.inhrelid FROM pg_inherits i JOIN touched t ON i.inhparent = t.oid
    )
    SELECT c.oid, n.nspname, c.relname, c.relreplident, w.reason
    FROM (SELECT DISTINCT oid FROM touched) t
    JOIN pg_class c ON c.oid = t.oid
    JOIN pg_namespace n ON n.oid = c.relnamespace
    LEFT JOIN rewrites w ON w.oid = c.oid
    WHERE EXISTS (SELECT FROM pg_publication_tables p
                  WHERE p.pubname = {publication} AND p.schemaname = n.nspname AND p.tablename = c.relname)
    ORDER BY c.oid
  LOOP
    PERFORM pg_logical_emit_message(true, {prefix}, jsonb_build_object(
      'format', {format}, 'slot', {slot}, 'publication', {publication}, 'command_tag', TG_TAG,
      'relation_oid', r.oid::int8, 'schema', r.nspname, 'table', r.relname,
      'published', (SELECT jsonb_agg(x.name ORDER BY a.attnum)
        FROM pg_publication_tables p, jsonb_array_elements_text(to_jsonb(p) -> 'attnames') x(name)
        JOIN pg_attribute a ON a.attrelid = r.oid AND a.attname = x.name
        WHERE p.pubname = {publication} AND p.schemaname = r.nspname AND p.tablename = r.relname
          AND (a.attgenerated = '' OR current_setting('server_version_num')::int >= 180000)),
      'replica_identity', r.relreplident, 'rewrite_reason', r.reason,
      'key', coalesce(CASE r.relreplident
        WHEN 'd' THEN (SELECT to_jsonb(i.indkey::int2[]) FROM pg_index i WHERE i.indrelid = r.oid AND i.indisprimary)
        WHEN 'i' THEN (SELECT to_jsonb(i.indkey::int2[]) FROM pg_index i WHERE i.indrelid = r.oid AND i.indisreplident)
        WHEN 'f' THEN (SELECT jsonb_agg(a.attnum ORDER BY a.attnum) FROM pg_attribute a
                       WHERE a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped)
        END, '[]'::jsonb),
      'columns', coalesce((SELECT jsonb_agg(jsonb_build_object(
          'attnum', a.attnum, 'name', a.attname, 'type_oid', a.atttypid::int8, 'typmod', a.atttypmod,
          'ndims', a.attndims, 'not_null', a.attnotnull, 'generated', a.attgenerated,
          'has_missing', a.atthasmissing, 'missing', CASE WHEN a.atthasmissing THEN a.attmissingval::text END)
          ORDER BY a.attnum)
        FROM pg_attribute a WHERE a.attrelid = r.oid AND a.attnum > 0 AND NOT a.attisdropped), '[]'::jsonb)
    )::text);
  END LOOP;
  PERFORM set_config({setting}, '', true);
END
"""
