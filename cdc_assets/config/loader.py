"""The YAML configuration file: loading, ``${VAR}`` substitution and validation, into the model
of :mod:`cdc_assets.config.model` (whose fields give each setting's default and kind).

Every mistake is a :class:`~cdc_assets.errors.ConfigError` naming the file and the key
(``tables.public.orders.truncate: expected 'apply' or 'ignore', got 'drop'``). Relative paths are
resolved against the folder of the configuration file, so the command line and Dagster agree
whatever their working directory. The source DSN is never shown: not in ``repr``, not in errors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any, TypeVar, get_args

import yaml

from cdc_assets.config.jdbc import jdbc_url
from cdc_assets.config.model import (
    DELTA_MIN_RETENTION_HOURS,
    ChangelogConfig,
    Config,
    DrainConfig,
    MaintenanceConfig,
    ScheduleConfig,
    SourceConfig,
    SparkConfig,
    TableConfig,
    Truncate,
    WarehouseConfig,
    default,
    default_of,
    is_uri,
)
from cdc_assets.errors import ConfigError
from cdc_assets.names import TableName
from cdc_assets.storage import StorageConfig, is_s3

CONFIG_ENV = "CDC_CONFIG"
_VARIABLE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_SECRET_KEYS = frozenset(
    {"dsn", "standby_dsn", "metastore_dsn", "access_key_id", "secret_access_key", "session_token"}
)  # never echoed

_Choice = TypeVar("_Choice", bound=str)
_Section = TypeVar("_Section")


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
        source=source.model(SourceConfig),
        changelog=changelog.model(ChangelogConfig, path=_location(changelog.text("path"), base)),
        warehouse=warehouse.model(
            WarehouseConfig,
            path=warehouse_path,
            table_properties=warehouse.settings("table_properties"),
            storage_options=warehouse.settings("storage_options"),
            maintenance=warehouse.optional_model("maintenance", MaintenanceConfig),
        ),
        tables=tables,
        spark=replace(spark, storage=storage) if delta_on_s3 else spark,
        schedule=reader.optional_model("schedule", ScheduleConfig),
        drain=reader.optional_model("drain", DrainConfig),
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
    if is_uri(value):
        return value.rstrip("/")
    path = Path(value).expanduser()
    return str(path if path.is_absolute() else (base / path).resolve())


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

    def model(self, cls: type[_Section], **given: Any) -> _Section:
        """This mapping read as ``cls`` (a section of :mod:`cdc_assets.config.model`): each field
        that says its kind, by that reader method, with the field's default; the fields the
        caller read its own way are ``given``."""
        values: dict[str, Any] = dict(given)
        for model_field in fields(cls):  # type: ignore[arg-type]
            if "kind" not in model_field.metadata:
                continue
            default = default_of(model_field)
            if default is None and self.get(model_field.name, None) is None:
                values[model_field.name] = None  # an optional setting left out
                continue
            read = getattr(self, model_field.metadata["kind"])
            values[model_field.name] = read(model_field.name, default, **model_field.metadata["options"])
        return cls(**values)

    def optional_model(self, key: str, cls: type[_Section]) -> _Section:
        """The section ``key`` read as ``cls``, or ``cls()`` when it is absent; no unknown key."""
        if self.get(key, None) is None:
            return cls()
        section = self.section(key)
        result = section.model(cls)
        section.done()
        return result

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

    def identifier(self, key: str, default: str) -> str:
        """A name Spark SQL takes unquoted (a catalog's)."""
        value = self.text(key, default)
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", value):
            raise self.fail(key, f"expected a name of letters, digits and underscores, got {value!r}")
        return value

    def count(self, key: str, default: int) -> int:
        """A non-negative integer (0 turns a step off)."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise self.fail(key, f"expected 0 (off) or a positive integer, got {value!r}")
        return value

    def number(self, key: str, default: float, what: str = "a number", above_zero: bool = False) -> float:
        """A number ≥ 0 (> 0 with ``above_zero``), fractions allowed (``what`` names it in the
        error: "a number of hours")."""
        value = self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf"):
            raise self.fail(key, f"expected {what}, 0 or more, got {value!r}")
        if above_zero and value <= 0:
            raise self.fail(key, f"expected {what} above 0, got {float(value)!r}")
        return float(value)

    def vacuum_hours(self, key: str, default: int) -> int:
        """VACUUM's retention: 0 (off) or at least Delta's safety check."""
        retention = self.count(key, default)
        if 0 < retention < DELTA_MIN_RETENTION_HOURS:
            raise self.fail(
                key,
                f"{retention} is below Delta's safety check ({DELTA_MIN_RETENTION_HOURS} hours, 7 days): VACUUM could"
                " delete files that running readers and writers still use (0 turns VACUUM off)",
            )
        return retention

    def settings(self, key: str) -> dict[str, str]:
        """An optional mapping of names to scalar values, as strings (booleans lower-case)."""
        value = self.get(key, {})
        if not isinstance(value, dict) or any(isinstance(v, (dict, list)) for v in value.values()):
            raise self.fail(key, "expected a mapping of names to values")
        return {str(k): str(v).lower() if isinstance(v, bool) else str(v) for k, v in value.items()}

    def choice(self, key: str, default: _Choice, choices: tuple[_Choice, ...]) -> _Choice:
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
                    truncate=table.choice("truncate", default(TableConfig, "truncate"), get_args(Truncate)),
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
        master = spark.get("master", None if remote else default(SparkConfig, "master"))
        if remote is not None and master is not None:
            raise spark.fail("remote", "set either spark.master or spark.remote, not both")
        result = SparkConfig(
            master=str(master) if master is not None else None,
            remote=str(remote) if remote is not None else None,
            conf=spark.settings("conf"),
            parallel_merges=spark.model(SparkConfig).parallel_merges,
            metastore_dsn=spark.optional_text("metastore_dsn"),
        )
        if result.metastore_dsn is not None:
            try:  # a DSN the metastore cannot use fails here, not at Spark's start
                jdbc_url(result.metastore_dsn)
            except ValueError as error:
                raise spark.fail("metastore_dsn", str(error)) from None
        spark.done()
        return result

    def optional_text(self, key: str, default: str | None = None) -> str | None:
        """A string, or None when absent or empty (``${VAR:-}``)."""
        value = self.get(key, default or "")
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

    def done(self) -> None:
        unknown = sorted(set(self.mapping) - self.used)
        if unknown:
            raise self.fail(str(unknown[0]), "unknown setting")
