"""The Spark session: local, a cluster through ``spark.master``, or Spark Connect through ``remote``.

A classic session gets Delta's SQL extension and catalog, and Delta's jars through
``spark.jars.packages`` (resolved from Maven Central by Spark's Ivy at session start; cached in
``~/.ivy2.5.2``; the jars a resolution gave are remembered there, and later starts pass them as
``spark.jars`` without resolving again: ``resolved_jars.py``). The jars requested are those of
the installed delta-spark, built for the installed pyspark's minor (``delta_package``); set
``spark.jars.packages`` or ``spark.jars`` in the configuration to choose other jars (e.g. for an
offline cluster). When Delta's jar is already on
Spark's own classpath (``$SPARK_HOME/jars``, as in deploy/Dockerfile's image), nothing is
resolved. With the warehouse on S3 (``SparkConfig.storage``), the session also gets Hadoop's s3a
settings from the ``storage`` section and the ``hadoop-aws`` jar of the Hadoop that pyspark ships
(which brings the AWS SDK bundle), unless it is on the classpath already. A Spark Connect server
must have all that itself: ``cdc-assets spark-server`` starts one with these very settings
(``connect_server.py``); a Connect session takes only the SQL settings of ``spark.conf``.
"""

from __future__ import annotations

import atexit
import os
import socket
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path

import pyspark
from pyspark.sql import SparkSession

from cdc_assets.apply.java_runtime import ensure_java
from cdc_assets.apply.metastore import CLASS_PATH, metastore_settings
from cdc_assets.apply.resolved_jars import ivy_home, record_jars, recorded_jars
from cdc_assets.config import SparkConfig
from cdc_assets.errors import ConfigError
from cdc_assets.interrupts import interrupts_deferred
from cdc_assets.source.reconnect import RECONNECT_SECONDS

SCALA_VERSION = "2.13"
# delta-spark releases with no jars of their own on Maven Central (4.4.1's Python package differs
# from 4.4.0's in its version number only): the release whose jars they run with
JARS_OF_RELEASE = {"4.4.1": "4.4.0"}


def delta_package(spark_version: str = pyspark.__version__, delta_version: str = version("delta-spark")) -> str:
    """The Maven coordinates of the jars of a delta-spark release built for a Spark version's
    minor (pyspark ``4.2.0``, delta-spark ``4.4.1`` → ``io.delta:delta-spark_4.2_2.13:4.4.0``),
    as delta-spark's own ``configure_spark_with_delta_pip`` names them."""
    minor = ".".join(spark_version.split(".")[:2])
    return f"io.delta:delta-spark_{minor}_{SCALA_VERSION}:{JARS_OF_RELEASE.get(delta_version, delta_version)}"


def hadoop_aws_package() -> str:
    """The Maven coordinates of the ``hadoop-aws`` jar matching the Hadoop client Spark runs with."""
    return f"org.apache.hadoop:hadoop-aws:{hadoop_version()}"


def hadoop_version() -> str:
    """The version of the Hadoop client jars on Spark's classpath (``hadoop-client-api-3.5.0.jar``)."""
    for folder in _jar_folders():
        for jar in sorted(folder.glob("hadoop-client-api-*.jar")):
            return jar.name.removeprefix("hadoop-client-api-").removesuffix(".jar")
    raise ConfigError(
        f"no hadoop-client-api jar in {', '.join(map(str, _jar_folders()))}: cannot choose the hadoop-aws jar for"
        " s3:// paths; put hadoop-aws (matching your Hadoop) on Spark's classpath, or list it in spark.jars.packages"
    )


