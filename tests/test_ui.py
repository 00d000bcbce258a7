"""The Dagster UI on the project's code location, as a person sees it: a real ``dagster-webserver``
(its own processes: the webserver and the code server it starts) on a set-up source, and headless
Chromium driven over the Chrome DevTools protocol.

The webserver loads ``-m dagster_project.definitions`` with ``CDC_CONFIG`` pointing to a config
written by :func:`tests.support.dagster_env.write_dagster_config` (a custom drain cron, so the schedule the
UI shows is the file's) and ``CDC_SOURCE_DSN`` of a throwaway database on which ``cdc-assets setup``
has run. Every page is checked for what it renders (``document.body.innerText``), waited for with a
timeout, never a sleep. A drain is launched through the webserver's GraphQL endpoint, executed by
the instance's run launcher in a process of its own, and its metadata is read off the asset's page.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import urllib.error
import urllib.request
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from dagster import __version__ as dg_version

from cdc_assets.changelog.reader import ChangeLogReader
from cdc_assets.config import load_config
from cdc_assets.lsn import format_lsn
from cdc_assets.pipeline.setup import setup
from cdc_sandbox.pgcluster import free_port
from dagster_project.demo.run import DAGSTER_YAML as DEMO_INSTANCE_YAML
from tests.support.browser import VIEWPORT, Browser, alive, start, stop
from tests.support.dagster_env import DDL, DSN_VARIABLE, ROOT, TABLES, write_dagster_config
from tests.support.database import Database
from tests.support.pipeline import wait_until

pytestmark = pytest.mark.slow  # not in the quick tier

CRON = "*/7 * * * *"  # not the default: the schedule the UI shows comes from the file
SLOT = "cdc_ui_slot"  # slot names are per cluster: not the other Dagster tests' slot
LOCATION = "dagster_project.definitions"
DRAIN_JOB = "cdc_drain"
ASSET_KEYS = ["cdc/changelog", "cdc/snapshot", "cdc/rebuild", "cdc/verify", "cdc/consistent_point"] + [
    f"{kind}/{table.replace('.', '/')}" for kind in ("delta", "maintenance", "history") for table in TABLES
]
SENSORS = [f"cdc_merges__{table.replace('.', '__')}" for table in TABLES]  # a merge sensor per table
POINT_SENSOR = "cdc_consistent_point"
# One transaction after the snapshot: what the launched drain must find.
TRANSACTION = [
    "INSERT INTO public.customers VALUES (100, 'customer 100', 'gold', DATE '2025-03-01')",
    "INSERT INTO public.orders VALUES (100, 100, 'paid', 99.5)",
    "UPDATE public.notes SET stars = 5 WHERE id = 1",
]

# Runs launched from the UI start at once (no daemon here), each in a process of its own; the
# demo's settings of the UI itself (no newsletter pop-up over the first screen).
INSTANCE_YAML = yaml.safe_dump(
    {
        "run_coordinator": {"module": "dagster._core.run_coordinator", "class": "DefaultRunCoordinator"},
        "telemetry": {"enabled": False},
        "nux": yaml.safe_load(DEMO_INSTANCE_YAML)["nux"],
    }
)


# -- the webserver -----------------------------------------------------------------------------------


@dataclass
class Webserver:
    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def get(self, path: str) -> Any:
        with urllib.request.urlopen(self.url + path, timeout=10) as response:
            return json.load(response)

    def graphql(self, query: str, **variables: Any) -> dict[str, Any]:
        request = urllib.request.Request(
            self.url + "/graphql",
            data=json.dumps({"query": query, "variables": variables}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=30) as response:
            answer = json.load(response)
        assert "errors" not in answer, answer
        return answer["data"]

    def server_info(self) -> dict[str, Any] | None:
        alive(self.process, self.log)
        try:
            return self.get("/server_info")
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            return None

    def location_status(self) -> tuple[str, str] | None:
        """The code location's load status and its type (``RepositoryLocation`` or ``PythonError``)."""
        data = self.graphql(
            "{ workspaceOrError { ... on Workspace { locationEntries { name loadStatus"
            " locationOrLoadError { __typename ... on PythonError { message } } } } } }"
        )
        for entry in data["workspaceOrError"]["locationEntries"]:
            if entry["name"] == LOCATION and entry["loadStatus"] == "LOADED":
                error = entry["locationOrLoadError"]
                assert error["__typename"] == "RepositoryLocation", error
                return entry["loadStatus"], error["__typename"]
        return None


