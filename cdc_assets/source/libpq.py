"""The libpq that psycopg's connections run on, and the addresses of the functions of it that the
binary copy calls from C (``_copy_rows.c``): a ``PGconn`` must only be handled by the library
that made it."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

from psycopg import pq
from psycopg.pq.misc import find_libpq_full_path

from cdc_assets.errors import CdcError


@dataclass(slots=True, frozen=True)
class CopyFunctions:
    """The addresses of ``PQgetCopyData`` and ``PQfreemem``."""

    get_copy_data: int
    free_mem: int


@cache
def copy_functions() -> CopyFunctions:
    library = _libpq()
    return CopyFunctions(_address(library, "PQgetCopyData"), _address(library, "PQfreemem"))


def _libpq() -> ctypes.CDLL:
    """psycopg's libpq: the one its ``binary`` wheel bundles, else the system's that psycopg found
    (the same library when it is loaded already)."""
    if pq.__impl__ == "binary":
        import psycopg_binary

        package = Path(psycopg_binary.__file__).parent
        found = [*(package.parent / "psycopg_binary.libs").glob("libpq*"), *(package / ".dylibs").glob("libpq*")]
        if len(found) != 1:
            raise CdcError(f"expected one libpq bundled with psycopg-binary in {package.parent}, found {len(found)}")
        return ctypes.CDLL(str(found[0]))
    path = find_libpq_full_path()
    if path is None:
        raise CdcError("cannot find the libpq psycopg runs on")
    return ctypes.CDLL(path)


def _address(library: ctypes.CDLL, function: str) -> int:
    address = ctypes.cast(getattr(library, function), ctypes.c_void_p).value
    if address is None:
        raise CdcError(f"libpq at {library._name} has no {function}")
    return address
