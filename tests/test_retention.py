"""Change-log retention (``cdc_assets.changelog.retention``) against real PostgreSQL: segments every reader
has applied are folded into a compacted base and deleted, and the log still replays to the source
(the oracle, ``tests/support/oracle.py``, reads each table from its latest copy); a table held
behind keeps its segments, ``status`` says how much it holds, and it catches up exactly; a drain
killed between writing the base and deleting the segments leaves a correct log.

``changelog.retention_hours: 0`` makes every applied segment old enough, so nothing waits for time,
``retention_every_minutes: 0`` makes retention due whenever it is run (after each drain here, as the
commands run it), and ``fold_min_share: 0`` writes a base whenever changes are folded (one test sets
the fold policy).
Without Spark, a table's applied LSN is written into its Delta log by delta-rs (the idempotent-write
marker the apply records, on a Delta table of no rows): retention reads nothing else of it. The one
test of real merges (a held table catching up, a rebuild from a base) uses Spark and is slow."""

from __future__ import annotations

from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from cdc_assets.apply.history import HistoryGoneError, history_rows
from cdc_assets.apply.runner import rebuild_table
from cdc_assets.changelog.checkpoint import write_checkpoint
from cdc_assets.changelog.retention import RetentionResult
from cdc_assets.changelog.snapshot_runs import is_base
from cdc_assets.changelog.store import changelog_store
from cdc_assets.errors import CdcError
from cdc_assets.pipeline.online_snapshot import CopyProgress, snapshot_tables
from cdc_assets.pipeline.retention import retain_when_due
from cdc_assets.pipeline.status import read_status
from cdc_assets.source import DrainLock
from dagster_project.assets import drain_metadata
from tests.support.applied_marker import mark_applied
from tests.support.commit_time import commit_at
from tests.support.database import Database
from tests.support.mirror import Mirror
from tests.support.pipeline import Pipeline

RANDOM_20K = "(SELECT string_agg(md5(random()::text), '') FROM generate_series(1, 640))"
KINDS = ["public.k", "public.f", "public.n"]


def create_kinds(db: Database) -> None:
    """A keyed table with a TOASTed column, a REPLICA IDENTITY FULL table with duplicate rows, a
    table without a key (append-only)."""
    for statement in (
        "CREATE TABLE k (id int PRIMARY KEY, v text, big text)",
        "CREATE TABLE f (a int, b text)",
        "ALTER TABLE f REPLICA IDENTITY FULL",
        "CREATE TABLE n (a int, b text)",
        f"INSERT INTO k SELECT i, 'v' || i, CASE WHEN i = 1 THEN {RANDOM_20K} END FROM generate_series(1, 20) i",
        "INSERT INTO f VALUES (1, 'x'), (1, 'x'), (2, 'y')",
        "INSERT INTO n VALUES (1, 'x'), (1, 'x')",
    ):
        db.execute(statement)


def change_kinds(db: Database, round_: int) -> None:
    """One transaction per statement: updates (one leaving the TOASTed column alone), a key change,
    deletes, inserts, a duplicate removed and added."""
    for statement in (
        f"UPDATE k SET v = v || '+{round_}' WHERE id = 1",
        f"UPDATE k SET v = 'r{round_}' WHERE id % 3 = {round_ % 3}",
        f"UPDATE k SET id = id + 1000 WHERE id = {round_ + 1}",
        f"DELETE FROM k WHERE id = {round_ + 10}",
        f"INSERT INTO k VALUES ({100 + round_}, 'new', NULL)",
        "DELETE FROM f WHERE ctid = (SELECT min(ctid) FROM f WHERE a = 1)",
        f"INSERT INTO f VALUES (1, 'x'), ({round_ + 10}, 'z')",
        f"INSERT INTO n VALUES ({round_}, 'r')",
    ):
        db.execute(statement)


def checkpoint_lsn(pipe: Pipeline) -> int:
    checkpoint = pipe.checkpoint()
    assert checkpoint is not None
    return checkpoint.lsn


def segments(pipe: Pipeline, table: str) -> list[str]:
    return sorted(p.name for p in (Path(pipe.changelog) / "tables" / table).glob("*.parquet"))


def bases(pipe: Pipeline, table: str) -> list[str]:
    return sorted(p.name for p in (Path(pipe.changelog) / "snapshots" / table).glob("*") if is_base(p.name))


