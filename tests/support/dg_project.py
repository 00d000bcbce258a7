"""A user's own Dagster project in a folder, driven with ``dg`` as its owner would.

:func:`write_project` writes what ``create-dagster project`` would (which needs the network): a
``pyproject.toml`` with ``[tool.dg]``, the root module with ``definitions.py`` loading its
``defs/`` folder, and a module of the user's own assets (:data:`REPORTS`): one downstream of a
mirror, kept current by ``AutomationCondition.eager()``. :func:`run_dg` runs the ``dg`` command line in
it, the project's folder and the repository on ``PYTHONPATH`` (as an editable install would).
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMPONENT = "dagster_project.component.CdcComponent"

REPORTS = """\
from pathlib import Path

import dagster as dg
import pyarrow as pa
from deltalake import DeltaTable, QueryBuilder

CUSTOMERS = dg.AssetKey(["shop", "delta", "public", "customers"])
MIRROR = Path(__file__).resolve().parents[3] / "data" / "shop" / "warehouse" / "public" / "customers"


@dg.asset(deps=[CUSTOMERS], automation_condition=dg.AutomationCondition.eager())
def customer_count() -> dg.MaterializeResult:
    query = QueryBuilder().register("customers", DeltaTable(str(MIRROR))).execute("SELECT count(*) AS n FROM customers")
    rows = pa.RecordBatchReader.from_stream(query).read_all().column("n")[0].as_py()
    return dg.MaterializeResult(metadata={"rows": rows})
"""


def write_project(root: Path, module: str) -> Path:
    """``create-dagster project`` at ``root`` (its folder's name must be ``module``; no ``uv sync``:
    the project runs on this environment's packages), with :data:`REPORTS` as ``defs/reports.py``;
    its ``defs`` folder."""
    assert root.name == module
    command = shutil.which("create-dagster")
    assert command is not None, "create-dagster is not installed"
    done = subprocess.run(
        [command, "project", str(root), "--no-uv-sync"], capture_output=True, text=True, check=False, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    defs = root / "src" / module / "defs"
    (defs / "reports.py").write_text(REPORTS, encoding="utf-8")
    return defs


def run_dg(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``dg <args>`` in the project at ``root`` (its output as text; the caller checks the code)."""
    command = shutil.which("dg")
    assert command is not None, "dg (dagster-dg-cli) is not installed"
    path = os.pathsep.join([str(root / "src"), str(ROOT), os.environ.get("PYTHONPATH", "")])
    env = {**os.environ, "PYTHONPATH": path, "NO_COLOR": "1"}
    return subprocess.run([command, *args], cwd=root, env=env, capture_output=True, text=True, check=False, timeout=300)
