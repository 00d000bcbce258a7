"""cdc-assets: PostgreSQL change data capture into Delta Lake, orchestrated by Dagster.

The library has no Dagster imports; `dagster_project` wraps it.
"""

__version__ = "0.1.0"