EVERY_RUN = {"retention_every_minutes": 0}  # retention due whenever it is run


def retained(pg: Database, tmp_path: Path, tables: list[str]) -> Pipeline:
    return Pipeline(pg, tmp_path, tables, changelog_settings={"retention_hours": 0, "fold_min_share": 0} | EVERY_RUN)


def drained(pipe: Pipeline, **kwargs: Any) -> RetentionResult:
    """A drain, then change-log retention (due: it runs)."""
    drained = pipe.drain(**kwargs)
    retention = pipe.retain()
    assert retention is not None, drained
    return retention


def kinds_drained(pg: Database, tmp_path: Path) -> Pipeline:
    """The three kinds of tables set up, changed once and drained, with a retention of 0."""
    create_kinds(pg)
    pipe = retained(pg, tmp_path, KINDS)
    pipe.setup()
    change_kinds(pg, 1)
    pipe.drain(wait=True)
    return pipe


def test_retention_folds_what_every_table_applied_and_the_log_still_replays(pg: Database, tmp_path: Path) -> None:
    pipe = kinds_drained(pg, tmp_path)
    applied = checkpoint_lsn(pipe)
    before = {t: segments(pipe, t) for t in KINDS}
    transactions_before = pipe.batch_starts()
    for table in KINDS:
        mark_applied(pipe.config(), table, applied)
    for round_ in (2, 3):
        change_kinds(pg, round_)
        drain = pipe.drain(wait=True)
        retention = pipe.retain()
        assert retention is not None
        pipe.assert_mirrors()
        checkpoint = pipe.checkpoint()
        assert checkpoint is not None
        for table in KINDS:
            state = checkpoint.tables[table]
            assert state.snapshot_run is not None and is_base(state.snapshot_run.run)
            assert state.folded is not None and state.folded.lsn <= applied
            assert bases(pipe, table) == [state.snapshot_run.run]
            assert not set(before[table]) & set(segments(pipe, table)), table  # the applied batches are gone
        assert min(pipe.batch_starts()) > max(transactions_before)
        applied = checkpoint_lsn(pipe)
        for table in KINDS:
            mark_applied(pipe.config(), table, applied)
    assert retention is not None
    folded = {t.table: t for t in retention.tables}
    assert all(folded[t].removed_segments and folded[t].base for t in KINDS), retention
    assert "compacted base" in drain_metadata(drain, retention)["retention"].value  # type: ignore[operator]  # the Dagster drain asset's
    state = pipe.checkpoint().tables["public.k"]  # type: ignore[union-attr]
    with pytest.raises(HistoryGoneError, match=r"the history of public.k for .* is gone"):
        history_rows(pipe.reader, "public.k", state, datetime.now(UTC).date())


def test_retention_runs_when_due_under_the_drain_lock(pg: Database, tmp_path: Path) -> None:
    """``changelog.retention_every_minutes``: retention runs when it never ran or last ran that long
    ago (the checkpoint records when), not while a drain holds the log, and never inside a drain."""
    create_kinds(pg)
    settings = {"retention_hours": 0, "fold_min_share": 0, "retention_every_minutes": 60}
    pipe = Pipeline(pg, tmp_path, KINDS, changelog_settings=settings)
    pipe.setup()
    change_kinds(pg, 1)
    pipe.drain()
    assert retained_at(pipe) is None  # the drain folds nothing itself
    for table in KINDS:
        mark_applied(pipe.config(), table, checkpoint_lsn(pipe))
    first = pipe.retain()
    assert first is not None and all(t.removed_segments for t in first.tables), first
    ran = retained_at(pipe)
    assert ran is not None
    change_kinds(pg, 2)
    pipe.drain()
    assert pipe.retain() is None and retained_at(pipe) == ran  # not due
    checkpoint = pipe.checkpoint()
    assert checkpoint is not None
    write_checkpoint(changelog_store(pipe.config()), replace(checkpoint, retained_at_us=ran - 61 * 60_000_000))
    with DrainLock(pipe.config().source, wait=False):  # a drain holds the log: retention is left for later
        assert pipe.retain() is None
    assert pipe.retain() is not None and (retained_at(pipe) or 0) > ran
    pipe.assert_mirrors()


def retained_at(pipe: Pipeline) -> int | None:
    checkpoint = pipe.checkpoint()
    assert checkpoint is not None
    return checkpoint.retained_at_us


