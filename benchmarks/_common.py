"""Shared pieces of the benchmarks: the throwaway server, pgbench, timing statistics, machine facts.

Not part of the library. Each benchmark script puts its own folder on ``sys.path`` (Python does
that for a script), so ``import _common`` works from ``python benchmarks/<name>.py``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

# Measure the library of this checkout even when the installed package points elsewhere (a stale
# editable install): the repository root goes first on sys.path, and on PYTHONPATH for children.
ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
os.environ["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])

from cdc_assets.apply.connect_server import STOP_TIMEOUT_S  # noqa: E402 - after the sys.path line above
from cdc_sandbox.pgcluster import ThrowawayCluster  # noqa: E402

# PostgreSQL's own default: the throwaway cluster's 64kB (which tests use to force spilling)
# would make the server spill or stream almost every pgbench transaction.
BENCH_SETTINGS = {"logical_decoding_work_mem": "64MB", "max_wal_size": "4GB", "checkpoint_timeout": "30min"}

MiB = 1 << 20


def start_cluster(major: int, **settings: str) -> ThrowawayCluster:
    cluster = ThrowawayCluster(major, settings={**BENCH_SETTINGS, **settings})
    cluster.start()
    return cluster


def client_command(cluster: ThrowawayCluster, program: str, *args: str) -> list[str]:
    """The command line of one of the cluster's client programs (``pgbench``, ``pg_recvlogical``):
    ``args``, then the connection options (loopback, the cluster's port, user ``postgres``); run as
    ``postgres`` when we are root, as the server is. Run it with ``cwd="/"``."""
    assert cluster.bin_dir is not None
    command = [str(cluster.bin_dir / program), *args, "-h", "127.0.0.1", "-p", str(cluster.port), "-U", "postgres"]
    if os.geteuid() == 0:
        command = ["runuser", "-u", "postgres", "--", *command]
    return command


def pgbench(cluster: ThrowawayCluster, *args: str) -> float:
    """Run pgbench against the cluster (as ``postgres`` when we are root); return its wall time."""
    command = [*client_command(cluster, "pgbench", *args), "postgres"]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd="/", check=False)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"pgbench {' '.join(args)} failed ({done.returncode}):\n{done.stderr}\n{done.stdout}")
    return elapsed


def flush_lsn(conn: Any) -> int:
    """``pg_current_wal_flush_lsn()`` as an int (``conn``: a psycopg connection)."""
    return int(conn.execute("SELECT (pg_current_wal_flush_lsn() - '0/0')::int8").fetchone()[0])


def recvlogical_args(slot: str, endpos: int, options: Sequence[tuple[str, str]]) -> list[str]:
    """pg_recvlogical's arguments (without the connection's): ``slot`` up to ``endpos`` into
    /dev/null, no fsync, the given pgoutput options."""
    from cdc_assets.lsn import format_lsn

    args = ["-d", "postgres", f"--slot={slot}", "--start", "--no-loop", f"--endpos={format_lsn(endpos)}"]
    return [*args, "-f", "/dev/null", "-F", "0", *(a for name, value in options for a in ("-o", f"{name}={value}"))]


def recvlogical(
    cluster: ThrowawayCluster, slot: str, endpos: int, options: Sequence[tuple[str, str]]
) -> dict[str, Any]:
    """``pg_recvlogical`` (PostgreSQL's own C client of the replication protocol) over ``slot`` up
    to ``endpos``, into /dev/null, no fsync; timed as a whole command. It confirms what it received,
    so the slot moves: one run per slot. Returns its wall seconds and CPU seconds (user + system,
    with the ``runuser`` that starts it when we are root)."""
    import resource

    args = recvlogical_args(slot, endpos, options)
    command = client_command(cluster, "pg_recvlogical", *args)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, cwd="/", check=False)
    elapsed = time.perf_counter() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        raise RuntimeError(f"pg_recvlogical failed ({done.returncode}):\n{done.stderr}\n{done.stdout}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"seconds": elapsed, "cpu_s": cpu, "command": " ".join(["pg_recvlogical", *args])}


PING_SECONDS = 0.2  # as the drain: how often a reader that is catching up asks the server its position


def stream_range(
    dsn: str,
    slot: str,
    publication: str,
    options: Sequence[tuple[str, str]],
    target: int,
    on_block: Callable[[Any], object] = lambda block: None,
    timeout: float = 1800.0,
) -> None:
    """Read ``slot`` over the streaming replication protocol (``cdc_assets.stream.reader.SlotStream``,
    its receiving child process) from its confirmed position until the server's position reaches
    ``target``, handing every ``MessageBlock`` to ``on_block``. Nothing is confirmed: the slot does
    not move, and the same range can be read again."""
    import psycopg

    from cdc_assets.config import SourceConfig
    from cdc_assets.stream.blocks import MessageBlock, StreamPosition
    from cdc_assets.stream.reader import SlotStream

    source = SourceConfig(dsn=dsn, publication=publication, slot=slot)
    with psycopg.connect(dsn, autocommit=True) as conn, SlotStream(conn, source, list(options), 0) as stream:
        deadline = time.monotonic() + timeout
        stream.ping()
        asked = time.monotonic()
        while True:
            frame = stream.next(timeout=max(0.0, asked + PING_SECONDS - time.monotonic()))
            if isinstance(frame, MessageBlock):
                on_block(frame)
            elif isinstance(frame, StreamPosition) and frame.lsn >= target:
                return
            now = time.monotonic()
            if now >= deadline:
                raise TimeoutError(f"slot {slot} did not reach the target position within {timeout:.0f} s")
            if now - asked >= PING_SECONDS:
                stream.ping()
                asked = now


@dataclass(slots=True)
class Series:
    """Repeated timings of one measurement over the same amount of work."""

    name: str
    items: int  # messages or changes per repetition
    nbytes: int  # payload bytes per repetition
    seconds: list[float] = field(default_factory=list)

    def add(self, seconds: float) -> None:
        self.seconds.append(seconds)

    @property
    def best(self) -> float:
        return min(self.seconds)

    @property
    def median(self) -> float:
        return statistics.median(self.seconds)

    def rate(self, which: str = "median") -> float:
        return self.items / getattr(self, which)

    def mb_rate(self, which: str = "median") -> float:
        return self.nbytes / MiB / getattr(self, which)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "items": self.items,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "best_s": self.best,
            "median_s": self.median,
            "rate_best": self.rate("best"),
            "rate_median": self.rate("median"),
            "mib_per_s_best": self.mb_rate("best"),
            "mib_per_s_median": self.mb_rate("median"),
        }


def timed(function: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = function()
    return time.perf_counter() - started, result


def machine() -> dict[str, Any]:
    """CPU model, cores, RAM, Python and library versions (for the report)."""
    model = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import numpy
    import psycopg
    import pyarrow

    return {
        "cpu_model": model,
        "logical_cpus": os.cpu_count(),
        "ram_gib": round(psutil.virtual_memory().total / (1 << 30), 1),
        "python": platform.python_version(),
        "psycopg": f"{psycopg.__version__} ({psycopg.pq.__impl__})",
        "pyarrow": pyarrow.__version__,
        "numpy": numpy.__version__,
        "kernel": platform.release(),
        "date": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
    }


LIBRARY = Path(__file__).resolve().parent.parent / "cdc_assets"


def code_version() -> dict[str, Any]:
    """Which library code is measured: the git commit, uncommitted library files, and a hash of
    every ``cdc_assets/**/*.py`` (compare the hash at the start and the end of a run)."""
    digest = hashlib.sha256()
    for path in sorted(LIBRARY.rglob("*.py")):
        digest.update(str(path.relative_to(LIBRARY)).encode())
        digest.update(path.read_bytes())

    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], capture_output=True, text=True, cwd=LIBRARY.parent, check=False)
        return done.stdout

    dirty = [line[3:] for line in git("status", "--porcelain", "--", "cdc_assets").splitlines() if line.strip()]
    return {
        "commit": git("rev-parse", "--short", "HEAD").strip(),
        "uncommitted": dirty,
        "sha256": digest.hexdigest()[:16],
    }


def describe_code(start: dict[str, Any], end: dict[str, Any] | None = None) -> str:
    text = f"library code: commit {start['commit']}"
    text += f", uncommitted changes in {', '.join(start['uncommitted'])}" if start["uncommitted"] else ", clean"
    text += f", source hash {start['sha256']}"
    if end is not None and end["sha256"] != start["sha256"]:
        text += f" -- WARNING: the library source changed during the run (now {end['sha256']})"
    return text


def tree_cpu_s(process: psutil.Process) -> float:
    """CPU seconds so far of ``process`` (with its children it has reaped) and of its live
    descendants."""
    times = process.cpu_times()
    total = times.user + times.system + times.children_user + times.children_system
    for child in process.children(recursive=True):
        try:
            child_times = child.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += child_times.user + child_times.system
    return total


def load_snapshot(interval: float = 1.0) -> dict[str, Any]:
    """The load average and the processes outside this one's tree that used CPU over ``interval``."""
    me = psutil.Process()
    ours = {me.pid, *(p.pid for p in me.children(recursive=True))}
    procs = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            proc.cpu_percent(None)
            procs.append(proc)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    time.sleep(interval)
    busy = []
    for proc in procs:
        try:
            cpu = proc.cpu_percent(None)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        if cpu >= 5 and proc.pid not in ours:
            cmd = " ".join(proc.info.get("cmdline") or [proc.info.get("name") or "?"])
            busy.append({"pid": proc.pid, "cpu_percent": round(cpu), "command": cmd[:90]})
    busy.sort(key=lambda item: -item["cpu_percent"])
    return {"loadavg": [round(x, 2) for x in os.getloadavg()], "other_busy_processes": busy}


def describe_load(snapshot: dict[str, Any]) -> str:
    busy = snapshot["other_busy_processes"]
    others = "; ".join(f"{b['cpu_percent']}% {b['command']}" for b in busy) or "none"
    return f"load average {snapshot['loadavg']}; other processes using CPU: {others}"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table (also readable on a terminal)."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(cells[0], widths)) + " |"]
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in cells[1:]:
        lines.append(
            "| " + " | ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths))) + " |"
        )
    return "\n".join(lines)


def write_json(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2, default=str) + "\n", encoding="utf-8")
        print(f"\nwrote {path}")


