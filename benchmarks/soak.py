"""Soak benchmark: many cycles of (changes → drain → apply), with and without maintenance, side by side.

    python benchmarks/soak.py [--pg 16] [--rows 1000000] [--changes 1000] [--cycles 1000]
                              [--bare-cycles 100] [--maintain-every 12] [--retention-hours 0.1]
                              [--read-every 100] [--conf KEY=VALUE] [--out soak-out]

A throwaway PostgreSQL gets one table of ``--rows`` rows (bigint key, int, 32-character text,
numeric(12,2), timestamptz). Two pipelines read it, each with its own slot, change log and
warehouse, both set up with ``cdc_assets.pipeline.setup.setup`` and applied on one warm Spark session:

* ``maintained``: the default ``warehouse.maintenance`` (``maintain_tables``: OPTIMIZE, REORG …
  APPLY (PURGE) when due, VACUUM with the 7-day default) every ``--maintain-every`` cycles — at one
  cycle per 5 minutes that is hourly, the default schedule — and ``changelog.retention_hours``
  ``--retention-hours`` (the time scale of the run: the default 7 days would keep every file of a
  run this short), run after each drain (``retention_every_minutes: 0``: due every time, as
  retention at the end of each drain was when the figures were taken);
* ``bare``: no maintenance and no retention (``changelog.retention_hours`` longer than the run),
  for the first ``--bare-cycles`` cycles only (its slot is dropped then): enough to show the
  growth, and its merges, slower cycle by cycle, would otherwise take most of the run's time;
  ending before cycle 100, it leaves ``maintained``'s reference window (cycles 100–200) to run
  alone, like the last 100 cycles it is compared with.

Each cycle is one source transaction of ``--changes`` changes with random keys (80% updates of
live keys, 10% inserts of new keys, 10% deletes of live keys), then for each pipeline a drain and
an apply (``cdc_assets.pipeline.drain.drain``, ``cdc_assets.apply.runner.apply_tables``), the pipelines
taking turns so that a busy moment of the machine falls on both. Recorded per cycle and pipeline:
apply seconds, the Delta table's data files and deletion-vector files (its current version, read
with delta-rs), the files in its ``_delta_log``, the change log's files and bytes on disk,
maintenance seconds when it ran, and what the apply cost in CPU — this Python process's, the
driver JVM's (every thread: tasks, Delta, the UI's listeners) and the JVM's garbage collections;
the JIT's compilation seconds and the compiled code the JVM holds after it;
every ``--read-every`` cycles the time of a full read (``sum(hash(*))`` over every row with
Spark) and the driver's heap after a full collection. A *control* tells the session's drift from the
table's: a copy of the maintained table made after the initial apply, which only every
``--read-every`` cycles gets one MERGE of ``--changes`` updates on the same session — if its time
rises too, what grows is the session, not the table.
Finally both Delta tables are compared with the source (``cdc_assets.pipeline.parity.verify_table``).

Output: ``soak.json`` (every figure; ``soak.partial.json`` every 50 cycles until then) and
``soak.png`` (the curves) in ``--out``, and the
acceptance lines: for ``maintained``, the median apply seconds of the last 100 cycles against
cycles 100–200 (target ≤ 1.2 ×), and the largest data-file and change-log-file counts of the
second half of the run against the first (bounded: they must not grow with the cycles).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _common as common
import numpy as np
import psycopg
from maintenance import cycle_changes

from cdc_assets.apply.maintenance import maintain_tables
from cdc_assets.apply.runner import apply_tables
from cdc_assets.apply.session import quiet_start, spark_session
from cdc_assets.apply.table_files import table_files
from cdc_assets.config import Config, load_config
from cdc_assets.pipeline.drain import drain
from cdc_assets.pipeline.parity import Parity, verify_table
from cdc_assets.pipeline.retention import retain_when_due
from cdc_assets.pipeline.setup import setup

TABLE = "public.soak"
NO_RETENTION_HOURS = 100_000.0
PUBLICATION = "soak_pub"
CREATE = """
CREATE TABLE {table} (
    id bigint PRIMARY KEY,
    k integer NOT NULL,
    label text NOT NULL,
    amount numeric(12, 2),
    updated timestamptz NOT NULL
)"""
FILL = """
INSERT INTO {table}
SELECT g, g % 1000, md5(g::text), (g % 100000) / 100.0, timestamptz '2024-01-01 00:00:00+00' + g * interval '1 s'
FROM generate_series(1, {rows}) AS g"""
CHANGES = (
    "UPDATE {table} SET k = k + 1, amount = amount + 1, updated = now() WHERE id = ANY(%(updates)s::int8[])",
    "DELETE FROM {table} WHERE id = ANY(%(deletes)s::int8[])",
    "INSERT INTO {table} SELECT g, g %% 1000, md5(g::text), 1.00, now() FROM unnest(%(inserts)s::int8[]) AS g",
)


@dataclass(slots=True)
class ChangingTable:
    """A source table of the soak's shape and the keys it holds: keys 1 to ``rows`` at first, then
    changed one random-key transaction at a time."""

    name: str
    live: np.ndarray
    next_key: int

    @classmethod
    def create(cls, conn: psycopg.Connection[Any], name: str, rows: int) -> ChangingTable:
        conn.execute(CREATE.format(table=name))
        conn.execute(FILL.format(table=name, rows=rows))
        return cls(name, np.arange(1, rows + 1, dtype=np.int64), rows + 1)

    def commit_changes(self, conn: psycopg.Connection[Any], changes: int, rng: np.random.Generator) -> None:
        """One transaction of ``changes`` changes with random keys (``cycle_changes``: 80% updates of
        live keys, 10% deletes of live keys, 10% inserts of new keys)."""
        ops, keys = cycle_changes(self.live, self.next_key, changes, rng)
        values = {f"{op}s": keys[ops == op].tolist() for op in ("update", "delete", "insert")}
        with conn.transaction():
            for statement in CHANGES:
                conn.execute(statement.format(table=self.name), values)
        inserted = np.asarray(values["inserts"], np.int64)
        self.live = np.setdiff1d(np.concatenate([self.live, inserted]), np.asarray(values["deletes"], np.int64))
        self.next_key += len(inserted)


@dataclass(slots=True)
class Pipeline:
    name: str
    config: Config
    maintained: bool
    cycles: list[dict[str, Any]] = field(default_factory=list)


def write_config(folder: Path, dsn: str, name: str, retention_hours: float, spark_conf: dict[str, str]) -> Config:
    folder.mkdir(parents=True, exist_ok=True)
    document = {
        "source": {"dsn": dsn, "publication": PUBLICATION, "slot": f"soak_{name}"},
        "changelog": {
            "path": str(folder / "changelog"),
            "retention_hours": retention_hours,
            "retention_every_minutes": 0,
        },
        "warehouse": {"path": str(folder / "warehouse")},
        "spark": {"conf": spark_conf},
        "tables": {TABLE: {}},
    }
    path = folder / "cdc.yaml"
    path.write_text(json.dumps(document, indent=2), encoding="utf-8")  # JSON is YAML
    return load_config(path)


def log_files(config: Config) -> tuple[int, int]:
    """Files and bytes under the change log's folder."""
    files = [p for p in Path(config.changelog.path).rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


def full_read_seconds(spark: Any, path: str) -> float:
    started = time.perf_counter()
    spark.read.format("delta").load(path).selectExpr("sum(hash(*))").collect()
    return time.perf_counter() - started


def copy_table(spark: Any, source: str, target: Path) -> None:
    """A new Delta table at ``target`` holding ``source``'s rows, with deletion vectors as ours."""
    spark.sql(
        f"CREATE TABLE delta.`{target}` USING delta TBLPROPERTIES ('delta.enableDeletionVectors' = 'true')"
        f" AS SELECT * FROM delta.`{source}`"
    )


def control_merge_seconds(spark: Any, control: Path, keys: list[int]) -> float:
    """One MERGE of updates to ``keys`` into the control table, timed."""
    spark.sql(
        f"SELECT id, k + 1 AS k FROM delta.`{control}` WHERE id IN ({', '.join(map(str, keys))})"
    ).createOrReplaceTempView("soak_control_source")
    started = time.perf_counter()
    spark.sql(
        f"MERGE INTO delta.`{control}` t USING soak_control_source s ON t.id = s.id WHEN MATCHED THEN UPDATE SET k = s.k"
    ).collect()
    return time.perf_counter() - started


@dataclass(slots=True)
class JvmGauges:
    """The driver JVM's own clocks, read through the session's gateway: CPU seconds, GC seconds,
    and the heap that survives a full collection."""

    spark: Any

    def _management(self) -> Any:
        return self.spark.sparkContext._jvm.java.lang.management.ManagementFactory

    def cpu_s(self) -> float:
        pid = self.spark.sparkContext._jvm.java.lang.ProcessHandle.current().pid()
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def gc_s(self) -> float:
        return float(sum(bean.getCollectionTime() for bean in self._management().getGarbageCollectorMXBeans())) / 1e3

    def jit_s(self) -> float:
        return float(self._management().getCompilationMXBean().getTotalCompilationTime()) / 1e3

    def code_cache_mb(self) -> float:
        """Compiled code held now, over the JVM's code heaps (what ``-XX:ReservedCodeCacheSize`` bounds)."""
        pools = self._management().getMemoryPoolMXBeans()
        return float(sum(pool.getUsage().getUsed() for pool in pools if "nmethods" in pool.getName())) / 1e6

    def live_heap_mb(self) -> float:
        self.spark.sparkContext._jvm.java.lang.System.gc()
        return float(self._management().getMemoryMXBean().getHeapMemoryUsage().getUsed()) / 1e6


def one_cycle(spark: Any, pipeline: Pipeline, cycle: int, args: argparse.Namespace) -> dict[str, Any]:
    config = pipeline.config
    drained = drain(config)
    retain_when_due(config)
    gauges = JvmGauges(spark)
    jvm_cpu, gc, jit, python_cpu = gauges.cpu_s(), gauges.gc_s(), gauges.jit_s(), time.process_time()
    started = time.perf_counter()
    applied = apply_tables(config, spark)
    record: dict[str, Any] = {
        "cycle": cycle,
        "apply_s": time.perf_counter() - started,
        "apply_python_cpu_s": time.process_time() - python_cpu,
        "apply_jvm_cpu_s": gauges.cpu_s() - jvm_cpu,
        "apply_gc_s": gauges.gc_s() - gc,
        "apply_jit_s": gauges.jit_s() - jit,
        "code_cache_mb": gauges.code_cache_mb(),
        "records": sum(a.records for a in applied),
        "drained_transactions": drained.transactions,
    }
    if pipeline.maintained and cycle % args.maintain_every == 0:
        started = time.perf_counter()
        maintain_tables(config, spark)
        record["maintain_s"] = time.perf_counter() - started
    path = config.target_path(config.tables[0])
    files = table_files(path)
    record["data_files"], record["deletion_vectors"], record["delta_bytes"] = (
        files.files,
        files.deletion_vectors,
        files.bytes,
    )
    record["log_files"], record["log_bytes"] = log_files(config)
    record["delta_log_files"] = sum(1 for _ in Path(path, "_delta_log").iterdir())
    if cycle % args.read_every == 0:
        record["full_read_s"] = full_read_seconds(spark, path)
        record["live_heap_mb"] = gauges.live_heap_mb()
    return record


def summary(pipeline: Pipeline) -> dict[str, Any]:
    cycles = pipeline.cycles
    half = len(cycles) // 2

    def median(key: str, part: list[dict[str, Any]]) -> float:
        return statistics.median(c[key] for c in part)

    early = [c for c in cycles if 100 <= c["cycle"] < 200] or cycles[: max(len(cycles) // 10, 1)]
    late = cycles[-100:] if len(cycles) >= 300 else cycles[-max(len(cycles) // 10, 1) :]
    return {
        "apply_median_early_s": median("apply_s", early),
        "apply_median_last_s": median("apply_s", late),
        "apply_ratio": median("apply_s", late) / median("apply_s", early),
        "jit_median_early_s": median("apply_jit_s", early),
        "jit_median_last_s": median("apply_jit_s", late),
        "code_cache_mb_max": max(c["code_cache_mb"] for c in cycles),
        "data_files_max_first_half": max(c["data_files"] for c in cycles[:half]),
        "data_files_max_second_half": max(c["data_files"] for c in cycles[half:]),
        "log_files_max_first_half": max(c["log_files"] for c in cycles[:half]),
        "log_files_max_second_half": max(c["log_files"] for c in cycles[half:]),
        "data_files_end": cycles[-1]["data_files"],
        "deletion_vectors_end": cycles[-1]["deletion_vectors"],
        "log_files_end": cycles[-1]["log_files"],
        "log_mb_end": cycles[-1]["log_bytes"] / 1e6,
        "full_reads_s": [(c["cycle"], round(c["full_read_s"], 3)) for c in cycles if "full_read_s" in c],
    }


def plot(pipelines: list[Pipeline], controls: list[tuple[int, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [
        ("apply_s", "apply seconds"),
        ("data_files", "Delta data files"),
        ("deletion_vectors", "deletion-vector files"),
        ("log_files", "change-log files"),
        ("log_bytes", "change-log MB"),
        ("full_read_s", "full read seconds"),
        ("delta_log_files", "files in _delta_log"),
        ("apply_jvm_cpu_s", "driver JVM CPU seconds per apply"),
        ("apply_gc_s", "driver GC seconds per apply"),
        ("apply_jit_s", "driver JIT compilation seconds per apply"),
        ("code_cache_mb", "driver compiled code held, MB"),
        ("live_heap_mb", "driver heap after a full GC, MB"),
    ]
    figure, axes = plt.subplots(len(panels), 1, figsize=(10, 3 * len(panels)), sharex=True)
    for axis, (key, title) in zip(axes, panels):
        for pipeline in pipelines:
            points = [(c["cycle"], c[key] / (1e6 if key == "log_bytes" else 1)) for c in pipeline.cycles if key in c]
            xs, ys = zip(*points) if points else ((), ())
            axis.plot(
                xs, ys, "o-" if key in ("full_read_s", "live_heap_mb") else "-", label=pipeline.name, linewidth=0.8
            )
        axis.set_title(title)
        axis.legend()
    if controls:
        xs, ys = zip(*controls)
        axes[5].plot(xs, ys, "s--", label="control MERGE (one per point)", linewidth=0.8)
        axes[5].legend()
    axes[-1].set_xlabel("cycle")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pg", type=int, default=16)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--changes", type=int, default=1_000)
    parser.add_argument("--cycles", type=int, default=1_000)
    parser.add_argument("--bare-cycles", type=int, default=100)
    parser.add_argument("--maintain-every", type=int, default=12)
    parser.add_argument("--retention-hours", type=float, default=0.1)
    parser.add_argument("--read-every", type=int, default=100)
    parser.add_argument("--out", default="soak-out")
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Spark setting of both pipelines' spark.conf (repeatable), e.g. to run without a default",
    )
    args = parser.parse_args()
    spark_conf = dict(item.partition("=")[::2] for item in args.conf)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    code = common.code_version()
    work = Path(tempfile.mkdtemp(prefix="cdc-soak-"))
    cluster = common.start_cluster(args.pg)
    try:
        with psycopg.connect(cluster.dsn(), autocommit=True) as conn:
            source = ChangingTable.create(conn, "soak", args.rows)
            conn.execute(f"CREATE PUBLICATION {PUBLICATION} FOR TABLE soak")
            conn.execute("VACUUM ANALYZE soak")
        pipelines = [
            Pipeline(
                "maintained",
                write_config(work / "maintained", cluster.dsn(), "maintained", args.retention_hours, spark_conf),
                True,
            ),
            Pipeline("bare", write_config(work / "bare", cluster.dsn(), "bare", NO_RETENTION_HOURS, spark_conf), False),
        ]
        for pipeline in pipelines:
            setup(pipeline.config)
        with quiet_start():
            spark = spark_session(pipelines[0].config.spark, "cdc-assets-soak")
        for pipeline in pipelines:
            apply_tables(pipeline.config, spark)  # the initial copy, not timed
        control = work / "control"
        copy_table(spark, pipelines[0].config.target_path(pipelines[0].config.tables[0]), control)
        controls: list[tuple[int, float]] = []
        control_keys = np.random.default_rng(11)
        parity: dict[str, Parity] = {}
        rng = np.random.default_rng(7)
        started = time.perf_counter()
        with psycopg.connect(cluster.dsn()) as conn:
            for cycle in range(1, args.cycles + 1):
                source.commit_changes(conn, args.changes, rng)
                if cycle == args.bare_cycles + 1:
                    parity["bare"] = verify_table(pipelines[1].config, pipelines[1].config.tables[0], spark).parity
                    with psycopg.connect(cluster.dsn(), autocommit=True) as admin:
                        admin.execute("SELECT pg_drop_replication_slot(%s)", (pipelines[1].config.source.slot,))
                running = pipelines if cycle <= args.bare_cycles else pipelines[:1]
                for pipeline in running if cycle % 2 else reversed(running):
                    pipeline.cycles.append(one_cycle(spark, pipeline, cycle, args))
                if cycle % args.read_every == 0:
                    sample = control_keys.choice(args.rows, args.changes, replace=False) + 1  # the copy's keys
                    controls.append((cycle, control_merge_seconds(spark, control, sample.tolist())))
                if cycle % 50 == 0:  # what a run stopped early has measured so far
                    partial = {
                        "args": vars(args),
                        "code": code,
                        "cycles": {p.name: p.cycles for p in pipelines},
                        "control_merges_s": controls,
                    }
                    common.write_json(str(out / "soak.partial.json"), partial)
                if cycle % 10 == 0 or cycle == args.cycles:
                    last = {p.name: p.cycles[-1] for p in running}
                    print(
                        f"[soak] cycle {cycle}/{args.cycles} ({time.perf_counter() - started:,.0f} s): "
                        + "; ".join(
                            f"{name} apply {c['apply_s']:.2f} s, {c['data_files']} files, "
                            f"{c['deletion_vectors']} DVs, log {c['log_files']} files"
                            for name, c in last.items()
                        ),
                        flush=True,
                    )
        parity["maintained"] = verify_table(pipelines[0].config, pipelines[0].config.tables[0], spark).parity
        results = {p.name: summary(p) for p in pipelines}
        document = {
            "args": vars(args),
            "machine": common.machine(),
            "code": code,
            "summary": results,
            "parity": {name: {"ok": r.ok, "rows": r.source.rows} for name, r in parity.items()},
            "cycles": {p.name: p.cycles for p in pipelines},
            "control_merges_s": controls,
        }
        common.write_json(str(out / "soak.json"), document)
        plot(pipelines, controls, out / "soak.png")
        print()
        rows = [
            (
                name,
                f"{s['apply_median_early_s']:.2f}",
                f"{s['apply_median_last_s']:.2f}",
                f"{s['apply_ratio']:.2f}",
                f"{s['data_files_max_first_half']} / {s['data_files_max_second_half']}",
                s["deletion_vectors_end"],
                f"{s['log_files_max_first_half']} / {s['log_files_max_second_half']}",
                f"{s['log_mb_end']:.1f}",
                "OK" if parity[name].ok else "DIFFERS",
            )
            for name, s in results.items()
        ]
        print(
            common.table(
                [
                    "pipeline",
                    "apply median, cycles 100–200 (s)",
                    "apply median, last 100 (s)",
                    "ratio",
                    "data files, max 1st / 2nd half",
                    "DVs at end",
                    "log files, max 1st / 2nd half",
                    "log MB at end",
                    "parity",
                ],
                rows,
            )
        )
        kept = results["maintained"]
        print(
            f"\ntarget: maintained apply ratio <= 1.2: {kept['apply_ratio']:.2f}; maintained files, max of each half: "
            f"data {kept['data_files_max_first_half']} / {kept['data_files_max_second_half']}, "
            f"log {kept['log_files_max_first_half']} / {kept['log_files_max_second_half']}"
        )
        print("control MERGE (s), by cycle: " + ", ".join(f"{cycle}: {s:.2f}" for cycle, s in controls))
        print(common.describe_code(code, common.code_version()))
        print(f"wrote {out / 'soak.json'} and {out / 'soak.png'}")
        return 0 if all(r.ok for r in parity.values()) else 1
    finally:
        cluster.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
