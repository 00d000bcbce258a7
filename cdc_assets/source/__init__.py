"""Everything that talks to the source database (psycopg 3): connections, checks, publication,
slot state and creation, what a slot holds back (held WAL, the transaction that pins it), the
exported-snapshot copy, catalog look-ups, heartbeat, DDL capture and the drain lock. The slot's stream is
:mod:`cdc_assets.stream`'s."""

from cdc_assets.source.catalog import column_ndims, describe_table, load_type_catalog
from cdc_assets.source.checks import (
    ServerSettings,
    check_source,
    read_server_settings,
    require_replication_role,
    require_server_settings,
    require_tables,
)
from cdc_assets.source.connection import (
    PINNED_SETTINGS,
    apply_pinned_settings,
    connect,
    server_major,
)
from cdc_assets.source.ddl_capture import DDL_PREFIX, DdlCapture, apply_ddl_capture
from cdc_assets.source.heartbeat import HEARTBEAT_PREFIX, emit_heartbeat
from cdc_assets.source.lock import DrainLock, TableCopyLock, drain_lock_key
from cdc_assets.source.publication import (
    ensure_publication,
    prune_publication,
    publication_exists,
    published_tables,
)
from cdc_assets.source.slot_holders import HELD_WAL_WARN_BYTES, HeldWal, PinningTransaction, read_held_wal
from cdc_assets.source.slots import SlotState, drop_slot, ensure_failover, read_slot, require_usable_slot
from cdc_assets.source.snapshot import (
    ExportedSnapshot,
    SnapshotReader,
    copy_again_when_rewritten,
    create_slot_command,
    create_slot_with_snapshot,
)

__all__ = [
    "DDL_PREFIX",
    "HEARTBEAT_PREFIX",
    "HELD_WAL_WARN_BYTES",
    "PINNED_SETTINGS",
    "DdlCapture",
    "DrainLock",
    "ExportedSnapshot",
    "HeldWal",
    "PinningTransaction",
    "ServerSettings",
    "SlotState",
    "SnapshotReader",
    "TableCopyLock",
    "apply_ddl_capture",
    "apply_pinned_settings",
    "check_source",
    "column_ndims",
    "connect",
    "copy_again_when_rewritten",
    "create_slot_command",
    "create_slot_with_snapshot",
    "describe_table",
    "drain_lock_key",
    "drop_slot",
    "emit_heartbeat",
    "ensure_failover",
    "ensure_publication",
    "load_type_catalog",
    "prune_publication",
    "publication_exists",
    "published_tables",
    "read_held_wal",
    "read_server_settings",
    "read_slot",
    "require_replication_role",
    "require_server_settings",
    "require_tables",
    "require_usable_slot",
    "server_major",
]
