"""The order of a following drain's merges (:class:`~cdc_assets.apply.follower.MergeFollower`): the
table whose oldest unmerged change came with the oldest durable batch is merged first — a table
that changed again while it merged goes before a table that changed after it, not behind it. Real
PostgreSQL, setup and drains; the merge itself stubbed (no Spark): it records the table and, for
the first merge after the first look's, waits until the test lets it end."""

from __future__ import annotations

import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from cdc_assets.apply import follower
from cdc_assets.apply.follower import MergeFollower
from tests.support.database import Database
from tests.support.pipeline import Pipeline, wait_until

TABLES = ["public.a", "public.b", "public.c"]


def test_the_table_with_the_oldest_unmerged_change_is_merged_first(
    pg: Database, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pg.connect() as conn:
        for table in TABLES:
            conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, v int)")
    pipe = Pipeline(pg, tmp_path, TABLES, spark={"parallel_merges": 1})  # one worker, on the session given
    pipe.setup()
    merged: list[str] = []
    held_ends = threading.Event()

    def apply_table(mirror: Any) -> SimpleNamespace:
        merged.append(mirror.name)
        if len(merged) == len(TABLES) + 1:
            assert held_ends.wait(60), "the test never let the held merge end"
        return SimpleNamespace(skipped=None, data_files=0)

    def write_and_drain(table: str, following: MergeFollower) -> None:
        pg.execute(f"INSERT INTO {table} VALUES ({len(merged) * 10 + 1}, 1)")
        pipe.drain()
        following.batch_durable()

    monkeypatch.setattr(follower, "apply_table", apply_table)
    applied: list[object] = []
    with MergeFollower(pipe.config(), None, applied.append) as following:  # type: ignore[arg-type]
        wait_until(lambda: len(applied) == len(TABLES), 30, "the first look's merges (every table: none has a mirror)")
        write_and_drain("public.b", following)  # b is due and starts merging (held)
        wait_until(lambda: len(merged) == len(TABLES) + 1, 30, "the merge of public.b to start")
        write_and_drain("public.b", following)  # b changes again while it merges
        wait_until(lambda: "public.b" in following._again, 30, "public.b due again")
        write_and_drain("public.a", following)  # then a changes
        wait_until(lambda: "public.a" in following._queue, 30, "public.a queued")
        held_ends.set()
        wait_until(lambda: len(applied) == len(TABLES) + 3, 60, "every merge")
    assert merged[len(TABLES) :] == ["public.b", "public.b", "public.a"], "b's second change is older than a's"
