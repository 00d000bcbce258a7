"""``cdc-assets demo``: registered with the ``cdc-assets`` command through the
``cdc_assets.commands`` entry point, so that the library never imports Dagster.

This module is loaded for every ``cdc-assets`` invocation: it only declares the arguments; the demo
itself (Dagster, a throwaway PostgreSQL) is imported when the command runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any


def add_demo_command(commands: Any) -> None:
    """Add ``demo`` to the ``cdc-assets`` subcommands (an argparse subparsers action)."""
    demo: argparse.ArgumentParser = commands.add_parser(
        "demo",
        help="the embedded default: a throwaway PostgreSQL, a workload, the whole pipeline, a parity check",
        description="Runs the whole pipeline on a throwaway PostgreSQL and ends with `parity OK` when every Delta"
        " table equals its source. With --ui, opens the Dagster UI on a folder a demo left.",
    )
    demo.add_argument("--dir", default="cdc-demo", help="folder for the demo's data (default: ./cdc-demo)")
    demo.add_argument("--force", action="store_true", help="replace the folder if it is not empty")
    demo.add_argument(
        "--storage",
        choices=("local", "s3"),
        default="local",
        help="where the change log and the Delta tables go: folders in --dir (default), or a bucket on a throwaway"
        " S3 server (moto's; its objects live in its memory and go with the demo)",
    )
    demo.add_argument("--ui", action="store_true", help="open the Dagster UI on the folder of an earlier demo")
    demo.add_argument("--port", type=int, default=3000, help="port of the Dagster UI (with --ui; default 3000)")
    demo.set_defaults(run=_run)


def _run(args: argparse.Namespace) -> int:
    from dagster_project.demo.run import open_ui, run_demo

    if args.ui:
        return open_ui(Path(args.dir), port=args.port)
    return 0 if run_demo(Path(args.dir), force=args.force, storage=args.storage) else 1
