"""Options for every JVM a test run starts through pyspark's ``spark-submit`` — the run's session,
a ``cdc-assets spark-server``, a command's own Spark — handed on through ``SPARK_SUBMIT_OPTS``,
which every process the run starts inherits.

``FEWER_COMPILATIONS``: a test run's JVMs mostly run code a few times each (every statement's
generated classes are new), so the JIT's default thresholds make it compile much that never
pays back; on two cores that compilation takes CPU from the other worker. Five times the default
thresholds: whole runs of 27:52 and 28:27 against 35:03 and 35:33, its JVMs' CPU 1,948 s against 2,613
(BENCHMARKS.md, "Test suite").
"""

from __future__ import annotations

import os

VARIABLE = "SPARK_SUBMIT_OPTS"
FEWER_COMPILATIONS = "-XX:CompileThresholdScaling=5"


def add(options: str) -> None:
    """Append ``options`` to the JVM options of every ``spark-submit`` started from now on."""
    os.environ[VARIABLE] = f"{os.environ.get(VARIABLE, '')} {options}".strip()
