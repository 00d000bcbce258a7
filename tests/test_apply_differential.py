"""Differential test of the whole pipeline: a seeded random workload on a real PostgreSQL, then
setup → (workload chunk → drain → apply)×N, and every Delta table compared with its source table,
value by value, read back with Spark and with delta-rs (docs/architecture.md, "Invariants": ≥ 6 seeds ×
≥ 2,000 operations in the suite, 20 seeds on demand; 0 mismatches, both readers agree).

Per seed (``tests/support/differential.py``; ``tests/support/workload.py`` says what the workload does):

1. a schema ``diff<seed>`` with the workload's eight tables and ~25 rows each (so the initial
   snapshot has content), its own publication, slot, change log and warehouse (that of a seed of 1 modulo 4 —
   1, 5, the smaller variants' 41 — with ``small_table_mb: 0``: every commit Spark's, with deletion vectors, none delta-rs's);
2. ``cdc_assets.pipeline.setup.setup``;
3. ``CDC_DIFF_SYNCS`` chunks of the workload (``CDC_DIFF_OPS`` operations in all, one forced
   large transaction in a random chunk; a chunk may end with a prepared transaction left open
   across the sync), each followed by a sync: ``cdc_assets.pipeline.drain.drain`` — with ``streaming`` on
   or off and a small or large ``batch_changes``, chosen per drain — and
   ``cdc_assets.apply.runner.apply_tables`` on the shared Spark session. Some chunks are split
   by an extra drain without an apply, so one apply covers several drains;
4. after every non-final sync the Delta tables are compared with the source through delta-rs
   (cheap; the tables must equal the source then too — nothing is being written during a sync);
   after the final sync through both Spark and delta-rs (``tests/support/mirror_diff.py``: the
   source read through the change log's own value conversion, multisets of exact values,
   ``_cdc_*`` columns ignored, the two readers compared with each other as well).

A failing seed does not stop the others; the test fails at the end with every difference of
every seed. Knobs: ``CDC_DIFF_SEEDS`` (number of seeds, default 6; the large variant: 20), ``CDC_DIFF_SEED_LIST``
(explicit seeds, e.g. ``7,12``), ``CDC_DIFF_SMALL_SEEDS`` (the seeds of the smaller variants — the bucket's here, Spark Connect's in ``tests/test_spark_connect.py`` —, default ``41``), ``CDC_DIFF_OPS`` (operations per seed, default 2000),
``CDC_DIFF_SYNCS`` (syncs per seed, default 3), ``CDC_DIFF_PARALLEL`` (seeds run at once, each in
its own schema with its own Spark session sharing the one SparkContext; default 3 — the merges of
small tables wait on latency, not on the two cores). Run with ``-s`` to see the totals.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dagster as dg
import pytest

from cdc_assets.changelog.checkpoint import read_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.drain import drain
from dagster_project.factory import build_definitions
from dagster_project.settings import load_settings
from tests.support.bucket import Bucket
from tests.support.config_file import DSN_VARIABLE
from tests.support.dagster_env import MergeTick, tick_merge_sensors
from tests.support.database import Database
from tests.support.differential import OPS, SMALL_OPS, SMALL_SEEDS, SeedResult, drop_slots, run_seed
from tests.support.mirror_diff import fast_spark
from tests.support.workload import WorkloadStats

pytestmark = pytest.mark.slow  # not in the quick tier

SEEDS = int(os.environ.get("CDC_DIFF_SEEDS", "6"))
SEED_LIST = [int(s) for s in os.environ.get("CDC_DIFF_SEED_LIST", "").split(",") if s.strip()]
PARALLEL = int(os.environ.get("CDC_DIFF_PARALLEL", "3"))


def test_differential_random_workloads(pg: Database, spark: Any, tmp_path: Path) -> None:
    seeds = SEED_LIST or list(range(SEEDS))
    started = time.monotonic()

    def one(seed: int) -> SeedResult:
        session = spark.newSession()  # its own SQL conf: Delta's txnAppId/txnVersion are per session
        with fast_spark(session):
            result = run_seed(pg, session, tmp_path / f"seed{seed}", seed)
        print(
            f"\nseed {seed}: {result.stats.line()}; {result.drains} drains ({result.changes:,} changes),"
            f" {result.syncs} syncs, {result.rows_compared:,} rows compared,"
            f" {'OK' if not result.problems else f'{len(result.problems)} FAILED check(s)'} ({result.elapsed_s:.0f} s)",
            flush=True,
        )
        return result

    with ThreadPoolExecutor(PARALLEL, thread_name_prefix="seed") as pool:
        results = list(pool.map(one, seeds))
    total = WorkloadStats()
    coverage: dict[str, dict[str, int]] = {}
    for result in results:
        total.add(result.stats)
        for table, counts in result.coverage.items():
            for what, n in counts.items():
                coverage.setdefault(table, {}).setdefault(what, 0)
                coverage[table][what] += n
    failed = [r for r in results if r.problems]
    print(
        f"\nDIFFERENTIAL TOTAL: {len(results)} seeds, {total.ops:,} operations ({total.line()}),"
        f" {sum(r.drains for r in results)} drains, {sum(r.syncs for r in results)} syncs,"
        f" {sum(r.changes for r in results):,} change records, {sum(r.rows_compared for r in results):,} rows compared,"
        f" {sum(len(r.problems) for r in results)} mismatching checks in {len(failed)} seed(s),"
        f" {time.monotonic() - started:.0f} s",
        flush=True,
    )
    for table, counts in coverage.items():
        print(f"  change log {table}: " + ", ".join(f"{what} {n:,}" for what, n in counts.items() if n))
    assert not failed, "\n\n".join(p for r in failed for p in r.problems)
    # The workload really did what the acceptance asks of it.
    assert len(results) == len(seeds) and all(r.stats.ops >= OPS for r in results)
    assert sum(r.rows_compared for r in results) > 0
    if len(seeds) < 6:  # fewer seeds need not meet every case below
        return
    assert (
        total.truncates
        and total.large_transactions >= len(seeds)
        and total.prepared_commits
        and total.prepared_rollbacks
    )
    assert total.savepoint_rollbacks and total.swaps and total.key_changes and total.prepared_left_pending
    # ... and the change logs carry the cases the semantics are about.
    assert coverage["docs"]["unchanged TOAST"] and coverage["docs"]["old K"]
    assert coverage["bag"]["old O"] and coverage["bag"]["unchanged TOAST"] and coverage["coded"]["old K"]
    assert coverage["orders"]["unchanged TOAST"] and all(coverage[t].get("truncate") for t in coverage)
    # ... and the merge took each of its ways of writing.
    writes = {w for r in results for w, n in r.writes.items() if n}
    assert {"create", "overwrite", "append", "MERGE", "MERGE (matched only)", "REPLACE ON"} <= writes, writes


def test_differential_with_the_change_log_and_the_warehouse_in_a_bucket(
    pg: Database, spark: Any, bucket: Bucket, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The smaller variant with everything in an S3 bucket (a real S3 API server): the change log
    written by pyarrow, the Delta tables merged by Spark through s3a, read back by Spark and by
    delta-rs from the bucket; then each table's Dagster sensor decides from the bucket alone — up
    to date after the merges (its mirror reported current as of the checkpoint), a merge requested
    once the log holds more changes."""

    def one(seed: int) -> SeedResult:
        session = spark.newSession()
        bucket.configure(session)
        with fast_spark(session):
            return run_seed(pg, session, tmp_path / f"seed{seed}", seed, ops=SMALL_OPS, bucket=bucket, drop_slot=False)

    with ThreadPoolExecutor(len(SMALL_SEEDS), thread_name_prefix="seed") as pool:
        results = list(pool.map(one, SMALL_SEEDS))
    assert not [p for r in results for p in r.problems], "\n\n".join(p for r in results for p in r.problems)
    assert all(r.rows_compared > 0 and r.changes > 0 for r in results), [(r.rows_compared, r.changes) for r in results]
    config = results[0].config
    assert config is not None and config.changelog.path.startswith(bucket.uri)
    assert config.target_path(config.tables[0]).startswith(bucket.uri)
    assert not list((tmp_path / f"seed{SMALL_SEEDS[0]}").glob("*/"))  # nothing but cdc.yaml on disk

    monkeypatch.setenv(DSN_VARIABLE, pg.dsn)
    for variable, value in bucket.environ().items():
        monkeypatch.setenv(variable, value)
    defs = build_definitions(load_settings(str(config.path)))
    instance = dg.DagsterInstance.ephemeral()

    def tick() -> MergeTick:
        return tick_merge_sensors(defs, instance)

    quiet = tick()  # merged by the seed, never by Dagster: the sensor says each mirror is current
    current = format_lsn(read_checkpoint(changelog_store(config)).lsn)  # type: ignore[union-attr]
    assert not quiet.run_requests, quiet.run_requests
    assert sorted((e.asset_key.path[1:], e.metadata["checkpoint_lsn"].value) for e in quiet.asset_events) == sorted(
        ([t.name.schema, t.name.name], current) for t in config.tables
    ), (quiet.reasons(), quiet.asset_events)
    pg.execute("TRUNCATE ONLY " + ", ".join(t.name.sql for t in config.tables))  # a change in every table
    drain(config, wait=True)
    due = tick()
    assert sorted(r.run_key.split("@")[0] for r in due.run_requests) == sorted(str(t.name) for t in config.tables), (
        due.reasons()
    )
    with pg.connect() as conn:
        drop_slots(conn, [f"diff_{seed}" for seed in SMALL_SEEDS])
