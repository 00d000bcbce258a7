"""Differential test of the whole pipeline: a seeded random workload on a real PostgreSQL, then
setup → (workload chunk → drain → apply)×N, and every Delta table compared with its source table,
value by value, read back with Spark and with delta-rs (docs/architecture.md, "Invariants", requires ≥ 20 seeds ×
≥ 2,000 operations, 0 mismatches, both readers agree).

Per seed (``tests/support/workload.py`` says what the workload does):

1. a schema ``diff<seed>`` with the workload's eight tables and ~25 rows each (so the initial
   snapshot has content), its own publication, slot, change log and warehouse;
2. ``cdc_assets.setup.setup``;
3. ``CDC_DIFF_SYNCS`` chunks of the workload (``CDC_DIFF_OPS`` operations in all, one forced
   large transaction in a random chunk; a chunk may end with a prepared transaction left open
   across the sync), each followed by a sync: ``cdc_assets.drain.drain`` — with ``streaming`` on
   or off and a small or large ``batch_changes``, chosen per drain — and
   ``cdc_assets.apply.runner.apply_tables`` on the shared Spark session. Some chunks are split
   by an extra drain without an apply, so one apply covers several drains;
4. after every non-final sync the Delta tables are compared with the source through delta-rs
   (cheap; the tables must equal the source then too — nothing is being written during a sync);
   after the final sync through both Spark and delta-rs (``tests/support/parity.py``: the
   source read through the change log's own value conversion, multisets of exact values,
   ``_cdc_*`` columns ignored, the two readers compared with each other as well).

A failing seed does not stop the others; the test fails at the end with every difference of
every seed. Knobs: ``CDC_DIFF_SEEDS`` (number of seeds, default 20), ``CDC_DIFF_SEED_LIST``
(explicit seeds, e.g. ``7,12``), ``CDC_DIFF_OPS`` (operations per seed, default 2000),
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

import psycopg
import pytest

from cdc_assets.apply.runner import apply_tables
from cdc_assets.config import Config, load_config
from cdc_assets.drain import drain
from cdc_assets.setup import setup
from tests.conftest import Database
from tests.support.parity import compare_all, fast_spark, report
from tests.support.workload import Workload, WorkloadStats, log_coverage, write_workload_config

pytestmark = pytest.mark.slow  # not in the quick tier

SEEDS = int(os.environ.get("CDC_DIFF_SEEDS", "20"))
SEED_LIST = [int(s) for s in os.environ.get("CDC_DIFF_SEED_LIST", "").split(",") if s.strip()]
OPS = int(os.environ.get("CDC_DIFF_OPS", "2000"))
SYNCS = int(os.environ.get("CDC_DIFF_SYNCS", "3"))
PARALLEL = int(os.environ.get("CDC_DIFF_PARALLEL", "3"))
DSN_VARIABLE = "CDC_SOURCE_DSN"


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
    elapsed_s: float = 0.0


def run_seed(db: Database, spark: Any, folder: Path, seed: int) -> SeedResult:
    started = time.monotonic()
    schema, slot = f"diff{seed}", f"diff_{seed}"
    plan = random.Random(f"pipeline-{seed}")  # pipeline choices; the workload has its own stream
    workload = Workload(db.dsn, schema, seed)
    result = SeedResult(seed, workload.stats)
    try:
        workload.create()
        workload.populate()
        config = load_config(
            write_workload_config(
                folder, {"dsn": "${" + DSN_VARIABLE + "}", "publication": f"{slot}_pub", "slot": slot}, workload.tables
            ),
            environ={DSN_VARIABLE: db.dsn},
        )
        setup(config)
        chunks = [OPS // SYNCS + (1 if i < OPS % SYNCS else 0) for i in range(SYNCS)]
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
            applied = apply_tables(config, spark)
            result.syncs += 1
            assert all(a.applied_lsn is not None for a in applied), [a.summary() for a in applied]
            parity = compare_all(config, db.dsn, spark if last else None)
            result.rows_compared += sum(p.rows_compared for p in parity)
            text = report(parity)
            if text:
                result.problems.append(f"seed {seed}, after sync {i + 1} of {SYNCS} ({how}):\n{text}")
        result.coverage = {t.split(".", 1)[1]: c for t, c in log_coverage(config.changelog_path).items()}
    except Exception as error:  # noqa: BLE001 — keep going with the other seeds; reported at the end
        result.problems.append(f"seed {seed}: {type(error).__name__}: {error}")
    finally:
        workload.close()
        with psycopg.connect(db.dsn, autocommit=True) as conn:
            mine = "SELECT gid FROM pg_prepared_xacts WHERE database = current_database() AND starts_with(gid, %s)"
            for gid in conn.execute(mine, (f"{schema}_",)).fetchall():
                conn.execute(f"ROLLBACK PREPARED '{gid[0]}'")
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s AND NOT active",
                (slot,),
            )
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
    if len(seeds) < 10:
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
