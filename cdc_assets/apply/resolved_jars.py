"""The jars Spark's Ivy resolved for a ``spark.jars.packages`` list, remembered beside Ivy's cache.

Spark resolves ``spark.jars.packages`` with Ivy at every start — about 3 s on two cores even when
every jar is cached, paid by every ``cdc-assets`` command and every Dagster run that merges. The
first session that starts with a package list records the jars Ivy gave it (Spark lists them in
``spark.jars``) in a small file named by the list; a later start whose recorded jars are all still
in the cache passes them as ``spark.jars`` and skips Ivy. A missing jar (a cleaned cache) means
one more resolution, which records the list again.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from urllib.parse import urlparse

RECORDS_FOLDER = "cdc-assets-resolved"
DEFAULT_IVY_HOME = Path.home() / ".ivy2.5.2"  # Spark 4's default for spark.jars.ivy


def ivy_home(settings: dict[str, str]) -> Path:
    """Ivy's home folder for a session with ``settings``."""
    return Path(settings["spark.jars.ivy"]) if settings.get("spark.jars.ivy") else DEFAULT_IVY_HOME


def recorded_jars(packages: str, home: Path) -> list[str] | None:
    """The jars recorded for ``packages``, if recorded and every one still exists."""
    try:
        jars = _record_path(packages, home).read_text(encoding="utf-8").split()
    except OSError:
        return None
    return jars if jars and all(_is_local_file(jar) for jar in jars) else None


def record_jars(packages: str, home: Path, jars: str | None) -> None:
    """Remember ``jars`` (Spark's comma-separated ``spark.jars`` after resolving ``packages``); a
    failure to write only means Ivy resolves again next time."""
    listed = [jar for jar in (jars or "").split(",") if jar]
    if not listed:
        return
    path = _record_path(packages, home)
    temporary = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary.write_text("\n".join(listed) + "\n", encoding="utf-8")
        temporary.replace(path)
    except OSError:
        temporary.unlink(missing_ok=True)


def _is_local_file(jar: str) -> bool:
    url = urlparse(jar)
    return url.scheme in ("", "file") and Path(url.path).is_file()


def _record_path(packages: str, home: Path) -> Path:
    return home / RECORDS_FOLDER / f"{hashlib.sha256(packages.encode()).hexdigest()[:24]}.txt"