def test_only_changes_older_than_the_retention_go_and_their_days_report_gone(pg: Database, tmp_path: Path) -> None:
    """Commit times days in the past (a replication origin's, as a subscriber replays them), a
    retention of one day: the old batches are folded, today's stay, and so does their history."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    settings = {"retention_hours": 24, "fold_min_share": 0} | EVERY_RUN
    pipe = Pipeline(pg, tmp_path, ["public.t"], changelog_settings=settings)
    pipe.setup()
    now = datetime.now(UTC)
    old_day = (now - timedelta(days=3)).date()
    commit_at(pg, now - timedelta(days=3), "INSERT INTO t VALUES (1, 'old')")
    pipe.drain(wait=True)
    commit_at(pg, now - timedelta(days=2), "UPDATE t SET v = 'older' WHERE id = 1")
    pipe.drain(wait=True)
    pg.execute("INSERT INTO t VALUES (2, 'today')")
    pipe.drain(wait=True)
    young = segments(pipe, "public.t")[-1]
    before = pipe.checkpoint().tables["public.t"]  # type: ignore[union-attr]
    assert history_rows(pipe.reader, "public.t", before, old_day).column("after").to_pylist() == [{"id": 1, "v": "old"}]
    mark_applied(pipe.config(), "public.t", checkpoint_lsn(pipe))
    assert drained(pipe).tables[0].removed_segments == 3  # snapshot, 2 old
    assert segments(pipe, "public.t") == [young]
    pipe.assert_mirrors()
    state = pipe.checkpoint().tables["public.t"]  # type: ignore[union-attr]
    with pytest.raises(HistoryGoneError, match=rf"the history of public.t for {old_day.isoformat()} is gone"):
        history_rows(pipe.reader, "public.t", state, old_day)
    today = history_rows(pipe.reader, "public.t", state, now.date())
    assert today.column("after").to_pylist() == [{"id": 2, "v": "today"}]


def test_a_table_held_behind_keeps_its_segments_and_status_names_it(pg: Database, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE a (id int PRIMARY KEY, v text)")
    pg.execute("CREATE TABLE b (id int PRIMARY KEY, v text)")
    pipe = retained(pg, tmp_path, ["public.a", "public.b"])
    pipe.setup()
    for round_ in (1, 2):
        pg.execute(f"INSERT INTO a VALUES ({round_}, 'a')")
        pg.execute(f"INSERT INTO b VALUES ({round_}, 'b')")
        pipe.drain(wait=True)
    mark_applied(pipe.config(), "public.a", checkpoint_lsn(pipe))
    held = segments(pipe, "public.b")
    transactions = pipe.batch_starts()
    pg.execute("INSERT INTO a VALUES (3, 'a')")
    by_table = {t.table: t for t in drained(pipe).tables}
    assert by_table["public.a"].removed_segments == 3 and by_table["public.b"].removed_segments == 0
    assert segments(pipe, "public.b") == held and pipe.batch_starts()[: len(transactions)] == transactions

    mark_applied(pipe.config(), "public.a", checkpoint_lsn(pipe))
    status = read_status(pipe.config())
    hold = {t.name: t.held for t in status.tables}
    assert hold["public.a"] is None
    # b's two batches of changes (its empty initial snapshot holds nothing)
    assert hold["public.b"] is not None and hold["public.b"].segments == 2 and hold["public.b"].bytes > 0
    assert any(line.strip().startswith("holds back the change log: 2 segments") for line in status.lines())
    assert status.to_json()["tables"]["public.b"]["held"]["segments"] == 2
    pipe.assert_mirrors()

    mark_applied(pipe.config(), "public.b", checkpoint_lsn(pipe))
    pg.execute("INSERT INTO b VALUES (3, 'b')")
    assert {t.table: t.removed_segments for t in drained(pipe).tables}["public.b"] == 3
    assert segments(pipe, "public.b") != held
    assert read_status(pipe.config()).tables[1].held.segments == 1  # type: ignore[union-attr]  # the batch not applied
    pipe.assert_mirrors()


def test_a_base_is_rewritten_only_once_the_changes_are_worth_it(pg: Database, tmp_path: Path) -> None:
    """``changelog.fold_min_share`` / ``fold_max_segments``: small batches past the retention stay
    (readable, not held) until they number ``fold_max_segments`` or their bytes reach the share of
    the table's copy; then one base takes them all."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    random_2k = "(SELECT string_agg(md5(g.i || '.' || h.j || random()), '') FROM generate_series(1, 64) AS h(j))"
    pg.execute(f"INSERT INTO t SELECT g.i, {random_2k} FROM generate_series(1, 100) AS g(i)")
    settings = {"retention_hours": 0, "fold_min_share": 0.5, "fold_max_segments": 3} | EVERY_RUN
    pipe = Pipeline(pg, tmp_path, ["public.t"], changelog_settings=settings)
    pipe.setup()

    def drained_once(statement: str) -> Any:
        """``statement``'s batch drained (retention folds up to the previous one) and marked applied."""
        pg.execute(statement)
        (outcome,) = drained(pipe).tables
        mark_applied(pipe.config(), "public.t", checkpoint_lsn(pipe))
        return outcome

    kept = segments(pipe, "public.t")  # the copy
    for round_ in (1, 2, 3):  # the copy and up to two small batches: not worth a base
        outcome = drained_once(f"UPDATE t SET id = id + 100 WHERE id = {round_}")
        assert (outcome.removed_segments, outcome.base, outcome.skipped) == (0, None, None)
        assert segments(pipe, "public.t")[: len(kept)] == kept
        kept = segments(pipe, "public.t")
        assert read_status(pipe.config()).tables[0].held is None
        pipe.assert_mirrors()
    assert bases(pipe, "public.t") == []

    outcome = drained_once("DELETE FROM t WHERE id = 4")  # a third small batch: fold_max_segments
    assert outcome.removed_segments == len(kept) and outcome.base is not None
    assert bases(pipe, "public.t") == [outcome.base]
    pipe.assert_mirrors()

    outcome = drained_once("UPDATE t SET v = reverse(v)")  # the previous small batch alone: kept
    assert (outcome.removed_segments, outcome.base) == (0, None)
    outcome = drained_once("DELETE FROM t WHERE id = 5")  # with the whole table rewritten: > half the base
    assert outcome.removed_segments == 2 and outcome.base is not None
    assert bases(pipe, "public.t") == [outcome.base]
    pipe.assert_mirrors()


