"""A table truncated or rewritten between a copy's snapshot and its read, against real PostgreSQL.

TRUNCATE (and VACUUM FULL, CLUSTER, a rewriting ALTER TABLE) is not MVCC-safe: a snapshot taken
before it commits reads the new, empty file. A copy therefore locks each table it reads, finds a
rewrite that committed after the snapshot, and starts again from a new snapshot
(docs/architecture.md, "The initial snapshot"). The TRUNCATE is committed at the one moment that
matters — the slot created, the table not yet locked — by wrapping the slot creation; everything
else is the real copy.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from psycopg import errors

import cdc_assets.pipeline.online_snapshot
import cdc_assets.pipeline.setup
from cdc_assets.config import SourceConfig
from cdc_assets.errors import TableRewrittenError
from cdc_assets.names import TableName
from cdc_assets.pipeline.online_snapshot import snapshot_tables
from cdc_assets.source import ExportedSnapshot, create_slot_with_snapshot
from cdc_assets.source.parallel_copy import ParallelCopy
from cdc_assets.source.snapshot import SnapshotReader
from tests.support.copied import KeptBlocks
from tests.support.database import Database
from tests.support.pipeline import Pipeline

TABLES = (
    "CREATE TABLE t (id int PRIMARY KEY, v text);"
    " INSERT INTO t SELECT g, 'before' FROM generate_series(1, 500) g;"
    " CREATE TABLE parted (id int PRIMARY KEY, v text) PARTITION BY RANGE (id);"
    " CREATE TABLE parted_low PARTITION OF parted FOR VALUES FROM (0) TO (100);"
    " CREATE TABLE parted_high PARTITION OF parted FOR VALUES FROM (100) TO (1000);"
    " INSERT INTO parted SELECT g, 'before' FROM generate_series(1, 300) g;"
    " CREATE PUBLICATION cdc_pub FOR TABLE t, parted WITH (publish_via_partition_root)"
)
TRUNCATE_T = "TRUNCATE t; INSERT INTO t SELECT g, 'after' FROM generate_series(1, 3) g"


def test_a_table_truncated_after_the_snapshot_is_refused_and_a_locked_one_cannot_be(pg: Database) -> None:
    """A TRUNCATE (of a table, of a leaf partition) committed after the snapshot: the reader and the
    parallel copy refuse the table, naming it and the slot; a reader that has locked a table holds
    the lock, and a TRUNCATE waits until it ends."""
    pg.execute(TABLES)
    source = SourceConfig(dsn=pg.dsn, slot=f"s_{pg.name}", publication="cdc_pub")
    t, parted = TableName("public", "t"), TableName("public", "parted")
    with create_slot_with_snapshot(source, temporary=True) as exported:
        pg.execute(TRUNCATE_T)
        pg.execute("TRUNCATE parted_high")
        with SnapshotReader(source, exported.snapshot_name) as reader:
            relation = reader.describe(t)
            with pytest.raises(TableRewrittenError) as refused:
                list(reader.chunks(relation, [False] * len(relation.columns)))
        assert "table public.t (t) was truncated or rewritten" in str(refused.value)
        assert f"slot {source.slot}" in str(refused.value)
        with ParallelCopy(source, exported.snapshot_name, 2) as copy:
            relation = copy.reader.describe(parted)
            plan = copy.plan(relation, [True] * len(relation.columns))
            with pytest.raises(TableRewrittenError, match=r"table public\.parted \(parted_high\)"):
                list(copy.run([plan], KeptBlocks()))

    with create_slot_with_snapshot(source, temporary=True) as exported:
        with SnapshotReader(source, exported.snapshot_name) as reader:
            relation = reader.describe(t)
            assert reader.lock(relation) == 'ONLY "public"."t"'  # what a worker does before reading
            with pg.connect(autocommit=True) as other:
                other.execute("SET lock_timeout = '100ms'")
                with pytest.raises(errors.LockNotAvailable):
                    other.execute("TRUNCATE t")
            rows = sum(len(columns[0]) for columns in reader.chunks(relation, [True] * len(relation.columns)))
        assert rows == 3


def truncating_once(pg: Database, statement: str, seen: list[int]) -> Callable[..., Any]:
    """A stand-in for ``create_slot_with_snapshot`` that commits ``statement`` right after creating
    the first slot (its snapshot taken, no table locked yet) and records the LSN after it."""

    @contextmanager
    def create(source: SourceConfig, *args: Any, **kwargs: Any) -> Iterator[ExportedSnapshot]:
        with create_slot_with_snapshot(source, *args, **kwargs) as exported:
            if not seen:
                pg.execute(statement)
                ((lsn,),) = pg.execute("SELECT (pg_current_wal_insert_lsn() - '0/0')::int8")
                seen.append(int(lsn))
            yield exported

    return create


def test_setup_copies_again_when_a_table_is_truncated_after_its_snapshot(
    pg: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Setup's slot was created, then ``t`` truncated and refilled before the copy locked it: setup
    drops that slot, takes a new snapshot after the TRUNCATE and copies the rows the source holds;
    the log replayed equals the source, and the restart is logged."""
    pg.execute(TABLES)
    seen: list[int] = []
    pipe = Pipeline(pg, tmp_path, ["public.t", "public.parted"])
    monkeypatch.setattr(cdc_assets.pipeline.setup, "create_slot_with_snapshot", truncating_once(pg, TRUNCATE_T, seen))
    with caplog.at_level(logging.WARNING):
        result = pipe.setup()
    assert result.snapshot_lsn is not None and result.snapshot_lsn > seen[0], "the copy kept the first snapshot"
    assert result.rows == {"public.t": 3, "public.parted": 300}
    assert any("copying again from a new snapshot (2 of 5)" in r.getMessage() for r in caplog.records)
    assert pg.execute("SELECT slot_name::text FROM pg_replication_slots") == [("cdc_slot",)]
    pg.execute("UPDATE t SET v = 'later' WHERE id = 2")
    pipe.drain()
    pipe.assert_mirrors(["public.t", "public.parted"])


def test_an_online_snapshot_copies_again_when_the_table_is_truncated_after_its_snapshot(
    pg: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An online run's temporary slot was created, then ``t`` truncated and refilled before the copy
    locked it: the run is abandoned (its folder deleted) and a new one copies ``t`` as of a snapshot
    after the TRUNCATE; replaying the log from that run gives the source, with no anomaly."""
    pg.execute(TABLES)
    pipe = Pipeline(pg, tmp_path, ["public.t", "public.parted"])
    pipe.setup()
    pg.execute("UPDATE t SET v = 'changed' WHERE id <= 10")
    seen: list[int] = []
    create = truncating_once(pg, TRUNCATE_T + "; UPDATE t SET v = 'moved' WHERE id = 1", seen)
    monkeypatch.setattr(cdc_assets.pipeline.online_snapshot, "create_slot_with_snapshot", create)
    (copied,) = snapshot_tables(pipe.config(), ["public.t"])
    assert copied.consistent_point > seen[0] and copied.rows == 3
    runs = sorted(p.name for p in (Path(pipe.changelog) / "snapshots" / "public.t").iterdir())
    assert runs == [copied.run], "the abandoned run is left"
    pg.execute("UPDATE t SET v = 'later' WHERE id = 2; INSERT INTO t VALUES (4, 'new')")
    pipe.drain()
    pipe.assert_mirrors(["public.t", "public.parted"])
    assert pg.execute("SELECT slot_name::text FROM pg_replication_slots") == [("cdc_slot",)]
