"""The cdc-assets pipeline, built from the configuration file (``$CDC_CONFIG`` or ``./cdc.yaml``)."""

import dagster as dg

from dagster_project.factory import build_definitions
from dagster_project.settings import load_settings


@dg.definitions
def defs() -> dg.Definitions:
    return build_definitions(load_settings())
