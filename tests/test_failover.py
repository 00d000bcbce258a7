"""Failover and foreign servers against real PostgreSQL 18 primaries and their ``pg_basebackup``
standbys: a failover slot that the drain follows onto the promoted standby (found through a
multi-host DSN), exactly — checked with the oracle; and every way of reaching a server whose slot
position means nothing to the change log refused before anything is read or advanced: a promotion
without a failover slot, a promotion that forked before the log's checkpoint, another cluster, a
slot re-created by hand, and a primary that holds the slot's changes back for a standby that is gone.
"""

from __future__ import annotations

from pathlib import Path

import dagster as dg
import pytest

from cdc_assets.changelog.checkpoint import Checkpoint
from cdc_assets.errors import (
    ConfigError,
    ServerMismatchError,
    SlotGapError,
    SlotMissingError,
    StandbyWaitError,
)
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.recover import recover
from cdc_assets.pipeline.status import read_status
from cdc_assets.source.server_identity import (
    ServerIdentity,
    ServerLineage,
    parse_timeline_history,
    require_same_history,
)
from cdc_sandbox.pgcluster import ThrowawayCluster
from dagster_project.factory import build_definitions
from dagster_project.naming import Naming
from dagster_project.settings import load_settings
from tests.support.dagster_env import DSN_VARIABLE, execute
from tests.support.database import ClusterPool, Database, create_database, drop_database
from tests.support.pipeline import Pipeline
from tests.support.standby_pair import STANDBY_SLOT, Pair, write

STANDBY_CHECK = dg.AssetCheckKey(Naming().changelog, "standby_slot_ready")


# -- the history check, as pure code ----------------------------------------------------------


def test_timeline_history_files_are_parsed() -> None:
    text = "1\t0/3000328\tno recovery target specified\n\n# a comment\n2\t1/A0\tbefore 2000-01-01\n"
    assert parse_timeline_history(text) == {1: 0x3000328, 2: 0x1_000000A0}


@pytest.mark.parametrize(
    ("current", "ends", "checkpoint", "refusal"),
    [
        (ServerIdentity("7", 1), {}, 0x500, None),
        (ServerIdentity("7", 3), {1: 0x500, 2: 0x900}, 0x500, None),  # forked at the checkpoint: nothing lost
        (ServerIdentity("8", 1), {}, 0x500, "another cluster"),
        (ServerIdentity("7", 2), {1: 0x4FF}, 0x500, "was promoted: timeline 2 left timeline 1 at 0/4FF"),
        (ServerIdentity("7", 3), {2: 0x900}, 0x500, "does not contain timeline 1"),
    ],
)
def test_a_server_continues_the_history_or_is_refused(
    current: ServerIdentity, ends: dict[int, int], checkpoint: int, refusal: str | None
) -> None:
    recorded, lineage = ServerIdentity("7", 1), ServerLineage(current, ends)
    if refusal is None:
        require_same_history(recorded, lineage, checkpoint, "s")
    else:
        with pytest.raises(ServerMismatchError, match=refusal):
            require_same_history(recorded, lineage, checkpoint, "s")


# -- a primary and its standby ------------------------------------------------------------------


def checkpoint_of(pipe: Pipeline) -> Checkpoint:
    checkpoint = pipe.checkpoint()
    assert checkpoint is not None
    return checkpoint


def refused(pipe: Pipeline, db: Database, error: type[Exception], message: str) -> None:
    """The drain raises ``error`` and leaves the checkpoint and the slot where they were."""
    before = pipe.checkpoint_bytes()
    slot = db.execute("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'cdc_slot'")
    with pytest.raises(error, match=message):
        pipe.drain()
    assert pipe.checkpoint_bytes() == before
    assert db.execute("SELECT confirmed_flush_lsn FROM pg_replication_slots WHERE slot_name = 'cdc_slot'") == slot


def standby_readiness(pipe: Pipeline, definitions: dg.Definitions) -> dg.AssetCheckEvaluation:
    """``cdc-assets status``'s view of the standby's copy of the slot, which must agree with the
    drain's ``standby_slot_ready`` check, evaluated in Dagster."""
    shown = read_status(pipe.config()).to_json()["standby_slot"]
    with dg.instance_for_test() as instance:
        result = execute(definitions, instance, dg.AssetSelection.checks(STANDBY_CHECK), name="standby_check")
    [evaluation] = result.get_asset_check_evaluations()
    assert shown["ready"] is evaluation.passed
    assert (shown["problem"] is None) is evaluation.passed
    return evaluation


# -- failover slots -------------------------------------------------------------------------------


