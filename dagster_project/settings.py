"""What the pipeline's definitions are built from: the same YAML file as the command line (or its
sections given inline, by a component's ``defs.yaml``), and the names they take.

The code location's file is ``$CDC_CONFIG`` or ``./cdc.yaml``. The source DSN must come from an
environment variable (``dsn: ${CDC_SOURCE_DSN}``): Dagster reads it at launch through ``EnvVar``,
so it never appears in the UI, and the code location loads without it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import yaml

from cdc_assets.config import Config, config_path
from cdc_assets.config.loader import parse_config
from cdc_assets.errors import ConfigError
from dagster_project.naming import Naming

_ENV_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}$")


@dataclass(slots=True, frozen=True)
class Settings:
    config: Config
    config_path: str  # the file read, or the one that holds the sections given inline
    dsn_env: str
    naming: Naming = Naming()
    config_text: str | None = None  # the sections given inline, as YAML

    def with_dsn(self, dsn: str) -> Config:
        """The configuration with the DSN Dagster resolved at launch."""
        return replace(self.config, source=replace(self.config.source, dsn=dsn))


def load_settings(path: str | None = None, *, text: str | None = None, naming: Naming = Naming()) -> Settings:
    """Read the configuration — the file at ``path``, or ``text`` (its sections given inline in the
    file at ``path``, which anchors its relative paths) — named by ``naming``; the DSN's
    environment variable need not be set yet."""
    file = config_path(path).resolve()
    try:
        read = file.read_text(encoding="utf-8") if text is None else text
    except FileNotFoundError:
        raise ConfigError(
            f"configuration file {file} does not exist: set CDC_CONFIG to your cdc-assets configuration"
            " (run `cdc-assets demo` for a working example)"
        ) from None
    try:
        raw = yaml.safe_load(read) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"{file}: not valid YAML: {error}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{file}: the document: expected a mapping")
    dsn = str(((raw.get("source") or {}).get("dsn")) or "").strip()
    match = _ENV_REFERENCE.match(dsn)
    if match is None:
        raise ConfigError(
            f"{file}: source.dsn must be an environment variable reference such as ${{CDC_SOURCE_DSN}} for Dagster,"
            " so the connection string stays out of the UI"
        )
    variable = match.group(1)
    environ = {**os.environ}
    environ.setdefault(variable, "set-at-launch")
    return Settings(parse_config(read, origin=file, environ=environ), str(file), variable, naming, text)
