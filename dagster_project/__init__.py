"""The Dagster code location for cdc-assets: thin wrappers around the `cdc_assets` library."""