def session_settings(config: SparkConfig, app_name: str = "cdc-assets") -> dict[str, str]:
    """Every setting a classic session starts with: Delta, UTC, small shuffles, s3a for a warehouse
    on S3, then the user's."""
    settings = {
        "spark.app.name": app_name,
        "spark.sql.extensions": "io.delta.sql.DeltaSparkSessionExtension",
        "spark.sql.catalog.spark_catalog": "org.apache.spark.sql.delta.catalog.DeltaCatalog",
        "spark.sql.session.timeZone": "UTC",
        "spark.sql.shuffle.partitions": "16",
        "spark.sql.execution.arrow.pyspark.enabled": "true",
        "spark.ui.showConsoleProgress": "false",
        # The UI keeps every SQL execution's plan and every job and stage up to these counts
        # (Spark's defaults: 1,000 each, and every RDD graph): a session that lives for months —
        # the Connect server, a long `apply` loop — would hold the last thousand MERGE plans on
        # the driver's heap, which each collection then walks again.
        "spark.sql.ui.retainedExecutions": "100",
        "spark.ui.retainedJobs": "200",
        "spark.ui.retainedStages": "200",
        "spark.ui.dagGraph.retainedRootRDDs": "200",
    }
    master = config.master or "local[2]"
    local = master.startswith("local")
    if local:
        # Delta rebuilds a table's state (its file list) with this many tasks on every new
        # version; the default (50) makes each read and MERGE of a small table take tens of
        # seconds on a few local cores.
        settings["spark.databricks.delta.snapshotPartitions"] = str(_local_cores(master))
        # VACUUM lists the table's folder with this many tasks; Spark's default (10,000) made a
        # VACUUM of a small table take 45-80 s on two local cores instead of 3-5 s.
        settings["spark.sql.sources.parallelPartitionDiscovery.parallelism"] = str(_local_cores(master))
        # Tungsten's memory pages (a join's hash table, an aggregation, a sort) are up to 64 MB and
        # a broadcast is cut into 4 MB blocks: on a heap of a few GB these are objects G1 calls
        # humongous (half a region or more), each allocated in regions of its own and each able to
        # start a concurrent marking cycle — a MERGE makes dozens. Pages and blocks of
        # LOCAL_PAGE_SIZE in the driver's regions of LOCAL_HEAP_REGION (java_options) are young
        # objects like any other (docs/architecture.md, "Spark Connect").
        settings["spark.buffer.pageSize"] = LOCAL_PAGE_SIZE
        settings["spark.broadcast.blockSize"] = LOCAL_PAGE_SIZE
    if config.storage is not None:
        settings |= {f"spark.hadoop.{key}": value for key, value in config.storage.hadoop_settings().items()}
    if not os.environ.get("HOME"):
        settings["spark.jars.ivy"] = "/tmp/.ivy2.5.2"  # Ivy needs a writable home
    if "spark.jars" not in config.conf and "spark.jars.packages" not in config.conf:
        packages = [] if delta_on_classpath() else [delta_package()]
        if config.storage is not None and not _on_classpath("*hadoop-aws-*.jar"):
            packages.append(hadoop_aws_package())
        if packages:
            settings |= _jars_or_packages(",".join(packages), ivy_home(settings | config.conf))
    metastore = {}
    if config.metastore_dsn:
        metastore = metastore_settings(config.metastore_dsn, config.conf, _on_classpath("postgresql-*.jar"))
    settings |= metastore
    settings.update(config.conf)
    if CLASS_PATH in metastore:  # the user's class path and the JDBC driver
        settings[CLASS_PATH] = metastore[CLASS_PATH]
    local_driver = (HEAP_REGION_OPTION + LOCAL_HEAP_REGION,) if local else ()
    for key in JAVA_OPTIONS:
        defaults = (CODE_CACHE_OPTION + CODE_CACHE_SIZE,) + (local_driver if key == DRIVER_JAVA_OPTIONS else ())
        settings[key] = java_options(config.conf.get(key, ""), defaults)
    return settings


def _jars_or_packages(packages: str, home: Path) -> dict[str, str]:
    """``packages`` to resolve, or the jars an earlier start resolved them to (resolved_jars.py)."""
    recorded = recorded_jars(packages, home)
    return {"spark.jars": ",".join(recorded)} if recorded else {"spark.jars.packages": packages}


DRIVER_JAVA_OPTIONS = "spark.driver.extraJavaOptions"
JAVA_OPTIONS = (DRIVER_JAVA_OPTIONS, "spark.executor.extraJavaOptions")
CODE_CACHE_OPTION = "-XX:ReservedCodeCacheSize="
CODE_CACHE_SIZE = "1g"
HEAP_REGION_OPTION = "-XX:G1HeapRegionSize="
LOCAL_HEAP_REGION = "4m"
LOCAL_PAGE_SIZE = "1m"  # below half of LOCAL_HEAP_REGION: no page or broadcast block is humongous


