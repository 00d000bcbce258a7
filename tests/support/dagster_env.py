"""The code location around one test database, driven in-process the way Dagster's daemons would.

:class:`DagsterEnv` owns a folder with a cdc-assets configuration for three tables (a
plain keyed one, a row-filtered one and a ``REPLICA IDENTITY FULL`` one, whose updates and deletes
carry the whole old row), a persistent Dagster test
instance, and the code location's definitions loaded through its real entry point
(``dagster_project.definitions.defs`` with ``CDC_CONFIG`` set). It evaluates the drain schedule and
the merge sensors as the daemon would (``build_schedule_context`` / ``build_sensor_context``
with cursors kept between ticks) and executes the run requests in-process against the instance,
on the test run's one Spark session (the code location's ``SparkResource`` calls ``getOrCreate``).

Delta tables are read with delta-rs (no Spark) and compared with ``SELECT *`` of the source read
the way the change log reads it (``tests/support/mirror_diff.py``).

:class:`ThreadRunLauncher` is a run launcher for the real run queue: the queue daemon dequeues a
run (pools permitting) and the launcher executes it in a thread of this process, or holds it
``STARTING`` like a run whose worker has not got going yet; terminating a held run cancels it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

import dagster as dg
import pytest
import yaml
from dagster._core.definitions.reconstruct import ReconstructableRepository
from dagster._core.execution.api import execute_run
from dagster._core.launcher import LaunchRunContext, RunLauncher
from dagster._serdes import ConfigurableClass
from dagster._serdes.config_class import ConfigurableClassData
from deltalake import DeltaTable as RustDeltaTable

from cdc_assets.apply.target import app_id, applied_lsn
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.config import Config, load_config
from cdc_assets.names import TableName
from cdc_assets.pipeline.setup import setup
from dagster_project.demo.run import DAGSTER_YAML
from dagster_project.merge_sensor import merge_sensors, shares_one_sensor
from dagster_project.naming import Naming
from tests.support.config_file import DSN_VARIABLE, FILE_NAME, SOURCE, write_config
from tests.support.database import Database
from tests.support.mirror_diff import assert_delta_equals_source, rust_rows
from tests.support.rows import source_rows, split_metadata

ROOT = Path(__file__).resolve().parents[2]
SLOT = SOURCE["slot"]
TABLES = ("public.customers", "public.orders", "public.notes")
MIRROR_KEYS = {t: dg.AssetKey(["delta", *t.split(".")]) for t in TABLES}
DEMO_INSTANCE: dict[str, Any] = yaml.safe_load(DAGSTER_YAML)  # the demo's instance settings: pools, run monitoring
ROW_FILTERS = {"public.orders": "status <> 'draft'"}
MAINTENANCE = {"compact_min_files": 2, "purge_min_deletion_vectors": 1}  # due on these small tables
SPARK = {
    "master": "local[2]",
    "conf": {"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4", "spark.default.parallelism": "2"},
}

DDL = """
CREATE TABLE public.customers (id int PRIMARY KEY, name text NOT NULL, tier text, since date);
CREATE TABLE public.orders (id int PRIMARY KEY, customer_id int, status text NOT NULL, amount numeric(10,2));
CREATE TABLE public.notes (id int PRIMARY KEY, body text, stars int);
ALTER TABLE public.notes REPLICA IDENTITY FULL;
CREATE TABLE public.scratch (n int);
INSERT INTO public.customers SELECT i, 'customer ' || i, 'silver', DATE '2024-01-01' + i FROM generate_series(1, 5) i;
INSERT INTO public.orders SELECT i, 1 + i % 5, CASE WHEN i % 3 = 0 THEN 'draft' ELSE 'paid' END, i * 10.5
  FROM generate_series(1, 6) i;
