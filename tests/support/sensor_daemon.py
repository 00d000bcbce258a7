"""Dagster's sensor daemon over the code location, in this process: the daemon's workspace (the code
location loaded in a code server subprocess, as ``dagster-daemon run`` loads it, with this
process's environment: ``CDC_CONFIG``, the DSN) and one pass of the daemon's sensor loop
(``execute_sensor_iteration``: each running sensor whose interval has passed ticks, its tick and
cursor recorded, its run requests submitted to the instance's run coordinator). Sensors are turned
off and on through the instance, as the UI's toggle does."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import dagster as dg
from dagster._core.remote_representation.external import RemoteSensor
from dagster._core.scheduler.instigation import TickStatus
from dagster._core.test_utils import create_test_daemon_workspace_context
from dagster._core.workspace.context import WorkspaceProcessContext
from dagster._core.workspace.load_target import ModuleTarget
from dagster._daemon.sensor import execute_sensor_iteration

from tests.support.dagster_env import CODE_LOCATION_MODULE, ROOT

LOCATION = "cdc_assets_under_test"


@dataclass
class SensorDaemon:
    instance: dg.DagsterInstance
    workspace: WorkspaceProcessContext

    def sensors(self) -> dict[str, RemoteSensor]:
        """The code location's sensors, as the UI lists them."""
        location = self.workspace.create_request_context().get_code_location(LOCATION)
        return {sensor.name: sensor for sensor in location.get_repository("__repository__").get_sensors()}

    def iterate(self) -> None:
        """One pass of the sensor daemon's loop."""
        list(execute_sensor_iteration(self.workspace, logging.getLogger("sensor-daemon"), None, None))

    def stop(self, name: str) -> None:
        sensor = self.sensors()[name]
        self.instance.stop_sensor(sensor.get_remote_origin_id(), sensor.selector_id, sensor)

    def start(self, name: str) -> None:
        self.instance.start_sensor(self.sensors()[name])

    def ticks(self, name: str) -> list[TickStatus]:
        """The statuses of the sensor's recorded ticks, the latest first."""
        sensor = self.sensors()[name]
        return [tick.status for tick in self.instance.get_ticks(sensor.get_remote_origin_id(), sensor.selector_id)]


@contextmanager
def sensor_daemon(instance: dg.DagsterInstance) -> Iterator[SensorDaemon]:
    target = ModuleTarget(CODE_LOCATION_MODULE, None, str(ROOT), LOCATION)
    with create_test_daemon_workspace_context(target, instance) as workspace:
        yield SensorDaemon(instance, workspace)
