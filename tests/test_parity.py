"""The read-only parity comparison (``cdc_assets.pipeline.parity``): which Delta version holds a
table's state at a source point, against a real PostgreSQL, change log and Delta table."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.changelog.store import changelog_store
from cdc_assets.lsn import parse_lsn
from cdc_assets.pipeline.parity import Uncompared, _version_at, read_parity
from tests.support.database import Database
from tests.support.mirror import Mirror

TABLE = "public.pa"


@pytest.mark.slow
def test_the_version_holding_a_point_is_found_before_and_after_it_and_waited_for_when_the_log_is_behind(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    mirror = Mirror(pg, tmp_path / "mirror", {TABLE: {}}, spark)
    mirror.sql("CREATE TABLE pa (id int PRIMARY KEY, v text)", "INSERT INTO pa VALUES (1, 'a')")
    mirror.setup()
    config = mirror.config()
    table = config.table(TABLE)
    reader = ChangeLogReader(changelog_store(config))

    def now() -> int:
        return parse_lsn(pg.execute("SELECT pg_current_wal_lsn()::text")[0][0])

    mirror.sql("INSERT INTO pa VALUES (2, 'b')")
    mirror.sync()
    first = (mirror.version(TABLE), mirror.applied(TABLE))
    between = now()  # after the first change, before the second
    mirror.sql("UPDATE pa SET v = 'c' WHERE id = 1")
    mirror.sync()
    second = (mirror.version(TABLE), mirror.applied(TABLE))
    assert second[0] > first[0] and second[1] > between >= first[1]  # type: ignore[operator]

    # A point between the merges: the later version holds a change after it, the earlier one is exact.
    assert _version_at(config, table, reader, between) == first
    # The point the last merge reached: the latest version.
    assert _version_at(config, table, reader, mirror.checkpoint_lsn()) == second

    # A change the log does not hold yet: nothing to compare until a drain passes the point.
    mirror.sql("DELETE FROM pa WHERE id = 2")
    behind = _version_at(config, table, reader, now())
    assert isinstance(behind, str) and "has not reached the snapshot point" in behind
    waited = read_parity(config, table, spark, wait_seconds=0.5)
    assert isinstance(waited, Uncompared) and "for 0.5 s" in waited.reason

    # Drained, not merged: the table's merge is waited for.
    mirror.drain()
    unmerged = _version_at(config, table, reader, mirror.checkpoint_lsn())
    assert isinstance(unmerged, str) and "merge has not brought its changes" in unmerged

    # Merged, and a following drain passes each new snapshot point: compared, equal.
    mirror.apply()
    following = mirror.popen("drain", "--follow", "120")
    try:
        parity = read_parity(config, table, spark, wait_seconds=60)
    finally:
        following.terminate()
        assert following.wait(timeout=60) == 130
    assert not isinstance(parity, Uncompared) and parity.ok and parity.source.rows == 1
    assert parity.delta_version == mirror.version(TABLE)
