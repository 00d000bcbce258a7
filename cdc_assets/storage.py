"""Object storage: the ``storage`` section configures the clients of an ``s3://`` path.

Clients touch the change log and the warehouse — pyarrow (the change log) and delta-rs (sensors,
status, maintenance figures) here; Spark's s3a (the Delta tables) is configured through
``spark.conf`` for now. :class:`StorageConfig` gives each client its settings from one endpoint,
region, addressing style and set of credentials, so ``s3://bucket/path`` names the same objects
for all of them. Without credentials, each client uses the default AWS credential chain
(environment, profile, instance or pod role).

Credentials are never shown: ``repr`` leaves them out, and errors name the endpoint and the
bucket only (docs/architecture.md, "Object storage").
"""

from __future__ import annotations

from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pyarrow.fs as pafs

S3_SCHEMES = ("s3", "s3a")


@dataclass(slots=True, frozen=True)
class StorageConfig:
    """``endpoint``: an S3-compatible server's URL (``http://minio:9000``), none for AWS itself;
    ``path_style``: bucket in the path rather than the host name (default: with an endpoint);
    the key pair and session token: none for the default AWS credential chain."""

    endpoint: str | None = None
    region: str | None = None
    path_style: bool | None = None
    access_key_id: str | None = field(default=None, repr=False)
    secret_access_key: str | None = field(default=None, repr=False)
    session_token: str | None = field(default=None, repr=False)

    @property
    def uses_path_style(self) -> bool:
        return self.path_style if self.path_style is not None else self.endpoint is not None

    @property
    def secrets(self) -> tuple[str, ...]:
        """The credential values (for tests and redaction), empty ones left out."""
        return tuple(s for s in (self.access_key_id, self.secret_access_key, self.session_token) if s)

    def filesystem(self, uri: str) -> tuple[pafs.FileSystem, str]:
        """pyarrow's filesystem for ``uri`` and the path inside it: ``s3://`` (or ``s3a://``) with
        these settings; any other scheme as pyarrow resolves it (``gs://``, ``abfs://``, ``file://``)."""
        scheme, _, rest = uri.partition("://")
        if scheme.lower() not in S3_SCHEMES:
            fs, path = pafs.FileSystem.from_uri(uri)
            return fs, str(path)
        options: dict[str, object] = {"region": self.region} if self.region else {}
        if self.endpoint:
            endpoint = urlsplit(self.endpoint)
            options |= {"endpoint_override": endpoint.netloc, "scheme": endpoint.scheme or "https"}
        options["force_virtual_addressing"] = not self.uses_path_style and bool(self.endpoint)
        if self.access_key_id:
            options |= {"access_key": self.access_key_id, "secret_key": self.secret_access_key}
            if self.session_token:
                options["session_token"] = self.session_token
        return pafs.S3FileSystem(**options), rest.rstrip("/")

    def delta_rs_options(self) -> dict[str, str]:
        """delta-rs ``storage_options`` (it reads ``s3://`` and ``s3a://`` alike)."""
        options: dict[str, str] = {}
        if self.endpoint:
            options["AWS_ENDPOINT_URL"] = self.endpoint
            if self.endpoint.startswith("http://"):
                options["AWS_ALLOW_HTTP"] = "true"
        if self.region:
            options["AWS_REGION"] = self.region
        options["AWS_VIRTUAL_HOSTED_STYLE_REQUEST"] = "false" if self.uses_path_style else "true"
        if self.access_key_id:
            options |= {"AWS_ACCESS_KEY_ID": self.access_key_id, "AWS_SECRET_ACCESS_KEY": self.secret_access_key or ""}
            if self.session_token:
                options["AWS_SESSION_TOKEN"] = self.session_token
        return options