INSERT INTO public.notes SELECT i, 'note ' || i, i FROM generate_series(1, 3) i;
"""


def write_dagster_config(folder: Path, *, tables: Sequence[str] = TABLES, **sections: Any) -> Path:
    """The code location's ``cdc.yaml`` in ``folder`` (:func:`~tests.support.config_file.write_config`):
    ``tables`` (``public.orders`` row-filtered), maintenance due on these small tables (their merges
    writing deletion vectors, as a large table's do), :data:`SPARK`;
    ``sections`` beside or in place of these (``source={"slot": …}``, ``schedule``, ``spark``, …)."""
    defaults: dict[str, Any] = {"warehouse": {"maintenance": MAINTENANCE, "small_table_mb": 0}, "spark": SPARK}
    row_filtered = {t: ({"row_filter": ROW_FILTERS[t]} if t in ROW_FILTERS else {}) for t in tables}
    return write_config(folder, row_filtered, **(defaults | sections))


CODE_LOCATION_MODULE = "dagster_project.definitions"


def load_code_location() -> dg.Definitions:
    """The code location as ``dg`` loads it: ``dagster_project.definitions.defs`` (``$CDC_CONFIG``)."""
    from dagster_project.definitions import defs

    loaded = defs()
    assert isinstance(loaded, dg.Definitions)
    return loaded


def execute(
    defs: dg.Definitions,
    instance: dg.DagsterInstance,
    selection: dg.AssetSelection,
    *,
    name: str,
    tags: Mapping[str, str] | None = None,
    partition_key: str | None = None,
    raise_on_error: bool = True,
) -> dg.ExecuteInProcessResult:
    """Run ``selection`` as one job in this process, recorded in ``instance``."""
    job = dg.define_asset_job(name, selection=selection)
    resolved = dg.Definitions.merge(defs, dg.Definitions(jobs=[job])).resolve_job_def(name)
    return resolved.execute_in_process(
        instance=instance, tags=dict(tags or {}), partition_key=partition_key, raise_on_error=raise_on_error
    )


def tick_time(minute: int) -> datetime:
    """The tests' clock: a schedule tick ``minute`` minutes past noon of one day."""
    return datetime(2026, 1, 5, 12, minute, tzinfo=UTC)


def commit_each(db: Database, transactions: Iterable[Iterable[str]]) -> None:
    """Commit each group of statements as one transaction."""
    with db.connect() as conn:
        for statements in transactions:
            with conn.transaction():
                for statement in statements:
                    conn.execute(statement)


def materialization(result: dg.ExecuteInProcessResult, key: dg.AssetKey) -> dict[str, Any]:
    """The metadata of the run's one materialization of ``key``."""
    events = [e for e in result.get_asset_materialization_events() if e.asset_key == key]
    assert len(events) == 1, events
    return {k: v.value for k, v in events[0].materialization.metadata.items()}


@dataclass
class SensorTick:
    """One evaluation of a table's merge sensor (its own, or the shared one), as the table sees it."""

    table: str
    sensor: dg.SensorDefinition
    run_requests: list[dg.RunRequest]
    skip_message: str | None
    cursor: str | None

    def reason(self) -> str | None:
        """Why the tick did nothing for this table (a skipped tick's message names each table)."""
        return sensor_reasons(self.skip_message).get(self.table)


def sensor_reasons(message: str | None) -> dict[str, str]:
    """A merge sensor's skip message, ``<reason>: <table>, <table>`` per line, as table → reason."""
    reasons = {}
    for line in (message or "").splitlines():
        reason, names = line.rsplit(": ", 1)
        reasons |= dict.fromkeys(names.split(", "), reason)
    return reasons


def merge_sensor_results(
    defs: dg.Definitions, instance: dg.DagsterInstance, cursors: dict[str, str | None] | None = None
) -> dict[str, Any]:
    """One tick of each merge sensor of ``defs``, as the daemon evaluates it: with its cursor in
    ``cursors``, which keeps the cursor it returns (None: with no cursor, none kept); sensor name →
    its ``SensorExecutionData``."""
    results = {}
    for sensor in merge_sensors(defs, Naming()):
        cursor = None if cursors is None else cursors.get(sensor.name)
        results[sensor.name] = sensor.evaluate_tick(
            dg.build_sensor_context(instance=instance, definitions=defs, cursor=cursor)
        )
        if cursors is not None and results[sensor.name].cursor is not None:
            cursors[sensor.name] = results[sensor.name].cursor
    return results


@dataclass
class MergeTick:
    """One tick of every merge sensor of a code location, taken together."""

    results: dict[str, Any]

    @property
    def run_requests(self) -> list[dg.RunRequest]:
        return [r for result in self.results.values() for r in result.run_requests or []]

    @property
    def asset_events(self) -> list[dg.AssetMaterialization]:
        return [e for result in self.results.values() for e in result.asset_events or []]

    def reasons(self) -> dict[str, str]:
        """Table → why its sensor did nothing for it."""
        return {t: r for result in self.results.values() for t, r in sensor_reasons(result.skip_message).items()}


def tick_merge_sensors(
    defs: dg.Definitions, instance: dg.DagsterInstance, cursors: dict[str, str | None] | None = None
) -> MergeTick:
    """:func:`merge_sensor_results`, taken together."""
    return MergeTick(merge_sensor_results(defs, instance, cursors))


def requested(ticks: Mapping[str, SensorTick]) -> set[str]:
    """The tables a merge sensor tick requested runs for."""
    return {table for table, tick in ticks.items() if tick.run_requests}


@dataclass
class DagsterEnv:
    db: Database
    folder: Path
    instance: dg.DagsterInstance
    defs: dg.Definitions = field(init=False)
    cursors: dict[str, str | None] = field(default_factory=dict)
    runs: int = 0

    def __post_init__(self) -> None:
        self.defs = load_code_location()

    # -- configuration and source ----------------------------------------------------------------

    @property
    def config_path(self) -> Path:
        return self.folder / FILE_NAME

    def config(self) -> Config:
        return load_config(self.config_path, environ={DSN_VARIABLE: self.db.dsn})

    def path(self, table: str) -> str:
        config = self.config()
        return config.target_path(config.table(table))

    def version(self, table: str) -> int:
        """The Delta table's version (delta-rs)."""
        return RustDeltaTable(self.path(table)).version()

    def applied(self, table: str) -> int | None:
        return applied_lsn(self.path(table), app_id(SLOT, str(TableName.parse(table))))

    def checkpoint_lsn(self) -> int:
        checkpoint = ChangeLogReader(self.config().changelog.path).checkpoint()
        assert checkpoint is not None
        return checkpoint.lsn

    def transactions(self, *transactions: Iterable[str]) -> None:
        """Commit each group of statements as one transaction."""
        commit_each(self.db, transactions)

    # -- the schedule and the sensors, as the daemon evaluates them ---------------------------

    def schedule_tick(self, when: datetime) -> tuple[dg.ScheduleDefinition, list[dg.RunRequest]]:
        schedule = self.defs.resolve_schedule_def("cdc_drain_schedule")
        with dg.build_schedule_context(instance=self.instance, scheduled_execution_time=when) as context:
            data = schedule.evaluate_tick(context)
        return schedule, list(data.run_requests or [])

    def run_schedule(self, when: datetime) -> dg.ExecuteInProcessResult:
        """Evaluate the drain schedule at ``when`` and execute the run it requests."""
        schedule, requests = self.schedule_tick(when)
        assert len(requests) == 1, requests
        request = requests[0]
        job = self.defs.resolve_job_def(schedule.job_name)
        tags = {**request.tags, "dagster/schedule_name": schedule.name}
        result = job.execute_in_process(instance=self.instance, run_config=request.run_config, tags=tags)
        assert result.success
        return result

    def merge_sensor_of(self, table: str) -> dg.SensorDefinition:
        """The merge sensor that ticks for ``table``: its own, or the one shared by every table."""
        config = self.config()
        name = Naming().merge_sensor if shares_one_sensor(config) else Naming().table_merge_sensor(config.table(table))
        return self.defs.resolve_sensor_def(name)

    def evaluate_sensors(self, *, fresh: bool = False) -> dict[str, SensorTick]:
        """One tick of each merge sensor, with the cursor of its previous tick (``fresh``: with no
        cursor, and the cursor it returns is not kept), seen per table: its run requests, the
        tick's skip message (a shared sensor ticks once for every table)."""
        results = merge_sensor_results(self.defs, self.instance, None if fresh else self.cursors)
        ticks = {}
        for table in (str(t.name) for t in self.config().tables):
            sensor = self.merge_sensor_of(table)
            result = results[sensor.name]
            requests = [r for r in result.run_requests or [] if (r.run_key or "").split("@")[0] == table]
            ticks[table] = SensorTick(table, sensor, requests, result.skip_message, result.cursor)
        return ticks

    def execute_request(self, tick: SensorTick, request: dg.RunRequest) -> dg.ExecuteInProcessResult:
        """Execute one sensor run request as the daemon would launch it: the request's job (else the
        sensor's), its tags."""
        job = self.defs.resolve_job_def(request.job_name or tick.sensor.job_name)
        tags = {**request.tags, "dagster/sensor_name": tick.sensor.name}
        if request.run_key:
            tags["dagster/run_key"] = request.run_key
        result = job.execute_in_process(
            instance=self.instance, run_config=request.run_config, tags=tags, partition_key=request.partition_key
        )
        assert result.success
        return result

    def merge_requested(self, ticks: dict[str, SensorTick]) -> dict[str, dg.ExecuteInProcessResult]:
        """Execute every run request of ``ticks``; each table's run."""
        results = {}
        for table, tick in ticks.items():
            for request in tick.run_requests:
                results[table] = self.execute_request(tick, request)
        return results

    def sync(self, minute: int) -> dict[str, dg.ExecuteInProcessResult]:
        """A scheduled drain at :func:`tick_time` ``minute``, then the merges the sensor requests."""
        self.run_schedule(tick_time(minute))
        return self.merge_requested(self.evaluate_sensors())

    def execute(self, selection: dg.AssetSelection, **kwargs: Any) -> dg.ExecuteInProcessResult:
        self.runs += 1
        return execute(self.defs, self.instance, selection, name=f"test_job_{self.runs}", **kwargs)

    # -- Delta against the source ----------------------------------------------------------------

    def delta_rows(self, table: str) -> list[dict[str, Any]]:
        data, _ = split_metadata(rust_rows(self.path(table)))
        return data

    def source_rows(self, table: str) -> list[dict[str, Any]]:
        with self.db.connect() as conn:
            return source_rows(conn, table, ROW_FILTERS.get(table))

    def assert_delta_equals_source(self, tables: Sequence[str] = TABLES) -> None:
        with self.db.connect() as conn:
            assert_delta_equals_source(conn, self.config(), tables)


# -- the real run queue ----------------------------------------------------------------------------


class ThreadRunLauncher(RunLauncher, ConfigurableClass):
    """Executes a dequeued run in a thread of this process, or holds it (``STARTING``, as a run
    whose worker has not started) when its job is in :attr:`HOLD`. ``terminate`` cancels a held run.

    A run's job is loaded from the code location module, as a run worker loads it, so the
    job's own executor runs its steps (in the run's thread for the automation's jobs).

    Runs execute one at a time (:attr:`EXECUTING`): two runs in threads of one process deadlock
    in Dagster's log set-up (``logging.config.dictConfig`` takes the logging lock, then each
    handler's; a run emitting an event holds its handler's, then wants the logging lock). A run
    dequeued wrongly still shows: the coordinator marks it ``STARTING`` when it launches it."""

    HOLD: ClassVar[set[str]] = set()
    EXECUTING: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, inst_data: ConfigurableClassData | None = None) -> None:
        self._inst_data = inst_data
        self.threads: dict[str, threading.Thread] = {}
        self.held: set[str] = set()
        self.errors: dict[str, BaseException] = {}
        super().__init__()

    @property
    def inst_data(self) -> ConfigurableClassData | None:
        return self._inst_data

    @classmethod
    def config_type(cls) -> dict[str, Any]:
        return {}

    @classmethod
    def from_config_value(cls, inst_data: ConfigurableClassData, config_value: Mapping[str, Any]) -> ThreadRunLauncher:
        return cls(inst_data=inst_data)

    def launch_run(self, context: LaunchRunContext) -> None:
        run = context.dagster_run
        if run.job_name in self.HOLD:
            self.held.add(run.run_id)
            return
        job = ReconstructableRepository.for_module(CODE_LOCATION_MODULE, "defs").get_reconstructable_job(run.job_name)

        def work() -> None:
            try:
                with self.EXECUTING:
                    execute_run(job, run, self._instance)
            except BaseException as error:  # noqa: BLE001 - reported to the test
                self.errors[run.run_id] = error

        thread = threading.Thread(target=work, name=f"run-{run.run_id[:8]}", daemon=True)
        self.threads[run.run_id] = thread
        thread.start()

    def terminate(self, run_id: str) -> bool:
        if run_id not in self.held:
            return False
        run = self._instance.get_run_by_id(run_id)
        assert run is not None
        self._instance.report_run_canceling(run)
        self._instance.report_run_canceled(run, message="canceled while its worker was starting")
        self.held.discard(run_id)
        return True


