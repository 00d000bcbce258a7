"""One seed of the differential test (``tests/test_apply_differential.py``; its smaller variants
there and in ``tests/test_spark_connect.py``): the seeded workload on its own schema, slot, change
log and warehouse, synced chunk by chunk (drains, then ``apply_tables``) and compared with the
source after every sync. Knobs: ``CDC_DIFF_OPS`` (operations per seed, default 2000),
``CDC_DIFF_SYNCS`` (syncs per seed, default 3), ``CDC_DIFF_SMALL_SEEDS`` (the smaller variants'
seeds, default ``41``)."""

from __future__ import annotations

import dataclasses
import os
import random
import time
from pathlib import Path
from typing import Any

import psycopg

from cdc_assets.apply.runner import apply_tables
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, load_config
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.setup import setup
from tests.support.bucket import Bucket
from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.database import Database
from tests.support.mirror_diff import compare_all, report
from tests.support.workload import Workload, WorkloadStats, log_coverage, tables_section

OPS = int(os.environ.get("CDC_DIFF_OPS", "2000"))
SYNCS = int(os.environ.get("CDC_DIFF_SYNCS", "3"))
SMALL_SEEDS = tuple(int(s) for s in os.environ.get("CDC_DIFF_SMALL_SEEDS", "41").split(","))  # large: 41,42,…
SMALL_OPS = 600  # operations per seed of the smaller variants


def drain_variant(config: Config, rng: random.Random) -> tuple[Config, str]:
    """``config`` with streaming and batch size chosen by ``rng``, and a line that says which."""
    streaming = rng.choice(("off", "on", "on"))
    batch = rng.choice((500, 5_000, 100_000))
    source = dataclasses.replace(config.source, streaming=streaming, batch_changes=batch)
    return dataclasses.replace(config, source=source), f"streaming {streaming}, batch {batch}"


@dataclasses.dataclass(slots=True)
class SeedResult:
    """What one seed did, and every difference it found."""

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
    """Drop those of ``slots`` that exist and are not in use."""
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
    if seed % 4 == 1:  # every commit Spark's, with deletion vectors (REPLACE ON among them), none delta-rs's
        sections["warehouse"] = sections.get("warehouse", {}) | {"small_table_mb": 0}
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