def png_size(data: bytes) -> tuple[int, int]:
    """Width and height of a well-formed 8-bit RGB(A) PNG: signature, every chunk's CRC, IHDR, image
    data that inflates to exactly one filtered scanline per row, IEND."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG"
    chunks: dict[bytes, bytes] = {}
    idat, offset = b"", 8
    while offset < len(data):
        length, kind = struct.unpack(">I4s", data[offset : offset + 8])
        body = data[offset + 8 : offset + 8 + length]
        (crc,) = struct.unpack(">I", data[offset + 8 + length : offset + 12 + length])
        assert zlib.crc32(kind + body) == crc, kind
        idat += body if kind == b"IDAT" else b""
        chunks.setdefault(kind, body)
        offset += 12 + length
    assert b"IEND" in chunks
    width, height, depth, color = struct.unpack(">IIBB", chunks[b"IHDR"][:10])
    assert depth == 8 and color in (2, 6), (depth, color)
    assert len(zlib.decompress(idat)) == height * (1 + width * (3 if color == 2 else 4))
    return width, height


def assert_rendered(browser: Browser, path: Path) -> None:
    """A screenshot of the whole viewport, far richer than a blank page's (PNG compresses a blank or
    single-colour page to almost nothing)."""
    data = browser.screenshot(path).read_bytes()
    assert png_size(data) == VIEWPORT
    assert len(data) > 5 * len(browser.blank) and len(data) > 20_000, (len(data), len(browser.blank))


# -- fixtures ----------------------------------------------------------------------------------------


@dataclass
class Ui:
    db: Database
    folder: Path
    server: Webserver

    @property
    def config_path(self) -> Path:
        return self.folder / "cdc.yaml"


@pytest.fixture(scope="module")
def ui(pg_module: Database, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ui]:
    """A set-up source and ``dagster-webserver -m dagster_project.definitions`` on it, loaded."""
    folder = tmp_path_factory.mktemp("ui")
    with pg_module.connect() as conn:
        conn.execute(DDL)
    config = write_dagster_config(folder, source={"slot": SLOT}, schedule={"drain_cron": CRON})
    setup(load_config(config, environ={DSN_VARIABLE: pg_module.dsn}))

    home = folder / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(INSTANCE_YAML)
    environ = {
        **os.environ,
        "CDC_CONFIG": str(config),
        DSN_VARIABLE: pg_module.dsn,
        "DAGSTER_HOME": str(home),
        # The checkout, for the code server and the run workers, installed or not.
        "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]),
    }
    port = free_port()
    log = folder / "webserver.log"
    command = ["dagster-webserver", "-m", LOCATION, "-d", str(ROOT), "-h", "127.0.0.1", "-p", str(port)]
    process = start(command, log, cwd=ROOT, env=environ)
    try:
        server = Webserver(f"http://127.0.0.1:{port}", process, log)
        try:
            info = wait_until(server.server_info, timeout=120, what="the webserver's /server_info")
            wait_until(server.location_status, timeout=120, what="the code location loaded")
        except TimeoutError as error:
            raise AssertionError(f"{error}; webserver log:\n{log.read_text()[-4000:]}") from error
        assert info["dagster_webserver_version"] == info["dagster_version"] == dg_version
        # The UI would greet a new instance with a community and newsletter dialog over the page a
        # second after it loads: the demo's (and deploy/'s) instance settings turn it off.
        assert server.graphql("{ shouldShowNux }")["shouldShowNux"] is False
        yield Ui(pg_module, folder, server)
    finally:
        stop(process)


@pytest.fixture(scope="module")
def browser(ui: Ui, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Browser]:
    chromium = Browser(tmp_path_factory.mktemp("chromium"))
    yield chromium
    chromium.close()


# -- tests -------------------------------------------------------------------------------------------


def test_asset_catalog_lists_every_asset_of_the_configured_tables(ui: Ui, browser: Browser, tmp_path: Path) -> None:
    browser.open(f"{ui.server.url}/assets")
    shown = [key.replace("/", " / ") for key in ASSET_KEYS]  # the catalog writes keys as "cdc / changelog"
    text = browser.wait_for(*shown, LOCATION)
    # Descriptions come from the code location and name this pipeline's own paths.
    assert f"Drains replication slot {SLOT} into the change log at {ui.folder / 'changelog'}" in text
    assert f"Delta mirror of public.orders at {ui.folder / 'warehouse' / 'public' / 'orders'}" in text
    links = browser.links()
    for key in ASSET_KEYS:
        assert f"/assets/{key}" in links, key

    # Each asset's status has loaded: nothing materialized yet (the drain, the consistent point, each
    # mirror and its maintenance), the snapshot and the rebuild partitioned by table.
    def statuses() -> bool:
        text = browser.text()
        return text.count("Never materialized") == 2 + 2 * len(TABLES) and f"{len(TABLES)} partitions" in text

    wait_until(statuses, timeout=45, what="every asset's status")
    assert_rendered(browser, tmp_path / "catalog.png")


def test_automation_shows_the_drain_schedule_with_the_files_cron_and_the_merge_sensor(
    ui: Ui, browser: Browser, tmp_path: Path
) -> None:
    browser.open(f"{ui.server.url}/automation")
    browser.wait_for("cdc_drain_schedule", *SENSORS, POINT_SENSOR, "Every 7 minutes")
    sensors = [*SENSORS, POINT_SENSOR]
    wait_until(lambda: browser.text().count("Standard sensor") == len(sensors), timeout=45, what="each sensor's kind")
    links = browser.links()
    assert f"/locations/{LOCATION}/schedules/cdc_drain_schedule" in links
    for sensor in sensors:
        assert f"/locations/{LOCATION}/sensors/{sensor}" in links
    assert_rendered(browser, tmp_path / "automation.png")

    browser.open(f"{ui.server.url}/locations/{LOCATION}/schedules/cdc_drain_schedule")
    text = browser.wait_for("Drains the replication slot into the change log", f"({CRON})", "Every 7 minutes")
    assert "*/5 * * * *" not in text
    assert any(link.endswith(f"/jobs/{DRAIN_JOB}") for link in browser.links()), browser.links()  # its target

    browser.open(f"{ui.server.url}/locations/{LOCATION}/sensors/{SENSORS[0]}")
    browser.wait_for(f"Requests a merge run of {TABLES[0]} when its change log holds changes beyond its Delta table's")


def test_drain_launched_through_graphql_runs_and_its_metadata_shows_on_the_asset_page(
    ui: Ui, browser: Browser, tmp_path: Path
) -> None:
    def checkpoint_lsn() -> int:
        config = load_config(ui.config_path, environ={DSN_VARIABLE: ui.db.dsn})
        checkpoint = ChangeLogReader(config.changelog.path).checkpoint()
        assert checkpoint is not None
        return checkpoint.lsn

    snapshot_lsn = checkpoint_lsn()  # setup's
    with ui.db.connect() as conn, conn.transaction():
        for statement in TRANSACTION:
            conn.execute(statement)
    launched = ui.server.graphql(
        """mutation Launch($params: ExecutionParams!) {
             launchRun(executionParams: $params) {
               __typename
               ... on LaunchRunSuccess { run { runId } }
               ... on PythonError { message }
               ... on RunConfigValidationInvalid { errors { message } }
             }
           }""",
        params={
            "selector": {"repositoryLocationName": LOCATION, "repositoryName": "__repository__", "jobName": DRAIN_JOB},
            "mode": "default",
            "runConfigData": "{}",
        },
    )["launchRun"]
    assert launched["__typename"] == "LaunchRunSuccess", launched
    run_id = launched["run"]["runId"]

    def finished() -> str | None:
        alive(ui.server.process, ui.server.log)
        status = ui.server.graphql(
            "query Run($id: ID!) { runOrError(runId: $id) { ... on Run { status } } }", id=run_id
        )["runOrError"]["status"]
        return status if status in ("SUCCESS", "FAILURE", "CANCELED") else None

    status = wait_until(finished, timeout=120, what="the drain run finished")
    if status != "SUCCESS":
        logs = ui.server.graphql(
            "query Logs($id: ID!) { logsForRun(runId: $id) { ... on EventConnection { events { __typename message } } } }",
            id=run_id,
        )
        pytest.fail(f"drain run {status}: {json.dumps(logs, indent=1)[-4000:]}")

    # The run drained the slot: the change log's checkpoint moved past the transaction.
    drained_lsn = checkpoint_lsn()
    assert drained_lsn > snapshot_lsn
    lsn = format_lsn(drained_lsn)

    # The asset's page shows that run's materialization with the drain's own numbers.
    browser.open(f"{ui.server.url}/assets/cdc/changelog?view=events")
    browser.wait_for("Materialized in run", run_id[:8], "checkpoint_lsn", lsn)
    metadata = {row[0]: row[1] for row in browser.table_rows() if len(row) >= 2}
    assert metadata["checkpoint_lsn"] == lsn
    assert (metadata["transactions"], metadata["changes"]) == ("1", str(len(TRANSACTION)))
    assert {table: metadata[f"changes/{table}"] for table in TABLES} == dict.fromkeys(TABLES, "1")
    assert metadata["wal_status"] in ("reserved", "extended") and int(metadata["slot_lag_bytes"]) >= 0
    assert_rendered(browser, tmp_path / "changelog.png")

    # And the run's page lists its step and its success.
    browser.open(f"{ui.server.url}/runs/{run_id}")
    browser.wait_for("cdc__changelog", "RUN_SUCCESS")