@pytest.mark.parametrize("point", ["retention-base", "retention-checkpoint", "retention-delete"])
@pytest.mark.slow
def test_a_drain_killed_while_folding_leaves_a_correct_log(pg: Database, tmp_path: Path, point: str) -> None:
    pipe = kinds_drained(pg, tmp_path)
    for table in KINDS:
        mark_applied(pipe.config(), table, checkpoint_lsn(pipe))
    change_kinds(pg, 2)
    killed = pipe.cli("drain", "--wait", env={**pipe.environ, "CDC_ASSETS_FAULT": point})
    assert killed.returncode == -9, killed.stderr
    pipe.assert_mirrors()
    named = pipe.checkpoint().tables["public.k"].snapshot_run  # type: ignore[union-attr]
    assert (named is not None) == (point != "retention-base")
    assert len(bases(pipe, "public.k")) == 1  # written, complete; named or not

    change_kinds(pg, 3)
    done = pipe.cli("drain", "--wait")
    assert done.returncode == 0, done.stderr
    assert "retention: public.k: removed " in done.stdout  # what the drain folded, one line per table
    pipe.assert_mirrors()
    checkpoint = pipe.checkpoint()
    assert checkpoint is not None
    for table in KINDS:
        run = checkpoint.tables[table].snapshot_run
        assert run is not None and bases(pipe, table) == [run.run]  # the unnamed base is deleted
        assert all(int(s.split("-")[0], 16) >= run.consistent_point for s in segments(pipe, table))


def test_a_segment_removed_during_a_read_is_an_error_naming_it(pg: Database, tmp_path: Path) -> None:
    pipe = kinds_drained(pg, tmp_path)
    chunks = pipe.reader.read_changes("public.k")  # listed now, read as iterated
    last = Path(pipe.changelog) / "tables" / "public.k" / segments(pipe, "public.k")[-1]
    last.unlink()
    with pytest.raises(CdcError, match=rf"segment tables/public.k/{last.name} of public.k was removed by change-log"):
        list(chunks)


