"""The YAML configuration file: loading, ``${VAR}`` substitution and validation.

Every mistake is a :class:`~cdc_assets.errors.ConfigError` naming the file and the key
(``tables.public.orders.truncate: expected 'apply' or 'ignore', got 'drop'``). Relative paths are
resolved against the folder of the configuration file, so the command line and Dagster agree
whatever their working directory. The source DSN is never shown: not in ``repr``, not in errors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from cdc_assets.errors import ConfigError
from cdc_assets.names import TableName
from cdc_assets.storage import StorageConfig, is_s3

CONFIG_ENV = "CDC_CONFIG"
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
_SECRET_KEYS = frozenset({"dsn", "access_key_id", "secret_access_key", "session_token"})  # never echoed

Streaming = Literal["off", "on", "parallel"]
_Choice = TypeVar("_Choice", bound=str)


@dataclass(slots=True, frozen=True)
class SourceConfig:
    """Where changes come from. ``dsn`` is a libpq connection string or URI; ``snapshot_workers``
    connections copy the initial snapshot (default: the machine's cores)."""

    dsn: str = field(repr=False)
    publication: str = "cdc_pub"
    slot: str = "cdc_slot"
    streaming: Streaming = "off"
    binary: bool = False
    two_phase: bool = False
    batch_changes: int = 1_000_000
    heartbeat: bool = False
    snapshot_workers: int = field(default_factory=lambda: os.cpu_count() or 1)


@dataclass(slots=True, frozen=True)
class TableConfig:
    """One mirrored table. ``target`` overrides the Delta path ``<warehouse>/<schema>/<table>``."""

    name: TableName
    row_filter: str | None = None
    truncate: Literal["apply", "ignore"] = "apply"
    target: str | None = None


PARALLEL_MERGES = 4
"""Tables one apply merges at once: a small table's MERGE mostly waits on Spark's per-job
latency, not on the cores, so a few overlap well even on two cores."""


@dataclass(slots=True, frozen=True)
class SparkConfig:
    """``master`` for a classic session (``local[2]``, ``spark://…``), or ``remote`` for Spark Connect;
    ``parallel_merges``: tables merged at once by one apply, each on its own session of the one
    application; ``storage``: the ``storage`` section when a Delta table is on S3 (Spark reaches
    it through s3a)."""

    master: str | None = "local[2]"
    remote: str | None = None
    conf: dict[str, str] = field(default_factory=dict)
    parallel_merges: int = PARALLEL_MERGES
    storage: StorageConfig | None = field(default=None, repr=False)


@dataclass(slots=True, frozen=True)
class ScheduleConfig:
    """Dagster automation: when the drain runs and how much lag the asset check tolerates.

    ``drain_lag_bytes``: besides the cron, a sensor requests a drain whenever the slot is at least
    this many WAL bytes behind (None: the cron alone), looking every ``drain_check_seconds``;
    each table's merge sensor looks every ``merge_check_seconds``. ``merge_with_drain``: each drain
    run also merges every table the drain brought changes to (one run per cycle, not one per
    table; a following drain merges after each durable batch, as it goes). A mirror whose last materialization is ``freshness_minutes`` old fails its freshness
    policy (warns at half)."""

    drain_cron: str = "*/5 * * * *"
    max_lag_bytes: int = 1 << 30
    drain_lag_bytes: int | None = None
    drain_check_seconds: int = 30
    merge_check_seconds: int = 30
    merge_with_drain: bool = False
    freshness_minutes: int = 30


FOLLOW_SECONDS = 0.0
COMMIT_SECONDS = 2.0


@dataclass(slots=True, frozen=True)
class DrainConfig:
    """How a drain reads the stream (``drain``).

    ``follow_seconds``: how long one drain follows the slot's stream once it has caught up (0: it
    stops as soon as it has caught up); ``commit_seconds``: how often a following drain makes what
    it received durable (segments, checkpoint, then the slot's confirmed position), and so how
    soon the change log's readers see a change."""

    follow_seconds: float = FOLLOW_SECONDS
    commit_seconds: float = COMMIT_SECONDS


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
    ``vacuum_retention_hours``: VACUUM's retention (0: no VACUUM), never below Delta's check."""

    cron: str = "0 * * * *"
    compact_min_files: int = 8
    zorder: bool = False
    purge_min_deletion_vectors: int = 8
    vacuum_retention_hours: int = DELTA_MIN_RETENTION_HOURS


CHANGELOG_RETENTION_HOURS = 168
"""How long the change log keeps a table's segments after every reader has applied them
(``changelog.retention_hours``; docs/architecture.md, "Change-log retention")."""

FOLD_MIN_SHARE = 0.25
"""Retention rewrites a table's compacted base (the whole table) only once the segments it would
fold hold this share of the current copy's bytes (``changelog.fold_min_share``; 0: whenever it
folds) or number ``FOLD_MAX_SEGMENTS``."""
FOLD_MAX_SEGMENTS = 200
"""``changelog.fold_max_segments``: the bound on a table's segments kept past the retention."""


