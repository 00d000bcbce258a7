"""The configuration's model: one frozen dataclass per section of the YAML file, each setting's
default written once, here. A field made with :func:`setting` also says how the loader reads and
checks it (``kind``: a method of the loader's ``SectionReader``, with its options); the loader
builds a section from its class, so a default is never repeated there.
"""

from __future__ import annotations

import os
import re
from dataclasses import MISSING, Field, dataclass, field
from pathlib import Path
from typing import Any, Literal

from cdc_assets.errors import ConfigError
from cdc_assets.names import TableName
from cdc_assets.storage import StorageConfig

Streaming = Literal["off", "on", "parallel"]
Truncate = Literal["apply", "ignore"]
MergeSensors = Literal["auto", "per_table", "shared"]
SmallTableWriter = Literal["delta-rs", "spark"]


def setting(default: Any = MISSING, kind: str = "text", *, factory: Any = MISSING, **options: Any) -> Any:
    """A field of a section: its ``default`` (or ``factory``; neither: required) and how the
    loader reads it — ``kind`` names a ``SectionReader`` method, ``options`` its keyword arguments."""
    metadata = {"kind": kind, "options": options}
    if factory is not MISSING:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def default(section: type[Any], name: str) -> Any:
    """The default of setting ``name`` of ``section`` (``...``: required)."""
    return default_of(section.__dataclass_fields__[name])


def default_of(model_field: Field[Any]) -> Any:
    """A field's default (``...``: required)."""
    if model_field.default is not MISSING:
        return model_field.default
    if model_field.default_factory is not MISSING:
        return model_field.default_factory()
    return ...


@dataclass(slots=True, frozen=True)
class SourceConfig:
    """Where changes come from (``source``). ``dsn`` is a libpq connection string or URI;
    ``snapshot_workers`` connections copy the initial snapshot (default: the machine's cores);
    ``failover``: the slot is a failover slot (PostgreSQL 17+), synced to standbys; ``standby_dsn``:
    a standby whose synced copy of the slot ``status`` reports; ``ddl_capture``: ``setup`` installs
    the event triggers that put each DDL of a published table in the stream (off: removes them)."""

    dsn: str = field(repr=False, metadata={"kind": "text", "options": {}})
    publication: str = setting("cdc_pub")
    slot: str = setting("cdc_slot", "slot_name")
    streaming: Streaming = setting("off", "choice", choices=("off", "on", "parallel"))
    binary: bool = setting(False, "flag")
    two_phase: bool = setting(False, "flag")
    batch_changes: int = setting(1_000_000, "positive")
    heartbeat: bool = setting(False, "flag")
    snapshot_workers: int = setting(kind="positive", factory=lambda: os.cpu_count() or 1)
    failover: bool = setting(False, "flag")
    ddl_capture: bool = setting(True, "flag")
    standby_dsn: str | None = field(default=None, repr=False, metadata={"kind": "optional_text", "options": {}})


@dataclass(slots=True, frozen=True)
class TableConfig:
    """One mirrored table. ``target`` overrides the Delta path ``<warehouse>/<schema>/<table>``."""

    name: TableName
    row_filter: str | None = None
    truncate: Truncate = "apply"
    target: str | None = None


PARALLEL_MERGES = 4
"""Tables one apply merges at once: a small table's MERGE mostly waits on Spark's per-job
latency, not on the cores, so a few overlap well even on two cores."""


@dataclass(slots=True, frozen=True)
class SparkConfig:
    """``master`` for a classic session (``local[2]``, ``spark://…``), or ``remote`` for Spark Connect;
    ``parallel_merges``: tables merged at once by one apply or following drain, each on its own
    session of the one application; ``storage``: the ``storage`` section when a Delta table is on S3 (Spark reaches
    it through s3a); ``metastore_dsn``: the PostgreSQL database of the applications' Hive metastore
    (None: Spark's catalog is its own affair — in memory, or what ``conf`` says)."""

    master: str | None = "local[2]"
    remote: str | None = None
    conf: dict[str, str] = field(default_factory=dict)
    metastore_dsn: str | None = field(default=None, repr=False)
    parallel_merges: int = setting(PARALLEL_MERGES, "positive")
    storage: StorageConfig | None = field(default=None, repr=False)


