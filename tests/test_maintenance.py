"""Delta table maintenance (``cdc_assets.apply.maintenance``) on real tables: real PostgreSQL, the
library API and ``cdc-assets maintain`` (its own Spark, in a subprocess), Delta tables read with
Spark and delta-rs.

Covered: OPTIMIZE compacts the files merges leave and takes their deletion vectors with it;
REORG … APPLY (PURGE) removes the deletion vectors left on files OPTIMIZE did not rewrite; the
table stays equal to its source; the applied LSN is the same after every maintenance commit, and
a merge replayed after maintenance is still skipped (by the apply and by Delta itself); VACUUM
deletes only files that left the table more than the retention ago; a following drain's merges
compact a table they grew to ``follow_compact_files`` files."""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from cdc_assets.apply.follower import MergeFollower
from cdc_assets.apply.maintenance import Maintained, maintain_table
from cdc_assets.apply.merge import write_plan
from cdc_assets.apply.runner import TableApplied
from cdc_assets.apply.table_files import table_files
from cdc_assets.apply.target import DeltaTarget
from cdc_assets.config import MaintenanceConfig
from cdc_assets.lsn import format_lsn
from tests.support.database import Database
from tests.support.mirror import Mirror
from tests.support.pipeline import wait_until
from tests.support.rows import difference

TABLE = "public.m"
DAY_S = 24 * 3600


def spread_changes(mirror: Mirror, round_: int) -> None:
    """Updates and deletes over the whole key range, and new keys: every merge writes new files
    and deletion vectors on the files it touched."""
    mirror.sql(
        f"UPDATE m SET v = v || '+', n = n + 1 WHERE id % 50 = {round_}",
        f"DELETE FROM m WHERE id % 50 = {round_ + 25}",
        f"INSERT INTO m SELECT i, 'new ' || i, i FROM generate_series({10_000 + 100 * round_}, {10_049 + 100 * round_}) i",
    )


def copied_mirror(pg: Database, spark: Any, tmp_path: Path, maintenance: dict[str, int]) -> Mirror:
    """The 2,000-row table ``m`` set up and copied to Delta, with these maintenance settings (and
    deletion vectors however small the table)."""
    mirror = Mirror(
        pg, tmp_path / "mirror", {TABLE: {}}, spark, warehouse={"maintenance": maintenance, "small_table_mb": 0}
    )
    mirror.sql(
        "CREATE TABLE m (id int PRIMARY KEY, v text, n int)",
        "INSERT INTO m SELECT i, 'row ' || i, i FROM generate_series(1, 2000) i",
    )
    mirror.setup()
    mirror.apply()
    return mirror


