"""Every copy reads a table's own rows, as PostgreSQL publishes them (docs/architecture.md,
"The initial snapshot", "Online snapshots"): an inheritance parent without its children's rows
(their changes arrive under the children), leaf partitions each with their own rows, and a
partitioned table through its root when the publication publishes via the partition root. After
setup, after a round of changes routed through parents and across partitions, and after an online
re-snapshot and more changes, every Delta table (read by Spark and by delta-rs) equals the rows
PostgreSQL publishes under its name.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cdc_assets.errors import PublicationMismatchError
from cdc_assets.pipeline.online_snapshot import snapshot_tables
from tests.support.database import Database
from tests.support.mirror import Mirror

pytestmark = pytest.mark.slow

INHERITANCE = (
    "CREATE TABLE parent (id int PRIMARY KEY, v text)",
    "CREATE TABLE child (extra int) INHERITS (parent)",
    "ALTER TABLE child ADD PRIMARY KEY (id)",
    "INSERT INTO parent VALUES (1, 'p1'), (2, 'p2')",
    "INSERT INTO child VALUES (10, 'c10', 100), (11, 'c11', 110)",
)
PARTITIONED = (
    "CREATE TABLE m (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)",
    "CREATE TABLE m_eu PARTITION OF m FOR VALUES IN ('eu')",
    "CREATE TABLE m_us PARTITION OF m FOR VALUES IN ('us')",
    "INSERT INTO m VALUES (1, 'eu', 'a'), (2, 'eu', 'b'), (3, 'us', 'c')",
)
CHANGES = (
    "UPDATE parent SET v = v || '!' WHERE id IN (1, 10)",  # id 10 is the child's: published as child
    "DELETE FROM parent WHERE id = 11",  # the child's row, deleted through the parent
    "INSERT INTO parent VALUES (3, 'p3')",
    "INSERT INTO child VALUES (12, 'c12', 120)",
    "UPDATE m SET region = 'us' WHERE id = 2",  # moves between partitions: D m_eu + I m_us
    "UPDATE m SET v = 'c!' WHERE id = 3",
    "INSERT INTO m VALUES (4, 'eu', 'd')",
)


def _ids(rows: list[dict[str, Any]]) -> list[int]:
    return sorted(row["id"] for row in rows)


def test_inheritance_parent_and_child_and_leaf_partitions(pg: Database, spark: Any, tmp_path: Path) -> None:
    tables = ["public.parent", "public.child", "public.m_eu", "public.m_us"]
    mirror = Mirror(pg, tmp_path / "mirror", {table: {} for table in tables}, spark)
    mirror.sql(*INHERITANCE, *PARTITIONED)
    created = mirror.setup()
    assert created.rows == {"public.parent": 2, "public.child": 2, "public.m_eu": 2, "public.m_us": 1}
    mirror.apply()
    assert _ids(mirror.check("public.parent")) == [1, 2]  # not the child's 10 and 11
    assert _ids(mirror.check("public.child")) == [10, 11]
    assert _ids(mirror.check("public.m_eu")) == [1, 2]
    mirror.sql(*CHANGES)
    mirror.sync()
    assert [(r["id"], r["v"]) for r in sorted(mirror.check("public.parent"), key=lambda r: r["id"])] == [
        (1, "p1!"),
        (2, "p2"),
        (3, "p3"),
    ]
    assert [(r["id"], r["v"]) for r in sorted(mirror.check("public.child"), key=lambda r: r["id"])] == [
        (10, "c10!"),
        (12, "c12"),
    ]
    assert _ids(mirror.check("public.m_eu")) == [1, 4]
    assert _ids(mirror.check("public.m_us")) == [2, 3]

    copied = snapshot_tables(mirror.config(), tables)  # online, each as PostgreSQL publishes it
    assert {c.table: c.rows for c in copied} == {
        "public.parent": 3,
        "public.child": 2,
        "public.m_eu": 2,
        "public.m_us": 2,
    }
    mirror.sql("UPDATE parent SET v = 'again' WHERE id IN (2, 12)", "UPDATE m SET region = 'eu' WHERE id = 3")
    mirror.sync()
    assert [(r["id"], r["v"]) for r in sorted(mirror.check("public.parent"), key=lambda r: r["id"])] == [
        (1, "p1!"),
        (2, "again"),
        (3, "p3"),
    ]
    assert [(r["id"], r["v"]) for r in sorted(mirror.check("public.child"), key=lambda r: r["id"])] == [
        (10, "c10!"),
        (12, "again"),
    ]
    assert _ids(mirror.check("public.m_eu")) == [1, 3, 4]
    assert _ids(mirror.check("public.m_us")) == [2]


def test_partitioned_table_through_its_root(pg: Database, spark: Any, tmp_path: Path) -> None:
    """A configured partitioned table: the publication cdc-assets creates publishes via the root."""
    mirror = Mirror(pg, tmp_path / "root", {"public.m": {}}, spark, source={"slot": "root_slot", "publication": "root"})
    mirror.sql(*PARTITIONED)
    assert mirror.setup().rows == {"public.m": 3}
    assert pg.execute("SELECT pubviaroot FROM pg_publication WHERE pubname = 'root'") == [(True,)]
    mirror.sql(*CHANGES[4:])
    mirror.sync()
    assert sorted((r["id"], r["region"], r["v"]) for r in mirror.check("public.m")) == [
        (1, "eu", "a"),
        (2, "us", "b"),
        (3, "us", "c!"),
        (4, "eu", "d"),
    ]

    (copied,) = snapshot_tables(mirror.config(), ["public.m"])
    assert copied.rows == 4
    mirror.sql("UPDATE m SET region = 'eu' WHERE id = 3", "DELETE FROM m WHERE id = 1")
    mirror.sync()
    assert sorted((r["id"], r["region"], r["v"]) for r in mirror.check("public.m")) == [
        (2, "us", "b"),
        (3, "eu", "c!"),
        (4, "eu", "d"),
    ]


def test_partitioned_table_under_a_publication_that_sends_its_leaves_is_refused(pg: Database, tmp_path: Path) -> None:
    pg.execute(";".join(PARTITIONED))
    pg.execute("CREATE PUBLICATION leaves FOR TABLE m")
    mirror = Mirror(pg, tmp_path / "leaves", {"public.m": {}}, None, source={"slot": "leaves", "publication": "leaves"})
    with pytest.raises(PublicationMismatchError) as refused:
        mirror.setup()
    assert str(refused.value).startswith(
        "publication leaves does not publish public.m (a partitioned table whose changes the publication sends under"
        " its leaf partitions: configure the leaves, or publish with publish_via_partition_root = true)"
    )
    assert pg.execute("SELECT count(*) FROM pg_replication_slots") == [(0,)]
