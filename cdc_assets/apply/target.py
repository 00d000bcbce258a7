"""A mirrored Delta table: where it is, what LSN it holds, its schema, and how the schema evolves.

The applied LSN lives in the Delta log itself: every data commit of cdc-assets carries Delta's
idempotent-write marker (``txnAppId`` = ``cdc_assets:<slot>:<schema.table>``, ``txnVersion`` = the
change-log checkpoint it applied), so the data and the position it reflects are one atomic commit
and a commit replayed with the same version is skipped by Delta itself. It is read back with
delta-rs (``transaction_version``), which needs no Spark — sensors use it too.

Every data commit is one Delta SQL statement (``MERGE INTO``, ``INSERT INTO``, ``INSERT OVERWRITE``)
over a temporary view of the change rows, run by :meth:`DeltaTarget.commit` — or, for a small
table's plain batch, one delta-rs commit made in this process (:meth:`DeltaTarget.commit_in_process`,
:mod:`cdc_assets.apply.in_process`); nothing here uses
Delta's Python ``DeltaTable`` builder, whose calls a Spark Connect server can only take with
Delta's Connect plugin. The table's state (exists, applied LSN, version, the last commit's
metrics) is read with delta-rs.

New tables get deletion vectors (merges write only changed rows) and column mapping (so dropped
columns can be dropped); ``warehouse.table_properties`` can override them. Every table records its
columns' source types (:data:`~cdc_assets.apply.column_types.SOURCE_TYPES`). A table is created
with ``CREATE OR REPLACE``, and only when delta-rs finds no table at its path: what a creation
killed before its first commit left there (an empty ``_delta_log``, data files) is replaced.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

import pyarrow as pa
from deltalake import CommitProperties, Transaction
from deltalake import DeltaTable as RustDeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError, TableNotFoundError
from pyspark.sql import DataFrame, Row, SparkSession
from pyspark.sql import functions as F
from pyspark.sql import types as T

from cdc_assets.apply.column_types import (
    SOURCE_TYPES,
    SourceType,
    check_column_types,
    recorded_source_types,
    source_types_property,
)
from cdc_assets.apply.commit_settings import (
    REPLACE_MATERIALIZE_SOURCE,
    TXN_APP_ID,
    TXN_VERSION,
    USER_METADATA,
    settings_around,
    small_table_settings,
)
from cdc_assets.apply.spark_literals import backquote, sql_string
from cdc_assets.apply.spark_types import delta_schema, spark_type, without_metadata
from cdc_assets.apply.table_files import data_bytes, data_files
from cdc_assets.config import Config, TableConfig
from cdc_assets.errors import CdcError, StorageError
from cdc_assets.faults import fault_point
from cdc_assets.pgoutput.records import ChangeChunk, DeltaColumn
from cdc_assets.pgoutput.schema import RelationSchema
from cdc_assets.storage import describe_storage_error

DEFAULT_TABLE_PROPERTIES = {
    "delta.enableDeletionVectors": "true",
    "delta.columnMapping.mode": "name",
}
CHANGE_DATA_FEED = "delta.enableChangeDataFeed"
ONE_FILE_ROWS = 100_000
"""A REPLACE ON of fewer rows appends them as one file (not one per partition of the batch): a busy
table takes a batch every few seconds, and each file is one more task in every later scan until
maintenance compacts them."""
APPLIED_KEY = "cdc_assets_applied_lsn"
"""The key of a data commit's user metadata (a JSON object) that holds the LSN it applied."""
NOTE_KEY = "cdc_assets_note"
"""The key of a data commit's user metadata that says why it wrote the table so (a copy)."""
METADATA_COLUMNS = (DeltaColumn.LSN, DeltaColumn.COMMIT_TIME)


def app_id(slot: str, table: str) -> str:
    """The idempotent-write application id of a table's commits."""
    return f"cdc_assets:{slot}:{table}"


def applied_lsn(
    path: str, app: str, storage_options: dict[str, str] | None = None, version: int | None = None
) -> int | None:
    """The change-log checkpoint a Delta table (at ``version``: its latest by default) was last
    brought to (None: no table, or never)."""
    table = open_table(path, storage_options, version)
    return None if table is None else table.transaction_version(app)


def table_applied_lsn(config: Config, table: TableConfig) -> int | None:
    """:func:`applied_lsn` of a configured table's Delta table."""
    return applied_lsn(
        config.target_path(table), app_id(config.source.slot, str(table.name)), config.delta_storage_options
    )


