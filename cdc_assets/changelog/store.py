"""The change log's storage: a local folder or any filesystem pyarrow supports (S3, GCS, …).

:class:`LogStore` names files relative to the change log's root and offers the few operations the
log needs: write a file durably (fsync on local disks), replace a small file atomically (temporary
file + rename locally; a single PUT, which object stores make atomic), list, read and delete.
"""

from __future__ import annotations

import builtins
import copy
import os
import re
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import IO

import pyarrow as pa
import pyarrow.fs as pafs

from cdc_assets.config import Config
from cdc_assets.errors import StorageError
from cdc_assets.storage import StorageConfig, describe_storage_error

_URI = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
TEMPORARY_MARK = ".tmp-"  # in the name of a file being replaced


class LogStore:
    """Files under one root folder, addressed by ``/``-separated relative names."""

    def __init__(self, root: str, storage: StorageConfig | None = None) -> None:
        """``storage`` configures an ``s3://`` root (without it, pyarrow's defaults apply)."""
        self.root = root.rstrip("/") or "/"
        self.storage = storage or StorageConfig()
        if _URI.match(root):
            self.fs, path = self.storage.filesystem(root)
            self._base = path.rstrip("/")
            self.local = isinstance(self.fs, pafs.LocalFileSystem)
        else:
            self.fs = pafs.LocalFileSystem()
            self._base = os.path.abspath(root)
            self.local = True

    def sub(self, folder: str) -> LogStore:
        """A store rooted at ``folder`` of this one, on the same filesystem."""
        sub = copy.copy(self)
        sub.root, sub._base = f"{self.root}/{folder}", self.path(folder)
        return sub

    def path(self, name: str) -> str:
        """The filesystem path of ``name`` (for pyarrow readers)."""
        return f"{self._base}/{name}" if name else self._base

    def exists(self, name: str) -> bool:
        with self._reaching():
            return bool(self.fs.get_file_info(self.path(name)).type != pafs.FileType.NotFound)

    def missing_bucket(self) -> str | None:
        """The bucket of an object-store root when it does not exist (a typo, or not created yet)."""
        if self.local:
            return None
        bucket = self._base.split("/", 1)[0]
        with self._reaching():
            return bucket if self.fs.get_file_info(bucket).type == pafs.FileType.NotFound else None

    def total_bytes(self) -> int:
        """The bytes of every file under the root."""
        selector = pafs.FileSelector(self.path(""), allow_not_found=True, recursive=True)
        with self._reaching():
            infos = self.fs.get_file_info(selector)
        return sum(i.size or 0 for i in infos if i.type == pafs.FileType.File)

    def list(self, folder: str) -> list[str]:
        """Names of the files directly inside ``folder`` (relative to the root), sorted."""
        return self._entries(folder, pafs.FileType.File)

    def folders(self, folder: str) -> builtins.list[str]:  # `list` here is the method above
        """Names of the folders directly inside ``folder``."""
        return self._entries(folder, pafs.FileType.Directory)

    def _entries(self, folder: str, kind: pafs.FileType) -> builtins.list[str]:
        selector = pafs.FileSelector(self.path(folder), allow_not_found=True, recursive=False)
        with self._reaching():
            infos = self.fs.get_file_info(selector)
        prefix = self.path("") + "/"
        return sorted(i.path[len(prefix) :] for i in infos if i.type == kind)

    def read_bytes(self, name: str) -> bytes | None:
        """The file's contents, or None if it does not exist."""
        try:
            with self._reaching(), self.fs.open_input_stream(self.path(name)) as stream:
                data: bytes = stream.read()
                return data
        except FileNotFoundError:
            return None

    @contextmanager
    def _reaching(self, action: str = "read") -> Iterator[None]:
        """A storage failure (not a missing file) as a :class:`StorageError` naming the log's root."""
        try:
            yield
        except FileNotFoundError:
            raise
        except OSError as error:
            raise StorageError(
                f"cannot {action} the change log at {self.root}: {describe_storage_error(error)}"
            ) from None

    @contextmanager
    def create(self, name: str) -> Iterator[IO[bytes] | pa.NativeFile]:
        """A new file for writing; on a local disk it is fsynced before the context ends."""
        path = self.path(name)
        with self._reaching("write"):
            if self.local:
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as handle:
                    yield handle
                    handle.flush()
                    os.fsync(handle.fileno())
            else:
                with self.fs.open_output_stream(path) as stream:
                    yield stream

    def open_output(self, name: str) -> IO[bytes] | pa.NativeFile:
        """A new file for a writer that keeps it open; end it with :meth:`finish_output`."""
        path = self.path(name)
        with self._reaching("write"):
            if not self.local:
                return self.fs.open_output_stream(path)  # an object store has no folders to create
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return open(path, "wb")

    def finish_output(self, handle: IO[bytes] | pa.NativeFile) -> None:
        """Make a file from :meth:`open_output` durable (fsync locally; an object store makes
        the object visible, whole, on close)."""
        with self._reaching("write"):
            if self.local:
                handle.flush()
                os.fsync(handle.fileno())
            handle.close()

    def replace(self, name: str, data: bytes) -> None:
        """Write ``name`` so that readers see the old or the new contents, never a mix."""
        if not self.local:
            with self.create(name) as stream:
                stream.write(data)
            return
        path = self.path(name)
        temporary = f"{path}{TEMPORARY_MARK}{os.getpid()}"
        with self.create(os.path.relpath(temporary, self._base)) as handle:
            handle.write(data)
        os.replace(temporary, path)
        _fsync_folder(os.path.dirname(path))

    def sync_folder(self, folder: str) -> None:
        """Make file creations in ``folder`` durable (local disks; a no-op elsewhere)."""
        if self.local and os.path.isdir(self.path(folder)):
            _fsync_folder(self.path(folder))

    def delete(self, name: str) -> None:
        with suppress(FileNotFoundError), self._reaching("delete from"):
            self.fs.delete_file(self.path(name))

    def delete_folder(self, folder: str) -> None:
        with suppress(FileNotFoundError), self._reaching("delete from"):
            self.fs.delete_dir(self.path(folder))


def _fsync_folder(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def changelog_store(config: Config) -> LogStore:
    """The configured change log's files, with the ``storage`` settings."""
    return LogStore(config.changelog.path, config.storage)
