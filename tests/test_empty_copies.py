"""A copy of an empty table is the table's whole contents too: applied, it empties the Delta table;
a rebuild starts from it (docs/architecture.md, "Online snapshots"). Against real PostgreSQL,
Spark and Delta, for a keyed, a REPLICA IDENTITY FULL and a keyless table.

The case the online-snapshot crash test met by chance: the source is truncated, the Delta table
has not applied the TRUNCATE yet, and an online snapshot copies the now empty table. The apply then
starts from the copy (the TRUNCATE before the copy's consistent point is not read again), so the
copy itself must empty the table, rows or none.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cdc_assets.apply.runner import rebuild_table
from cdc_assets.pipeline.online_snapshot import snapshot_tables
from tests.support.database import Database
from tests.support.mirror import Mirror

TABLES = ("public.keyed", "public.full_row", "public.keyless")
CREATE = (
    "CREATE TABLE keyed (id int PRIMARY KEY, v text)",
    "CREATE TABLE full_row (id int, v text)",
    "ALTER TABLE full_row REPLICA IDENTITY FULL",
    "CREATE TABLE keyless (id int, v text)",
    "INSERT INTO keyed SELECT g, 'before' FROM generate_series(1, 50) g",
    "INSERT INTO full_row SELECT g % 10, 'before' FROM generate_series(1, 50) g",  # duplicate rows
    "INSERT INTO keyless SELECT g, 'before' FROM generate_series(1, 50) g",
)


@pytest.mark.slow
def test_an_empty_online_copy_empties_the_delta_table_and_a_rebuild_starts_from_it(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    mirror = Mirror(pg, tmp_path / "mirror", {table: {} for table in TABLES}, spark)
    mirror.sql(*CREATE)
    mirror.setup()
    mirror.apply()
    for table in TABLES:
        assert len(mirror.check(table)) == 50
    mirror.sql("TRUNCATE keyed, full_row, keyless")  # drained below, never applied before the copy
    copied = snapshot_tables(mirror.config(), list(TABLES))
    assert {c.table: c.rows for c in copied} == dict.fromkeys(TABLES, 0)
    mirror.sync()
    for table in TABLES:
        assert mirror.check(table) == [], table
    mirror.sql(*(f"INSERT INTO {t.split('.')[1]} VALUES (7, 'after')" for t in TABLES))
    mirror.sync()
    config = mirror.config()
    for table in TABLES:
        assert mirror.check(table) == [{"id": 7, "v": "after"}], table
        rebuilt = rebuild_table(config, config.table(table), spark)  # from the empty copy, then the insert
        assert rebuilt.inserted == 1, rebuilt.summary()
        assert mirror.check(table) == [{"id": 7, "v": "after"}], table


@pytest.mark.slow
def test_a_table_empty_at_setup_can_be_rebuilt(pg: Database, spark: Any, tmp_path: Path) -> None:
    mirror = Mirror(pg, tmp_path / "mirror", {table: {} for table in TABLES}, spark)
    mirror.sql(*CREATE[:4])
    mirror.setup()
    mirror.sql(*(f"INSERT INTO {t.split('.')[1]} VALUES (7, 'after')" for t in TABLES))
    mirror.sync()
    config = mirror.config()
    for table in TABLES:
        rebuilt = rebuild_table(config, config.table(table), spark)
        assert rebuilt.inserted == 1, rebuilt.summary()
        assert mirror.check(table) == [{"id": 7, "v": "after"}], table
