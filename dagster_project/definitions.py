"""Code location entry point: the pipeline built from the configuration file.

``dg dev`` / ``dg check defs`` from the repository root, or ``dagster dev -m
dagster_project.definitions`` anywhere the package is installed. The file is ``$CDC_CONFIG`` or
``./cdc.yaml``.
"""

import dagster as dg

from dagster_project.factory import build_definitions, run_executor
from dagster_project.settings import load_settings


@dg.definitions
def defs() -> dg.Definitions:
    settings = load_settings()
    return dg.Definitions.merge(build_definitions(settings), dg.Definitions(executor=run_executor(settings)))
