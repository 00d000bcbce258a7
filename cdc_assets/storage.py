"""Object storage: the ``storage`` section configures the clients of an ``s3://`` path.

Three clients touch the change log and the warehouse: pyarrow (the change log), delta-rs (sensors,
status, maintenance figures) and Spark's s3a (the Delta tables' merges and reads; Hadoop's settings,
given to a classic session at start by :mod:`cdc_assets.apply.session`). :class:`StorageConfig`
gives each its settings from one endpoint, region, addressing style and set of credentials, so
``s3://bucket/path`` names the same objects for all of them. Without credentials, each client uses the default AWS credential chain
(environment, profile, instance or pod role).

Credentials are never shown: ``repr`` leaves them out, and errors name the endpoint and the
bucket only (docs/architecture.md, "Object storage").
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import pyarrow.fs as pafs

S3_SCHEMES = ("s3", "s3a")
S3A = "org.apache.hadoop.fs.s3a"
DEFAULT_REGION = "us-east-1"  # what an S3-compatible server is asked for when no region is set (it ignores it)


def describe_storage_error(error: BaseException) -> str:
    """A storage client's error on one line: its chain of causes, the HTTP status and the S3 error
    code and message, without terminal colours, query strings or the XML around them (neither
    pyarrow's nor delta-rs's messages hold credentials)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(error)).replace("\u21b3", "")
    steps = [re.sub(r"\?\S*", "", line.strip()) for line in text.splitlines()]
    steps = [step for step in steps if step and not step.startswith("<")]
    code, message = re.search(r"<Code>(.*?)</Code>", text), re.search(r"<Message>(.*?)</Message>", text)
    if code:
        steps.append(f"{code.group(1)}: {message.group(1)}" if message else code.group(1))
    return " → ".join(steps) or type(error).__name__


def is_s3(uri: str) -> bool:
    """Whether ``uri`` is an ``s3://`` or ``s3a://`` location."""
    return uri.partition("://")[0].lower() in S3_SCHEMES


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
        rest = uri.partition("://")[2]
        if not is_s3(uri):
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
        # Writes upload in the writing thread, not in the background: a part whose background
        # upload met a connection reset can leave the stream's close waiting forever (pyarrow 26),
        # and a segment abandoned after a failure is closed, if not by us, by the garbage collector.
        return pafs.S3FileSystem(background_writes=False, **options), rest.rstrip("/")

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

    def hadoop_settings(self) -> dict[str, str]:
        """Hadoop's s3a settings (Spark takes each as ``spark.hadoop.<key>``); ``s3://`` is read by
        s3a too, so a path means the same objects to Spark as to pyarrow and delta-rs."""
        settings = {"fs.s3.impl": f"{S3A}.S3AFileSystem", "fs.AbstractFileSystem.s3.impl": f"{S3A}.S3A"}
        settings["fs.s3a.path.style.access"] = str(self.uses_path_style).lower()
        if self.endpoint:
            settings["fs.s3a.endpoint"] = self.endpoint
            settings["fs.s3a.connection.ssl.enabled"] = str(self.endpoint.startswith("https://")).lower()
        if self.region or self.endpoint:
            settings["fs.s3a.endpoint.region"] = self.region or DEFAULT_REGION
        if self.access_key_id:
            settings |= {"fs.s3a.access.key": self.access_key_id, "fs.s3a.secret.key": self.secret_access_key or ""}
            provider = "SimpleAWSCredentialsProvider"
            if self.session_token:
                settings["fs.s3a.session.token"] = self.session_token
                provider = "TemporaryAWSCredentialsProvider"
            settings["fs.s3a.aws.credentials.provider"] = f"{S3A}.{provider}"
        return settings
