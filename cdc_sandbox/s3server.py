"""A throwaway S3 API server for tests and the demo: moto's standalone server (``moto[server]``,
a real HTTP endpoint speaking the S3 REST API), in its own process on a free loopback port.

MinIO would be the closer match to a production object store, but it is a Go program that these
machines can only get from GitHub or Go's module proxy; moto installs from PyPI.

``with ThrowawayS3Server() as s3: s3.create_bucket("lake")`` — ``s3.storage()`` is the matching
``storage`` section (endpoint, region, path-style, a key pair moto accepts).
"""

from __future__ import annotations

import secrets
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from types import TracebackType
from typing import IO

import pyarrow.fs as pafs

from cdc_assets.storage import StorageConfig
from cdc_sandbox.pgcluster import free_port

START_TIMEOUT_S = 30.0


class S3ServerError(RuntimeError):
    """The S3 server did not start."""


@dataclass(slots=True)
class ThrowawayS3Server:
    """moto's S3 server on ``127.0.0.1:<port>``; its objects live in its memory and go with it."""

    region: str = "us-east-1"
    port: int = 0
    access_key_id: str = field(default_factory=lambda: f"cdc-test-{secrets.token_hex(6)}", repr=False)
    secret_access_key: str = field(default_factory=lambda: secrets.token_urlsafe(24), repr=False)
    _process: subprocess.Popen[bytes] | None = field(default=None, repr=False)
    _log: IO[bytes] | None = field(default=None, repr=False)

    def __enter__(self) -> ThrowawayS3Server:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def storage(self) -> StorageConfig:
        """The ``storage`` settings that reach this server."""
        return StorageConfig(
            endpoint=self.endpoint,
            region=self.region,
            path_style=True,
            access_key_id=self.access_key_id,
            secret_access_key=self.secret_access_key,
        )

    def start(self) -> None:
        self.port = self.port or free_port()
        self._log = tempfile.TemporaryFile()  # noqa: SIM115 — closed by stop(); read only if it fails to start
        self._process = subprocess.Popen(
            [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if self._process.poll() is not None:
                self._log.seek(0)
                error = self._log.read().decode(errors="replace")[-2000:]
                code = self._process.returncode
                self.stop()
                raise S3ServerError(f"the S3 server (moto) exited with {code}: {error}")
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                return
            except (urllib.error.URLError, ConnectionError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise S3ServerError(f"the S3 server (moto) did not answer on {self.endpoint} within 30 s") from None
                time.sleep(0.1)  # polling a server that is starting

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
            self._process = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def create_bucket(self, name: str) -> str:
        """Create bucket ``name``; return its ``s3://`` URI."""
        storage = self.storage()
        pafs.S3FileSystem(
            access_key=storage.access_key_id,
            secret_key=storage.secret_access_key,
            endpoint_override=f"127.0.0.1:{self.port}",
            scheme="http",
            region=self.region,
            allow_bucket_creation=True,
        ).create_dir(name)
        return f"s3://{name}"
