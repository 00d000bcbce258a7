"""The ``cdc-assets`` command: a parser and a dispatch to the use cases (``cdc_assets.pipeline``),
which the Dagster assets call too; every result prints its own lines (``cdc_assets.console``).

Errors cdc-assets expects (bad config, missing slot, invalidated slot, …) print one clear line and
exit non-zero (2 for a configuration error, 1 otherwise) without a traceback. SIGINT and SIGTERM
stop a command cleanly (exit 130), with whatever servers it started.

Other packages add commands through the ``cdc_assets.commands`` entry points (``dagster_project``
adds ``demo``), so that this library imports none of them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any

from cdc_assets.apply.connect_loss import connect_lost
from cdc_assets.config import Config, SparkConfig, config_path, load_config
from cdc_assets.console import CopyRates, Progress, printer
from cdc_assets.errors import CdcError, ConfigError
from cdc_assets.interrupts import stop_on_sigterm

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_assets.pipeline.sync import SyncSteps

COMMANDS_ENTRY_POINT = "cdc_assets.commands"
"""Entry-point group of commands other packages add: each is ``add(subparsers) -> None``."""


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    stop_on_sigterm()
    try:
        return int(args.run(args) or 0)
    except ConfigError as error:
        print(f"cdc-assets: configuration error: {error}", file=sys.stderr)
        return 2
    except CdcError as error:
        print(f"cdc-assets: {error}", file=sys.stderr)
        return 1
    except Exception as error:
        if not connect_lost(error):
            raise
        print(
            f"cdc-assets: the Spark Connect server (spark.remote) went away or was started again"
            f" ({str(error).splitlines()[0]}); nothing past the last Delta commit was written:"
            f" run the command again once the server answers",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        print("cdc-assets: interrupted; nothing past the last checkpoint was advanced", file=sys.stderr)
        return 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cdc-assets",
        description="PostgreSQL change data capture into Delta Lake, orchestrated by Dagster.",
    )
    commands = parser.add_subparsers(required=True, metavar="command")

    def command(name: str, help_text: str, run: Callable[[argparse.Namespace], int | None]) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.add_argument("-c", "--config", help="configuration file (default: $CDC_CONFIG, else ./cdc.yaml)")
        sub.set_defaults(run=run)
        return sub

    setup = command(
        "setup",
        "create the publication and slot if missing and copy the initial snapshot; later, add the tables the config"
        " gained to the publication and copy them online",
        _setup,
    )
    setup.add_argument(
        "--prune", action="store_true", help="drop tables no longer configured from the publication (owned by the role)"
    )
    snapshot = command("snapshot", "copy configured tables again while the drain goes on (online snapshot)", _snapshot)
    snapshot.add_argument("tables", nargs="+", metavar="TABLE", help="a configured table (schema.table)")
    command(
        "recover",
        "after the slot was lost (dropped, invalidated, a failover without a failover slot): create a new slot and"
        " copy every table again online while the source takes writes",
        _recover,
    )
    drain = command(
        "drain", "drain the slot into the change log until caught up (and follow it); then retention, when due", _drain
    )
    drain.add_argument("--wait", action="store_true", help="wait for another drain of the slot instead of failing")
    drain.add_argument(
        "--follow",
        type=_seconds,
        metavar="SECONDS",
        help="once caught up, follow the slot's stream this long (default: drain.follow_seconds, 0 = stop)",
    )
    apply = command("apply", "merge the change log into the Delta tables", _apply)
    apply.add_argument("--table", action="append", metavar="T", help="only this table (schema.table); repeatable")
    apply.add_argument(
        "--consistent",
        action="store_true",
        help="merge every table up to the same checkpoint, then publish the consistent point they make",
    )
    point = command(
        "consistent-point",
        "the latest consistent point (every table's Delta version as of one source position)",
        _consistent_point,
    )
    point.add_argument("--json", action="store_true", help="print JSON")
    point.add_argument("--at", metavar="LSN|TIME", help="the latest point at or before an LSN (X/X) or an ISO time")
    maintain = command("maintain", "compact, purge deletion vectors and vacuum the Delta tables when due", _maintain)
    maintain.add_argument("--table", action="append", metavar="T", help="only this table (schema.table); repeatable")
    sync = command("sync", "drain, then retention when due, then apply (and with --maintain, maintain)", _sync)
    sync.add_argument("--wait", action="store_true", help="wait for another drain of the slot instead of failing")
    sync.add_argument(
        "--follow",
        type=_seconds,
        metavar="SECONDS",
        help="once caught up, follow the slot's stream this long, merging the tables after each durable batch"
        " (default: drain.follow_seconds, 0 = stop)",
    )
    sync.add_argument(
        "--maintain",
        action="store_true",
        help="then compact, purge and vacuum the Delta tables when due (one Spark start)",
    )
    status = command("status", "slot position and lag, checkpoint, applied LSN per table", _status)
    status.add_argument("--json", action="store_true", help="print JSON")
    server = command(
        "spark-server",
        "run a Spark Connect server with Delta in the foreground, for runs that set spark.remote (Ctrl-C stops it)",
        _spark_server,
    )
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=15002, help="port to listen on (default: 15002)")
    server.add_argument("--master", default="local[*]", help="the server's Spark master (default: local[*])")
    server.add_argument("--log", metavar="FILE", help="append the server's own output to FILE (default: discard)")
    for extension in entry_points(group=COMMANDS_ENTRY_POINT):  # `demo`, from dagster_project
        extension.load()(commands)
    return parser


def _config(args: argparse.Namespace) -> Config:
    return load_config(args.config)


def _spark(config: Config) -> Callable[[], SparkSession]:
    """Start the configured Spark session, quietly, when called."""

    def start() -> SparkSession:
        from cdc_assets.apply.session import quiet_start, spark_session

        print(f"starting Spark ({config.spark.remote or config.spark.master})", file=sys.stderr)
        with quiet_start():
            spark = spark_session(config.spark)
        if not config.spark.remote:  # a Connect server's log level is its own
            spark.sparkContext.setLogLevel("ERROR")
        return spark

    return start


def _seconds(text: str) -> float:
    """A ``--follow`` value: seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds, 0 or more, got {text!r}")
    return value