@pytest.mark.slow
def test_the_drain_follows_a_failover_slot_onto_the_promoted_standby(
    syncing_pair: Pair, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pair = syncing_pair
    source = {"failover": True, "streaming": "on", "two_phase": True, "standby_dsn": pair.standby.dsn(pair.name)}
    pipe = Pipeline(pair.on_primary, tmp_path, ["public.t"], source=source)
    pipe.dsn = pair.dsn()
    pipe.setup()
    monkeypatch.setenv(DSN_VARIABLE, pipe.dsn)
    definitions = build_definitions(load_settings(str(pipe.config_path)))
    assert STANDBY_CHECK in definitions.resolve_job_def("cdc_drain").asset_layer.asset_graph.asset_check_keys
    not_ready = standby_readiness(pipe, definitions)
    assert not not_ready.passed and not_ready.severity == dg.AssetCheckSeverity.WARN
    assert "standby slot cdc_slot: not ready" in (not_ready.description or "")
    primary = pair.on_primary
    assert primary.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = 'cdc_slot'") == [(True,)]
    write(primary, "INSERT INTO t SELECT g, 'v' || g FROM generate_series(1, 50) g")
    write(primary, "UPDATE t SET id = id + 10000 WHERE id <= 10", "DELETE FROM t WHERE id BETWEEN 20 AND 25")
    write(primary, "INSERT INTO t SELECT g, repeat('x', 200) FROM generate_series(100, 2100) g")  # streamed
    with primary.connect() as conn:
        conn.execute("BEGIN")
        conn.execute("INSERT INTO t VALUES (5000, 'prepared')")
        conn.execute("PREPARE TRANSACTION 'p1'")
        conn.execute("COMMIT PREPARED 'p1'")
    pipe.drain()
    drained = checkpoint_of(pipe).lsn
    standby = pair.on_standby

    pair.wait_slot_synced("cdc_slot", drained, pipe.drain)
    ready = standby_readiness(pipe, definitions)
    assert ready.passed, ready.description
    assert ready.metadata["synced"].value is True and ready.metadata["confirmed_flush_lsn"].value != "none"
    write(primary, "TRUNCATE t", "INSERT INTO t VALUES (1, 'after truncate')")  # drained, not yet synced
    pipe.drain()
    write(primary, "UPDATE t SET v = 'pending' WHERE id = 1")  # only in WAL: drained after the promotion
    pair.replayed()
    pair.fail_over()

    pipe.drain()  # the multi-host DSN reaches the promoted standby
    write(standby, "INSERT INTO t VALUES (2, 'on the new primary')", "DELETE FROM t WHERE id = 1")
    pipe.drain()
    checkpoint = checkpoint_of(pipe)
    assert checkpoint.server is not None and checkpoint.server.timeline == 2
    pipe.db = standby
    replica = pipe.assert_mirrors()
    assert {"id": 2, "v": "on the new primary"} in replica.rows("public.t")
    assert all(row["id"] != 1 for row in replica.rows("public.t"))


def test_failover_needs_postgresql_17(clusters: ClusterPool, tmp_path: Path) -> None:
    db = create_database(clusters.get(15))
    try:
        db.execute("CREATE TABLE t (id int PRIMARY KEY)")
        pipe = Pipeline(db, tmp_path, ["public.t"], source={"failover": True})
        with pytest.raises(ConfigError, match=r"source.failover: failover slots need PostgreSQL 17 or later"):
            pipe.setup()
    finally:
        drop_database(db)


def test_the_drain_turns_an_existing_slot_into_a_failover_slot(pair: Pair, tmp_path: Path) -> None:
    pipe = Pipeline(pair.on_primary, tmp_path, ["public.t"])
    pipe.setup()
    slot_failover = "SELECT failover FROM pg_replication_slots WHERE slot_name = 'cdc_slot'"
    assert pair.on_primary.execute(slot_failover) == [(False,)]
    pipe.update_source(failover=True)
    write(pair.on_primary, "INSERT INTO t VALUES (1, 'a')")
    assert pipe.drain().checkpoint_lsn > 0
    assert pair.on_primary.execute(slot_failover) == [(True,)]
    pipe.assert_mirrors()


def test_a_primary_waiting_for_a_lost_standby_is_an_error(syncing_pair: Pair, tmp_path: Path) -> None:
    pair = syncing_pair
    pipe = Pipeline(pair.on_primary, tmp_path, ["public.t"], source={"failover": True})
    pipe.setup()
    write(pair.on_primary, "INSERT INTO t VALUES (1, 'a')")
    pipe.drain()
    pair.standby.halt()
    pair.on_primary.execute(f"SELECT pg_drop_replication_slot('{STANDBY_SLOT}')")
    write(pair.on_primary, "INSERT INTO t VALUES (2, 'b')")
    config = (tmp_path / "cdc.yaml").read_text()
    (tmp_path / "cdc.yaml").write_text(config + "drain:\n  standby_wait_seconds: 2\n")
    refused(
        pipe,
        pair.on_primary,
        StandbyWaitError,
        r"replication slot cdc_slot: the server has sent nothing past LSN [0-9A-F/]+ for \d+ s because it waits"
        rf" until the standby slots of synchronized_standby_slots = '{STANDBY_SLOT}' have the WAL"
        rf" \({STANDBY_SLOT} does not exist\)",
    )


# -- servers the change log cannot continue from ----------------------------------------------------


def test_a_promotion_without_a_failover_slot_stops_the_drain(pair: Pair, tmp_path: Path) -> None:
    pipe = Pipeline(pair.on_primary, tmp_path, ["public.t"])
    pipe.dsn = pair.dsn()
    pipe.setup()
    write(pair.on_primary, "INSERT INTO t VALUES (1, 'a')")
    pipe.drain()
    pair.replayed()
    pair.fail_over()
    standby = pair.on_standby
    with pytest.raises(SlotMissingError, match="replication slot cdc_slot does not exist"):
        pipe.drain()
    write(standby, "INSERT INTO t VALUES (2, 'b')")
    standby.execute("SELECT pg_create_logical_replication_slot('cdc_slot', 'pgoutput')")  # by hand, later
    refused(pipe, standby, SlotGapError, r"replication slot cdc_slot has confirmed LSN .* past the change log's")


def test_a_promotion_that_forked_before_the_checkpoint_is_refused(pair: Pair, tmp_path: Path) -> None:
    pipe = Pipeline(pair.on_primary, tmp_path, ["public.t"])
    pipe.dsn = pair.dsn()
    pipe.setup()
    pair.replayed()
    pair.standby.halt()  # the primary goes on alone: what it writes now never reaches the standby
    for i in range(20):
        write(pair.on_primary, f"INSERT INTO t VALUES ({i}, 'only on the old primary')")
    pipe.drain()
    held = checkpoint_of(pipe).lsn
    pair.primary.halt()
    pair.standby.resume()
    pair.standby.promote()
    standby = pair.on_standby
    standby.execute("SELECT pg_create_logical_replication_slot('cdc_slot', 'pgoutput')")
    (created_at,) = standby.execute(
        "SELECT (confirmed_flush_lsn - '0/0')::int8 FROM pg_replication_slots WHERE slot_name = 'cdc_slot'"
    )[0]
    assert created_at < held  # the new slot alone would not be refused as ahead of the log
    refused(
        pipe,
        standby,
        ServerMismatchError,
        rf"the server was promoted: timeline 2 left timeline 1 at [0-9A-F/]+, but the change log already holds"
        rf" timeline 1 up to {format_lsn(held)}",
    )
    write(standby, "INSERT INTO t VALUES (100, 'on the new timeline')")
    gap = recover(pipe.config()).gap  # the new timeline is behind the log: written past it first
    assert gap is not None and gap.lost_after == held and gap.slot_point > held
    pipe.drain()
    pipe.db = standby
    assert {"id": 100, "v": "on the new timeline"} in pipe.assert_mirrors().rows("public.t")


def test_another_cluster_is_refused(pg: Database, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pipe.setup()
    recorded = checkpoint_of(pipe).server
    assert recorded is not None
    with ThrowawayCluster(18) as other:  # the same database, table, publication and slot, on another cluster
        twin = create_database(other)
        twin.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
        twin.execute("CREATE PUBLICATION cdc_pub FOR TABLE t")
        twin.execute("SELECT pg_create_logical_replication_slot('cdc_slot', 'pgoutput')")
        pg.execute("SELECT pg_drop_replication_slot('cdc_slot')")
        pipe.dsn = twin.dsn
        refused(
            pipe,
            twin,
            ServerMismatchError,
            rf"source.dsn reaches the server with system identifier \d+, timeline 1, but the change log was read"
            rf" from the server with system identifier {recorded.system_identifier}, timeline 1: another cluster",
        )


def test_a_slot_recreated_by_hand_is_refused(pg: Database, tmp_path: Path) -> None:
    pg.execute("CREATE TABLE t (id int PRIMARY KEY, v text)")
    pipe = Pipeline(pg, tmp_path, ["public.t"])
    pipe.setup()
    write(pg, "INSERT INTO t VALUES (1, 'a')")
    pipe.drain()
    write(pg, "INSERT INTO t VALUES (2, 'lost with the slot')")
    pg.execute("SELECT pg_drop_replication_slot('cdc_slot')")
    pg.execute("SELECT pg_create_logical_replication_slot('cdc_slot', 'pgoutput')")
    refused(pipe, pg, SlotGapError, r"replication slot cdc_slot has confirmed LSN .* past the change log's checkpoint")
