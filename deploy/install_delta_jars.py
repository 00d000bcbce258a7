"""Build step of deploy/Dockerfile: put Delta's jars, and s3a's for ``s3://`` paths, on Spark's own
classpath.

    python deploy/install_delta_jars.py SPARK_HOME IVY_DIR

Starts a local Spark session that resolves Delta's jars and ``hadoop-aws`` (with the AWS SDK
bundle it depends on) with Spark's Ivy into IVY_DIR (from Maven Central), writes, merges and reads
a small Delta table as a smoke test, then copies into
``SPARK_HOME/jars`` only the resolved jars whose artifact Spark does not ship itself. Spark's own
versions win, as they do for ``spark.jars.packages`` (Spark's jars come first on the classpath):
copying every resolved jar would put a second, older Jackson, Hadoop client, Parquet and
RoaringBitmap beside Spark's. Afterwards every driver, master and worker started from this
SPARK_HOME has Delta and s3a without contacting Maven, and ``cdc_assets.apply.session`` stops
asking for the packages.
"""

from __future__ import annotations

import re
import shutil
import sys
import tempfile
from pathlib import Path

# artifact-version[-classifier].jar: 2.21.2, 1.5.7-3, 33.6.0-jre, 4.2.13.Final-linux-x86_64
_JAR = re.compile(r"^(?P<name>.+?)-(?P<version>\d[\w.]*(?:-\d+)?(?:-[A-Za-z][\w.]*)*)\.jar$")


def artifact(jar: str, *, ivy: bool = False) -> str:
    """The artifact of a jar file name, without version (and, for a jar from Ivy's cache, named
    ``organisation_artifact-revision.jar``, without organisation):
    ``com.fasterxml.jackson.core_jackson-core-2.13.5.jar`` (ivy) and ``jackson-core-2.21.2.jar``
    are both ``jackson-core``."""
    name = jar.split("_", 1)[1] if ivy else jar
    match = _JAR.match(name)
    return match.group("name") if match else name.removesuffix(".jar")


def install(spark_home: Path, ivy: Path) -> list[Path]:
    """Resolve, smoke-test and copy; returns the jars copied into ``spark_home/jars``."""
    from cdc_assets.apply.session import delta_package, hadoop_aws_package, spark_session
    from cdc_assets.config import SparkConfig

    packages = f"{delta_package()},{hadoop_aws_package()}"
    conf = {"spark.jars.packages": packages, "spark.jars.ivy": str(ivy), "spark.ui.enabled": "false"}
    spark = spark_session(SparkConfig(master="local[1]", conf=conf), app_name="install-delta-jars")
    with tempfile.TemporaryDirectory() as folder:
        path = f"{folder}/smoke"
        spark.range(10).write.format("delta").save(path)
        spark.sql(f"MERGE INTO delta.`{path}` t USING (SELECT 3 AS id UNION ALL SELECT 42) s ON t.id = s.id"
                  " WHEN MATCHED THEN DELETE WHEN NOT MATCHED THEN INSERT *")  # fmt: skip
        count = spark.read.format("delta").load(path).count()
    spark.stop()
    if count != 10:
        raise SystemExit(f"Delta smoke test failed: {count} rows instead of 10")
    jars = spark_home / "jars"
    shipped = {artifact(p.name) for p in jars.glob("*.jar")}
    copied = []
    for jar in sorted((ivy / "jars").glob("*.jar")):
        if artifact(jar.name, ivy=True) not in shipped:
            copied.append(Path(shutil.copy2(jar, jars / jar.name)))
    for wanted in ("delta-spark_", "hadoop-aws"):
        if not any(artifact(p.name, ivy=True).startswith(wanted) for p in copied):
            raise SystemExit(f"no {wanted} jar was copied from {ivy / 'jars'}")
    return copied


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    for jar in install(Path(argv[0]), Path(argv[1])):
        print(f"added {jar}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
