"""Differential test of the whole pipeline: a seeded random workload on a real PostgreSQL, then
setup → (workload chunk → drain → apply)×N, and every Delta table compared with its source table,
value by value, read back with Spark and with delta-rs (docs/architecture.md, "Invariants": ≥ 6 seeds ×
≥ 2,000 operations in the suite, 20 seeds on demand; 0 mismatches, both readers agree).

Per seed (``tests/support/workload.py`` says what the workload does):

1. a schema ``diff<seed>`` with the workload's eight tables and ~25 rows each (so the initial
   snapshot has content), its own publication, slot, change log and warehouse;
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

import dataclasses
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import dagster as dg
import psycopg
import pytest

from cdc_assets.apply.runner import apply_tables
from cdc_assets.changelog.checkpoint import read_checkpoint
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, load_config
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.setup import setup
from dagster_project.factory import build_definitions
from dagster_project.merge_sensor import MERGE_SENSOR
from dagster_project.settings import load_settings
from tests.support.bucket import Bucket
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.database import Database
from tests.support.mirror_diff import compare_all, fast_spark, report
from tests.support.workload import Workload, WorkloadStats, log_coverage, tables_section

pytestmark = pytest.mark.slow  # not in the quick tier

SEEDS = int(os.environ.get("CDC_DIFF_SEEDS", "6"))
SEED_LIST = [int(s) for s in os.environ.get("CDC_DIFF_SEED_LIST", "").split(",") if s.strip()]
OPS = int(os.environ.get("CDC_DIFF_OPS", "2000"))
SYNCS = int(os.environ.get("CDC_DIFF_SYNCS", "3"))
PARALLEL = int(os.environ.get("CDC_DIFF_PARALLEL", "3"))


def drain_variant(config: Config, rng: random.Random) -> tuple[Config, str]:
    streaming = rng.choice(("off", "on", "on"))
    batch = rng.choice((500, 5_000, 100_000))
    source = dataclasses.replace(config.source, streaming=streaming, batch_changes=batch)
    return dataclasses.replace(config, source=source), f"streaming {streaming}, batch {batch}"


@dataclasses.dataclass
class SeedResult:
    seed: int
    stats: WorkloadStats
    rows_compared: int = 0
    syncs: int = 0
    drains: int = 0
    changes: int = 0
    problems: list[str] = dataclasses.field(default_factory=list)
    coverage: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    writes: dict[str, int] = dataclasses.field(default_factory=dict)  # commits per way of writing
    elapsed_s: float = 0.0
    config: Config | None = None


def drop_slots(conn: psycopg.Connection[Any], slots: list[str]) -> None:
    conn.execute(
        "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = ANY(%s) AND NOT active",
        (slots,),
    )


def run_seed(
    db: Database,
    spark: Any,
    folder: Path,
    seed: int,
    *,
    ops: int = OPS,
    bucket: Bucket | None = None,
    remote: str | None = None,
    drop_slot: bool = True,
) -> SeedResult:
    """One seed; with ``bucket``, the change log and the warehouse are in it (``spark`` must reach
    it); ``remote``: ``spark`` is a session of the Spark Connect server there (the configuration
    says so, so that tables are merged side by side on sessions of their own); ``drop_slot``: drop
    the seed's slot at the end (else only if the seed failed)."""
    started = time.monotonic()
    schema, slot = f"diff{seed}", f"diff_{seed}"
    plan = random.Random(f"pipeline-{seed}")  # pipeline choices; the workload has its own stream
    workload = Workload(db.dsn, schema, seed)
    result = SeedResult(seed, workload.stats)
    sections: dict[str, Any] = {}
    environ = {DSN_VARIABLE: db.dsn}
    if bucket is not None:
        sections = {
            "changelog": {"path": f"{bucket.uri}/seed{seed}/changelog"},
            "warehouse": {"path": f"{bucket.uri}/seed{seed}/warehouse"},
            "storage": bucket.section(),
        }
        environ |= bucket.environ()
    if remote is not None:
        sections["spark"] = {"remote": remote}
    try:
        workload.create()
        workload.populate()
        source = {"publication": f"{slot}_pub", "slot": slot}
        path = write_config(folder, tables_section(workload.tables), source=source, **sections)
        config = load_config(path, environ=environ)
        result.config = config
        setup(config)

        def sync(how: str) -> None:
            applied = apply_tables(config, spark)
            result.syncs += 1
            assert all(a.applied_lsn is not None for a in applied), [a.summary() for a in applied]
            for table in applied:
                result.writes[table.write] = result.writes.get(table.write, 0) + 1
            parity = compare_all(config, db.dsn, spark if how == "last" else None)
            result.rows_compared += sum(p.rows_compared for p in parity)
            text = report(parity)
            if text:
                result.problems.append(f"seed {seed}, after sync {result.syncs} ({how}):\n{text}")

        chunks = [ops // SYNCS + (1 if i < ops % SYNCS else 0) for i in range(SYNCS)]
        large_chunk = plan.randrange(SYNCS)
        for i, ops in enumerate(chunks):
            last = i == SYNCS - 1
            large_at = plan.randrange(ops) if i == large_chunk else None
            if plan.random() < 0.4 and ops > 10:  # two drains, one apply
                first = plan.randrange(1, ops)
                workload.run(
                    first, allow_pending=False, large_at=large_at if large_at is not None and large_at < first else None
                )
                variant, _ = drain_variant(config, plan)
                done = drain(variant)
                result.drains += 1
                result.changes += done.total_changes
                rest_large = large_at - first if large_at is not None and large_at >= first else None
                workload.run(ops - first, allow_pending=not last, large_at=rest_large)
            else:
                workload.run(ops, allow_pending=not last, large_at=large_at)
            if last:
                workload.finish()
            variant, how = drain_variant(config, plan)
            done = drain(variant)
            result.drains += 1
            result.changes += done.total_changes
            sync("last" if last else how)
            if i == 0 and not last:  # a batch of one kind, which the merge writes by a cheaper path
                kind = plan.choice(["insert", "update"])
                workload.one_kind(kind, 40)
                done = drain(config)
                result.drains += 1
                result.changes += done.total_changes
                sync(f"{kind}s only")
        result.coverage = {t.split(".", 1)[1]: c for t, c in log_coverage(changelog_store(config)).items()}
    except Exception as error:  # noqa: BLE001 — keep going with the other seeds; reported at the end
        result.problems.append(f"seed {seed}: {type(error).__name__}: {error}")
    finally:
        workload.close()
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            mine = "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s)"
            for gid in conn.execute(mine, (f"{schema}_",)).fetchall():
                conn.execute(f"ROLLBACK PREPARED '{gid[0]}'")
            if drop_slot or result.problems:
                drop_slots(conn, [slot])
    result.elapsed_s = time.monotonic() - started
    return result


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
    assert {"create", "overwrite", "append", "MERGE", "MERGE (matched only)"} <= writes, writes


BUCKET_SEEDS = tuple(
    int(s) for s in os.environ.get("CDC_DIFF_SMALL_SEEDS", "41").split(",")
)  # the large variant: 41,42,…
BUCKET_OPS = 600


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
            return run_seed(pg, session, tmp_path / f"seed{seed}", seed, ops=BUCKET_OPS, bucket=bucket, drop_slot=False)

    with ThreadPoolExecutor(len(BUCKET_SEEDS), thread_name_prefix="seed") as pool:
        results = list(pool.map(one, BUCKET_SEEDS))
    assert not [p for r in results for p in r.problems], "\n\n".join(p for r in results for p in r.problems)
    assert all(r.rows_compared > 0 and r.changes > 0 for r in results), [(r.rows_compared, r.changes) for r in results]
    config = results[0].config
    assert config is not None and config.changelog.path.startswith(bucket.uri)
    assert config.target_path(config.tables[0]).startswith(bucket.uri)
    assert not list((tmp_path / f"seed{BUCKET_SEEDS[0]}").glob("*/"))  # nothing but cdc.yaml on disk

    monkeypatch.setenv(DSN_VARIABLE, pg.dsn)
    for variable, value in bucket.environ().items():
        monkeypatch.setenv(variable, value)
    defs = build_definitions(load_settings(str(config.path)))
    instance = dg.DagsterInstance.ephemeral()

    def tick() -> Any:
        sensor = defs.resolve_sensor_def(MERGE_SENSOR)
        return sensor.evaluate_tick(dg.build_sensor_context(instance=instance, definitions=defs))

    quiet = tick()  # merged by the seed, never by Dagster: the sensor says each mirror is current
    current = format_lsn(read_checkpoint(changelog_store(config)).lsn)  # type: ignore[union-attr]
    assert not quiet.run_requests, quiet.run_requests
    assert sorted((e.asset_key.path[1:], e.metadata["checkpoint_lsn"].value) for e in quiet.asset_events) == sorted(
        ([t.name.schema, t.name.name], current) for t in config.tables
    ), (quiet.skip_message, quiet.asset_events)
    pg.execute("TRUNCATE ONLY " + ", ".join(t.name.sql for t in config.tables))  # a change in every table
    drain(config, wait=True)
    due = tick()
    assert sorted(r.run_key.split("@")[0] for r in due.run_requests) == sorted(str(t.name) for t in config.tables), (
        due.skip_message
    )
    with pg.connect() as conn:
        drop_slots(conn, [f"diff_{seed}" for seed in BUCKET_SEEDS])
