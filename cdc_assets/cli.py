"""The ``cdc-assets`` command: what the Dagster assets do, for operators and scripts.

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
import time
from collections.abc import Callable, Sequence
from importlib.metadata import entry_points
from typing import TYPE_CHECKING, Any, TextIO

from cdc_assets.apply.connect_loss import connect_lost
from cdc_assets.changelog.store import changelog_store
from cdc_assets.config import Config, SparkConfig, TableConfig, config_path, load_config
from cdc_assets.errors import CdcError, ConfigError
from cdc_assets.interrupts import stop_on_sigterm
from cdc_assets.lsn import format_lsn
from cdc_assets.names import TableName

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

    from cdc_assets.changelog.stream_writer import DurableBatch

COMMANDS_ENTRY_POINT = "cdc_assets.commands"
"""Entry-point group of commands other packages add: each is ``add(subparsers) -> None``."""


class Progress:
    """One status line, rewritten in place on a terminal and printed every few seconds elsewhere."""

    def __init__(self, stream: TextIO = sys.stderr, interval_s: float = 5.0) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.interval_s = interval_s
        self._last = 0.0
        self._shown = False

    def show(self, text: str, *, force: bool = False) -> None:
        now = time.monotonic()
        if self.tty:
            self.stream.write(f"\r\033[K{text}")
            self._shown = True
        elif force or now - self._last >= self.interval_s:
            self.stream.write(text + "\n")
            self._last = now
        self.stream.flush()

    def done(self) -> None:
        if self.tty and self._shown:
            self.stream.write("\n")
            self.stream.flush()


class CopyRates:
    """The initial copy's progress line: a table's rows and rows/s since the copy's first block
    (tables are copied at once, so each table's rate is its share of the copy)."""

    def __init__(self) -> None:
        self._started: float | None = None

    def line(self, table: str, rows: int) -> str:
        now = time.monotonic()
        self._started = self._started or now
        rate = f", {rows / (now - self._started):,.0f} rows/s" if now > self._started else ""
        return f"snapshot {table}: {rows:,} rows{rate}"


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
    sync = command("sync", "drain, then apply (and with --maintain, maintain)", _sync)
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


def _setup(args: argparse.Namespace) -> int:
    from cdc_assets.pipeline.setup import setup

    config = _config(args)
    progress = Progress()
    rates = CopyRates()
    result = setup(
        config,
        prune=args.prune,
        progress=lambda table, rows: progress.show(rates.line(table, rows)),
        copy_progress=lambda p: progress.show(p.line()),
    )
    progress.done()
    if result.created_publication:
        print(f"created publication {config.source.publication}")
    for table in result.added:
        print(f"added {table} to publication {config.source.publication}")
    for table in result.removed:
        print(f"dropped {table} from publication {config.source.publication} (its Delta table stays)")
    if result.removed and config.warehouse.catalog is not None:
        from cdc_assets.apply.catalog import unregister_mirrors

        removed = [TableName.parse(name) for name in result.removed]
        mirrors = [(name, config.target_path(TableConfig(name))) for name in removed]
        for entry in unregister_mirrors(_spark(config), config.warehouse.catalog, mirrors):
            print(f"dropped {entry} from the catalog (its files stay)")
    if result.created_slot:
        print(f"created slot {config.source.slot}; snapshot at LSN {format_lsn(result.snapshot_lsn or 0)}")
        for table, rows in result.rows.items():
            print(f"  {table}: {rows:,} rows")
    for copied in result.copied:
        print(f"copied online: {copied.summary()}")
    if result.ddl_capture is not None and (line := result.ddl_capture.line()) is not None:
        print(line)
    if not (result.created_slot or result.added or result.removed or result.copied):
        print(f"already set up: slot {config.source.slot} and the change log at {config.changelog.path} exist")
        return 0
    print(f"done in {result.elapsed_s:.1f} s")
    return 0


def _snapshot(args: argparse.Namespace) -> int:
    from cdc_assets.pipeline.online_snapshot import snapshot_tables

    progress = Progress()
    for copied in snapshot_tables(_config(args), args.tables, progress=lambda p: progress.show(p.line())):
        progress.done()
        print(copied.summary())
    return 0


def _recover(args: argparse.Namespace) -> int:
    from cdc_assets.pipeline.recover import recover

    progress = Progress()
    result = recover(
        _config(args),
        progress=lambda p: progress.show(p.line()),
        on_gap=lambda gap: print(f"recover: {gap.describe()}"),
    )
    progress.done()
    for line in result.lines():
        print(line)
    if result.copied:
        print("the next drain records each copy, and the next apply brings its table to the source")
    return 0


def _seconds(text: str) -> float:
    """A ``--follow`` value: seconds, 0 or more."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of seconds, 0 or more, got {text!r}")
    return value


def _drain(args: argparse.Namespace) -> int:
    config = _config(args)
    _drain_log(args, config)
    return _retain(config)


def _retain(config: Config) -> int:
    from cdc_assets.pipeline.retention import retain_when_due

    retention = retain_when_due(config)
    for line in retention.lines() if retention else []:
        print(line)
    return 0


def _drain_log(args: argparse.Namespace, config: Config, on_batch: Callable[[DurableBatch], None] | None = None) -> int:
    from cdc_assets.changelog.stream_writer import DrainProgress
    from cdc_assets.pipeline.drain import drain

    progress = Progress()

    def show(p: DrainProgress) -> None:
        rate = p.changes / p.elapsed_s if p.elapsed_s > 0 else 0.0
        progress.show(
            f"batch {p.batches}: {p.transactions:,} transactions, {p.changes:,} changes ({rate:,.0f}/s),"
            f" checkpoint {format_lsn(p.checkpoint_lsn)} of {format_lsn(p.target_lsn)}"
        )

    result = drain(
        config, wait=args.wait, progress=show, follow_seconds=getattr(args, "follow", None), on_batch=on_batch
    )
    progress.done()
    print(
        f"drained {result.transactions:,} transactions, {result.total_changes:,} changes in {result.batches} batches"
        f" ({result.elapsed_s:.1f} s); checkpoint {format_lsn(result.start_lsn)} -> {format_lsn(result.checkpoint_lsn)}"
    )
    for table, count in sorted(result.changes.items()):
        print(f"  {table}: {count:,} changes")
    if result.slot is not None and result.slot.lag_bytes is not None:
        print(f"slot {result.slot.name}: lag {result.slot.lag_bytes:,} bytes, WAL status {result.slot.wal_status}")
    if result.held is not None and (warning := result.held.warning()) is not None:
        print(warning)
    return 0


def _apply(args: argparse.Namespace, config: Config | None = None, spark: SparkSession | None = None) -> int:
    from cdc_assets.apply.runner import TableApplied, apply_tables
    from cdc_assets.changelog.checkpoint import require_checkpoint

    config = config or _config(args)

    def show(result: TableApplied) -> None:
        print(result.summary())

    if spark is None:  # nothing to apply before setup: say so before starting Spark
        require_checkpoint(changelog_store(config))
    consistent = getattr(args, "consistent", False)
    if consistent and getattr(args, "table", None):
        raise ConfigError("apply --consistent merges every table: it takes no --table")
    apply_tables(config, spark or _spark(config), getattr(args, "table", None), progress=show)
    if consistent:
        from cdc_assets.apply.consistent_points import publish_point

        point = publish_point(config)
        print(
            f"consistent point {point.summary()}" if not isinstance(point, str) else f"no new consistent point: {point}"
        )
    return 0


def _consistent_point(args: argparse.Namespace) -> int:
    from datetime import datetime

    from cdc_assets.apply.consistent_points import PointLog
    from cdc_assets.lsn import parse_lsn

    log = PointLog(_config(args))
    if args.at is None:
        point = log.latest()
    elif "/" in args.at:
        point = log.at(lsn=parse_lsn(args.at))
    else:
        try:
            when = datetime.fromisoformat(args.at.replace("Z", "+00:00"))
        except ValueError:
            raise ConfigError(f"--at {args.at!r} is neither an LSN (X/X) nor an ISO 8601 time") from None
        point = log.at(when=when if when.tzinfo else when.astimezone())
    if point is None:
        where = f" at or before {args.at}" if args.at else ""
        raise CdcError(f"no consistent point{where} in {log.path}")
    print(json.dumps(point.to_json(), indent=2) if args.json else point.summary())
    return 0


def _spark(config: Config) -> SparkSession:
    """The configured Spark session, started quietly."""
    from cdc_assets.apply.session import quiet_start, spark_session

    print(f"starting Spark ({config.spark.remote or config.spark.master})", file=sys.stderr)
    with quiet_start():
        spark = spark_session(config.spark)
    if not config.spark.remote:  # a Connect server's log level is its own
        spark.sparkContext.setLogLevel("ERROR")
    return spark


def _maintain(args: argparse.Namespace, config: Config | None = None, spark: SparkSession | None = None) -> int:
    from cdc_assets.apply.maintenance import Maintained, maintain_tables

    config = config or _config(args)

    def show(result: Maintained) -> None:
        print(f"maintained {result.summary()}")

    maintain_tables(config, spark or _spark(config), getattr(args, "table", None), progress=show)
    return 0


def _sync(args: argparse.Namespace) -> int:
    from cdc_assets.apply.follower import MergeFollower
    from cdc_assets.pipeline.held_copies import HeldTableCopier, drain_with_copies
    from cdc_assets.pipeline.online_snapshot import TableCopied

    config = _config(args)
    follow = config.drain.follow_seconds if args.follow is None else args.follow

    def copied(done: TableCopied) -> None:
        print(f"copied again {done.summary()}", flush=True)

    if follow > 0:  # merge after each durable batch while the drain follows
        spark = _spark(config)
        with (
            MergeFollower(
                config,
                spark,
                lambda applied: print(applied.summary(), flush=True),
                lambda point: print(f"consistent point {point.summary()}", flush=True),
                lambda compacted: print(f"compacted {compacted.summary()}", flush=True),
            ) as merges,
            HeldTableCopier(config, copied) as copies,
        ):

            def durable(_: DurableBatch) -> None:
                merges.batch_durable()
                copies.batch_durable()

            _drain_log(args, config, on_batch=durable)
        _retain(config)
        spark = merges.spark
    else:
        drain_with_copies(config, lambda: _drain_log(args, config), copied)
        _retain(config)
        spark = _spark(config)
    _apply(args, config, spark)
    return _maintain(args, config, spark) if args.maintain else 0


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


def _status(args: argparse.Namespace) -> int:
    from cdc_assets.pipeline.status import read_status

    status = read_status(_config(args))
    if args.json:
        print(json.dumps(status.to_json(), indent=2))
        return 0
    for line in status.lines():
        print(line)
    return 0


def run(argv: Sequence[str] | None = None) -> Any:
    """Entry point for ``python -m cdc_assets``."""
    sys.exit(main(argv))
