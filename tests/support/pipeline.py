"""A cdc-assets pipeline around one test database: a config file in a temporary folder, the Python
API and the command line (in a subprocess), and looks at the slot and the change log."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cdc_assets.changelog.checkpoint import Checkpoint, read_checkpoint
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.retention import RetentionResult
from cdc_assets.changelog.store import LogStore
from cdc_assets.config import Config, load_config
from cdc_assets.pipeline.drain import DrainResult, drain
from cdc_assets.pipeline.retention import retain_when_due
from cdc_assets.pipeline.setup import SetupResult, setup
from tests.support.config_file import DSN_VARIABLE, FILE_NAME, write_config
from tests.support.database import Database
from tests.support.oracle import Replica, assert_mirrors

ROOT = Path(__file__).resolve().parents[2]


def wait_until(
    condition: Callable[[], object], timeout: float = 30.0, what: str = "condition", interval: float = 0.02
) -> Any:
    """Poll ``condition`` until it returns something true and return that (the poll interval is
    no synchronisation: the test proceeds on the condition, not on time)."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not met within {timeout} s")
        time.sleep(interval)


@dataclass(slots=True)
class CliResult:
    returncode: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


@dataclass
class Pipeline:
    """``tables``: ``schema.table`` names; ``source``: extra ``source:`` settings of the file."""

    db: Database
    folder: Path
    tables: list[str]
    source: dict[str, Any] = field(default_factory=dict)
    dsn: str | None = None  # the source DSN (default: the database's, as superuser)
    changelog_settings: dict[str, Any] = field(default_factory=dict)  # ``changelog:`` settings beside the path
    spark: dict[str, Any] | None = None  # the ``spark:`` section (e.g. ``remote``: the commands' Spark Connect server)

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.update_source()

    # -- configuration -------------------------------------------------------------------

    @property
    def config_path(self) -> Path:
        return self.folder / FILE_NAME

    @property
    def changelog(self) -> str:
        return str(self.folder / "changelog")

    def update_source(self, **source: Any) -> None:
        """Rewrite the file, with ``source`` settings changed (e.g. ``streaming="on"``)."""
        self.source.update(source)
        write_config(self.folder, self.tables, source=self.source, changelog=self.changelog_settings, spark=self.spark)

    @property
    def environ(self) -> dict[str, str]:
        return {**os.environ, DSN_VARIABLE: self.dsn or self.db.dsn}

    def config(self) -> Config:
        return load_config(self.config_path, environ={DSN_VARIABLE: self.dsn or self.db.dsn})

    # -- running -------------------------------------------------------------------------

    def setup(self, **kwargs: Any) -> SetupResult:
        return setup(self.config(), **kwargs)

    def drain(self, **kwargs: Any) -> DrainResult:
        """``drain``, waiting for the lock by default: the session of the setup or drain just before
        ends on the server asynchronously, and may still hold it."""
        kwargs.setdefault("wait", True)
        return drain(self.config(), **kwargs)

    def retain(self) -> RetentionResult | None:
        """Change-log retention, as the commands run it after a drain (when due)."""
        return retain_when_due(self.config())

    def cli(self, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> CliResult:
        """``python -m cdc_assets <args> -c <config>`` in a subprocess."""
        done = subprocess.run(
            self.cli_command(*args),
            capture_output=True,
            text=True,
            env=env or self.environ,
            cwd=ROOT,
            timeout=timeout,
            check=False,
        )
        return CliResult(done.returncode, done.stdout, done.stderr)

    def cli_command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cdc_assets", *args, "-c", str(self.config_path)]

    def popen(self, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        return subprocess.Popen(
            self.cli_command(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env or self.environ,
            cwd=ROOT,
        )

    # -- looking -------------------------------------------------------------------------

    @property
    def reader(self) -> ChangeLogReader:
        return ChangeLogReader(self.changelog)

    def checkpoint(self) -> Checkpoint | None:
        return read_checkpoint(LogStore(self.changelog))

    def checkpoint_bytes(self) -> bytes:
        return (Path(self.changelog) / "_checkpoint.json").read_bytes()

    def confirmed_flush(self, slot: str = "cdc_slot") -> int | None:
        rows = self.db.execute(
            "SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        )
        return rows[0][0] if rows else None

    def flush_lsn(self) -> int:
        return self.db.execute("SELECT (pg_current_wal_flush_lsn() - '0/0')::int8")[0][0]

    def assert_mirrors(self, tables: list[str] | None = None) -> Replica:
        return assert_mirrors(self.changelog, self.db.dsn, tables or self.tables)

    def batch_starts(self) -> list[int]:
        """Batch start LSNs of the transaction files, in log order."""
        return sorted(int(p.name.split("-")[0], 16) for p in (Path(self.changelog) / "transactions").glob("*.parquet"))


def invalidate_slot(db: Database, slot: str, *first: str) -> None:
    """Make the server invalidate ``slot`` (``max_slot_wal_keep_size`` exceeded: WAL switched and
    checkpointed until ``wal_status`` is ``lost``), after running the statements ``first``; the
    limit is lifted again."""
    with db.connect() as conn:
        conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
        conn.execute("SELECT pg_reload_conf()")
        try:
            for statement in first:
                conn.execute(statement)

            def lost() -> bool:
                conn.execute("SELECT pg_switch_wal()")
                conn.execute("CHECKPOINT")
                row = conn.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,))
                return row.fetchone() == ("lost",)

            wait_until(lost, what=f"slot {slot} invalidated")
        finally:
            conn.execute("ALTER SYSTEM RESET max_slot_wal_keep_size")
            conn.execute("SELECT pg_reload_conf()")
