"""Consistent points: every mirrored table as of one change-log position ``L``.

Each Delta table is merged on its own, so the tables' latest versions may hold different source
positions. A point names, for one checkpoint LSN ``L``, a Delta version of every configured table
that holds the table exactly as of ``L`` (:mod:`cdc_assets.apply.versions`): read together, those
versions are the source database as it was once every transaction that ended by ``L`` had
committed and no later one — one snapshot, as PostgreSQL gives a reader. A point is only found
for an ``L`` every table holds whole; a table merged past ``L`` counts through an older version.

Points are kept in a small Delta table of the warehouse, ``_cdc/consistent_points`` (one row per
point: ``lsn``, ``lsn_text``, ``commit_time`` — the commit time of the latest transaction the
change log holds at ``L`` —, ``tables`` — a map from table to Delta version —, ``published``),
written with delta-rs. A point is appended with Delta's idempotent-write marker (its application
id, version ``L``), and only when ``L`` is past the latest point: publishing again after a crash
writes nothing twice. Readers take the latest point, or the one at or before an LSN or a time.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.fs as pafs
from deltalake import CommitProperties, QueryBuilder, Transaction, write_deltalake
from deltalake import DeltaTable as RustDeltaTable
from pyspark.sql import DataFrame, SparkSession

from cdc_assets.apply.target import app_id, open_table
from cdc_assets.apply.versions import AppliedVersion, applied_versions, version_holding
from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config
from cdc_assets.config.model import DELTA_MIN_RETENTION_HOURS, is_uri, join_location
from cdc_assets.errors import CdcError, ConfigError
from cdc_assets.faults import fault_point
from cdc_assets.lsn import format_lsn, parse_lsn
from cdc_assets.pgoutput.messages import unix_time

POINTS_FOLDER = ("_cdc", "consistent_points")
CANDIDATES = 20
"""How many positions, newest first, are tried for a new point."""
TIDY_FILES = 100
"""Files of the points table past which publishing tidies it (:meth:`PointLog.tidy`)."""
TIME_TYPE = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema(
    [
        pa.field("lsn", pa.int64(), nullable=False),
        pa.field("lsn_text", pa.string(), nullable=False),
        pa.field("commit_time", TIME_TYPE),
        pa.field("tables", pa.map_(pa.string(), pa.int64()), nullable=False),
        pa.field("published", TIME_TYPE, nullable=False),
    ]
)


class PointGoneError(CdcError):
    """A consistent point whose Delta versions can no longer be read (VACUUM, log cleanup)."""


@dataclass(slots=True, frozen=True)
class ConsistentPoint:
    """Every configured table as of ``lsn``: the Delta version of each that holds it."""

    lsn: int
    commit_time_us: int | None  # the latest transaction the change log holds at ``lsn`` committed then
    tables: dict[str, int]
    published_us: int = 0

    @property
    def commit_time(self) -> datetime | None:
        return None if self.commit_time_us is None else unix_time(self.commit_time_us)

    def to_json(self) -> dict[str, Any]:
        """``{"lsn": "X/XXXXXXXX", "commit_time": "<ISO 8601>", "tables": {"public.orders": 12, …}}``."""
        when = self.commit_time
        return {
            "lsn": format_lsn(self.lsn),
            "commit_time": None if when is None else when.isoformat().replace("+00:00", "Z"),
            "tables": dict(sorted(self.tables.items())),
        }

    def lines(self) -> list[str]:
        return [f"consistent point {self.summary()}"]

    def summary(self) -> str:
        when = self.commit_time
        tables = ", ".join(f"{name} v{version}" for name, version in sorted(self.tables.items()))
        return f"{format_lsn(self.lsn)} (source commit {when.isoformat() if when else 'unknown'}): {tables}"


def points_path(config: Config) -> str:
    """Where the warehouse keeps its consistent points."""
    return join_location(config.warehouse.path, *POINTS_FOLDER)


class PointLog:
    """The warehouse's consistent points (read and appended with delta-rs)."""

    def __init__(self, config: Config) -> None:
        self.path = points_path(config)
        self.app = app_id(config.source.slot, "consistent_points")
        self.storage_options = config.delta_storage_options

    def points(self) -> list[ConsistentPoint]:
        """Every point, oldest first."""
        table = open_table(self.path, self.storage_options)
        if table is None:
            return []
        return sorted((_point(row) for row in _read_points(table).to_pylist()), key=lambda point: point.lsn)

    def latest(self) -> ConsistentPoint | None:
        points = self.points()
        return points[-1] if points else None

    def at(self, lsn: int | None = None, when: datetime | None = None) -> ConsistentPoint | None:
        """The latest point at or before ``lsn``, or whose source commit time is at or before ``when``."""
        found = None
        for point in self.points():
            if lsn is not None and point.lsn > lsn:
                break
            if when is not None and (point.commit_time is None or point.commit_time > when):
                continue
            found = point
        return found

    def find(self, at: str | None = None) -> ConsistentPoint:
        """The latest point, or the latest at or before ``at``: an LSN (``X/X``) or an ISO 8601 time
        (local time when it names no zone); :class:`CdcError` when there is none."""
        if at is None:
            point = self.latest()
        elif "/" in at:
            point = self.at(lsn=parse_lsn(at))
        else:
            try:
                when = datetime.fromisoformat(at.replace("Z", "+00:00"))
            except ValueError:
                raise ConfigError(f"{at!r} is neither an LSN (X/X) nor an ISO 8601 time") from None
            point = self.at(when=when if when.tzinfo else when.astimezone())
        if point is None:
            raise CdcError(f"no consistent point{f' at or before {at}' if at else ''} in {self.path}")
        return point

    def append(self, point: ConsistentPoint) -> bool:
        """Record ``point``; False if a point at or past its LSN is recorded already."""
        table = open_table(self.path, self.storage_options)
        if table is not None and (table.transaction_version(self.app) or -1) >= point.lsn:
            return False
        tables = list(point.tables.items())
        row = pa.table(
            [
                pa.array([point.lsn], pa.int64()),
                pa.array([format_lsn(point.lsn)]),
                pa.array([point.commit_time_us], pa.int64()).cast(TIME_TYPE),
                pa.array([tables], SCHEMA.field("tables").type),
                pa.array([point.published_us], pa.int64()).cast(TIME_TYPE),
            ],
            schema=SCHEMA,
        )
        write_deltalake(
            self.path,
            row,
            mode="append",
            storage_options=self.storage_options,
            commit_properties=CommitProperties(app_transactions=[Transaction(self.app, point.lsn)]),
        )
        fault_point("consistent-point")
        return True

    def tidy(self, keep_hours: int) -> None:
        """Once the table has ``TIDY_FILES`` files: drop the points published more than
        ``keep_hours`` ago (their versions are past VACUUM's retention) except the latest, and
        rewrite the rest into one file — a point every few seconds must not leave a file each."""
        table = open_table(self.path, self.storage_options)
        if table is None or len(table.file_uris()) < TIDY_FILES:
            return
        latest = pc.max(_read_points(table).column("lsn")).as_py()
        cutoff = datetime.fromtimestamp(time.time() - keep_hours * 3600, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")
        table.delete(f"published < '{cutoff}' AND lsn < {latest}")
        table.optimize.compact()
        table.vacuum(retention_hours=1, dry_run=False, enforce_retention_duration=False)


def _read_points(table: RustDeltaTable) -> pa.Table:
    """Every row of the points table, read by delta-rs's query engine (its pyarrow dataset path
    leaves a process that aborts at exit, now and then)."""
    names = ", ".join(f.name for f in SCHEMA)
    return pa.RecordBatchReader.from_stream(
        QueryBuilder().register("points", table).execute(f"SELECT {names} FROM points")
    ).read_all()


def _point(row: dict[str, Any]) -> ConsistentPoint:
    commit_time, published = row["commit_time"], row["published"]
    return ConsistentPoint(
        int(row["lsn"]),
        None if commit_time is None else _us(commit_time),
        {str(name): int(version) for name, version in row["tables"]},
        _us(published),
    )


def _us(moment: datetime) -> int:
    return int(moment.timestamp()) * 1_000_000 + moment.microsecond


def find_point(config: Config, reader: ChangeLogReader, after: ConsistentPoint | None = None) -> ConsistentPoint | str:
    """The newest point past ``after`` that every configured table holds, or why there is none.

    The positions tried are the change log's checkpoint and the applied LSNs of the tables' latest
    versions, newest first. The tables' versions are read before the checkpoint, so the checkpoint
    covers every position they hold."""
    histories: dict[str, list[AppliedVersion]] = {
        str(t.name): applied_versions(
            config.target_path(t), app_id(config.source.slot, str(t.name)), config.delta_storage_options
        )
        for t in config.tables
    }
    checkpoint = reader.require_checkpoint()
    floor = -1 if after is None else after.lsn
    positions = {checkpoint.lsn} | {
        v.applied_lsn for versions in histories.values() for v in versions if v.applied_lsn is not None
    }
    why = "no position to try" if after is None else f"no position past {format_lsn(floor)} to try"
    for lsn in sorted((p for p in positions if floor < p <= checkpoint.lsn), reverse=True)[:CANDIDATES]:
        versions: dict[str, int] = {}
        for name, history in histories.items():
            found = version_holding(reader, checkpoint, name, history, lsn)
            if not isinstance(found, AppliedVersion):
                why = found or f"{name} has no Delta table yet"
                break
            versions[name] = found.version
        else:
            return ConsistentPoint(lsn, _commit_time_at(reader, lsn, after, checkpoint.snapshot_time_us), versions)
    return why


def _commit_time_at(
    reader: ChangeLogReader, lsn: int, after: ConsistentPoint | None, snapshot_time_us: int | None
) -> int | None:
    """When the latest transaction the log holds at ``lsn`` committed (the initial snapshot's time
    if it holds none)."""
    transactions = reader.transactions(-1 if after is None else after.lsn, lsn)
    if transactions.num_rows:
        latest = pc.max(transactions.column("commit_time")).as_py()
        return _us(latest)
    return snapshot_time_us if after is None else after.commit_time_us


def publish_point(config: Config) -> ConsistentPoint | str:
    """Find and record a new point; the point, or why none was published."""
    log = PointLog(config)
    latest = log.latest()
    found = find_point(config, ChangeLogReader(changelog_store(config)), latest)
    if isinstance(found, str):
        return found
    published = replace(found, published_us=time.time_ns() // 1000)
    if not log.append(published):
        return f"a point at or past {format_lsn(found.lsn)} was published meanwhile"
    log.tidy(config.warehouse.maintenance.vacuum_retention_hours or DELTA_MIN_RETENTION_HOURS)
    return published


def point_files_since(config: Config, table: str) -> int | None:
    """When (ms since 1970) the first commit after ``table``'s version in the latest point was made:
    every file that version reads and a later commit removed left the table then or later. None
    when there is no point, or the point's version is the table's latest."""
    point = PointLog(config).latest()
    if point is None or table not in point.tables:
        return None
    delta = open_table(config.target_path(config.table(table)), config.delta_storage_options)
    version = point.tables[table]
    if delta is None or delta.version() <= version:
        return None
    following = [c for c in delta.history(delta.version() - version) if int(c["version"]) == version + 1]
    return int(following[0]["timestamp"]) if following else 0  # no longer in the log: keep everything


def point_tables(config: Config, point: ConsistentPoint) -> dict[str, Any]:
    """Each table of ``point`` opened with delta-rs at its version (``deltalake.DeltaTable``), after
    checking that every file it needs is still there (:class:`PointGoneError` otherwise)."""
    opened = {}
    for table in config.tables:
        name = str(table.name)
        if name not in point.tables:
            raise CdcError(f"the consistent point at {format_lsn(point.lsn)} has no version of {name}")
        opened[name] = _open_version(config, name, config.target_path(table), point)
    return opened


def _open_version(config: Config, name: str, path: str, point: ConsistentPoint) -> Any:
    version = point.tables[name]
    gone = f"the consistent point at {format_lsn(point.lsn)} can no longer be read: {name} version {version}"
    try:
        table = open_table(path, config.delta_storage_options, version)
    except Exception as error:  # noqa: BLE001 - delta-rs raises several kinds for a version it cannot load
        raise PointGoneError(f"{gone} is not in its Delta log any more ({error})") from None
    if table is None:
        raise PointGoneError(f"{gone}: there is no Delta table at {path}")
    missing = _missing_files(config, table.file_uris())
    if missing:
        raise PointGoneError(f"{gone}: VACUUM removed {len(missing)} of its files (e.g. {missing[0]})")
    try:
        for _ in pa.RecordBatchReader.from_stream(table.deletion_vectors()):
            pass
    except Exception as error:  # noqa: BLE001 - a deletion vector file VACUUM removed
        raise PointGoneError(f"{gone}: a deletion vector of it cannot be read ({error})") from None
    return table


def _missing_files(config: Config, uris: list[str]) -> list[str]:
    """Those of ``uris`` (a version's data files) that are not there."""
    if not uris:
        return []
    filesystem = config.storage.filesystem(uris[0])[0] if is_uri(uris[0]) else pafs.LocalFileSystem()
    paths = [uri.partition("://")[2] if is_uri(uri) else uri for uri in uris]
    return [uri for uri, info in zip(uris, filesystem.get_file_info(paths)) if info.type == pafs.FileType.NotFound]


def point_query(config: Config, point: ConsistentPoint) -> QueryBuilder:
    """delta-rs's SQL engine (DataFusion) with each table of ``point`` registered at its version
    as ``<schema>_<table>`` — delta-rs's pyarrow path reads neither deletion vectors nor column
    mapping, which the mirrors use; its query engine does."""
    query = QueryBuilder()
    for name, table in point_tables(config, point).items():
        query.register(name.replace(".", "_"), table)
    return query


def point_frames(spark: SparkSession, config: Config, point: ConsistentPoint) -> dict[str, DataFrame]:
    """Each table of ``point`` as a Spark DataFrame of its version (Delta's ``versionAsOf``), once
    every file those versions need is found (:class:`PointGoneError` otherwise)."""
    point_tables(config, point)
    return {
        str(table.name): spark.read.format("delta")
        .option("versionAsOf", point.tables[str(table.name)])
        .load(config.target_path(table))
        for table in config.tables
    }


def register_views(spark: SparkSession, config: Config, point: ConsistentPoint) -> dict[str, str]:
    """Temporary views of ``point``'s tables for Spark SQL, named ``<schema>_<table>``; returns
    table → view."""
    views = {}
    for name, frame in point_frames(spark, config, point).items():
        views[name] = name.replace(".", "_")
        frame.createOrReplaceTempView(views[name])
    return views