def report_result(folder: str, name: str, result: dict[str, Any]) -> None:
    """``result`` with the machine and the code, written to ``folder/name`` and printed."""
    Path(folder).mkdir(parents=True, exist_ok=True)
    write_json(str(Path(folder) / name), {"machine": machine(), "code": code_version(), "result": result})
    print(json.dumps(result, indent=2))


def started(command: list[str], env: dict[str, str], log: Path, cwd: Path) -> subprocess.Popen[bytes]:
    """``command`` in a process group of its own, its output into ``log``."""
    with log.open("wb") as out:
        return subprocess.Popen(command, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def stop(process: subprocess.Popen[bytes], timeout_s: float = 2 * STOP_TIMEOUT_S) -> None:
    """SIGTERM to the process group (``dagster dev`` and the Connect server shut down on it; not
    SIGINT, which a process started in the background of a script inherits as ignored), then
    SIGKILL what is left. The wait outlasts the Connect server's own (its JVM is in a session of
    its own: killing the ``spark-server`` process before it has stopped the JVM would orphan it)."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def wait_for_line(log: Path, text: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text(errors="replace"):
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode}; see {log}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{text!r} did not appear in {log} within {timeout_s:.0f} s")
        time.sleep(0.5)


def cdc(env: dict[str, str], work: Path, *args: str) -> None:
    subprocess.run([sys.executable, "-m", "cdc_assets", *args], env=env, cwd=work, check=True)


def dagster_files(work: Path, instance: dict[str, Any]) -> dict[str, str]:
    """The Dagster instance (``work/dagster_home/dagster.yaml``) and a workspace of the project's
    code location beside ``work/cdc.yaml``; the environment that runs them."""
    home = work / "dagster_home"
    home.mkdir()
    (home / "dagster.yaml").write_text(json.dumps(instance, indent=2), encoding="utf-8")  # JSON is YAML
    workspace = {
        "load_from": [{"python_module": {"module_name": "dagster_project.definitions", "working_directory": str(ROOT)}}]
    }
    (work / "workspace.yaml").write_text(json.dumps(workspace, indent=2), encoding="utf-8")
    return {"CDC_CONFIG": str(work / "cdc.yaml"), "DAGSTER_HOME": str(home)}
