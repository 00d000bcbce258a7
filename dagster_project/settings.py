"""What the code location is built from: the same YAML file as the command line.

The file is ``$CDC_CONFIG`` or ``./cdc.yaml``. The source DSN must come from an environment
variable (``dsn: ${CDC_SOURCE_DSN}``): Dagster reads it at launch through ``EnvVar``, so it never
appears in the UI, and the code location loads without it.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace

import yaml

from cdc_assets.config import Config, config_path, load_config
from cdc_assets.errors import ConfigError

_ENV_REFERENCE = re.compile(r"^\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-[^}]*)?\}$")


@dataclass(slots=True, frozen=True)
class Settings:
    config: Config
    config_path: str
    dsn_env: str

    def with_dsn(self, dsn: str) -> Config:
        """The configuration with the DSN Dagster resolved at launch."""
        return replace(self.config, source=replace(self.config.source, dsn=dsn))


def load_settings(path: str | None = None) -> Settings:
    """Read the configuration; the DSN's environment variable need not be set yet."""
    file = config_path(path).resolve()
    try:
        raw = yaml.safe_load(file.read_text(encoding="utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError(
            f"configuration file {file} does not exist: set CDC_CONFIG to your cdc-assets configuration"
            " (run `cdc-assets demo` for a working example)"
        ) from None
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
    return Settings(load_config(file, environ), str(file), variable)