def java_options(options: str, defaults: tuple[str, ...]) -> str:
    """A driver's or executor's JVM options: ``options`` with each of ``defaults``
    (``-XX:Name=value``) in front that they do not set themselves.

    Every JVM gets a code cache of ``CODE_CACHE_SIZE``: every query compiles classes of its own
    (whole-stage code generation writes the query's literals — a MERGE's key bounds, a batch's
    keys — into the code), which the JIT compiles in turn; in a JVM that lives for days that code
    takes most of the default code cache (240 MB), and the fuller the cache, the more compiled code
    that is not hot the JVM evicts — Delta's and Spark's planning code, run once per statement — to
    compile it again (docs/architecture.md, "Spark Connect"). A local driver, which runs the tasks
    too, gets heap regions of ``LOCAL_HEAP_REGION`` (``session_settings``).
    """
    missing = [option for option in defaults if option.split("=")[0] + "=" not in options]
    return " ".join([*missing, options]).strip()


def delta_on_classpath() -> bool:
    """Whether Spark's own jars (pyspark's ``jars`` folder, or ``$SPARK_HOME/jars``) include Delta."""
    return _on_classpath("*delta-spark_*.jar")


def _on_classpath(pattern: str) -> bool:
    return any(any(folder.glob(pattern)) for folder in _jar_folders())


def _jar_folders() -> list[Path]:
    """Spark's own jar folders: ``$SPARK_HOME/jars`` first, then pyspark's."""
    folders = [Path(os.environ["SPARK_HOME"]) / "jars"] if os.environ.get("SPARK_HOME") else []
    folders.append(Path(pyspark.__file__).resolve().parent / "jars")
    return [folder for folder in folders if folder.is_dir()]


def _local_cores(master: str) -> int:
    """The worker threads of a ``local``, ``local[N]``, ``local[*]`` or ``local[N,F]`` master."""
    inside = master[master.find("[") + 1 : master.find("]")] if "[" in master else "1"
    first = inside.split(",")[0].strip()
    if first == "*":
        return os.cpu_count() or 1
    return max(int(first), 1) if first.isdigit() else 1


@contextmanager
def table_session(spark: SparkSession, config: SparkConfig) -> Iterator[SparkSession]:
    """A session of ``spark``'s application with ``spark``'s SQL settings as they are now, and its
    own from then on, for one table's commit beside others (Delta's idempotent-write settings are
    per session). Classic: ``newSession()``. Spark Connect has no ``newSession`` (and the
    ``cloneSession`` of pyspark 4.2 returns a session that cannot be stopped): a new session on
    the server at ``spark.remote``, released afterwards."""
    if not is_connect(spark):
        session = spark.newSession()
        _copy_settings(spark, session)
        yield session
        return
    if config.remote is None:
        raise ConfigError("a second Spark Connect session needs the server's address: set spark.remote")
    session = _connect(config)
    try:
        _copy_settings(spark, session)
        yield session
    finally:
        _release(session, config.remote)


def _copy_settings(source: SparkSession, target: SparkSession) -> None:
    """``source``'s SQL settings that ``target`` lacks or has otherwise, where they can change."""
    have = target.conf.getAll
    for key, value in source.conf.getAll.items():
        if have.get(key) != value and source.conf.isModifiable(key):
            target.conf.set(key, value)


SESSION_SETTING_PREFIXES = ("spark.sql.", "spark.databricks.")
DEFAULT_CONNECT_PORT = 15002  # Spark Connect's, when an sc:// address names none
_CONNECT_SESSIONS: dict[str, SparkSession] = {}  # this process's session per Spark Connect server
CONNECT_RETRY_MAX_SECONDS = RECONNECT_SECONDS[-1]
CONNECT_RETRIES = 64  # with the pause at most CONNECT_RETRY_MAX_SECONDS: about ten minutes


def close_connect_sessions() -> None:
    """Stop the Spark Connect sessions this process keeps: released on their servers, or, where a
    server no longer answers, only disconnected. Runs at exit: pyspark's own exit clean-up of an
    open session calls its server and, when the server is gone, retries for minutes."""
    while _CONNECT_SESSIONS:
        address, session = _CONNECT_SESSIONS.popitem()
        _release(session, address)


def _release(session: SparkSession, address: str) -> None:
    """Stop ``session``: released on its server, or, where the server no longer answers, only
    disconnected (a release would wait through the client's retries)."""
    if _answers(address):
        session.stop()
    else:
        session.client.close()


def discard_connect_session(session: SparkSession) -> None:
    """Close ``session``'s connection without a call to its server, which lost it; the next
    :func:`spark_session` for the server opens a new one."""
    if not connect_session_closed(session):
        session.client.close()