def _setup(args: argparse.Namespace) -> None:
    from cdc_assets.pipeline.setup import setup

    config, progress, rates = _config(args), Progress(), CopyRates()
    result = setup(
        config,
        prune=args.prune,
        progress=lambda table, rows: progress.show(rates.line(table, rows)),
        copy_progress=lambda p: progress.show(p.line()),
        spark=_spark(config),
    )
    printer(progress)(result)


def _snapshot(args: argparse.Namespace) -> None:
    from cdc_assets.pipeline.online_snapshot import snapshot_tables

    progress = Progress()
    for copied in snapshot_tables(_config(args), args.tables, progress=lambda p: progress.show(p.line())):
        progress.done()
        print(copied.summary())


def _recover(args: argparse.Namespace) -> None:
    from cdc_assets.pipeline.recover import recover

    progress = Progress()
    report = printer(progress)
    result = recover(_config(args), progress=lambda p: progress.show(p.line()), on_gap=report)
    report(result)


def _sync(args: argparse.Namespace, steps: SyncSteps | None = None) -> None:
    """``sync`` (``drain``: with ``steps`` of its own)."""
    from cdc_assets.pipeline.sync import SyncSteps, sync

    config, progress = _config(args), Progress()
    sync(
        config,
        _spark(config),
        steps or SyncSteps(maintain=args.maintain),
        wait=args.wait,
        follow_seconds=args.follow,
        report=printer(progress),
        progress=lambda p: progress.show(p.line()),
    )


def _drain(args: argparse.Namespace) -> None:
    from cdc_assets.pipeline.sync import DRAIN_ONLY

    _sync(args, DRAIN_ONLY)


def _apply(args: argparse.Namespace) -> None:
    from cdc_assets.pipeline.sync import apply

    config = _config(args)
    apply(config, _spark(config), args.table, consistent=args.consistent, report=printer())


def _maintain(args: argparse.Namespace) -> None:
    from cdc_assets.apply.maintenance import maintain_tables

    config = _config(args)
    maintain_tables(config, _spark(config)(), args.table, progress=printer())


def _consistent_point(args: argparse.Namespace) -> None:
    from cdc_assets.apply.consistent_points import PointLog

    point = PointLog(_config(args)).find(args.at)
    print(json.dumps(point.to_json(), indent=2) if args.json else point.summary())


def _status(args: argparse.Namespace) -> None:
    from cdc_assets.pipeline.status import read_status

    status = read_status(_config(args))
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
    else:
        printer()(status)


def _spark_server(args: argparse.Namespace) -> int:
    from pathlib import Path

    from cdc_assets.apply.connect_server import ConnectServer, serve

    # the configuration's spark section (Delta's jars, spark.conf, s3a) when there is a file;
    # without one, a plain server with Delta
    found = args.config is not None or config_path().exists()
    spark = _config(args).spark if found else SparkConfig()
    server = ConnectServer(spark, args.host, args.port, args.master, Path(args.log) if args.log else None)
    print(f"starting a Spark Connect server ({args.master}) on {server.address}", file=sys.stderr)
    code = serve(server, lambda address: print(f"listening at {address} (Ctrl-C stops it)", flush=True))
    print("stopped", file=sys.stderr)
    return code


def run(argv: Sequence[str] | None = None) -> Any:
    """Entry point for ``python -m cdc_assets``."""
    sys.exit(main(argv))
