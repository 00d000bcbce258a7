"""``python -m cdc_assets``: the command line."""

from cdc_assets.cli import run

run()