@dataclass(slots=True, frozen=True)
class ScheduleConfig:
    """Dagster automation (``schedule``): when the drain runs and how much lag the asset check tolerates.

    ``drain_lag_bytes``: besides the cron, a sensor requests a drain whenever the slot is at least
    this many WAL bytes behind (None: the cron alone), looking every ``drain_check_seconds``;
    the merge sensors look every ``merge_check_seconds``: one per table (``merge_sensors:
    per_table``), one for every table (``shared``), or ``auto`` — one per table up to a number of
    tables (``dagster_project.merge_sensor.PER_TABLE_SENSORS_MAX``). ``merge_with_drain``: each drain
    run also merges every table the drain brought changes to (one run per cycle, not one per
    table; a following drain merges after each durable batch, as it goes). A mirror whose last
    materialization is ``freshness_minutes`` old fails its freshness policy (warns at half).
    ``run_max_concurrent``: the steps one Dagster run executes at once (a run over several tables,
    launched from the UI, merges that many tables side by side), each in a process of its own that
    starts its own Spark unless ``spark.remote`` is set — not ``spark.parallel_merges``, which
    counts sessions of one Spark application. The read-only ``parity`` check waits up to
    ``parity_wait_seconds`` for the drain and the table's merge to pass its snapshot point."""

    drain_cron: str = setting("*/5 * * * *", "cron")
    max_lag_bytes: int = setting(1 << 30, "positive")
    drain_lag_bytes: int | None = setting(None, "positive")
    drain_check_seconds: int = setting(30, "positive")
    merge_check_seconds: int = setting(30, "positive")
    merge_sensors: MergeSensors = setting("auto", "choice", choices=("auto", "per_table", "shared"))
    merge_with_drain: bool = setting(False, "flag")
    freshness_minutes: int = setting(30, "positive")
    run_max_concurrent: int = setting(2, "positive")
    parity_wait_seconds: int = setting(300, "positive")


@dataclass(slots=True, frozen=True)
class DrainConfig:
    """How a drain reads the stream (``drain``).

    ``follow_seconds``: how long one drain follows the slot's stream once it has caught up (0: it
    stops as soon as it has caught up); ``commit_seconds``: how often a following drain makes what
    it received durable (segments, checkpoint, then the slot's confirmed position), and so how
    soon the change log's readers see a change; ``standby_wait_seconds``: how long a drain lets the
    server hold the slot's changes back for the standbys of ``synchronized_standby_slots`` before it
    stops with an error that says so."""

    follow_seconds: float = setting(0.0, "number", what="a number of seconds")
    commit_seconds: float = setting(2.0, "number", what="a number of seconds", above_zero=True)
    standby_wait_seconds: float = setting(60.0, "number", what="a number of seconds", above_zero=True)


DELTA_MIN_RETENTION_HOURS = 168
"""Delta's VACUUM safety check: a retention below the table's ``delta.deletedFileRetentionDuration``
(one week unless a table property changes it) can delete files a running reader or writer still
needs."""


@dataclass(slots=True, frozen=True)
class MaintenanceConfig:
    """Delta table maintenance (``warehouse.maintenance``): when it runs and what it does.

    ``compact_min_files``: OPTIMIZE when the table has at least this many data files (0: never);
    ``zorder``: order compacted files by the first key column; ``purge_min_deletion_vectors``:
    ``REORG … APPLY (PURGE)`` when at least this many files carry deletion vectors (0: never);
    ``vacuum_retention_hours``: VACUUM's retention (0: no VACUUM), never below Delta's check;
    ``follow_compact_files``: a following drain that merges compacts a table (OPTIMIZE) right after
    the merge that leaves it with at least this many data files (0: never) — a table merged every
    few seconds gains hundreds of files an hour, and its MERGEs slow down with them."""

    cron: str = setting("0 * * * *", "cron")
    compact_min_files: int = setting(8, "count")
    zorder: bool = setting(False, "flag")
    purge_min_deletion_vectors: int = setting(8, "count")
    vacuum_retention_hours: int = setting(DELTA_MIN_RETENTION_HOURS, "vacuum_hours")
    follow_compact_files: int = setting(32, "count")