def connect_session_closed(session: SparkSession) -> bool:
    """Whether ``session`` is a Spark Connect session whose connection is closed."""
    return bool(getattr(session, "is_stopped", False))  # a Connect session's property


def _connect(config: SparkConfig, app_name: str | None = None) -> SparkSession:
    """A new session on the Spark Connect server at ``spark.remote``, whose calls are retried
    while the server does not answer, at least every :data:`CONNECT_RETRY_MAX_SECONDS` and for
    about ten minutes in all (the client's own default waits up to a minute between attempts)."""
    from pyspark.sql.connect.client.retries import DefaultPolicy

    builder = _remote_builder(config)
    session = (builder.appName(app_name) if app_name else builder).create()
    session.client.set_retry_policies(
        [DefaultPolicy(max_retries=CONNECT_RETRIES, max_backoff=int(CONNECT_RETRY_MAX_SECONDS * 1000))]
    )
    return session


def _answers(address: str) -> bool:
    """Whether the Spark Connect server at ``sc://host[:port][/;…]`` accepts a connection."""
    host, _, port = address.removeprefix("sc://").split("/", 1)[0].partition(":")
    try:
        with socket.create_connection((host, int(port or DEFAULT_CONNECT_PORT)), timeout=2.0):
            return True
    except OSError:
        return False


def _remote_builder(config: SparkConfig) -> SparkSession.Builder:
    """A Spark Connect session's builder: the server at ``spark.remote``, and the SQL settings of
    ``spark.conf`` (``spark.sql.*``, Delta's ``spark.databricks.*``), which are per session; the
    other settings are the server's own (``cdc-assets spark-server`` starts with all of them)."""
    assert config.remote is not None
    builder = SparkSession.builder.remote(config.remote)
    for key, value in config.conf.items():
        if key.startswith(SESSION_SETTING_PREFIXES):
            builder = builder.config(key, value)
    return builder


def _require_connect_client() -> None:
    """Spark Connect's client libraries are installed (pyspark's ``connect`` extra)."""
    try:
        from pyspark.sql.connect.utils import check_dependencies

        check_dependencies()
    except ImportError as error:
        raise ConfigError(
            f"spark.remote needs Spark Connect's client libraries: pip install 'cdc-assets[connect]' ({error})"
        ) from None


def is_connect(spark: SparkSession) -> bool:
    """Whether ``spark`` is a Spark Connect client session."""
    return type(spark).__module__.startswith("pyspark.sql.connect")


def spark_session(config: SparkConfig, app_name: str = "cdc-assets") -> SparkSession:
    """The session for ``config`` (an existing active one with the same master is reused)."""
    if config.remote:
        _require_connect_client()
        # not getOrCreate: pyspark refuses a remote session in a process that has a classic one
        session = _CONNECT_SESSIONS.get(config.remote)
        if session is None or connect_session_closed(session):
            session = _CONNECT_SESSIONS[config.remote] = _connect(config, app_name)
            # registered after the session's own exit hook, so it runs first (atexit is last in, first out)
            atexit.unregister(close_connect_sessions)
            atexit.register(close_connect_sessions)
        return session
    settings = session_settings(config, app_name)
    ensure_java()
    builder = SparkSession.builder.master(config.master or "local[2]")
    for key, value in settings.items():
        builder = builder.config(key, value)
    # An interrupt while pyspark launches the JVM leaves a JVM whose gateway never started: it
    # never learns that its parent is gone and runs on for good. So the launch is not cut short.
    with interrupts_deferred():
        session = builder.getOrCreate()
    packages = settings.get("spark.jars.packages")
    if packages and "spark.jars.packages" not in config.conf:
        started = session.sparkContext.getConf()
        if started.get("spark.jars.packages") == packages:  # this start resolved them, not an earlier session
            record_jars(packages, ivy_home(settings), started.get("spark.jars"))
    return session


@contextmanager
def quiet_start() -> Iterator[None]:
    """Keep the JVM's start-up chatter (Ivy's dependency report) off the terminal; show it only if
    starting fails."""
    with tempfile.TemporaryFile(mode="w+b") as log:
        saved = [os.dup(1), os.dup(2)]
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            yield
        except BaseException:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            log.seek(0)
            sys.stderr.write(log.read().decode(errors="replace")[-4000:])
            raise
        finally:
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            for fd in saved:
                os.close(fd)
