"""A bucket of the test run's S3 server, as a configuration file and Spark see it: a ``storage``
section whose credentials are ``${ENV}`` references, the environment that resolves them, and a
Spark session's s3a settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from cdc_assets.storage import StorageConfig
from cdc_sandbox.s3server import ThrowawayS3Server

KEY_ID_VARIABLE, SECRET_VARIABLE = "CDC_S3_ACCESS_KEY_ID", "CDC_S3_SECRET_ACCESS_KEY"


@dataclass(slots=True)
class Bucket:
    """An empty bucket on the test run's S3 server: ``uri`` is ``s3://<name>``."""

    server: ThrowawayS3Server
    uri: str

    @property
    def storage(self) -> StorageConfig:
        """The ``storage`` settings that reach it."""
        return self.server.storage()

    def section(self) -> dict[str, Any]:
        """The ``storage`` section of a configuration file, credentials read from the environment."""
        storage = self.storage
        return {
            "endpoint": storage.endpoint,
            "region": storage.region,
            "path_style": True,
            "access_key_id": "${" + KEY_ID_VARIABLE + "}",
            "secret_access_key": "${" + SECRET_VARIABLE + "}",
        }

    def environ(self) -> dict[str, str]:
        """The variables :meth:`section` reads."""
        storage = self.storage
        return {KEY_ID_VARIABLE: storage.access_key_id or "", SECRET_VARIABLE: storage.secret_access_key or ""}

    def configure(self, session: Any) -> None:
        """Point the test run's Spark application (which has the s3a jars) at the server: Hadoop's
        s3a settings in its Hadoop configuration, where a real deployment's ``spark.hadoop.*``
        settings land at start (``cdc_assets.apply.session``) and where every reader of a path
        looks — Delta's catalog too, whose CREATE TABLE … AS SELECT ignores the session's SQL
        settings — and as the session's SQL settings, which a session's own file system access
        takes in."""
        hadoop = session.sparkContext._jsc.hadoopConfiguration()
        for key, value in self.storage.hadoop_settings().items():
            hadoop.set(key, value)
            session.conf.set(key, value)