@dataclass(slots=True, frozen=True)
class WarehouseConfig:
    """The Delta tables (``warehouse``): ``path`` the folder or URI they live under
    (``<path>/<schema>/<table>`` unless a table names its ``target``), ``table_properties`` for
    the tables cdc-assets creates, ``storage_options`` for delta-rs beside the ``storage``
    section's, and their ``maintenance``. ``consistent_points``: publish a consistent point
    whenever every table holds one source position (the Dagster sensor and asset, and a
    following drain's merges; ``apply --consistent`` publishes whatever this says).
    ``catalog``: the Spark catalog each mirror is registered in by name, ``<catalog>.<schema>.<table>``
    (None: reached by path only). ``small_table_mb``: a MERGE into a table whose data files add up
    to less than this rewrites the files it changes instead of writing deletion vectors, and a
    small batch into it runs without generated code (0: never; docs/architecture.md, "Small
    tables"). ``small_table_writer``: who commits a small table's plain batch — ``delta-rs`` in
    the apply's own process (no Spark job), or ``spark`` (its MERGE with the settings above)."""

    path: str
    table_properties: dict[str, str] = field(default_factory=dict)
    storage_options: dict[str, str] = field(default_factory=dict, repr=False)
    maintenance: MaintenanceConfig = field(default_factory=MaintenanceConfig)
    consistent_points: bool = setting(True, "flag")
    catalog: str | None = setting(None, "identifier")
    small_table_mb: float = setting(4.0, "number")
    small_table_writer: SmallTableWriter = setting("delta-rs", "choice", choices=("delta-rs", "spark"))


@dataclass(slots=True, frozen=True)
class ChangelogConfig:
    """The change log (``changelog``): ``path`` its folder or URI, and its retention.

    ``retention_hours``: how long the change log keeps a table's segments after every reader has
    applied them (docs/architecture.md, "Change-log retention"); retention rewrites a table's
    compacted base (the whole table) only once the segments it would fold hold ``fold_min_share``
    of the current copy's bytes (0: whenever it folds) or number ``fold_max_segments``, the bound on
    a table's segments kept past the retention; it is due once ``retention_every_minutes`` have
    passed since it last ran (0: whenever a command or a drain run ends)."""

    path: str
    retention_hours: float = setting(168.0, "number", what="a number of hours")
    retention_every_minutes: float = setting(60.0, "number", what="a number of minutes")
    fold_min_share: float = setting(0.25, "number")
    fold_max_segments: int = setting(200, "positive")


@dataclass(slots=True, frozen=True)
class Config:
    source: SourceConfig
    changelog: ChangelogConfig
    warehouse: WarehouseConfig
    tables: tuple[TableConfig, ...]
    spark: SparkConfig = field(default_factory=SparkConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    drain: DrainConfig = field(default_factory=DrainConfig)
    path: Path | None = None

    def table(self, name: str | TableName) -> TableConfig:
        wanted = name if isinstance(name, TableName) else TableName.parse(name)
        for table in self.tables:
            if table.name == wanted:
                return table
        known = ", ".join(str(t.name) for t in self.tables)
        raise ConfigError(f"table {wanted} is not configured (configured: {known})")

    @property
    def delta_storage_options(self) -> dict[str, str]:
        """delta-rs ``storage_options``: the ``storage`` section's, then ``warehouse.storage_options``."""
        return self.storage.delta_rs_options() | self.warehouse.storage_options

    def target_path(self, table: TableConfig) -> str:
        """The Delta table's location."""
        if table.target is not None:
            return table.target
        return join_location(self.warehouse.path, table.name.schema, table.name.name)


_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")


def is_uri(location: str) -> bool:
    """Whether ``location`` is an object-store URI (``s3://…``) rather than a local path."""
    return _URI.match(location) is not None


def join_location(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts]) if is_uri(root) else str(Path(root, *parts))
