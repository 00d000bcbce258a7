"""Installing the project as a user does: its source without what a build left in it, on a machine
whose C compilers all fail."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

PROJECT = Path(__file__).resolve().parents[2]
COMPILERS = ("cc", "gcc", "c++", "g++", "clang", "x86_64-linux-gnu-gcc")


def project_source(destination: Path) -> Path:
    """A copy of the project's files without what builds and runs left in it (``build/``, compiled
    modules, egg-info, caches, data): what pip builds from a fresh checkout."""
    anywhere = shutil.ignore_patterns("*.so", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis")

    def ignored(folder: str, names: list[str]) -> set[str]:
        top = {".git", "build", "dist", "data", ".venv", "cdc-demo"} if Path(folder) == PROJECT else set()
        return set(anywhere(folder, names)) | (top & set(names))

    shutil.copytree(PROJECT, destination, ignore=ignored)
    return destination


def without_compiler(folder: Path) -> dict[str, str]:
    """This process's environment with every C compiler failing: ``cc``, ``gcc`` and the like first
    on ``PATH`` as scripts that exit 1, ``CC=false``; and no ``PYTHONPATH`` (the installed package,
    not a checkout, is imported)."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in COMPILERS:
        script = folder / name
        script.write_text("#!/bin/sh\nexit 1\n")
        script.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return {**env, "PATH": f"{folder}{os.pathsep}{env.get('PATH', '')}", "CC": "false"}
