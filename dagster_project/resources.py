"""Dagster resources: the source (DSN from the environment) and the Spark session; and how a step,
check or sensor finds them, under the keys its pipeline's naming gives them."""

from typing import Any, TypeVar

import dagster as dg

from cdc_assets.apply.session import quiet_start, spark_session
from cdc_assets.config import Config, SparkConfig
from dagster_project.settings import Settings, load_settings

_Resource = TypeVar("_Resource")


class CdcSource(dg.ConfigurableResource):  # type: ignore[type-arg]  # Dagster's own resources leave it open too
    """The cdc-assets configuration (the file at ``config_path``, or its sections given inline as
    ``config_text``), with the source DSN resolved at launch (``EnvVar``)."""

    config_path: str
    config_text: str | None = None
    dsn: str

    def config(self) -> Config:
        return load_settings(self.config_path, text=self.config_text).with_dsn(self.dsn)


class SparkResource(dg.ConfigurableResource):  # type: ignore[type-arg]
    """A Spark session with Delta: ``master`` (``local[2]``, ``spark://…``) or ``remote`` (Spark
    Connect). The session lives as long as the run's process. The object-storage settings (and
    their credentials) are read from the configuration (``config_path``, ``config_text``: with
    ``${VAR}`` references) in the run's process, never part of the resource's configuration
    (which the UI shows)."""

    master: str | None = None
    remote: str | None = None
    conf: dict[str, str] = {}  # noqa: RUF012 - a pydantic field (copied per instance); the default is in dagster's config schema
    config_path: str | None = None
    config_text: str | None = None

    def session(self) -> Any:
        storage = (
            load_settings(self.config_path, text=self.config_text).config.spark.storage if self.config_path else None
        )
        with quiet_start():
            session = spark_session(
                SparkConfig(master=self.master, remote=self.remote, conf=dict(self.conf), storage=storage)
            )
        if not self.remote:
            session.sparkContext.setLogLevel("ERROR")
        return session


def pipeline_resources(settings: Settings) -> dict[str, Any]:
    """The pipeline's two resources, under its naming's keys."""
    config = settings.config
    naming = settings.naming
    return {
        naming.source_resource: CdcSource(
            config_path=settings.config_path, config_text=settings.config_text, dsn=dg.EnvVar(settings.dsn_env)
        ),
        naming.spark_resource: SparkResource(
            master=config.spark.master,
            remote=config.spark.remote,
            conf=config.spark.conf,
            config_path=settings.config_path,
            config_text=settings.config_text,
        ),
    }


def source_keys(settings: Settings) -> set[str]:
    """What a step that reads the source requires (``required_resource_keys``)."""
    return {settings.naming.source_resource}


def both_keys(settings: Settings) -> set[str]:
    """What a step that reads the source and writes with Spark requires."""
    return {settings.naming.source_resource, settings.naming.spark_resource}


def _resource(context: Any, key: str, kind: type[_Resource]) -> _Resource:
    found = getattr(context.resources, key)
    if not isinstance(found, kind):
        raise TypeError(f"resource {key} is a {type(found).__name__}, not a {kind.__name__}")
    return found


def source_of(context: Any, settings: Settings) -> CdcSource:
    """The run's (or tick's) source resource."""
    return _resource(context, settings.naming.source_resource, CdcSource)


def spark_of(context: Any, settings: Settings) -> SparkResource:
    """The run's Spark resource."""
    return _resource(context, settings.naming.spark_resource, SparkResource)
