"""Errors cdc-assets raises on purpose.

Every one names what went wrong and where (slot, LSN, table, byte offset) and is raised before
anything is advanced; the command line prints them without a traceback.
"""

from __future__ import annotations

from cdc_assets.lsn import format_lsn


class CdcError(Exception):
    """Base class: an expected failure with a message fit for an operator."""


class ConfigError(CdcError):
    """The configuration file is missing, unreadable or invalid."""


class DecodeError(CdcError):
    """A pgoutput message could not be decoded.

    ``message_type`` is the message's name (``Insert``) or its type byte when unknown, ``offset``
    the byte offset inside the message where decoding failed — None for a column value, whose
    ``reason`` names the type and row instead; ``lsn`` and ``slot`` are filled in by callers that
    know them (see :meth:`at`).
    """

    def __init__(
        self,
        reason: str,
        *,
        message_type: str | None,
        offset: int | None,
        lsn: int | None = None,
        slot: str | None = None,
    ) -> None:
        self.reason = reason
        self.message_type = message_type
        self.offset = offset
        self.lsn = lsn
        self.slot = slot
        super().__init__(self._describe())

    def _describe(self) -> str:
        if self.offset is None:
            text = f"cannot decode {self.reason}"
        else:
            what = f"{self.message_type} message" if self.message_type else "message"
            text = f"cannot decode {what} at byte {self.offset}: {self.reason}"
        where = []
        if self.slot is not None:
            where.append(f"slot {self.slot}")
        if self.lsn is not None:
            where.append(f"LSN {format_lsn(self.lsn)}")
        return f"{text} ({', '.join(where)})" if where else text

    def at(self, *, lsn: int | None = None, slot: str | None = None) -> DecodeError:
        """The same error with the caller's position filled in."""
        return DecodeError(
            self.reason,
            message_type=self.message_type,
            offset=self.offset,
            lsn=self.lsn if lsn is None else lsn,
            slot=self.slot if slot is None else slot,
        )

    def within(self, context: str) -> DecodeError:
        """The same error with ``context`` (e.g. the table and column) before the reason."""
        return DecodeError(
            f"{context}: {self.reason}",
            message_type=self.message_type,
            offset=self.offset,
            lsn=self.lsn,
            slot=self.slot,
        )


class NotSetUpError(CdcError):
    """The change log has no checkpoint: ``cdc-assets setup`` has not run (or not finished)."""


class StorageError(CdcError):
    """The change log's or a Delta table's storage cannot be reached or read (a missing bucket,
    refused access, an unreachable endpoint): the message names the location, never a credential."""


class SourceError(CdcError):
    """The source database failed or refused a request (connection, server settings, catalogs)."""


class SourceUnavailableError(SourceError):
    """The source cannot be reached, or the connection to it ended: the server is down or
    restarting, or the network failed. Worth trying again later."""


class SourcePermissionError(SourceError):
    """The source role lacks a privilege: REPLICATION, table ownership, SELECT, CREATE."""


class TableMissingError(SourceError):
    """A configured table does not exist in the source database (or is not a table)."""


class PublicationMissingError(SourceError):
    """The configured publication does not exist."""


class PublicationMismatchError(SourceError):
    """The publication exists but does not publish every configured table."""


class TableRewrittenError(SourceError):
    """A table was truncated or rewritten (TRUNCATE, VACUUM FULL, CLUSTER, a rewriting ALTER TABLE)
    after a copy's snapshot was taken and before the copy locked it. Those commands are not
    MVCC-safe: the snapshot would read the table as empty, so the copy must start again."""


class LostPositionError(SourceError):
    """The slot, or its server, is lost to the change log: what only ``cdc-assets recover`` resolves.

    ``reason`` says in a few words what happened (recover records it in the gap); ``detail`` what it
    means and what to do. The message is both."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(reason, detail)
        self.reason = reason
        self.detail = detail

    def __str__(self) -> str:
        return f"{self.reason}: {self.detail}"


class SlotMissingError(LostPositionError):
    """The configured replication slot does not exist."""


class SlotInvalidatedError(LostPositionError):
    """The server invalidated the slot (``wal_status = 'lost'``): changes after it are gone."""


class SlotMismatchError(SourceError):
    """The slot exists but cannot be used as configured (plugin, database, two-phase, physical)."""


class SlotActiveError(SourceError):
    """Another session (a walsender or a second reader) is using the slot right now."""


class ServerMismatchError(LostPositionError):
    """``source.dsn`` reaches another cluster than the change log was read from, or a server whose
    timeline history does not continue the log's (a promotion that lost what the log holds)."""


class StandbyWaitError(SourceError):
    """The server holds the slot's changes back until the standbys of ``synchronized_standby_slots``
    have the WAL, and they do not come."""


class SlotGapError(LostPositionError):
    """The slot is ahead of the change log: changes between the two positions are lost."""


class DrainLockedError(SourceError):
    """Another process holds the drain lock of the slot."""