def test_a_quiet_table_does_not_hold_the_log_back(pg: Database, tmp_path: Path) -> None:
    """A table without changes keeps its old applied LSN (the apply has nothing to write for it)."""
    pg.execute("CREATE TABLE quiet (id int PRIMARY KEY)")
    pg.execute("CREATE TABLE busy (id int PRIMARY KEY)")
    pipe = retained(pg, tmp_path, ["public.quiet", "public.busy"])
    pipe.setup()
    mark_applied(pipe.config(), "public.quiet", checkpoint_lsn(pipe))
    for round_ in (1, 2):
        pg.execute(f"INSERT INTO busy VALUES ({round_})")
        pipe.drain(wait=True)
        mark_applied(pipe.config(), "public.busy", checkpoint_lsn(pipe))
    pg.execute("INSERT INTO busy VALUES (3)")
    drained(pipe)
    assert len(pipe.batch_starts()) == 1  # the last batch's: the one busy has not applied
    assert read_status(pipe.config()).tables[0].held is None


def test_an_online_snapshot_older_than_a_base_is_replaced_by_the_base(pg: Database, tmp_path: Path) -> None:
    """A run copied as of ``C`` whose announcement is drained after retention folded past ``C``:
    the changes in ``(C, base]`` it would need are gone, so the base stands in for it."""
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pg.execute("INSERT INTO t SELECT i, 'v' FROM generate_series(1, 10) i")
    pipe = retained(pg, tmp_path, ["public.t"])
    pipe.setup()
    during: list[int] = []

    def write_once(_: CopyProgress) -> None:  # after the run's consistent point, before its announcement
        if not during:
            pg.execute("UPDATE t SET v = 'during' WHERE id = 1")
            during.append(pg.execute("SELECT (pg_current_wal_lsn() - '0/0')::int8")[0][0])

    (copied,) = snapshot_tables(pipe.config(), ["public.t"], progress=write_once)
    mark_applied(pipe.config(), "public.t", during[0])
    drained(pipe, upto_lsn=during[0])  # the update, not the announcement; then retention
    state = pipe.checkpoint().tables["public.t"]  # type: ignore[union-attr]
    assert state.snapshot_run is not None and is_base(state.snapshot_run.run)
    assert state.snapshot_run.consistent_point > copied.consistent_point

    pipe.drain(wait=True)  # the announcement
    state = pipe.checkpoint().tables["public.t"]  # type: ignore[union-attr]
    assert state.snapshot_run is not None and is_base(state.snapshot_run.run)
    assert state.snapshot_run.position > copied.announced_lsn  # the end of the announcing transaction
    pipe.assert_mirrors()


@pytest.mark.slow
def test_a_held_table_catches_up_exactly_and_a_rebuild_starts_from_the_base(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    tables = {"public.a": {}, "public.b": {}}
    settings = {"retention_hours": 0, "fold_min_share": 0} | EVERY_RUN
    mirror = Mirror(pg, tmp_path / "mirror", tables, spark, changelog=settings)

    def drain_and_retain() -> None:
        mirror.drain()
        assert retain_when_due(mirror.config()) is not None

    mirror.sql(
        "CREATE TABLE a (id int PRIMARY KEY, v text)",
        "CREATE TABLE b (id int PRIMARY KEY, v text)",
        "INSERT INTO a SELECT i, 'a' FROM generate_series(1, 50) i",
        "INSERT INTO b SELECT i, 'b' FROM generate_series(1, 50) i",
    )
    mirror.setup()
    mirror.apply()
    for round_ in (1, 2):
        mirror.sql(f"UPDATE a SET v = 'a{round_}' WHERE id % 5 = {round_}", f"DELETE FROM b WHERE id = {round_}")
        mirror.sql(f"UPDATE b SET v = 'b{round_}' WHERE id % 7 = {round_}", f"INSERT INTO a VALUES ({100 + round_})")
        drain_and_retain()
        mirror.apply(["public.a"])
    b_folder = Path(mirror.config().changelog.path) / "tables" / "public.b"
    held = sorted(p.name for p in b_folder.glob("*.parquet"))
    assert len(held) == 2  # b's changes since its last apply: held back by b
    drain_and_retain()  # retention again: a's segments are gone, b's are not
    a_folder = Path(mirror.config().changelog.path) / "tables" / "public.a"
    assert not list(a_folder.glob("*.parquet")) and sorted(p.name for p in b_folder.glob("*.parquet")) == held

    mirror.apply()
    mirror.check("public.a")
    mirror.check("public.b")
    config = mirror.config()
    rebuilt = rebuild_table(config, config.table("public.a"), spark)
    assert rebuilt.applied_lsn == mirror.checkpoint_lsn()
    mirror.check("public.a")
