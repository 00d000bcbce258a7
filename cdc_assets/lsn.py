"""Log sequence numbers: 64-bit WAL positions, written by PostgreSQL as ``X/Y`` (two hex halves)."""

from __future__ import annotations

import re

_LSN_TEXT = re.compile(r"^([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})$")


def format_lsn(lsn: int) -> str:
    """Format an LSN the way PostgreSQL prints ``pg_lsn`` (``16/B374D848``)."""
    if not 0 <= lsn < 1 << 64:
        raise ValueError(f"LSN out of range: {lsn}")
    return f"{lsn >> 32:X}/{lsn & 0xFFFFFFFF:X}"


def parse_lsn(text: str) -> int:
    """Parse ``X/Y`` text into an int."""
    match = _LSN_TEXT.match(text.strip())
    if match is None:
        raise ValueError(f"not an LSN: {text!r} (expected X/Y in hex)")
    return int(match.group(1), 16) << 32 | int(match.group(2), 16)
