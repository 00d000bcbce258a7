"""Without a C compiler (``setup.py``: the C module is optional): ``pip install`` of the project in
a virtual environment where every compiler fails succeeds without the C module, and the installed
``cdc-assets setup`` copies a table through the pure Python row splitter into the change log. The
whole demo in a fresh virtual environment is the same check by hand (BENCHMARKS.md, "Without a C
compiler"); this one reuses the machine's packages (``--system-site-packages``, ``--no-deps``) to
stay short."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.config_file import DSN_VARIABLE, write_config
from tests.support.database import Database
from tests.support.install import project_source, without_compiler

pytestmark = pytest.mark.slow

ROWS = 50_000


def test_install_without_a_compiler_copies_in_python(pg: Database, tmp_path: Path) -> None:
    env = {**without_compiler(tmp_path / "bin"), DSN_VARIABLE: pg.dsn}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    python = str(venv / "bin" / "python")
    source = project_source(tmp_path / "source")
    pip = subprocess.run(
        [python, "-m", "pip", "install", "-v", "--no-deps", str(source)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert pip.returncode == 0, pip.stdout[-4000:] + pip.stderr[-4000:]
    assert 'building extension "cdc_assets.source._copy_rows" failed' in pip.stdout + pip.stderr
    where = subprocess.run(
        [python, "-c", "from cdc_assets.source import copy_rows; print(copy_rows.__file__, copy_rows.PATH)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    module, path = where.stdout.split()
    assert Path(module).is_relative_to(venv) and path == "python"

    pg.execute(
        "CREATE TABLE t (id int PRIMARY KEY, label text, amount numeric(12, 2), at timestamptz, tags text[]);"
        f" INSERT INTO t SELECT g, md5(g::text), g / 7.0, timestamptz '2024-01-01' + g * interval '1 s',"
        f" CASE WHEN g % 3 = 0 THEN NULL ELSE ARRAY['a', g::text] END FROM generate_series(1, {ROWS}) g"
    )
    config = write_config(tmp_path / "cdc", ["public.t"])
    setup = subprocess.run(
        [python, "-m", "cdc_assets", "setup", "--config", str(config)],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert setup.returncode == 0, setup.stdout + setup.stderr
    assert "(rows split in pure Python)" in setup.stderr  # the copy's progress line
    assert f"public.t: {ROWS:,} rows" in setup.stdout
