"""A class data sharing archive of Spark's classes for the test run's JVMs.

Every Spark JVM of a test run (its session's, a command's own, a ``cdc-assets spark-server``) is
started by pyspark's ``spark-submit``, and spends seconds loading and verifying the same few
thousand classes of Spark's jars. A dynamic CDS archive (JDK 13 and later: ``-XX:ArchiveClassesAtExit``
once, ``-XX:SharedArchiveFile`` after) maps them instead: a local session's start to its first
Delta commit takes ~8 s instead of ~12.5 here. ``SPARK_SUBMIT_OPTS`` hands the option to every JVM
``spark-submit`` starts, in this process and in every process it starts.

The archive is kept per Java, pyspark and Spark jar set in ``~/.cache/cdc-assets-tests``; a run of
the whole suite builds it when missing (40–50 s), the quick tier only uses one that exists. A JVM
whose class path does not start with the archive's (a driver class path in front) runs without
it, as it would have anyway; the JVM's CDS messages are off.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pyspark

from tests.support import jvm_options

QUIET = "-Xlog:cds=off -Xlog:cds+dynamic=off"
FOLDER = Path.home() / ".cache" / "cdc-assets-tests"

# What the archive's run does: a local session with the project's settings, a Delta table created,
# written, merged and read, so that the classes of a merge's planning are in it.
_TRAINING = """
import sys
from cdc_assets.apply.session import spark_session
from cdc_assets.config import SparkConfig

table = sys.argv[1]
spark = spark_session(SparkConfig(master="local[1]", conf={"spark.ui.enabled": "false"}), app_name="class-archive")
spark.sql(f"CREATE TABLE delta.`{table}` (id bigint, v string) USING delta").collect()
spark.sql(f"INSERT INTO delta.`{table}` VALUES (1, 'a'), (2, 'b')").collect()
spark.createDataFrame([(2, "c"), (3, "d")], "id bigint, v string").createOrReplaceTempView("s")
spark.sql(f"MERGE INTO delta.`{table}` t USING s ON t.id = s.id WHEN MATCHED THEN UPDATE SET *"
          " WHEN NOT MATCHED THEN INSERT *").collect()
assert spark.read.format("delta").load(table).count() == 3
gateway = spark.sparkContext._gateway
spark.stop()
gateway.proc.stdin.close()  # the JVM exits, writing the archive
gateway.proc.wait(timeout=300)
"""


def archive_path() -> Path:
    """Where the archive of this Java, pyspark and jar set is kept."""
    java = os.path.realpath(shutil.which("java") or "java")
    jars = sorted(path.name for path in (Path(pyspark.__file__).resolve().parent / "jars").glob("*.jar"))
    identity = "\n".join([java, str(os.stat(java).st_mtime_ns), pyspark.__version__, *jars])
    return FOLDER / f"spark-{hashlib.sha256(identity.encode()).hexdigest()[:16]}.jsa"


def build(path: Path) -> None:
    """Write the archive at ``path`` by one training run (written aside, then moved in place); a
    warning, and no archive, where the run fails."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as folder:
        scratch = Path(folder) / "archive.jsa"
        environ = dict(os.environ) | {jvm_options.VARIABLE: f"-XX:ArchiveClassesAtExit={scratch} {QUIET}"}
        done = subprocess.run(
            [sys.executable, "-c", _TRAINING, str(Path(folder) / "table")],
            env=environ,
            capture_output=True,
            text=True,
            check=False,
            timeout=600,
        )
        if done.returncode == 0 and scratch.is_file():
            os.replace(scratch, path)
        else:  # the run goes on without it; its Spark tests will say what is wrong with Spark
            warnings.warn(
                f"no class data sharing archive (exit {done.returncode}):\n{done.stderr[-2000:]}", stacklevel=2
            )


def use(*, build_missing: bool) -> None:
    """Hand every JVM ``spark-submit`` starts from now on the archive (built first if missing
    and ``build_missing``); nothing where there is none."""
    path = archive_path()
    if not path.is_file() and build_missing:
        build(path)
    if path.is_file():
        jvm_options.add(f"-XX:SharedArchiveFile={path} {QUIET}")
