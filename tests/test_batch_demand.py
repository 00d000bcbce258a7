"""A following drain's merges call for a batch (:class:`~cdc_assets.changelog.batch_demand.BatchDemand`):
a change received while a merge ran is made durable and merged once that merge ends, not at the
drain's next ``drain.commit_seconds``. The calls and answers alone, then the whole of ``sync``
following the stream against real PostgreSQL and the test run's Spark session."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from cdc_assets.apply import follower
from cdc_assets.apply.follower import MergeFollower
from cdc_assets.changelog.batch_demand import BatchDemand
from cdc_assets.config import load_config
from cdc_assets.pipeline.setup import setup
from cdc_assets.pipeline.sync import SyncResult, sync
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.database import Database
from tests.support.mirror_diff import assert_delta_equals_source, holds_key
from tests.support.pipeline import wait_until

TABLE = "public.notes"
FOLLOW_SECONDS = 20.0
COMMIT_SECONDS = 600.0  # no batch ends on time while the test follows: only the merges' calls end one


def test_a_call_is_answered_by_a_batch_ended_after_it_and_closing_releases_it() -> None:
    demand = BatchDemand()
    answered: list[bool] = []
    caller = threading.Thread(target=lambda: answered.append(demand.call(timeout=30)))
    caller.start()
    wait_until(lambda: demand.calls == 1, 10, "the call")
    demand.answer(0, made=True)  # a batch ended before the call: not its answer
    caller.join(0.2)
    assert caller.is_alive() and not answered
    demand.answer(1, made=True)
    caller.join(10)
    assert answered == [True]
    assert demand.call(timeout=0.01) is False  # nobody answers: the wait ends at its timeout
    nothing_new = threading.Thread(target=lambda: answered.append(demand.call(timeout=30)))
    nothing_new.start()
    wait_until(lambda: demand.calls == 3, 10, "the third call")
    demand.answer(3, made=False)  # answered, but no batch was durable: nothing to look at
    nothing_new.join(10)
    started = time.monotonic()
    waiting = threading.Thread(target=lambda: answered.append(demand.call(timeout=30)))
    waiting.start()
    wait_until(lambda: demand.calls == 4, 10, "the fourth call")
    demand.close()
    waiting.join(10)
    assert answered == [True, False, False] and time.monotonic() - started < 10
    assert demand.call(timeout=30) is False  # closed: at once


def test_a_worker_calls_once_a_round_and_only_for_changes_the_drain_holds(tmp_path: Path) -> None:
    """:meth:`MergeFollower._calls_now` (the threads are not started): a worker calls when it has
    merged a table or tables are queued, the drain holds changes no batch made durable, the last
    look is old enough, and no table due after the last call is still unmerged."""
    config = load_config(write_config(tmp_path, [TABLE]), environ={DSN_VARIABLE: "postgresql://unused"})
    demand = BatchDemand()
    following = MergeFollower(config, None, lambda applied: None, demand=demand)  # type: ignore[arg-type]
    following._looked_at = time.monotonic() - follower.CALL_AFTER_SECONDS
    assert not following._calls_now(demand, merged=True)  # the drain holds nothing new
    demand.received = True
    assert following._calls_now(demand, merged=True)
    assert not following._calls_now(demand, merged=False)  # nothing merged, nothing queued
    following._queue[TABLE] = 1
    assert following._calls_now(demand, merged=False)
    following._round = {TABLE}  # due after the last call, not merged since
    assert not following._calls_now(demand, merged=True)
    following._round = set()
    following._looked_at = time.monotonic() + 60  # a look just now
    assert not following._calls_now(demand, merged=True)


def test_a_change_received_during_a_merge_is_merged_after_it_not_at_the_next_timed_batch(
    pg: Database, spark: Any, tmp_path: Path
) -> None:
    """The drain ends a batch only every ``COMMIT_SECONDS`` (longer than the test): the row
    written before the follow is received into the open batch while the first look's merge
    (creating the mirror from its copy) runs; that merge's end calls for a batch, and the row
    reaches the mirror while the drain still follows."""
    pg.execute(f"CREATE TABLE {TABLE} (id int PRIMARY KEY, body text)")
    pg.execute(f"INSERT INTO {TABLE} SELECT g, 'copied ' || g FROM generate_series(1, 20) g")
    path = write_config(
        tmp_path,
        [TABLE],
        drain={"follow_seconds": FOLLOW_SECONDS, "commit_seconds": COMMIT_SECONDS},
        warehouse={"small_table_writer": "spark"},  # a merge long enough to call for a batch after it
    )
    config = load_config(path, environ={DSN_VARIABLE: pg.dsn})
    setup(config)
    pg.execute(f"INSERT INTO {TABLE} VALUES (100, 'written before the follow')")
    results: list[SyncResult] = []
    follower = threading.Thread(target=lambda: results.append(sync(config, lambda: spark, wait=True)))
    started = time.monotonic()
    follower.start()
    try:
        wait_until(lambda: holds_key(config.target_path(config.table(TABLE)), 100), FOLLOW_SECONDS, "row 100 merged")
        merged_after = time.monotonic() - started
        assert follower.is_alive(), "row 100 was merged only by the drain's last batch"
    finally:
        follower.join(FOLLOW_SECONDS * 3)
    assert merged_after < FOLLOW_SECONDS and results
    with pg.connect() as conn:
        assert_delta_equals_source(conn, config, [TABLE])