@pytest.mark.slow
def test_maintain_compacts_purges_and_keeps_the_table_and_its_applied_lsn(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    maintenance = {"compact_min_files": 6, "purge_min_deletion_vectors": 1}
    mirror = copied_mirror(pg, spark, tmp_path, maintenance)
    for round_ in range(1, 5):
        spread_changes(mirror, round_)
        mirror.sync()
    # The last batch is written by hand, so that it can be replayed after maintenance.
    spread_changes(mirror, 5)
    mirror.drain()
    target, plan, lsn = mirror.pending_plan(TABLE)
    write_plan(target, plan, lsn)
    path = mirror.path(TABLE)
    before = table_files(path)
    assert before.files >= 6 and before.deletion_vectors >= 4, before
    rows = mirror.check(TABLE)

    done = mirror.cli("maintain", "--table", TABLE)
    assert done.returncode == 0, done.stderr
    after = table_files(path)
    assert after.files < before.files and after.deletion_vectors == 0 and after.version > before.version, after
    assert done.stdout.splitlines() == [
        f"maintained {TABLE}: OPTIMIZE, VACUUM (0 files deleted); files {before.files} → {after.files}, deletion vectors"
        f" {before.deletion_vectors} → 0, {before.bytes / 1e6:,.1f} → {after.bytes / 1e6:,.1f} MB,"
        f" Delta version {before.version} → {after.version}; applied LSN {format_lsn(lsn)} ("
        + done.stdout.rsplit("(", 1)[-1].rstrip("\n")
    ], done.stdout
    assert mirror.applied(TABLE) == lsn
    assert not difference(mirror.check(TABLE), rows)

    # The batch replayed after maintenance changes nothing: the apply sees the applied LSN, and
    # Delta skips a commit at it by itself.
    replay = write_plan(target, plan, lsn)
    assert (replay.inserted, replay.updated, replay.deleted) == (0, 0, 0)
    double = f"INSERT INTO {target.sql_name} SELECT * FROM {{}}"  # would double every row
    target.commit(double.format, target.read(), lsn, batch_rows=0)
    assert mirror.version(TABLE) == after.version and mirror.applied(TABLE) == lsn
    assert not difference(mirror.check(TABLE), rows)

    # A merge after maintenance leaves a deletion vector on the large file; with compaction not
    # due, the purge alone rewrites it.
    spread_changes(mirror, 6)
    mirror.sync()
    merged = table_files(path)
    assert merged.deletion_vectors >= 1
    purge_only = replace(mirror.config().warehouse.maintenance, compact_min_files=0)
    purged = maintain_table(target, purge_only, TABLE)
    assert purged.steps == ("REORG PURGE", "VACUUM") and purged.before == merged
    assert purged.after is not None and purged.after.deletion_vectors == 0 and purged.after.deleted_rows == 0
    assert purged.applied_lsn == mirror.applied(TABLE) == mirror.checkpoint_lsn()
    assert Path(path, "_delta_log", "_last_checkpoint").exists()  # that LSN was read through a log checkpoint
    mirror.check(TABLE)


@pytest.mark.slow
def test_a_follower_compacts_a_table_once_its_merges_leave_it_with_follow_compact_files(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    """Each merge adds files; the merge that leaves the table with ``follow_compact_files`` of them
    is followed by an OPTIMIZE of that table alone (reported, under its write lock): fewer files,
    no deletion vector, the applied LSN kept, the table equal to its source."""
    maintenance = {"follow_compact_files": 4, "compact_min_files": 0, "purge_min_deletion_vectors": 0}
    mirror = copied_mirror(pg, spark, tmp_path, maintenance)
    path = mirror.path(TABLE)
    assert table_files(path).files < 4
    merged: list[TableApplied] = []
    compacted: list[Maintained] = []
    with MergeFollower(mirror.config(), spark, merged.append, on_compacted=compacted.append) as follower:
        for round_ in range(1, 7):
            spread_changes(mirror, round_)
            mirror.drain()
            follower.batch_durable()
            wait_until(lambda done=round_: len(merged) == done, timeout=120, what=f"merge {round_}")
            if (merged[-1].data_files or 0) >= 4:  # its compaction is reported after it, by close()
                break
    assert len(compacted) == 1, [m.summary() for m in merged]
    done = compacted[0]
    assert merged[-1].data_files is not None and merged[-1].data_files >= 4
    assert done.steps == ("OPTIMIZE",) and done.before is not None and done.after is not None
    assert done.before.files == merged[-1].data_files and done.after.files < done.before.files
    assert done.after.deletion_vectors == 0 and done.applied_lsn == merged[-1].applied_lsn
    assert all(m.data_files is not None and m.data_files < 4 for m in merged[:-1])
    assert table_files(path) == done.after
    mirror.check(TABLE)


@pytest.mark.slow
def test_vacuum_deletes_only_files_older_than_the_retention(spark: Any, tmp_path: Path) -> None:
    """VACUUM with the default retention (7 days): a file that left the table just now stays (time
    travel to the version before OPTIMIZE still reads), an untracked file older than 7 days is
    deleted, one younger than 7 days stays."""
    path = str(tmp_path / "t")
    for start in range(0, 300, 100):
        spark.range(start, start + 100, 1, 1).selectExpr("id", "cast(id AS string) AS v").write.format("delta").mode(
            "append"
        ).save(path)
    target = DeltaTarget(spark, path, "cdc_assets:test:public.t")
    now = time.time()
    old, young = Path(path, "part-old-orphan.parquet"), Path(path, "part-young-orphan.parquet")
    for file, age_days in ((old, 8), (young, 6)):
        file.write_bytes(b"not part of the table")
        os.utime(file, (now - age_days * DAY_S, now - age_days * DAY_S))
    version = table_files(path).version

    done = maintain_table(target, MaintenanceConfig(compact_min_files=2), "public.t")
    assert done.steps == ("OPTIMIZE", "VACUUM") and done.vacuumed_files == 1, done
    assert done.before is not None and done.after is not None and (done.before.files, done.after.files) == (3, 1)
    assert not old.exists() and young.exists()
    earlier = spark.read.format("delta").option("versionAsOf", version).load(path)
    assert earlier.count() == 300 == target.read().count()
