"""Dagster resources: the source (DSN from the environment) and the Spark session."""

from typing import Any

import dagster as dg

from cdc_assets.apply.session import quiet_start, spark_session
from cdc_assets.config import Config, SparkConfig
from dagster_project.settings import load_settings


class CdcSource(dg.ConfigurableResource):  # type: ignore[type-arg]  # Dagster's own resources leave it open too
    """The cdc-assets configuration file, with the source DSN resolved at launch (``EnvVar``)."""

    config_path: str
    dsn: str

    def config(self) -> Config:
        return load_settings(self.config_path).with_dsn(self.dsn)


class SparkResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """A Spark session with Delta: ``master`` (``local[2]``, ``spark://…``) or ``remote`` (Spark
    Connect). The session lives as long as the run's process. The object-storage settings (and
    their credentials) are read from ``config_path`` in the run's process, never part of the
    resource's configuration (which the UI shows)."""

    master: str | None = None
    remote: str | None = None
    conf: dict[str, str] = {}  # noqa: RUF012 - a pydantic field (copied per instance); the default is in dagster's config schema
    config_path: str | None = None

    def session(self) -> Any:
        storage = load_settings(self.config_path).config.spark.storage if self.config_path else None
        with quiet_start():
            session = spark_session(
                SparkConfig(master=self.master, remote=self.remote, conf=dict(self.conf), storage=storage)
            )
        if not self.remote:
            session.sparkContext.setLogLevel("ERROR")
        return session
