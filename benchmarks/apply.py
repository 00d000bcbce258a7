"""Apply benchmark: N changes into a Delta table of M rows — the project's write, an append of N rows
by Spark, and the same changes merged by delta-rs (the peer a user would pick for small batches).

    python benchmarks/apply.py [--n 10000,100000,1000000] [--m 1000000,10000000] [--sizes NxM,...]
                               [--mixes mixed,inserts,updates,upserts] [--repeat 3] [--repeat-large 1] [--recent 1.0]
                               [--driver-memory 8g] [--conf KEY=VALUE] [--table-property KEY=VALUE]
                               [--no-peer] [--out apply.json]

What is measured -- the project's real apply path, minus reading the change log from Parquet:

* the change set: N change records in the change log's exact format (``ChangeRecordBuilder``'s
  record schema, the commit columns prepended per transaction by
  ``cdc_assets.transactions.with_commit_columns``; transactions of ``--tx-size`` changes), for a
  7-column table ``public.big`` (bigint key, int, text, timestamptz, numeric(12,2), bool, float8):
  per ``--mixes``: ``mixed`` — 80% UPDATEs of distinct existing keys (no old tuple, as pgoutput
  sends for a default replica identity), 10% DELETEs of other existing keys (``K`` old key), 10%
  INSERTs of new keys; ``inserts`` — INSERTs of new keys only; ``updates`` — UPDATEs of distinct
  existing keys only; ``upserts`` — 90% UPDATEs, 10% INSERTs, no DELETE. Keys are drawn uniformly at random over the table (``--recent 0.1``: over its
  newest tenth, as the changes of a serial key cluster) and the changes shuffled over the
  transactions;
* **merge** = ``planner.plan_changes`` (net change per key) + ``merge.write_plan`` on a
  ``target.DeltaTarget`` -- exactly what ``runner.apply_table`` does after
  ``ChangeLogReader.read_changes``: one Delta commit with the applied LSN, written as the plan's
  batch allows (``mixed``: a MERGE; ``inserts``: an append; ``updates`` and ``upserts``: a REPLACE
  ON the key — the run records which);
* **delta-rs** (unless ``--no-peer``) = the same plan's rows merged by delta-rs
  (``DeltaTable.merge``: delete, update, insert on the key) into a copy of the same rows in a table
  without deletion vectors and column mapping (delta-rs writes neither), outside Spark;
* **append** = the same N row images as INSERTs of a keyless relation (same columns), through the
  same two calls: ``plan_changes`` gives an append plan and ``write_plan`` appends the N rows to the
  same M-row table (the project's own append path, also one commit with the applied LSN);
* each is timed end to end (plan + write, wall clock, the Spark session already warm); the
  ratios are merge / append and delta-rs / append per (N, M, mix), medians over the repetitions.
  Acceptance (the ``mixed`` mix): 100k changes into a 1M-row table take at most 2x the time of
  appending 100k rows.

The base tables: per M, one table created as ``write_plan`` would create it (the project's
``delta_schema`` and table properties: deletion vectors, column mapping), then filled with M rows
from ``spark.range`` in a single Delta append (``--rows-per-file`` rows per file). Every
measurement (merge or append) runs on its own fresh copy of that pristine table -- a file copy of
the table folder into a new path (Delta paths are relative; a new path also keeps Spark's DeltaLog
cache honest), removed afterwards -- so each one starts from version 1 with M rows.

``--table-property delta.enableDeletionVectors=false`` creates the project's base table with that
property over the defaults (``warehouse.table_properties``), e.g. copy-on-write tables.

The Spark session is ``cdc_assets.apply.session.spark_session`` (the project's settings:
Delta extension, 16 shuffle partitions, Arrow) with ``--master`` (default ``local[*]``) and
``--driver-memory``. One untimed warm-up pair (10,000 changes, or M) runs first.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time
from decimal import Decimal
from pathlib import Path
from typing import Any

import _common as common
import numpy as np
import pyarrow as pa

from cdc_assets.apply.merge import MergeCounts, write_plan
from cdc_assets.apply.session import quiet_start, spark_session
from cdc_assets.apply.spark_types import delta_arrow_type, delta_schema, to_delta_arrow
from cdc_assets.apply.target import DeltaTarget, app_id
from cdc_assets.changelog.planner import plan_changes
from cdc_assets.config import SparkConfig
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.records import ChangeChunk, DeltaColumn, RecordColumn
from cdc_assets.pgoutput.schema import ColumnSchema, RelationSchema
from cdc_assets.transactions import CommitInfo, with_commit_columns

SLOT = "bench_slot"
TABLE = "public.big"
INT8, INT4, TEXT, TIMESTAMPTZ, NUMERIC, BOOL, FLOAT8 = 20, 23, 25, 1184, 1700, 16, 701
NUMERIC_12_2 = ((12 << 16) | 2) + 4  # typmod of numeric(12, 2)
COLUMNS = [
    ("id", INT8, -1),
    ("k", INT4, -1),
    ("label", TEXT, -1),
    ("created", TIMESTAMPTZ, -1),
    ("amount", NUMERIC, NUMERIC_12_2),
    ("ok", BOOL, -1),
    ("score", FLOAT8, -1),
]
BASE_LSN = 0x1000  # the base table's _cdc_lsn
FIRST_COMMIT = 0x1_0000_0000
T0_US = 1_795_000_000_000_000  # 2026-11-18, commit time of the first benchmark transaction


def relation(keyed: bool) -> RelationSchema:
    """``public.big``, keyed on ``id`` (default replica identity) or without a key (append-only)."""
    columns = tuple(ColumnSchema(name, oid, typmod, keyed and name == "id", 0) for name, oid, typmod in COLUMNS)
    return RelationSchema(16400, "public", "big", "d", columns)


KEYED = relation(True)
KEYLESS = relation(False)


def fmt_count(n: int) -> str:
    for unit, size in (("M", 1_000_000), ("k", 1_000)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return f"{n:,}"


def parse_count(text: str) -> int:
    text = text.strip().lower().replace("_", "").replace(",", "")
    scale = {"k": 1_000, "m": 1_000_000}.get(text[-1:], 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


# -- change sets ------------------------------------------------------------------------------


def images(keys: np.ndarray, row_type: pa.StructType, mask: np.ndarray | None = None) -> pa.StructArray:
    """Changed row images for ``keys`` (every column differs from the base row)."""
    children = [
        pa.array(keys, pa.int64()),
        pa.array(((keys * 7) % 1000).astype(np.int32)),
        pa.array([f"changed-{k:x}" for k in keys.tolist()], pa.string()),
        pa.array((1_767_225_600 + keys) * 1_000_000, pa.int64()).cast(pa.timestamp("us", tz="UTC")),
        pa.array([Decimal(int(c)).scaleb(-2) for c in ((keys * 13) % 10_000_000).tolist()], pa.decimal128(12, 2)),
        pa.array(keys % 2 == 0),
        pa.array(keys / 3.0),
    ]
    assert [f.type for f in row_type] == [c.type for c in children], (list(row_type), [c.type for c in children])
    return pa.StructArray.from_arrays(children, fields=list(row_type), mask=None if mask is None else pa.array(mask))


def change_records(
    rel: RelationSchema, ops: np.ndarray, keys: np.ndarray, tx_size: int, first_commit: int
) -> tuple[pa.Table, int]:
    """Change-log records (commit columns + ``ChangeRecordBuilder``'s record columns) for ``ops``
    on ``keys``, ``tx_size`` changes per transaction; returns them and the last end LSN."""
    builder = ChangeRecordBuilder(rel)
    n = len(ops)
    is_delete = ops == "delete"
    new = images(keys, builder.row_type, mask=is_delete if is_delete.any() else None)
    old_children = [pa.array(keys, pa.int64())] + [pa.nulls(n, f.type) for f in list(builder.row_type)[1:]]
    old = pa.StructArray.from_arrays(old_children, fields=list(builder.row_type), mask=pa.array(~is_delete))
    schema = builder.schema
    records = pa.RecordBatch.from_arrays(
        [
            pa.array(np.arange(n, dtype=np.int64) % tx_size),
            pa.array(ops, pa.string()),
            pa.array(np.where(is_delete, "K", None), pa.string()),
            pa.nulls(n, schema.field(RecordColumn.UNCHANGED).type),
            pa.nulls(n, schema.field(RecordColumn.SPECIAL).type),
            pa.nulls(n, schema.field(RecordColumn.TRUNCATE).type),
            new,
            old,
        ],
        schema=schema,
    )
    batches = []
    end_lsn = first_commit
    for t, start in enumerate(range(0, n, tx_size)):
        commit = first_commit + t * 0x1000
        end_lsn = commit + 0x28
        info = CommitInfo(xid=1000 + t, commit_lsn=commit, end_lsn=end_lsn, commit_time_us=T0_US + t * 1000)
        batches.append(with_commit_columns(records.slice(start, tx_size), info))
    # The change log's reader returns a table per segment; one chunk stands for that here.
    return pa.Table.from_batches(batches).combine_chunks(), end_lsn


WARM_UP_CHANGES = 10_000
MIXES = {
    "mixed": (0.8, 0.1),
    "inserts": (0.0, 0.0),
    "updates": (1.0, 0.0),
    "upserts": (0.9, 0.0),
}  # (updates, deletes) shares


def change_set(
    n: int, m: int, rng: np.random.Generator, tx_size: int, recent: float = 1.0, mix: str = "mixed"
) -> dict[str, Any]:
    """N changes of ``mix``; the updated and deleted keys are drawn from the newest ``recent`` share
    of the table's keys (1.0: uniformly over the whole table), or from as many as they need."""
    update_share, delete_share = MIXES[mix]
    updates, deletes = int(n * update_share), int(n * delete_share)
    inserts = n - updates - deletes
    window = min(m, max(int(m * recent), updates + deletes))
    existing = (
        rng.choice(window, size=updates + deletes, replace=False).astype(np.int64) + (m - window) + 1
    )  # base keys are 1..m
    keys = np.concatenate([existing, np.arange(m + 1, m + 1 + inserts, dtype=np.int64)])
    ops = np.array(["update"] * updates + ["delete"] * deletes + ["insert"] * inserts, dtype=object)
    order = rng.permutation(n)
    keys, ops = keys[order], ops[order]
    merge_records, merge_lsn = change_records(KEYED, ops, keys, tx_size, FIRST_COMMIT)
    append_ops = np.full(n, "insert", dtype=object)
    append_records, append_lsn = change_records(KEYLESS, append_ops, keys, tx_size, FIRST_COMMIT)
    return {
        "expected": {"updated": updates, "deleted": deletes, "inserted": inserts},
        "merge": (merge_records, merge_lsn),
        "append": (append_records, append_lsn),
    }


# -- Delta tables -----------------------------------------------------------------------------


def table_columns() -> pa.Schema:
    row_type = ChangeRecordBuilder(KEYED).row_type
    return pa.schema([pa.field(f.name, delta_arrow_type(f.type)) for f in row_type])


PLAIN = {"delta.enableDeletionVectors": "false", "delta.columnMapping.mode": "none"}
"""Table properties of the delta-rs peer's copy: delta-rs writes neither feature."""


def build_base(
    spark: Any, path: Path, m: int, rows_per_file: int, properties: dict[str, str] | None = None
) -> dict[str, Any]:
    """The pristine M-row table: created empty as ``write_plan`` creates a table (``properties``
    over the project's defaults), then one append."""
    from pyspark.sql import functions as F

    target = DeltaTarget(spark, str(path), app_id(SLOT, TABLE), table_properties=properties)
    schema = delta_schema(table_columns())
    started = time.perf_counter()
    target.create(table_columns(), KEYED)
    parts = max(1, -(-m // rows_per_file))
    rows = spark.range(1, m + 1, 1, parts).select(
        F.col("id"),
        (F.col("id") % 1000).cast("int").alias("k"),
        F.md5(F.col("id").cast("string")).alias("label"),
        F.timestamp_seconds(F.lit(1_704_067_200) + F.col("id")).alias("created"),
        ((F.col("id") % 100_000) / 100).cast("decimal(12,2)").alias("amount"),
        (F.col("id") % 3 == 0).alias("ok"),
        (F.col("id") / 7.0).alias("score"),
        F.lit(BASE_LSN).cast("bigint").alias(DeltaColumn.LSN),
        F.lit("2026-01-01 00:00:00").cast("timestamp").alias(RecordColumn.COMMIT_TIME),
    )
    rows.select([F.col(f.name).cast(f.dataType) for f in schema.fields]).write.format("delta").mode("append").save(
        str(path)
    )
    seconds = time.perf_counter() - started
    files = data_files(path)
    return {
        "rows": m,
        "seconds": seconds,
        "files": len(files),
        "bytes": sum(f.stat().st_size for f in files),
    }


def data_files(path: Path) -> list[Path]:
    """The table's Parquet files (column mapping puts them under random-prefix folders)."""
    return [f for f in path.rglob("*.parquet") if "_delta_log" not in f.parts]


def last_operation(spark: Any, path: str) -> dict[str, Any]:
    from delta.tables import DeltaTable

    row = DeltaTable.forPath(spark, path).history(1).collect()[0]
    return {
        "version": int(row["version"]),
        "operation": row["operation"],
        "metrics": dict(row["operationMetrics"] or {}),
    }


def rust_merge(path: str, plan: Any) -> MergeCounts:
    """The plan's rows merged by delta-rs: delete, update, insert on the key."""
    from deltalake import DeltaTable as RustDeltaTable

    rows = to_delta_arrow(plan.rows)
    columns = [f.name for f in table_columns()] + [DeltaColumn.LSN, RecordColumn.COMMIT_TIME]
    values = {c: f"s.{c}" for c in columns}
    metrics = (
        RustDeltaTable(path)
        .merge(rows.select([*columns, DeltaColumn.ACTION]), "t.id = s.id", source_alias="s", target_alias="t")
        .when_matched_delete("s._cdc_action = 'delete'")
        .when_matched_update(values)
        .when_not_matched_insert(values, "s._cdc_action = 'upsert'")
        .execute()
    )
    return MergeCounts(
        metrics["num_target_rows_inserted"],
        metrics["num_target_rows_updated"],
        metrics["num_target_rows_deleted"],
        "delta-rs",
    )


def run_one(spark: Any, kind: str, base: Path, trial: Path, changes: dict[str, Any], m: int, n: int) -> dict[str, Any]:
    """Copy the pristine table to ``trial``, then plan and write ``kind`` ('merge' or 'append':
    write_plan; 'delta-rs': :func:`rust_merge`, ``base`` being the plain copy)."""
    shutil.copytree(base, trial)
    try:
        records, lsn = changes["append" if kind == "append" else "merge"]
        rel = KEYLESS if kind == "append" else KEYED
        target = DeltaTarget(spark, str(trial), app_id(SLOT, TABLE))
        gc.collect()
        started = time.perf_counter()
        plan = plan_changes([ChangeChunk(rel, records)], rel)
        planned = time.perf_counter()
        counts = rust_merge(str(trial), plan) if kind == "delta-rs" else write_plan(target, plan, lsn)
        done = time.perf_counter()
        # Verification, untimed.
        rows_after = target.read().count()
        applied = lsn if kind == "delta-rs" else target.applied_lsn()  # delta-rs records no applied LSN here
        operation = last_operation(spark, str(trial))
        expected = changes["expected"]
        if kind != "append":
            want_counts = (expected["inserted"], expected["updated"], expected["deleted"])
            want_rows = m + expected["inserted"] - expected["deleted"]
        else:
            want_counts = (n, 0, 0)
            want_rows = m + n
        got_counts = (counts.inserted, counts.updated, counts.deleted)
        ok = got_counts == want_counts and rows_after == want_rows and applied == lsn
        if not ok:
            print(
                f"WARNING: {kind} N={n} M={m}: counts {got_counts} (expected {want_counts}), rows {rows_after}"
                f" (expected {want_rows}), applied LSN {applied} (expected {lsn})",
                flush=True,
            )
        return {
            "kind": kind,
            "plan_s": planned - started,
            "write_s": done - planned,
            "total_s": done - started,
            "plan_rows": plan.rows.num_rows,
            "counts": {"inserted": counts.inserted, "updated": counts.updated, "deleted": counts.deleted},
            "write": counts.write,
            "rows_after": rows_after,
            "verified": ok,
            "delta": operation,
            "loadavg": [round(x, 2) for x in os.getloadavg()],
        }
    finally:
        shutil.rmtree(trial, ignore_errors=True)


# -- main -------------------------------------------------------------------------------------


def _settings(items: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` arguments as a dict."""
    return {key.strip(): value.strip() for key, _, value in (item.partition("=") for item in items)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--n", default="10000,100000,1000000", help="changes per apply, comma-separated (10k, 1M allowed)"
    )
    parser.add_argument("--m", default="1000000,10000000", help="rows of the base table, comma-separated")
    parser.add_argument("--sizes", help="explicit NxM pairs instead of the --n x --m grid, e.g. 100kx1M,10kx10M")
    parser.add_argument(
        "--mixes", default="mixed,inserts,updates", help=f"change mixes, comma-separated: {', '.join(MIXES)}"
    )
    parser.add_argument("--no-peer", action="store_true", help="skip the delta-rs merges")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions of each pair with N < 1M and M < 10M")
    parser.add_argument("--repeat-large", type=int, default=1, help="repetitions of pairs with N >= 1M or M >= 10M")
    parser.add_argument("--tx-size", type=int, default=100, help="changes per source transaction")
    parser.add_argument("--rows-per-file", type=int, default=500_000, help="rows per Parquet file of the base tables")
    parser.add_argument(
        "--recent",
        type=float,
        default=1.0,
        help="draw the updated and deleted keys from this newest share of the table (1.0: uniform over all of it;"
        " 0.1: the newest tenth, as changes of a serial key cluster)",
    )
    parser.add_argument("--master", default="local[*]")
    parser.add_argument("--driver-memory", default="8g")
    parser.add_argument(
        "--conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra Spark setting on top of the project's session settings (repeatable), e.g. to try a Delta knob",
    )
    parser.add_argument(
        "--table-property",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Delta table property of the project's base table over its defaults (repeatable)",
    )
    parser.add_argument("--seed", type=int, default=20261122)
    parser.add_argument("--workdir", help="folder for the tables (default: a new temporary folder, removed after)")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (pristine base tables)")
    parser.add_argument("--out", "--json", dest="out", help="write the results to this JSON file")
    args = parser.parse_args()

    if args.sizes:
        pairs = []
        for item in args.sizes.split(","):
            n_text, m_text = item.lower().split("x")
            pairs.append((parse_count(n_text), parse_count(m_text)))
    else:
        pairs = [(parse_count(n), parse_count(m)) for m in args.m.split(",") for n in args.n.split(",")]
    ms = sorted({m for _, m in pairs})
    mixes = [mix.strip() for mix in args.mixes.split(",") if mix.strip()]
    unknown = [mix for mix in mixes if mix not in MIXES]
    if unknown:
        parser.error(f"unknown mixes {unknown}: choose from {', '.join(MIXES)}")
    kinds = ("append", "merge") if args.no_peer else ("append", "merge", "delta-rs")

    machine = common.machine()
    code_start = common.code_version()
    load_before = common.load_snapshot()
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="cdc-bench-apply-"))
    workdir.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(args.seed)
    conf = {"spark.driver.memory": args.driver_memory, "spark.ui.enabled": "false"}
    conf |= _settings(args.conf)
    properties = _settings(args.table_property)
    results: dict[str, Any] = {
        "benchmark": "apply",
        "command": " ".join(["python", *sys.argv]),
        "machine": machine,
        "spark": {"master": args.master, "conf": conf},
        "tx_size": args.tx_size,
        "recent": args.recent,
        "mixes": mixes,
        "rows_per_file": args.rows_per_file,
        "table_properties": properties,
        "bases": {},
        "runs": [],
        "errors": [],
    }
    started_all = time.perf_counter()
    print(f"pairs (N, M): {[(fmt_count(n), fmt_count(m)) for n, m in pairs]}; work folder {workdir}", flush=True)
    with quiet_start():
        spark = spark_session(SparkConfig(master=args.master, conf=conf), app_name="cdc-assets-bench-apply")
    spark.sparkContext.setLogLevel("ERROR")
    import delta
    import pyspark

    results["spark"]["pyspark"] = pyspark.__version__
    results["spark"]["delta_jars"] = spark.conf.get("spark.jars.packages", "on the classpath")
    results["spark"]["delta_python"] = getattr(delta, "__version__", "?")
    print(
        f"Spark {pyspark.__version__} {args.master}, driver memory {args.driver_memory}, Delta jars {results['spark']['delta_jars']}",
        flush=True,
    )
    trial_no = 0
    try:
        for m in ms:
            base = workdir / f"base-{fmt_count(m)}"
            plain = workdir / f"base-plain-{fmt_count(m)}"
            try:
                if not args.no_peer and not (plain / "_delta_log").exists():
                    print(f"[M={fmt_count(m)}] building the plain base table (delta-rs) ...", flush=True)
                    build_base(spark, plain, m, args.rows_per_file, PLAIN)
                if not (base / "_delta_log").exists():
                    print(f"[M={fmt_count(m)}] building the base table ...", flush=True)
                    info = build_base(spark, base, m, args.rows_per_file, properties)
                else:
                    files = data_files(base)
                    info = {
                        "rows": m,
                        "seconds": None,
                        "files": len(files),
                        "bytes": sum(f.stat().st_size for f in files),
                    }
                results["bases"][str(m)] = info
                seconds = f"{info['seconds']:.1f} s" if info["seconds"] is not None else "reused"
                print(
                    f"[M={fmt_count(m)}] base: {info['files']} files, {info['bytes'] / common.MiB:,.0f} MiB ({seconds})",
                    flush=True,
                )
            except Exception as error:  # noqa: BLE001 -- record and go on with the other sizes
                message = f"M={m}: building the base table failed: {type(error).__name__}: {str(error)[:500]}"
                print(f"ERROR {message}", flush=True)
                results["errors"].append(message)
                continue
            bases = {"append": base, "merge": base, "delta-rs": plain}
            if m == ms[0] and "warmup" not in results:
                warm = min(WARM_UP_CHANGES, m)  # a mixed set changes distinct keys of the table
                print(f"[warm-up] {fmt_count(warm)} changes, {', '.join(kinds)} (untimed) ...", flush=True)
                changes = change_set(warm, m, rng, args.tx_size, args.recent)
                results["warmup"] = [
                    run_one(
                        spark, kind, bases[kind], workdir / f"trial-{(trial_no := trial_no + 1)}", changes, m, warm
                    )["total_s"]
                    for kind in kinds
                ]
            for n, pair_m in pairs:
                if pair_m != m:
                    continue
                large = n >= 1_000_000 or m >= 10_000_000
                repeat = args.repeat_large if large else args.repeat
                for mix in mixes:
                    made = time.perf_counter()
                    changes = change_set(n, m, rng, args.tx_size, args.recent, mix)
                    print(
                        f"[N={fmt_count(n)} M={fmt_count(m)} {mix}] change set built in {time.perf_counter() - made:.1f} s",
                        flush=True,
                    )
                    for r in range(repeat):
                        order = kinds[r % len(kinds) :] + kinds[: r % len(kinds)]  # each kind first in turn
                        for kind in order:
                            trial_no += 1
                            try:
                                run = run_one(spark, kind, bases[kind], workdir / f"trial-{trial_no}", changes, m, n)
                            except Exception as error:  # noqa: BLE001
                                message = f"N={n} M={m} {mix} {kind} round {r + 1}: {type(error).__name__}: {str(error)[:500]}"
                                print(f"ERROR {message}", flush=True)
                                results["errors"].append(message)
                                continue
                            run.update({"n": n, "m": m, "mix": mix, "round": r + 1})
                            results["runs"].append(run)
                            metrics = run["delta"]["metrics"]
                            extra = ""
                            if kind == "merge" and not run["write"].startswith("MERGE"):
                                extra = f"; {run['write']}: {metrics.get('numFiles', '?')} files added"
                            elif kind == "merge":
                                extra = (
                                    f"; {run['write']}: {metrics.get('numTargetFilesAdded', '?')} files added,"
                                    f" {metrics.get('numTargetDeletionVectorsAdded', '?')} deletion vectors,"
                                    f" executionTimeMs {metrics.get('executionTimeMs', '?')}"
                                )
                            print(
                                f"[N={fmt_count(n)} M={fmt_count(m)} {mix}] round {r + 1} {kind:8}: plan"
                                f" {run['plan_s']:.2f} s + write {run['write_s']:.2f} s = {run['total_s']:.2f} s"
                                f" {'(verified)' if run['verified'] else '(NOT VERIFIED)'}{extra}",
                                flush=True,
                            )
                    del changes
    finally:
        spark.stop()
        if not args.keep and not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    results["elapsed_s"] = time.perf_counter() - started_all
    load_after = common.load_snapshot()
    code_end = common.code_version()
    results.update(load_before=load_before, load_after=load_after, code_start=code_start, code_end=code_end)

    # -- summary --
    def series(n: int, m: int, mix: str, kind: str, field: str = "total_s") -> list[Any]:
        return [r[field] for r in results["runs"] if (r["n"], r["m"], r["mix"], r["kind"]) == (n, m, mix, kind)]

    def paired(n: int, m: int, mix: str, kind: str) -> list[float]:
        """``kind`` / append of the same round (back to back on copies of the same base table)."""
        rounds = sorted({r["round"] for r in results["runs"] if (r["n"], r["m"], r["mix"]) == (n, m, mix)})
        out = []
        for number in rounds:
            mine = [
                r["total_s"]
                for r in results["runs"]
                if (r["n"], r["m"], r["mix"], r["kind"], r["round"]) == (n, m, mix, kind, number)
            ]
            base = [
                r["total_s"]
                for r in results["runs"]
                if (r["n"], r["m"], r["mix"], r["kind"], r["round"]) == (n, m, mix, "append", number)
            ]
            out += [a / b for a in mine for b in base]
        return out

    summary = []
    for n, m in pairs:
        for mix in mixes:
            merge, append, peer = (series(n, m, mix, kind) for kind in ("merge", "append", "delta-rs"))
            if not merge or not append:
                summary.append({"n": n, "m": m, "mix": mix, "missing": True})
                continue
            entry: dict[str, Any] = {
                "n": n,
                "m": m,
                "mix": mix,
                "rounds": min(len(merge), len(append)),
                "write": sorted(set(series(n, m, mix, "merge", "write"))),
                "append_s": statistics.median(append),
                "merge_s": statistics.median(merge),
                "merge_plan_s": statistics.median(series(n, m, mix, "merge", "plan_s")),
                "peer_s": statistics.median(peer) if peer else None,
            }
            entry["ratio"] = entry["merge_s"] / entry["append_s"]
            entry["ratio_per_round"] = paired(n, m, mix, "merge")
            entry["peer_ratio"] = entry["peer_s"] / entry["append_s"] if peer else None
            entry["merge_changes_per_s"] = n / entry["merge_s"]
            summary.append(entry)
    results["summary"] = summary

    print()
    print(
        f"N changes into M rows: the project's write, Spark's append of N rows, delta-rs's merge; medians; Spark {args.master}"
    )
    rows = []
    for e in summary:
        if e.get("missing"):
            rows.append(
                [fmt_count(e["n"]), fmt_count(e["m"]), e["mix"], "-", "-", "-", "-", "-", "-", "failed / not run"]
            )
            continue
        per_round = e["ratio_per_round"]
        spread = f"{min(per_round):.2f}-{max(per_round):.2f}" if len(per_round) > 1 else "-"
        peer = "-" if e["peer_s"] is None else f"{e['peer_s']:.2f} ({e['peer_ratio']:.2f} x)"
        rows.append(
            [
                fmt_count(e["n"]),
                fmt_count(e["m"]),
                e["mix"],
                " / ".join(e["write"]),
                e["rounds"],
                f"{e['append_s']:.2f}",
                f"{e['merge_s']:.2f}",
                f"{e['ratio']:.2f}",
                spread,
                peer,
            ]
        )
    print(
        common.table(
            [
                "N",
                "M",
                "mix",
                "written as",
                "rounds",
                "append s",
                "write s",
                "write/append",
                "per round",
                "delta-rs s (/append)",
            ],
            rows,
        )
    )

    growth = []
    done = {(e["n"], e["m"]): e for e in summary if not e.get("missing") and e["mix"] == "mixed"}
    for n in sorted({n for n, _ in pairs}):
        have = sorted(m for (nn, m) in done if nn == n)
        for small, big in itertools.pairwise(have):
            a, b = done[(n, small)], done[(n, big)]
            growth.append(
                {
                    "n": n,
                    "m_from": small,
                    "m_to": big,
                    "m_factor": big / small,
                    "merge_factor": b["merge_s"] / a["merge_s"],
                    "append_factor": b["append_s"] / a["append_s"],
                }
            )
    results["growth"] = growth
    if growth:
        print("\nGrowth with M at fixed N (time at the larger M / time at the smaller M):")
        print(
            common.table(
                ["N", "M", "M x", "merge time x", "append time x"],
                [
                    [
                        fmt_count(g["n"]),
                        f"{fmt_count(g['m_from'])} -> {fmt_count(g['m_to'])}",
                        f"{g['m_factor']:.0f}",
                        f"{g['merge_factor']:.2f}",
                        f"{g['append_factor']:.2f}",
                    ]
                    for g in growth
                ],
            )
        )

    key = done.get((100_000, 1_000_000))
    if key is not None:
        verdict = key["ratio"] <= 2.0
        results["acceptance"] = {
            "n": 100_000,
            "m": 1_000_000,
            "ratio": key["ratio"],
            "required": "<= 2.0",
            "pass": verdict,
        }
        print(
            f"\nacceptance: 100k changes into 1M rows: merge {key['merge_s']:.2f} s / append {key['append_s']:.2f} s"
            f" = {key['ratio']:.2f} (ratio of medians), required <= 2.0: {'PASS' if verdict else 'FAIL'}"
        )
        if len(key["ratio_per_round"]) > 1:
            print(
                f"  same-round ratios: {', '.join(f'{r:.2f}' for r in key['ratio_per_round'])}"
                f" (median {statistics.median(key['ratio_per_round']):.2f})"
            )
    else:
        print("\nacceptance: the pair N=100k, M=1M was not measured")
    if results["errors"]:
        print("\nerrors:\n  " + "\n  ".join(results["errors"]))
    unverified = [r for r in results["runs"] if not r["verified"]]
    if unverified:
        print(f"\nWARNING: {len(unverified)} runs did not verify (counts, rows or applied LSN)")
    print(f"\nbefore: {common.describe_load(load_before)}\nafter:  {common.describe_load(load_after)}")
    print(common.describe_code(code_start, code_end))
    print(f"total time {results['elapsed_s'] / 60:.1f} min")
    common.write_json(args.out, results)
    return 0 if results.get("acceptance", {}).get("pass", True) and not results["errors"] and not unverified else 1


if __name__ == "__main__":
    sys.exit(main())