@dataclass(slots=True, frozen=True)
class Config:
    source: SourceConfig
    changelog_path: str
    warehouse_path: str
    tables: tuple[TableConfig, ...]
    spark: SparkConfig = field(default_factory=SparkConfig)
    warehouse_table_properties: dict[str, str] = field(default_factory=dict)
    warehouse_storage_options: dict[str, str] = field(default_factory=dict, repr=False)
    storage: StorageConfig = field(default_factory=StorageConfig)
    maintenance: MaintenanceConfig = field(default_factory=MaintenanceConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    drain: DrainConfig = field(default_factory=DrainConfig)
    changelog_retention_hours: float = CHANGELOG_RETENTION_HOURS
    changelog_fold_min_share: float = FOLD_MIN_SHARE
    changelog_fold_max_segments: int = FOLD_MAX_SEGMENTS
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
        return self.storage.delta_rs_options() | self.warehouse_storage_options

    def target_path(self, table: TableConfig) -> str:
        """The Delta table's location."""
        if table.target is not None:
            return table.target
        return _join(self.warehouse_path, table.name.schema, table.name.name)


def config_path(explicit: str | os.PathLike[str] | None = None) -> Path:
    """The configuration file to use: ``explicit``, else ``$CDC_CONFIG``, else ``./cdc.yaml``."""
    chosen = explicit or os.environ.get(CONFIG_ENV) or "cdc.yaml"
    return Path(chosen)


def load_config(path: str | os.PathLike[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    """Read, substitute and validate a configuration file."""
    file = config_path(path)
    try:
        text = file.read_text(encoding="utf-8")
    except FileNotFoundError:
        how = "" if path else f" (set {CONFIG_ENV} or pass -c/--config)"
        raise ConfigError(f"configuration file {file} does not exist{how}") from None
    except OSError as error:
        raise ConfigError(f"cannot read configuration file {file}: {error.strerror}") from None
    return parse_config(text, origin=file, environ=os.environ if environ is None else environ)


def parse_config(text: str, *, origin: Path, environ: Mapping[str, str]) -> Config:
    """Validate configuration ``text``; ``origin`` names it in errors and anchors relative paths."""
    where = str(origin)
    try:
        document = yaml.safe_load(_substitute(text, environ, where))
    except yaml.YAMLError as error:
        raise ConfigError(f"{where}: not valid YAML: {error}") from None
    reader = _Reader(where, document if document is not None else {}, "")
    base = origin.resolve().parent
    source = reader.section("source")
    changelog = reader.section("changelog")
    warehouse = reader.section("warehouse")
    warehouse_path = _location(warehouse.text("path"), base)
    storage = reader.storage()
    spark = reader.spark()
    tables = reader.tables(base)
    delta_on_s3 = is_s3(warehouse_path) or any(t.target is not None and is_s3(t.target) for t in tables)
    config = Config(
        source=SourceConfig(
            dsn=source.text("dsn"),
            publication=source.text("publication", "cdc_pub"),
            slot=source.slot_name("slot", "cdc_slot"),
            streaming=source.choice("streaming", ("off", "on", "parallel"), "off"),
            binary=source.flag("binary", False),
            two_phase=source.flag("two_phase", False),
            batch_changes=source.positive("batch_changes", 1_000_000),
            heartbeat=source.flag("heartbeat", False),
            snapshot_workers=source.positive("snapshot_workers", os.cpu_count() or 1),
        ),
        changelog_path=_location(changelog.text("path"), base),
        changelog_retention_hours=changelog.number("retention_hours", CHANGELOG_RETENTION_HOURS, "a number of hours"),
        changelog_fold_min_share=changelog.number("fold_min_share", FOLD_MIN_SHARE),
        changelog_fold_max_segments=changelog.positive("fold_max_segments", FOLD_MAX_SEGMENTS),
        warehouse_path=warehouse_path,
        warehouse_table_properties=warehouse.settings("table_properties"),
        warehouse_storage_options=warehouse.settings("storage_options"),
        maintenance=warehouse.maintenance(),
        tables=tables,
        spark=replace(spark, storage=storage) if delta_on_s3 else spark,
        schedule=reader.schedule(),
        drain=reader.drain(),
        storage=storage,
        path=origin,
    )
    for section in (source, changelog, warehouse, reader):
        section.done()
    return config


def _substitute(text: str, environ: Mapping[str, str], where: str) -> str:
    def replace(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(2)
        value = environ.get(name)
        if value is None:
            if default is not None:
                return default
            line = text.count("\n", 0, match.start()) + 1
            raise ConfigError(f"{where}, line {line}: environment variable {name} is not set")
        return value

    return _VARIABLE.sub(replace, text)


def _location(value: str, base: Path) -> str:
    """An object-store URI as is; a local path made absolute against the config's folder."""
    if _URI.match(value):
        return value.rstrip("/")
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


def _join(root: str, *parts: str) -> str:
    return "/".join([root.rstrip("/"), *parts]) if _URI.match(root) else str(Path(root, *parts))


class _Reader:
    """Typed access to one mapping of the document, with errors that name the key path."""

    def __init__(self, where: str, mapping: Any, prefix: str) -> None:
        if not isinstance(mapping, dict):
            raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the document'}: expected a mapping")
        self.where = where
        self.mapping = mapping
        self.prefix = prefix
        self.used: set[str] = set()

    def fail(self, key: str, problem: str) -> ConfigError:
        return ConfigError(f"{self.where}: {self.prefix}{key}: {problem}")

    def get(self, key: str, default: Any = ...) -> Any:
        self.used.add(key)
        if key in self.mapping and self.mapping[key] is not None:
            return self.mapping[key]
        if default is ...:
            raise self.fail(key, "is required")
        return default

    def section(self, key: str) -> _Reader:
        return _Reader(self.where, self.get(key), f"{self.prefix}{key}.")

    def text(self, key: str, default: Any = ...) -> str:
        value = self.get(key, default)
        if not isinstance(value, str) or not value.strip():
            shown = "a value that is not a string" if key in _SECRET_KEYS else repr(value)
            raise self.fail(key, f"expected a non-empty string, got {shown}")
        return value

    def slot_name(self, key: str, default: str) -> str:
        value = self.text(key, default)
        if not re.fullmatch(r"[a-z0-9_]{1,63}", value):
            raise self.fail(
                key, f"a replication slot name is 1-63 lower-case letters, digits or underscores, got {value!r}"
            )
        return value

    def flag(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {value!r}")
        return value

    def positive(self, key: str, default: int) -> int:
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise self.fail(key, f"expected a positive integer, got {value!r}")
        return value

    def cron(self, key: str, default: str) -> str:
        value = self.text(key, default)
        if len(value.split()) != 5:
            raise self.fail(
                key, f"expected a cron expression of five fields (minute hour day month weekday), got {value!r}"
            )
        return value

    def count(self, key: str, default: int) -> int:
        """A non-negative integer (0 turns a step off)."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(key, f"expected 0 (off) or a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: float, what: str = "a number") -> float:
        """A number ≥ 0, fractions allowed (``what`` names it in the error: "a number of hours")."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise self.fail(key, f"expected {what}, 0 or more, got {value!r}")
        return float(value)

    def settings(self, key: str) -> dict[str, str]:
        """An optional mapping of names to scalar values, as strings (booleans lower-case)."""
        value = self.get(key, {})
        if not isinstance(value, dict) or any(isinstance(v, (dict, list)) for v in value.values()):
            raise self.fail(key, "expected a mapping of names to values")
        return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}

    def choice(self, key: str, choices: tuple[_Choice, ...], default: _Choice) -> _Choice:
        value = self.get(key, default)
        if value is False and "off" in choices:  # YAML reads a bare `off` as false
            value = "off"
        if value is True and "on" in choices:
            value = "on"
        if value not in choices:
            expected = " or ".join(repr(c) for c in choices)
            raise self.fail(key, f"expected {expected}, got {value!r}")
        return choices[choices.index(value)]

    def tables(self, base: Path) -> tuple[TableConfig, ...]:
        raw = self.get("tables")
        if not isinstance(raw, dict) or not raw:
            raise self.fail("tables", "expected a mapping of schema.table names to settings, with at least one table")
        tables = []
        for key, settings in raw.items():
            try:
                name = TableName.parse(str(key))
            except ValueError as error:
                raise self.fail(f"tables.{key}", str(error)) from None
            table = _Reader(self.where, settings or {}, f"{self.prefix}tables.{key}.")
            row_filter = table.get("row_filter", None)
            if row_filter is not None and (not isinstance(row_filter, str) or not row_filter.strip()):
                raise table.fail("row_filter", f"expected an SQL boolean expression, got {row_filter!r}")
            target = table.get("target", None)
            tables.append(
                TableConfig(
                    name=name,
                    row_filter=row_filter,
                    truncate=table.choice("truncate", ("apply", "ignore"), "apply"),
                    target=_location(target, base) if isinstance(target, str) else None,
                )
            )
            table.done()
        if len({t.name for t in tables}) != len(tables):
            raise self.fail("tables", "a table is listed twice")
        return tuple(tables)

    def spark(self) -> SparkConfig:
        if self.get("spark", None) is None:
            return SparkConfig()
        spark = self.section("spark")
        remote = spark.get("remote", None)
        master = spark.get("master", None if remote else "local[2]")
        if remote is not None and master is not None:
            raise spark.fail("remote", "set either spark.master or spark.remote, not both")
        result = SparkConfig(
            master=str(master) if master is not None else None,
            remote=str(remote) if remote is not None else None,
            conf=spark.settings("conf"),
            parallel_merges=spark.positive("parallel_merges", PARALLEL_MERGES),
        )
        spark.done()
        return result

    def optional_text(self, key: str) -> str | None:
        """A string, or None when absent or empty (``${VAR:-}``)."""
        value = self.get(key, "")
        if not isinstance(value, str):
            shown = "a value that is not a string" if key in _SECRET_KEYS else repr(value)
            raise self.fail(key, f"expected a string, got {shown}")
        return value.strip() or None

    def storage(self) -> StorageConfig:
        if self.get("storage", None) is None:
            return StorageConfig()
        section = self.section("storage")
        endpoint = section.optional_text("endpoint")
        if endpoint is not None and not re.match(r"^https?://[^/\s]+/?$", endpoint):
            raise section.fail("endpoint", f"expected http(s)://host[:port], got {endpoint!r}")
        path_style = section.get("path_style", None)
        if path_style is not None and not isinstance(path_style, bool):
            raise section.fail("path_style", f"expected true or false, got {path_style!r}")
        key_id, secret = section.optional_text("access_key_id"), section.optional_text("secret_access_key")
        if (key_id is None) != (secret is None):
            raise section.fail(
                "access_key_id" if key_id is None else "secret_access_key",
                "set both access_key_id and secret_access_key, or neither (the default AWS credential chain)",
            )
        result = StorageConfig(
            endpoint=endpoint.rstrip("/") if endpoint else None,
            region=section.optional_text("region"),
            path_style=path_style,
            access_key_id=key_id,
            secret_access_key=secret,
            session_token=section.optional_text("session_token"),
        )
        section.done()
        return result

    def schedule(self) -> ScheduleConfig:
        if self.get("schedule", None) is None:
            return ScheduleConfig()
        schedule = self.section("schedule")
        lag = schedule.get("drain_lag_bytes", None)
        result = ScheduleConfig(
            drain_cron=schedule.cron("drain_cron", "*/5 * * * *"),
            max_lag_bytes=schedule.positive("max_lag_bytes", 1 << 30),
            drain_lag_bytes=None if lag is None else schedule.positive("drain_lag_bytes", 1),
            drain_check_seconds=schedule.positive("drain_check_seconds", 30),
            merge_check_seconds=schedule.positive("merge_check_seconds", 30),
            merge_with_drain=schedule.flag("merge_with_drain", False),
            freshness_minutes=schedule.positive("freshness_minutes", 30),
        )
        schedule.done()
        return result

    def drain(self) -> DrainConfig:
        if self.get("drain", None) is None:
            return DrainConfig()
        drain = self.section("drain")
        commit = drain.number("commit_seconds", COMMIT_SECONDS, "a number of seconds")
        if commit <= 0:
            raise drain.fail("commit_seconds", f"expected a number of seconds above 0, got {commit!r}")
        config = DrainConfig(
            follow_seconds=drain.number("follow_seconds", FOLLOW_SECONDS, "a number of seconds"),
            commit_seconds=commit,
        )
        drain.done()
        return config

    def maintenance(self) -> MaintenanceConfig:
        if self.get("maintenance", None) is None:
            return MaintenanceConfig()
        section = self.section("maintenance")
        default = MaintenanceConfig()
        retention = section.count("vacuum_retention_hours", default.vacuum_retention_hours)
        if 0 < retention < DELTA_MIN_RETENTION_HOURS:
            raise section.fail(
                "vacuum_retention_hours",
                f"{retention} is below Delta's safety check ({DELTA_MIN_RETENTION_HOURS} hours, 7 days): VACUUM could"
                " delete files that running readers and writers still use (0 turns VACUUM off)",
            )
        result = MaintenanceConfig(
            cron=section.cron("cron", default.cron),
            compact_min_files=section.count("compact_min_files", default.compact_min_files),
            zorder=section.flag("zorder", default.zorder),
            purge_min_deletion_vectors=section.count("purge_min_deletion_vectors", default.purge_min_deletion_vectors),
            vacuum_retention_hours=retention,
        )
        section.done()
        return result

    def done(self) -> None:
        unknown = sorted(set(self.mapping) - self.used)
        if unknown:
            raise self.fail(str(unknown[0]), "unknown setting")
