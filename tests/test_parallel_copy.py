"""The initial snapshot in parallel (``cdc_assets/source/parallel_copy.py``, ``binary_copy.py``)
against real PostgreSQL: values converted exactly as what pgoutput sends, tables split into ``ctid``
ranges copied by several workers equal to the source (inheritance and partitioned tables too),
and a worker's error failing setup cleanly, with the table named, and setup rerunnable."""

from __future__ import annotations

import itertools
import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pyarrow as pa
import pytest

from cdc_assets.config import SourceConfig, parse_config
from cdc_assets.errors import ConfigError, SourcePermissionError
from cdc_assets.names import TableName
from cdc_assets.pgoutput.arrow import ChangeRecordBuilder
from cdc_assets.pgoutput.messages import InsertMessage
from cdc_assets.pgoutput.types import TypeCatalog
from cdc_assets.pipeline.snapshot_copy import RANGE_POSITIONS
from cdc_assets.source import connect, create_slot_with_snapshot, load_type_catalog
from cdc_assets.source.copy_plan import RANGE_BLOCKS_MAX, RANGE_BLOCKS_MIN, BlockRange, block_ranges
from cdc_assets.source.parallel_copy import ParallelCopy
from cdc_assets.source.snapshot import SnapshotReader
from tests.support.copied import KeptBlocks, sent_rows, typed_rows
from tests.support.database import Database
from tests.support.peek import create_slot, peek_decoded, pgoutput_options
from tests.support.pipeline import Pipeline, wait_until
from tests.support.rows import read_source_text

# Values a copy must carry exactly: quotes, commas, line breaks inside values, backslashes, a lone
# "\." (the end-of-data marker of text COPY), the empty string beside NULL, non-ASCII; arrays,
# enums (binary) beside inet and a composite (text: no binary conversion).
TRICKY = (
    "CREATE TYPE mood AS ENUM ('sad', 'happy');"
    " CREATE TYPE pair AS (x int, y text);"
    " CREATE TABLE tricky (id int PRIMARY KEY, t text, b bytea, arr text[], m mood[], j jsonb, c char(3),"
    " ip inet, p pair);"
    " CREATE TABLE single (v text);"
    " CREATE PUBLICATION cdc_pub FOR TABLE tricky, single"
)
TRICKY_ROWS = (
    "INSERT INTO tricky VALUES"
    " (1, 'plain', '\\x00ff', '{a,b}', '{sad}', '{\"k\": \"v\"}', 'ab', '10.0.0.1', ROW(1, 'a')),"
    " (2, 'line\nbreak', '\\x0a0d2c22', '{\"with,comma\",\"quote\\\"d\"}', '{happy,NULL}', '\"str\"', '', '::1/128', ROW(NULL, NULL)),"
    " (3, 'cr\r\nlf and \"quotes\", commas', '', '{}', '{}', 'null', NULL, NULL, ROW(2, 'x,\"y\"')),"
    " (4, '', NULL, '{\"\",NULL}', NULL, '[]', ' x ', '192.168.0.0/16', NULL),"
    " (5, NULL, '\\x5c2e', NULL, '{}', NULL, NULL, NULL, NULL),"
    " (6, E'\\\\.', '\\x', '{\"\\\\\\\\\"}', '{sad,happy}', '{\"a\\\\nb\": 1}', 'q\"', '10.0.0.2', ROW(3, '')),"
    " (7, 'tab\there \\ backslash', '\\x5c', '{\"line\nbreak\"}', '{}', '1', '\"', NULL, NULL),"
    " (8, 'ünïcødé ✓ 日本', convert_to('ü', 'UTF8'), '{ü}', '{}', '{\"ü\": \"✓\"}', 'ü', NULL, ROW(4, 'ü')),"
    " (9, ' leading and trailing ', NULL, '{\" \"}', '{}', '\"\"', '  ', NULL, NULL);"
    " INSERT INTO single VALUES (NULL), (''), ('\"'), (NULL), ('x'), (E'\\n')"
)


def test_block_ranges_cover_the_table_once() -> None:
    assert block_ranges(0, 4) == block_ranges(2 * RANGE_BLOCKS_MIN - 1, 4) == [BlockRange(None, None)]
    for blocks, workers in ((2 * RANGE_BLOCKS_MIN, 4), (10_000, 2), (140_000, 2), (140_000, 1), (1_000_000, 8)):
        ranges = block_ranges(blocks, workers)
        assert len(ranges) > 1 and ranges[0].start is None and ranges[-1].end is None
        assert all(a.end == b.start for a, b in itertools.pairwise(ranges))
        sizes = [(r.end or blocks) - (r.start or 0) for r in ranges]
        assert sum(sizes) == blocks and min(sizes) >= RANGE_BLOCKS_MIN and max(sizes) <= RANGE_BLOCKS_MAX
    assert len(block_ranges(10_000, 2)) == 8  # four per worker
    assert BlockRange(3, 7).condition == "ctid >= '(3,0)'::tid AND ctid < '(7,0)'::tid"
    assert BlockRange(None, None).condition == ""


