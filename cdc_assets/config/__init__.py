"""The configuration: its model (one dataclass per section, each default written once) and the
loader of the YAML file."""

from cdc_assets.config.loader import CONFIG_ENV, config_path, load_config, parse_config
from cdc_assets.config.model import (
    DELTA_MIN_RETENTION_HOURS,
    PARALLEL_MERGES,
    ChangelogConfig,
    Config,
    DrainConfig,
    MaintenanceConfig,
    ScheduleConfig,
    SourceConfig,
    SparkConfig,
    Streaming,
    TableConfig,
    WarehouseConfig,
)

__all__ = [
    "CONFIG_ENV",
    "DELTA_MIN_RETENTION_HOURS",
    "PARALLEL_MERGES",
    "ChangelogConfig",
    "Config",
    "DrainConfig",
    "MaintenanceConfig",
    "ScheduleConfig",
    "SourceConfig",
    "SparkConfig",
    "Streaming",
    "TableConfig",
    "WarehouseConfig",
    "config_path",
    "load_config",
    "parse_config",
]