def delta_target(config: Config, table: TableConfig, spark: SparkSession) -> DeltaTarget:
    """The Delta table of a configured table (to read; to write it, see :mod:`cdc_assets.apply.write_path`)."""
    return DeltaTarget(
        spark,
        config.target_path(table),
        app_id(config.source.slot, str(table.name)),
        table_properties=config.warehouse.table_properties,
        storage_options=config.delta_storage_options,
        small_table_bytes=round(config.warehouse.small_table_mb * 1e6),
        small_writes_in_process=config.warehouse.small_table_writer == "delta-rs",
    )


def latest_version(path: str, storage_options: dict[str, str] | None = None) -> int | None:
    """The Delta table's latest version (None: there is no table)."""
    table = open_table(path, storage_options)
    return None if table is None else table.version()


def delta_table_exists(path: str, storage_options: dict[str, str] | None = None) -> bool:
    """Whether ``path`` holds a Delta table."""
    return open_table(path, storage_options) is not None


def open_table(path: str, storage_options: dict[str, str] | None, version: int | None = None) -> RustDeltaTable | None:
    """The Delta table at ``path`` (at ``version``: its latest by default) read with delta-rs
    (None: there is none)."""
    try:
        return RustDeltaTable(path, version=version, storage_options=storage_options)
    except TableNotFoundError:
        return None
    except OSError as error:
        raise StorageError(f"cannot read the Delta table at {path}: {describe_storage_error(error)}") from None


@dataclass(slots=True)
class SchemaChange:
    """How the table's columns must change before new data is written."""

    add: list[tuple[str, pa.DataType]]
    drop: list[str]
    retype: list[tuple[str, pa.DataType]]
    # where each added column goes: after this column (None: first), so the table keeps the
    # source's column order, with the metadata columns last
    after: dict[str, str | None] = field(default_factory=dict)
    source_types: str | None = None  # the new value of SOURCE_TYPES, recorded last

    def __bool__(self) -> bool:
        return bool(self.add or self.drop or self.retype or self.source_types)