def create_source(db: Database, folder: Path, slot: str = SLOT, **sections: Any) -> None:
    """The three tables with rows, the configuration file (``sections`` beside
    :func:`write_dagster_config`'s, ``source`` settings beside ``slot``), and ``cdc-assets setup``."""
    with db.connect() as conn:
        conn.execute(DDL)
    source = {"slot": slot, **sections.pop("source", {})}
    config = write_dagster_config(folder, source=source, **sections)
    setup(load_config(config, environ={DSN_VARIABLE: db.dsn}))


def source_with_schedule(
    db: Database, folder: Path, monkeypatch: pytest.MonkeyPatch, slot: str, schedule: dict[str, Any], **sections: Any
) -> dg.Definitions:
    """The three tables set up with a drain sensor's ``schedule`` (and ``sections``, e.g. ``drain``);
    the code location loaded on them."""
    monkeypatch.setenv("CDC_CONFIG", str(folder / FILE_NAME))
    monkeypatch.setenv(DSN_VARIABLE, db.dsn)
    # heartbeat: a drain's logical message moves the slot past WAL that holds no published change
    # (the scratch table's rows below), which would otherwise keep the lag up drain after drain
    create_source(db, folder, slot=slot, source={"heartbeat": True}, schedule=schedule, **sections)
    return load_code_location()
