"""``CdcComponent``: one source database's pipeline in a Dagster project (a ``defs.yaml``).

``attributes``: ``config``, the cdc-assets configuration file (relative to the ``defs.yaml``'s
folder; ``cdc.yaml`` by default), or its sections given inline (``source``, ``changelog``,
``warehouse``, ``tables``, …); and ``key_prefix``, the first parts of every asset key, beside the
prefix of every other name (``naming.py``): two components with different prefixes mirror two
databases in one code location. ``build_defs`` builds what the standalone code location does
(``factory.build_definitions``), but for its executor, which is the project's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import dagster as dg
import yaml

from cdc_assets.errors import ConfigError
from dagster_project.factory import build_definitions
from dagster_project.naming import Naming
from dagster_project.scaffold import CONFIG_FILE, CdcScaffolder
from dagster_project.settings import Settings, load_settings

COMPONENT_FILE = "defs.yaml"


@dg.scaffold_with(CdcScaffolder)
class CdcComponent(dg.Component, dg.Model, dg.Resolvable):
    """PostgreSQL tables mirrored into Delta Lake by logical replication (cdc-assets): the drain,
    a mirror asset per table, their checks, sensors, schedules and jobs."""

    config: str | None = None
    key_prefix: list[str] = []  # noqa: RUF012 - a pydantic field (copied per instance)
    source: dict[str, Any] | None = None
    changelog: dict[str, Any] | None = None
    warehouse: dict[str, Any] | None = None
    tables: dict[str, Any] | None = None
    storage: dict[str, Any] | None = None
    spark: dict[str, Any] | None = None
    schedule: dict[str, Any] | None = None
    drain: dict[str, Any] | None = None

    def build_defs(self, context: dg.ComponentLoadContext) -> dg.Definitions:
        return build_definitions(self.settings(context.path))

    def settings(self, folder: Path) -> Settings:
        """The settings of the file the attributes name, or of their inline sections (which the
        ``defs.yaml`` holds: errors name it), with the attributes' key prefix."""
        here = folder / COMPONENT_FILE
        try:
            naming = Naming(tuple(self.key_prefix))
        except ConfigError as error:
            raise ConfigError(f"{here}: attributes.{error}") from None
        sections = {
            key: value
            for key in ("source", "changelog", "warehouse", "tables", "storage", "spark", "schedule", "drain")
            if (value := getattr(self, key)) is not None
        }
        if not sections:
            return load_settings(str(folder / (self.config or CONFIG_FILE)), naming=naming)
        if self.config is not None:
            raise ConfigError(
                f"{here}: attributes: `config` names a file, and sections are given inline: one or the other"
            )
        return load_settings(str(here), text=yaml.safe_dump(sections, sort_keys=False), naming=naming)
