"""Every Dagster name the pipeline defines — asset keys, job, sensor, schedule, op and pool names,
resource keys and the values of its run tags — derived from one ``key_prefix``.

The default prefix (none) gives the names of a code location with one database: ``cdc/changelog``,
``delta/<schema>/<table>``, ``cdc_drain``, ``cdc_merges``, pool ``cdc_drain__<slot>``, resources
``source`` and ``spark``. A prefix ``["shop"]`` puts ``shop`` in front of every asset key
(``shop/delta/public/orders``) and ``shop__`` in front of every other name (``shop__cdc_drain``,
``shop__source``), so several databases' pipelines live side by side in one code location.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import dagster as dg

from cdc_assets.config import TableConfig
from cdc_assets.errors import ConfigError

_PART = re.compile(r"[A-Za-z0-9_]+")
SEPARATOR = "__"


def table_slug(table: TableConfig) -> str:
    """``schema__table``: a name fit for Dagster pools, sensors and jobs."""
    return f"{table.name.schema}{SEPARATOR}{table.name.name}".replace(".", "_").replace("-", "_")


@dataclass(slots=True, frozen=True)
class Naming:
    """The names of one pipeline (one source database); ``key_prefix``: the first parts of its
    asset keys, each letters, digits and underscores (the other names join them with ``__``)."""

    key_prefix: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for part in self.key_prefix:
            if not _PART.fullmatch(part):
                raise ConfigError(f"key_prefix: {part!r} is not letters, digits and underscores")

    # -- asset keys ---------------------------------------------------------------------------------

    def key(self, *path: str) -> dg.AssetKey:
        return dg.AssetKey([*self.key_prefix, *path])

    @property
    def changelog(self) -> dg.AssetKey:
        return self.key("cdc", "changelog")

    @property
    def snapshot(self) -> dg.AssetKey:
        return self.key("cdc", "snapshot")

    @property
    def rebuild(self) -> dg.AssetKey:
        return self.key("cdc", "rebuild")

    @property
    def verify(self) -> dg.AssetKey:
        return self.key("cdc", "verify")

    @property
    def consistent_point(self) -> dg.AssetKey:
        return self.key("cdc", "consistent_point")

    def mirror(self, table: TableConfig) -> dg.AssetKey:
        return self.key("delta", table.name.schema, table.name.name)

    def history(self, table: TableConfig) -> dg.AssetKey:
        return self.key("history", table.name.schema, table.name.name)

    def maintenance(self, table: TableConfig) -> dg.AssetKey:
        return self.key("maintenance", table.name.schema, table.name.name)

    # -- names: jobs, sensors, schedules, ops, pools, resources, run-tag values -----------------------

    def name(self, base: str) -> str:
        """``base`` behind the prefix's parts, joined by ``__``."""
        return SEPARATOR.join([*self.key_prefix, base])

    @property
    def drain_job(self) -> str:
        return self.name("cdc_drain")

    @property
    def point_job(self) -> str:
        """The consistent point's job, and its sensor's name."""
        return self.name("cdc_consistent_point")

    @property
    def copy_job(self) -> str:
        """The job that copies a rewritten table again, for the shared merge sensor."""
        return self.name("cdc_copy_held")

    def table_copy_job(self, table: TableConfig) -> str:
        """The same job, for ``table``'s own merge sensor."""
        return f"{self.copy_job}{SEPARATOR}{table_slug(table)}"

    @property
    def recover_job(self) -> str:
        return self.name("cdc_recover")

    @property
    def recover_op(self) -> str:
        return self.name("recover")

    @property
    def maintain(self) -> str:
        """The maintenance job and its schedule."""
        return self.name("cdc_maintain")

    @property
    def maintenance_op(self) -> str:
        return self.name("maintenance")

    @property
    def merge_sensor(self) -> str:
        """The one merge sensor for every table (``schedule.merge_sensors``)."""
        return self.name("cdc_merges")

    def table_merge_sensor(self, table: TableConfig) -> str:
        """A table's own merge sensor."""
        return f"{self.merge_sensor}{SEPARATOR}{table_slug(table)}"

    def is_merge_sensor(self, name: str) -> bool:
        """Whether ``name`` is one of this pipeline's merge sensors (the shared one or a table's)."""
        return name == self.merge_sensor or name.startswith(f"{self.merge_sensor}{SEPARATOR}")

    @property
    def drain_schedule(self) -> str:
        return self.name("cdc_drain_schedule")

    @property
    def drain_sensor(self) -> str:
        return self.name("cdc_drain_on_lag")

    def merge_job(self, table: TableConfig) -> str:
        return self.name(f"cdc_merge{SEPARATOR}{table_slug(table)}")

    def drain_pool(self, slot: str) -> str:
        return self.name(f"cdc_drain{SEPARATOR}{slot}")

    def table_pool(self, table: TableConfig) -> str:
        return self.name(f"cdc_table{SEPARATOR}{table_slug(table)}")

    def history_pool(self, table: TableConfig) -> str:
        return self.name(f"cdc_history{SEPARATOR}{table_slug(table)}")

    @property
    def source_resource(self) -> str:
        return self.name("source")

    @property
    def spark_resource(self) -> str:
        return self.name("spark")

    def slot_tag(self, slot: str) -> str:
        """The value of the ``cdc/drain``, ``cdc/merges`` and ``cdc/point`` run tags: the slot."""
        return self.name(slot)

    def table_tag(self, table: TableConfig) -> str:
        """The value of the ``cdc/table`` run tag: the table's slug."""
        return self.name(table_slug(table))