def test_copied_values_are_what_pgoutput_sends(pg: Database) -> None:
    """Every value through the copy — the parallel copy, and ``SnapshotReader.chunks`` two rows at
    a time — converts to exactly the change record values of the text pgoutput sends for the row
    and of the text the oracle reads with a binary cursor; columns whose type converts from binary
    arrive in binary, the others (inet, a composite) as their output function's text."""
    pg.execute(TRICKY)
    source = SourceConfig(dsn=pg.dsn, slot=f"s_{pg.name}")
    with pg.connect(autocommit=True) as conn:
        create_slot(conn, f"obs_{pg.name}")
    pg.execute(TRICKY_ROWS)
    tables = [TableName("public", "tricky"), TableName("public", "single")]
    with create_slot_with_snapshot(source) as snapshot:
        with ParallelCopy(source, snapshot.snapshot_name, workers=2) as copy:
            relations = [copy.reader.describe(table) for table in tables]
            oids = [c.type_oid for relation in relations for c in relation.columns]
            catalog = TypeCatalog.of(load_type_catalog(copy.reader.connection, oids))
            builders = {r.qualified_name: ChangeRecordBuilder(r, catalog) for r in relations}
            plans = [copy.plan(b.relation, b.binary_supported) for b in builders.values()]
            parallel: dict[str, list[list[pa.Array]]] = {str(t): [] for t in tables}
            for task, blocks in copy.run(plans, KeptBlocks()):  # two tables: two worker processes
                parallel[task.plan.relation.qualified_name].extend(blocks)
        with SnapshotReader(source, snapshot.snapshot_name, chunk_rows=2) as reader:
            chunked = {name: list(reader.chunks(b.relation, b.binary_supported)) for name, b in builders.items()}
    with connect(source, purpose="test") as conn:
        options = pgoutput_options(pg.version, "cdc_pub")
        sent: dict[str, list[tuple[bytes | None, ...]]] = {str(t): [] for t in tables}
        for decoded in peek_decoded(conn, f"obs_{pg.name}", options):
            if isinstance(decoded.message, InsertMessage):
                name = "public.tricky" if len(decoded.message.new_tuple.values) > 1 else "public.single"
                sent[name].append(tuple(decoded.message.new_tuple.values))
        oracle = {str(t): read_source_text(conn, t).rows for t in tables}
    assert builders["public.tricky"].binary_supported == (True,) * 7 + (False, False)
    assert [len(chunk[0]) for chunk in chunked["public.tricky"]] == [2, 2, 2, 2, 1]
    for table, builder in builders.items():
        expected = sent_rows(builder, sent[table])
        assert typed_rows(builder, parallel[table], builder.binary_supported) == expected, table
        assert typed_rows(builder, chunked[table], builder.binary_supported) == expected, table
        assert sent_rows(builder, oracle[table]) == expected, table
    assert (None,) in sent["public.single"] and (b"",) in sent["public.single"]  # NULL beside the empty string
    assert len(sent["public.tricky"]) == 9


WORKLOAD = (
    # ~1,100 blocks: split into several ranges; deleted and updated rows leave holes and move rows
    "CREATE TABLE big (id int PRIMARY KEY, pad text, n numeric, at timestamptz)",
    "INSERT INTO big SELECT g, repeat(md5(g::text), 8), g / 7.0, timestamptz '2024-01-01' + g * interval '1 min'"
    " FROM generate_series(1, 30000) g",
    "DELETE FROM big WHERE id % 97 = 0",
    "UPDATE big SET pad = 'moved' WHERE id % 101 = 0",
    "CREATE TABLE parent (id int PRIMARY KEY, pad text)",
    "CREATE TABLE child (extra int) INHERITS (parent)",
    "ALTER TABLE child ADD PRIMARY KEY (id)",
    "INSERT INTO parent SELECT g, repeat('p', 300) FROM generate_series(1, 20000) g",
    "INSERT INTO child SELECT g, repeat('c', 60), g FROM generate_series(100001, 105000) g",
    "CREATE TABLE m (id int, region text, v text, PRIMARY KEY (id, region)) PARTITION BY LIST (region)",
    "CREATE TABLE m_eu PARTITION OF m FOR VALUES IN ('eu')",
    "CREATE TABLE m_us PARTITION OF m FOR VALUES IN ('us')",
    "INSERT INTO m SELECT g, CASE WHEN g % 3 = 0 THEN 'us' ELSE 'eu' END, repeat('m', 300)"
    " FROM generate_series(1, 30000) g",
    "CREATE TABLE empty (id int PRIMARY KEY)",
)
TABLES = ["public.big", "public.parent", "public.child", "public.m", "public.empty"]