class DeltaTarget:
    """One Delta table at ``path``, written only through :meth:`create`, :meth:`evolve` and
    :meth:`commit`."""

    def __init__(
        self,
        spark: SparkSession,
        path: str,
        app: str,
        *,
        table_properties: dict[str, str] | None = None,
        storage_options: dict[str, str] | None = None,
        small_table_bytes: int = 0,
        small_writes_in_process: bool = False,
    ) -> None:
        self.spark = spark
        self.path = path
        self.app = app
        self.table_properties = {**DEFAULT_TABLE_PROPERTIES, **(table_properties or {})}
        self.storage_options = storage_options
        self.small_table_bytes = small_table_bytes
        self.small_writes_in_process = small_writes_in_process
        self._snapshot: RustDeltaTable | None = None
        self._snapshot_read = False
        self.note: str | None = None
        """What the next data commit says in its user metadata beside its LSN (``cdc_assets_note``):
        why the table was written the way it was, for its Delta history (a copy and its reason)."""
        self.creation_properties: dict[str, str] = {}
        """Table properties a table this target creates records besides the configured ones."""

    @property
    def sql_name(self) -> str:
        return f"delta.{backquote(self.path)}"

    def snapshot(self) -> RustDeltaTable | None:
        """The table's latest version read with delta-rs (None: no table) — read once, and again
        only after this target writes (:meth:`create`, :meth:`evolve`, :meth:`commit`,
        :meth:`execute`): a merge's every question about the table costs one read of its log."""
        if not self._snapshot_read:
            self._snapshot, self._snapshot_read = open_table(self.path, self.storage_options), True
        return self._snapshot

    def _wrote(self) -> None:
        self._snapshot, self._snapshot_read = None, False

    def applied_lsn(self, version: int | None = None) -> int | None:
        if version is not None:
            return applied_lsn(self.path, self.app, self.storage_options, version)
        table = self.snapshot()
        return None if table is None else table.transaction_version(self.app)

    def exists(self) -> bool:
        return self.snapshot() is not None

    def read(self, version: int | None = None) -> DataFrame:
        """The table, at ``version`` (Delta's time travel) or its latest."""
        reader = self.spark.read.format("delta")
        return (reader if version is None else reader.option("versionAsOf", version)).load(self.path)

    def version(self) -> int:
        return self._table().version()

    def data_files(self) -> int:
        return data_files(self._table())

    def last_commit(self) -> tuple[int, dict[str, int]]:
        """The table's version and the operation metrics Delta recorded for its latest commit (one
        read of the log)."""
        table = self._table()
        metrics = table.history(1)[0].get("operationMetrics") or {}
        return table.version(), {name: int(value) for name, value in metrics.items()}

    def feeds_changes(self) -> bool:
        """Whether the table records Delta's change data feed (``delta.enableChangeDataFeed``)."""
        table = self.snapshot()
        return table is not None and table.metadata().configuration.get(CHANGE_DATA_FEED, "").lower() == "true"

    def is_small(self) -> bool:
        """Whether the table exists and its data files add up to less than ``small_table_bytes``."""
        table = self.snapshot() if self.small_table_bytes else None
        return table is not None and data_bytes(table) < self.small_table_bytes

    def small_commit_settings(self, batch_rows: int, local_source: bool = False) -> dict[str, str]:
        """Spark settings for a commit of ``batch_rows`` rows: on a table whose data files add up to
        less than ``small_table_bytes``, those of :func:`~cdc_assets.apply.commit_settings.small_table_settings`;
        none otherwise."""
        return small_table_settings(batch_rows, local_source) if self.is_small() else {}

    def fence(self) -> None:
        """Record the table's applied LSN again, in a commit of its own, so that a commit another
        writer started before — a merge that a killed process left running on its Spark Connect
        server, or in a JVM that outlived it — fails Delta's conflict check (it read the applied
        LSN this commit sets) instead of landing after this writer planned from the table. A
        commit that lands before the fence is in the table this writer reads next; one that lands
        between the fence's read and its commit is found in the version before the fence, whose
        LSN is then recorded again."""
        table = self.snapshot()
        lsn = None if table is None else table.transaction_version(self.app)
        while table is not None and lsn is not None:
            try:
                self._commit_lsn_alone(table, lsn, "fence")
            except CommitFailedError:  # another commit won: fence what the table holds now
                table = self.snapshot()
                lsn = None if table is None else table.transaction_version(self.app)
                continue
            table = self._table()
            before = applied_lsn(self.path, self.app, self.storage_options, table.version() - 1)
            if before is None or before <= lsn:
                return
            lsn = before

    def record_applied(self, lsn: int) -> None:
        """Record ``lsn`` as the applied LSN in a commit without data: a range holding schema
        changes of the table and none of its rows (a commit another writer made since this target
        read the table fails it, as a data commit would)."""
        self._commit_lsn_alone(self._table(), lsn, "schema change")
        fault_point("apply-commit")

    def _commit_lsn_alone(self, table: RustDeltaTable, lsn: int, why: str) -> None:
        """A delta-rs commit of ``table`` without data that records ``lsn`` as its applied LSN
        (``why`` in its metadata)."""
        with self._writing_with_delta_rs():
            table.create_write_transaction(
                [],
                mode="append",
                schema=table.schema(),
                commit_properties=CommitProperties(
                    app_transactions=[Transaction(self.app, lsn)], custom_metadata={"cdc_assets": why}
                ),
            )

    @contextmanager
    def _writing_with_delta_rs(self) -> Iterator[None]:
        """Around a delta-rs write of this table: a storage failure is a :class:`StorageError`
        naming the table; the table is read again afterwards, whatever the outcome."""
        try:
            yield
        except OSError as error:
            raise StorageError(
                f"cannot write the Delta table at {self.path}: {describe_storage_error(error)}"
            ) from None
        finally:
            self._wrote()

    def _table(self) -> RustDeltaTable:
        table = self.snapshot()
        if table is None:
            raise StorageError(f"no Delta table at {self.path}")
        return table

    def create_statement(self, relation: RelationSchema) -> str:
        """``CREATE OR REPLACE TABLE … USING delta TBLPROPERTIES (…) AS``: how this table, of
        ``relation``'s columns, is created with its first rows (call only where :meth:`exists` is
        false)."""
        properties = {
            **self.table_properties,
            **self.creation_properties,
            SOURCE_TYPES: source_types_property(relation),
        }
        listed = ", ".join(f"{sql_string(k)} = {sql_string(v)}" for k, v in properties.items())
        return f"CREATE OR REPLACE TABLE {self.sql_name} USING delta TBLPROPERTIES ({listed}) AS"

    def create(self, columns: pa.Schema, relation: RelationSchema) -> None:
        """The table with ``columns`` (and the metadata columns), no rows and no applied LSN (the
        first data commit records one)."""
        view = f"cdc_empty_{uuid.uuid4().hex}"
        self.spark.createDataFrame([], delta_schema(columns)).createTempView(view)
        try:
            self.spark.sql(f"{self.create_statement(relation)} SELECT * FROM {backquote(view)}")
        finally:
            self.spark.catalog.dropTempView(view)
            self._wrote()
        fault_point("apply-create")

    def recorded_source_types(self) -> dict[str, SourceType] | None:
        """The source types the table records for its columns (None: none recorded)."""
        return recorded_source_types(self._table().metadata().configuration)

    def check_column_types(self, table: str, chunks: Sequence[ChangeChunk]) -> None:
        """Refuse ``chunks`` of ``table`` that would change a column's type while its source type
        stays (:func:`~cdc_assets.apply.column_types.check_column_types`)."""
        if not self.exists():
            check_column_types(table, {}, None, chunks)
            return
        current = {f.name: f.dataType for f in self.spark_schema().fields}
        check_column_types(table, current, self.recorded_source_types(), chunks)

    def schema_change(self, columns: pa.Schema, relation: RelationSchema) -> SchemaChange:
        """What must change so the table has exactly ``columns`` (plus the metadata columns) and
        records ``relation``'s source types."""
        current = {f.name: f.dataType for f in self.spark_schema().fields}
        wanted = {f.name: f.type for f in columns}
        add = [(name, kind) for name, kind in wanted.items() if name not in current]
        drop = [name for name in current if name not in wanted and name not in METADATA_COLUMNS]
        retype = [
            (name, kind) for name, kind in wanted.items() if name in current and spark_type(kind) != current[name]
        ]
        order = list(wanted)
        after = {name: order[order.index(name) - 1] if order.index(name) else None for name, _ in add}
        recorded = self._table().metadata().configuration.get(SOURCE_TYPES)
        types = source_types_property(relation)
        return SchemaChange(add, drop, retype, after, None if recorded == types else types)

    def spark_schema(self) -> T.StructType:
        """The table's columns in Spark types, from its Delta log (Delta stores Spark's schema JSON;
        the fields' metadata, such as column mapping's, left out as a read of the table does)."""
        return T.StructType.fromJson(without_metadata(json.loads(self._table().schema().to_json())))

    def evolve(self, change: SchemaChange) -> None:
        """Apply a schema change: ADD / DROP COLUMN in place (column mapping), a changed type by
        rewriting the column with a cast (Delta readers do not support type widening), then the
        new source types."""
        try:
            self._evolve(change)
        finally:
            self._wrote()

    def _evolve(self, change: SchemaChange) -> None:
        for name, kind in change.add:
            if name not in change.after:
                position = ""  # at the end
            else:
                previous = change.after[name]
                position = " FIRST" if previous is None else f" AFTER {backquote(previous)}"
            self.spark.sql(
                f"ALTER TABLE {self.sql_name} ADD COLUMNS ({backquote(name)} {spark_type(kind).simpleString()}{position})"
            )
            fault_point("apply-evolve")
        for name in change.drop:
            self.spark.sql(f"ALTER TABLE {self.sql_name} DROP COLUMN {backquote(name)}")
            fault_point("apply-evolve")
        if change.retype:
            frame = self.read()
            for name, kind in change.retype:
                frame = frame.withColumn(name, frame[name].cast(spark_type(kind)))
            frame.write.format("delta").mode("overwrite").option("overwriteSchema", "true").save(self.path)
            fault_point("apply-evolve")
        if change.source_types is not None:
            self.spark.sql(
                f"ALTER TABLE {self.sql_name} SET TBLPROPERTIES ({sql_string(SOURCE_TYPES)} = {sql_string(change.source_types)})"
            )
            fault_point("apply-evolve")

    def commit(
        self,
        statement: Callable[[str], str],
        source: DataFrame,
        lsn: int,
        *,
        batch_rows: int,
        local_source: bool = False,
        idempotent: bool = True,
    ) -> dict[str, int]:
        """Run ``statement(view)`` — Delta SQL on this table (:attr:`sql_name`) reading ``source``
        as the temporary view ``view`` — as one commit recording ``lsn`` as the table's applied
        LSN. Delta skips it if the table already holds ``lsn`` or later. Returns the statement's
        result row (a MERGE's counts; empty for an INSERT or a skipped commit). ``batch_rows``: the
        rows of the batch ``source`` holds; ``local_source``: ``source`` is those rows alone, held in
        the driver (:meth:`small_commit_settings`).

        ``idempotent=False`` (a rebuild at the LSN the table already holds) writes without the
        idempotency marker: the table's recorded version stays ``lsn``.
        """
        view = f"cdc_source_{uuid.uuid4().hex}"
        source.createTempView(view)
        try:
            with self._commit_settings(lsn, batch_rows, local_source, idempotent):
                rows = self.execute(statement(view))
        finally:
            self.spark.catalog.dropTempView(view)
        fault_point("apply-commit")
        return {name: int(value) for name, value in rows[0].asDict().items()} if rows else {}

    def replace(self, rows: DataFrame, condition: str, lsn: int, *, batch_rows: int) -> None:
        """Delta's ``INSERT … REPLACE ON`` as one commit recording ``lsn`` (skipped as
        :meth:`commit`'s): every row of the table (``t``) for which a row of ``rows`` (``s``)
        satisfies ``condition`` is deleted — a deletion vector, one pass over the table — and
        ``rows`` — a batch's, held in the driver: not copied first — cast to the table's types,
        appended (as one file below :data:`ONE_FILE_ROWS`). Spark's SQL form of the statement is
        not offered for Delta tables; this is the DataFrame writer's."""
        fields = {f.name: f.dataType for f in self.spark_schema().fields}
        typed = rows.select(*[F.col(backquote(c)).cast(fields[c]).alias(c) for c in rows.columns])
        if batch_rows < ONE_FILE_ROWS:
            typed = typed.coalesce(1)
        writer = typed.alias("s").write.format("delta").mode("overwrite")
        writer = writer.option("targetAlias", "t").option("replaceOn", condition)
        try:
            with self._commit_settings(lsn, batch_rows, local_source=True, also={REPLACE_MATERIALIZE_SOURCE: "none"}):
                writer.save(self.path)
        finally:
            self._wrote()
        fault_point("apply-commit")

    @contextmanager
    def _commit_settings(
        self,
        lsn: int,
        batch_rows: int,
        local_source: bool,
        idempotent: bool = True,
        also: dict[str, str] | None = None,
    ) -> Iterator[None]:
        """The session's settings of a commit recording ``lsn`` (its user metadata, Delta's
        idempotency marker, :meth:`small_commit_settings`, ``also``) around it, the session's own
        put back after."""
        settings = {
            USER_METADATA: self._user_metadata(lsn),
            **self.small_commit_settings(batch_rows, local_source),
            **(also or {}),
        }
        if idempotent:
            settings |= {TXN_APP_ID: self.app, TXN_VERSION: str(lsn)}
        with settings_around(self.spark, settings):
            yield

    def commit_in_process(
        self, write: Callable[[RustDeltaTable, CommitProperties], dict[str, int]], lsn: int
    ) -> dict[str, int]:
        """Run ``write`` — a delta-rs write of this table, in this process — with the commit
        properties that record ``lsn`` as the table's applied LSN (Delta's idempotency marker and
        the user metadata of :meth:`commit`); returns what ``write`` returns (its counts)."""
        properties = CommitProperties(
            app_transactions=[Transaction(self.app, lsn)], custom_metadata={"userMetadata": self._user_metadata(lsn)}
        )
        try:
            with self._writing_with_delta_rs():
                counts = write(self._table(), properties)
        except CommitFailedError:
            raise  # another writer's commit won (is_delta_conflict)
        except DeltaError as error:  # delta-rs's own (a failed read of a file among them): named, no traceback
            message = str(error).splitlines()[0] if str(error) else type(error).__name__
            raise CdcError(f"cannot write the Delta table at {self.path} with delta-rs: {message}") from None
        fault_point("apply-commit")
        return counts

    def _user_metadata(self, lsn: int) -> str:
        """A data commit's user metadata: the LSN it applies, and :attr:`note`."""
        return json.dumps({APPLIED_KEY: lsn} | ({NOTE_KEY: self.note} if self.note else {}))

    def execute(self, statement: str) -> list[Row]:
        """Run a Delta SQL statement that may write this table (a commit's, or maintenance's:
        ``OPTIMIZE``, ``REORG``, ``VACUUM``); its result rows."""
        try:
            return self.spark.sql(statement).collect()
        finally:
            self._wrote()


DELTA_CONFLICTS = (
    "[DELTA_CONCURRENT_",
    "[DELTA_METADATA_CHANGED]",
    "[DELTA_PROTOCOL_CHANGED]",
)
"""The error classes of a Delta commit that lost to another writer's commit since its snapshot."""


def is_delta_conflict(error: BaseException) -> bool:
    """Whether ``error`` is a Delta commit that lost to a concurrent commit (classic or Connect)."""
    text = str(error)
    return isinstance(error, CommitFailedError) or any(marker in text for marker in DELTA_CONFLICTS)
