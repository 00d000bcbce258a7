"""The ``START_REPLICATION`` command for the configured slot: pgoutput's options per server version."""

from __future__ import annotations

from cdc_assets.config import SourceConfig
from cdc_assets.errors import ConfigError
from cdc_assets.lsn import format_lsn
from cdc_assets.names import quote_identifier


def max_proto_version(major: int) -> int:
    """The highest pgoutput protocol a server speaks: 2 on 14, 3 on 15, 4 on 16+."""
    return 4 if major >= 16 else 3 if major == 15 else 2


def pgoutput_options(config: SourceConfig, major: int, *, two_phase: bool) -> list[tuple[str, str]]:
    """pgoutput's ``(name, value)`` options for a server major version.

    ``two_phase`` is the slot's actual flag, never the configuration's wish: a session started with
    ``two_phase 'on'`` turns a slot two-phase for good (invariant 6).
    """
    options = [("proto_version", str(max_proto_version(major))), ("publication_names", config.publication)]
    options.append(("messages", "true"))
    if config.binary:
        options.append(("binary", "true"))
    if config.streaming == "parallel" and major < 16:
        raise ConfigError(
            f"source.streaming: 'parallel' needs PostgreSQL 16 or later (the server is {major}); use 'on' or 'off'"
        )
    if config.streaming != "off":
        options.append(("streaming", config.streaming if major >= 16 else "true"))  # 14/15 take a boolean
    if two_phase:
        if major < 15:
            raise ConfigError(f"two-phase decoding needs PostgreSQL 15 or later (the server is {major})")
        options.append(("two_phase", "on"))
    if major >= 16:
        options.append(("origin", "any"))
    return options


def start_replication_command(slot: str, start_lsn: int, options: list[tuple[str, str]]) -> str:
    """``START_REPLICATION SLOT "slot" LOGICAL X/X (name 'value', …)``."""
    quoted = ", ".join(f"{name} {_literal(value)}" for name, value in options)
    return f"START_REPLICATION SLOT {quote_identifier(slot)} LOGICAL {format_lsn(start_lsn)} ({quoted})"


def _literal(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"