def _blocks(pg: Database, table: str) -> int:
    (blocks,) = pg.execute(
        "SELECT greatest(pg_relation_size(%(t)s::regclass), (SELECT max(pg_relation_size(relid))"
        " FROM pg_partition_tree(%(t)s::regclass) WHERE isleaf)) / current_setting('block_size')::int8",
        {"t": table},
    )[0]
    return int(blocks)


@pytest.mark.slow
def test_parallel_setup_equals_the_source(pg: Database, tmp_path: Path) -> None:
    """Three workers copy tables split into ctid ranges — a plain table with holes, an
    inheritance parent without its child's rows, a partitioned table through its root (ranges
    over every leaf) — and an empty table; the log replays to the source, before and after a
    round of changes."""
    pg.execute(";".join(WORKLOAD))
    for table in ("big", "parent", "m"):
        assert len(block_ranges(_blocks(pg, table), 3)) >= 3, table
    pipe = Pipeline(pg, tmp_path, TABLES, source={"snapshot_workers": 3})
    progress: dict[str, list[int]] = {}
    result = pipe.setup(progress=lambda table, rows: progress.setdefault(table, []).append(rows))
    assert result.rows == {
        "public.big": 30000 - 309,
        "public.parent": 20000,
        "public.child": 5000,
        "public.m": 30000,
        "public.empty": 0,
    }
    for table, counts in progress.items():
        assert counts == sorted(counts) and counts[-1] == result.rows[table], table
    replica = pipe.assert_mirrors()
    assert len(replica["public.big"]) == 30000 - 309
    positions = [
        p for chunk in pipe.reader.read_changes("public.big") for p in chunk.records.column("_cdc_position").to_pylist()
    ]
    ranges = {p // RANGE_POSITIONS for p in positions}  # each range numbers its rows from its own base
    assert len(set(positions)) == len(positions) and len(ranges) == len(block_ranges(_blocks(pg, "big"), 3))
    pg.execute(
        "UPDATE big SET pad = 'changed' WHERE id % 1000 = 1; DELETE FROM parent WHERE id % 500 = 0;"
        " UPDATE m SET region = 'us' WHERE id % 7 = 1 AND region = 'eu'; INSERT INTO empty VALUES (1)"
    )
    pipe.drain()
    pipe.assert_mirrors()


@pytest.fixture
def copier(pg: Database) -> Any:
    """A LOGIN REPLICATION role that is not superuser (row-level security applies to it)."""
    name = f"r_{pg.name}_copier"
    pg.execute(f'CREATE ROLE "{name}" LOGIN REPLICATION')
    pg.execute(f'GRANT CREATE ON DATABASE "{pg.name}" TO "{name}"; GRANT CREATE ON SCHEMA public TO "{name}"')
    yield name
    pg.execute(f'DROP OWNED BY "{name}"')
    pg.execute(f'DROP ROLE "{name}"')


def _guarded_big(pg: Database, copier: str, check: str, *more: str) -> None:
    """``big`` (the workload's first table) created by ``copier`` behind a row-level security
    policy that runs ``check`` (PL/pgSQL statements, the row's key in ``id``) for every row read;
    then ``more`` statements as ``copier``."""
    with pg.connect(autocommit=True) as conn:
        conn.execute(f'SET ROLE "{copier}"')
        conn.execute(";".join(WORKLOAD[:3]))
        conn.execute(
            f"CREATE FUNCTION readable(id int) RETURNS bool LANGUAGE plpgsql STABLE AS $$ BEGIN {check}"
            " RETURN true; END $$;"
            " CREATE POLICY guard ON big USING (readable(id));"
            " ALTER TABLE big ENABLE ROW LEVEL SECURITY, FORCE ROW LEVEL SECURITY"
        )
        for statement in more:
            conn.execute(statement)


def _copier_pipeline(pg: Database, tmp_path: Path, copier: str, tables: list[str]) -> Pipeline:
    """A pipeline of ``tables`` copied by two workers, connecting as ``copier``."""
    return Pipeline(pg, tmp_path, tables, source={"snapshot_workers": 2}, dsn=pg.cluster.dsn(pg.name, user=copier))


def test_a_worker_error_fails_setup_cleanly(pg: Database, tmp_path: Path, copier: str) -> None:
    """A row the source role may not read, in one range of a table copied by two workers: setup
    fails with one error naming the table, the other workers stop, no checkpoint is written and
    no copy connection is left; once the table is readable, setup runs again and is exact."""
    _guarded_big(
        pg,
        copier,
        "IF id = 15000 THEN RAISE EXCEPTION 'row % of big is confidential', id"
        " USING ERRCODE = 'insufficient_privilege'; END IF;",
        "CREATE TABLE small (id int PRIMARY KEY); INSERT INTO small VALUES (1), (2)",
    )
    pipe = _copier_pipeline(pg, tmp_path, copier, ["public.big", "public.small"])
    with pytest.raises(SourcePermissionError) as failed:
        pipe.setup()
    assert str(failed.value) == "cannot copy table public.big: row 15000 of big is confidential"
    assert pipe.checkpoint() is None and Path(pipe.changelog, "_setup.json").exists()
    wait_until(  # a closed connection's server process ends a moment later
        lambda: (
            pg.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name = 'cdc-assets:snapshot'") == [(0,)]
        ),
        what="the copy's connections to close",
    )
    cli = pipe.cli("setup")
    assert cli.returncode == 1
    assert cli.stderr.splitlines()[-1] == "cdc-assets: cannot copy table public.big: row 15000 of big is confidential"
    assert "Traceback" not in cli.stderr

    pg.execute("ALTER TABLE big NO FORCE ROW LEVEL SECURITY")
    result = pipe.setup()
    assert result.created_slot and result.rows == {"public.big": 30000 - 309, "public.small": 2}
    assert not Path(pipe.changelog, "_setup.json").exists()
    pipe.assert_mirrors()


SLEEPING = "SELECT pid FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND datname = current_database()"


def test_a_killed_setup_leaves_no_copy_worker_behind(pg: Database, tmp_path: Path, copier: str) -> None:
    """Setup's copy held inside both workers' COPY (a row-level security function that sleeps on
    rows of every range), then the CLI SIGKILLed: its worker process dies with it (the kernel's
    parent-death signal) instead of copying on, nothing is checkpointed, and setup run again is
    exact."""
    _guarded_big(pg, copier, "IF id % 1000 = 0 THEN PERFORM pg_sleep(600); END IF;")
    assert len(block_ranges(_blocks(pg, "big"), 2)) >= 2
    pipe = _copier_pipeline(pg, tmp_path, copier, ["public.big"])
    setup = pipe.popen("setup")
    try:
        wait_until(lambda: len(pg.execute(SLEEPING)) == 2, timeout=120, what="both workers to be inside a COPY")
        workers = [child for child in psutil.Process(setup.pid).children() if "spawn_main" in " ".join(child.cmdline())]
        assert len(workers) == 1  # the CLI's process copies too
    finally:
        os.kill(setup.pid, signal.SIGKILL)
        setup.wait(timeout=60)  # not its output: a worker left alive would hold the pipes open
        for pipe_end in (setup.stdout, setup.stderr):
            if pipe_end is not None:
                pipe_end.close()
    try:
        wait_until(lambda: not _alive(workers[0]), what="the copy worker to die with setup")
    finally:  # the server notices a client gone only when it next writes to it
        for (pid,) in pg.execute(SLEEPING):
            pg.execute("SELECT pg_terminate_backend(%s)", (pid,))
    assert pipe.checkpoint() is None

    pg.execute("ALTER TABLE big NO FORCE ROW LEVEL SECURITY")
    result = pipe.setup()
    assert result.rows == {"public.big": 30000 - 309}
    pipe.assert_mirrors()


def _alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_snapshot_workers_setting(tmp_path: Path) -> None:
    def source(extra: str) -> SourceConfig:
        text = f"source:\n  dsn: x\n{extra}changelog: {{path: log}}\nwarehouse: {{path: wh}}\ntables: {{t: {{}}}}\n"
        return parse_config(text, origin=tmp_path / "cdc.yaml", environ={}).source

    assert source("").snapshot_workers == (os.cpu_count() or 1)
    assert source("  snapshot_workers: 3\n").snapshot_workers == 3
    for bad in ("0", "-1", "two", "true", "1.5"):
        with pytest.raises(ConfigError) as refused:
            source(f"  snapshot_workers: {bad}\n")
        assert str(refused.value).startswith(f"{tmp_path / 'cdc.yaml'}: source.snapshot_workers: expected a positive")
