"""A whole pipeline around one test database for the apply tests: a configuration file under a
temporary folder (per-table ``row_filter`` / ``truncate``), ``setup`` / ``drain`` /
``apply_tables`` through the library API on the shared Spark session, the CLI in a subprocess,
and :meth:`Mirror.check`, which reads a Delta table with Spark *and* delta-rs and compares both
with the source."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cdc_assets.apply.runner import TableApplied, apply_tables
from cdc_assets.apply.target import DeltaTarget, app_id, applied_lsn, delta_target
from cdc_assets.changelog.planner import ChangePlan, plan_changes
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.config import Config, load_config
from cdc_assets.names import TableName
from cdc_assets.pgoutput.records import DeltaColumn
from cdc_assets.pipeline.drain import DrainResult, drain
from cdc_assets.pipeline.setup import SetupResult, setup
from cdc_assets.pipeline.sync import sync
from tests.support.config_file import DSN_VARIABLE, FILE_NAME, write_config
from tests.support.database import Database
from tests.support.mirror_diff import delta_version, rust_table, spark_table
from tests.support.rows import difference, source_rows, split_metadata, table_rows
from tests.support.spark_host import COMMANDS_SPARK, OWN_SPARK

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Mirror:
    """``tables``: ``schema.table`` → its settings in the file (``row_filter``, ``truncate``)."""

    db: Database
    folder: Path
    tables: dict[str, dict[str, Any]]
    spark: Any
    results: list[TableApplied] = field(default_factory=list)
    source: dict[str, Any] = field(default_factory=dict)  # ``source:`` settings beside the defaults
    warehouse: dict[str, Any] = field(default_factory=dict)  # ``warehouse:`` settings beside the path
    changelog: dict[str, Any] = field(default_factory=dict)  # ``changelog:`` settings beside the path
    spark_settings: dict[str, Any] = field(default_factory=dict)  # ``spark:`` settings beside the base's
    own_spark: bool = False  # the commands start a Spark of their own even beside the test run's

    def __post_init__(self) -> None:
        self.write_config()

    def write_config(self) -> None:
        """(Re)write the configuration file from the fields (``tables`` as they are now)."""
        base = self.commands_spark
        conf = base["conf"] | self.spark_settings.get("conf", {})
        write_config(
            self.folder,
            self.tables,
            source=self.source,
            changelog=self.changelog,
            warehouse=self.warehouse,
            spark=base | self.spark_settings | {"conf": conf},
        )

    @property
    def commands_spark(self) -> dict[str, Any]:
        """The base of the file's ``spark:`` section, which the commands run by :meth:`cli` use:
        with the test run's session (``spark`` given), that session's Spark Connect endpoint
        (``tests/support/spark_host.py``); without it, or with ``own_spark``, a local Spark of each
        command's own."""
        return OWN_SPARK if self.spark is None or self.own_spark else COMMANDS_SPARK

    @property
    def config_path(self) -> Path:
        return self.folder / FILE_NAME

    def config(self) -> Config:
        return load_config(self.config_path, environ={DSN_VARIABLE: self.db.dsn})

    # -- running ---------------------------------------------------------------------------------

    def sql(self, *statements: str) -> None:
        """Run ``statements`` in one transaction."""
        with self.db.connect() as conn, conn.transaction():
            for statement in statements:
                conn.execute(statement)

    def setup(self) -> SetupResult:
        return setup(self.config())

    def drain(self) -> DrainResult:
        # wait: the lock of the setup or drain just before may not be released yet (the server
        # ends the closed session asynchronously)
        return drain(self.config(), wait=True)

    def apply(self, tables: Sequence[str] | None = None) -> dict[str, TableApplied]:
        results = apply_tables(self.config(), self.spark, tables)
        self.results.extend(results)
        for result in results:
            print(result.summary())
        return {r.table: r for r in results}

    def sync(self) -> dict[str, TableApplied]:
        """``cdc-assets sync`` (:func:`~cdc_assets.pipeline.sync.sync`): drain (copying the tables a
        DDL rewrote), retention when due, then apply, on the shared Spark session."""
        results = sync(self.config(), lambda: self.spark, wait=True).applied
        self.results.extend(results)
        for result in results:
            print(result.summary())
        return {r.table: r for r in results}

    def pending_plan(self, table: str) -> tuple[DeltaTarget, ChangePlan, int]:
        """(target, plan, checkpoint LSN) of the records of ``table`` the Delta table does not hold,
        planned the way ``apply_table`` does."""
        config = self.config()
        settings = config.table(table)
        reader = ChangeLogReader(config.changelog.path)
        checkpoint = reader.checkpoint()
        assert checkpoint is not None
        target = delta_target(config, settings, self.spark)
        applied = target.applied_lsn()
        assert applied is not None and applied < checkpoint.lsn
        chunks = list(reader.read_changes(table, after=applied, upto=checkpoint.lsn))
        plan = plan_changes(chunks, checkpoint.tables[table].relation, truncate=settings.truncate)
        return target, plan, checkpoint.lsn

    def cli(self, *args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self._command(*args),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=timeout,
            check=False,
            env={**child_environ(), DSN_VARIABLE: self.db.dsn},
        )

    def popen(self, *args: str) -> subprocess.Popen[str]:
        """The command of :meth:`cli`, started and left running."""
        return subprocess.Popen(
            self._command(*args),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=ROOT,
            env={**child_environ(), DSN_VARIABLE: self.db.dsn},
        )

    def _command(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "cdc_assets", *args, "-c", str(self.config_path)]

    # -- looking ---------------------------------------------------------------------------------

    def path(self, table: str) -> str:
        config = self.config()
        return config.target_path(config.table(table))

    def applied(self, table: str) -> int | None:
        return applied_lsn(self.path(table), app_id(self.config().source.slot, str(TableName.parse(table))))

    def checkpoint_lsn(self) -> int:
        checkpoint = ChangeLogReader(self.config().changelog.path).checkpoint()
        assert checkpoint is not None
        return checkpoint.lsn

    def version(self, table: str) -> int:
        return delta_version(self.path(table))

    def records(self, table: str) -> list[dict[str, Any]]:
        """Every change record of ``table`` in the change log (commit columns and all)."""
        reader = ChangeLogReader(self.config().changelog.path)
        return [r for chunk in reader.read_changes(table) for r in chunk.records.to_pylist()]

    def delta(self, table: str) -> list[dict[str, Any]]:
        """The table's rows, read by Spark and by delta-rs, asserted equal (metadata included)."""
        return self._read(table)[1]

    def _read(self, table: str) -> tuple[list[str], list[dict[str, Any]]]:
        path = self.path(table)
        by_spark = spark_table(self.spark, path)
        by_rust = rust_table(path)
        spark_rows, rust_rows = table_rows(by_spark), table_rows(by_rust)
        problem = difference(spark_rows, rust_rows, ("Spark", "delta-rs"))
        assert not problem, f"{table}: Spark and delta-rs read different rows:\n{problem}"
        assert by_rust.column_names == by_spark.column_names, (by_spark.column_names, by_rust.column_names)
        return by_spark.column_names, spark_rows

    def check(
        self, table: str, *, where: str | None = None, expected: list[dict[str, Any]] | None = None
    ) -> list[dict[str, Any]]:
        """Both readers agree; the data equals the source (``SELECT * [WHERE where]``) or
        ``expected``; the columns are the source's, in order, then the metadata columns; every
        row's ``_cdc_lsn`` is at most the applied LSN. Returns the rows (without metadata)."""
        in_delta, rows = self._read(table)
        data, meta = split_metadata(rows)
        with self.db.connect() as conn:
            source = source_rows(conn, table, where)
            if expected is None:
                expected = source
            columns = [
                c
                for (c,) in conn.execute(
                    "SELECT attname::text FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0"
                    " AND NOT attisdropped ORDER BY attnum",
                    (TableName.parse(table).sql,),
                ).fetchall()
            ]
        problem = difference(data, expected, ("Delta", "the source" if expected is source else "the expected rows"))
        assert not problem, f"{table}: Delta differs:\n{problem}"
        assert in_delta == [*columns, DeltaColumn.LSN, DeltaColumn.COMMIT_TIME], (
            f"{table}: Delta has columns {in_delta}, the source {columns}"
        )
        applied = self.applied(table)
        assert applied is not None
        assert all(m[DeltaColumn.LSN] is not None and 0 < m[DeltaColumn.LSN] <= applied for m in meta), (applied, meta)
        assert all(m[DeltaColumn.COMMIT_TIME] is not None for m in meta)
        return data


def child_environ() -> dict[str, str]:
    """This process's environment for a child process, without the mark pyspark sets in a process
    that opened a Spark Connect session (the child starts its own Spark)."""
    import os

    return {key: value for key, value in os.environ.items() if key != "SPARK_CONNECT_MODE_ENABLED"}
