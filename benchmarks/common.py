"""What the benchmark scripts share: machine facts, a fresh embedded registry, family pushes, tables."""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks.family import MEMBERS

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
FAMILY = "bench"
GB = 1e9
MB = 1e6


def _state() -> dict:
    """What may change while a benchmark runs: the checkout's commit, whether registry/ has edits
    (a run's processes may have imported either), and how busy the machine is."""
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "registry"], cwd=REPO, capture_output=True, text=True
            ).stdout.strip()
        )
    except OSError:
        commit, dirty = None, None
    return {"git_commit": commit, "registry_dirty": dirty, "loadavg_1_5_15": [round(x, 2) for x in os.getloadavg()]}


# Taken when a benchmark script imports this module, before it measures anything: machine_info()
# is called when the results are written, and the commit, the edits and the load it reports are
# those the run started with (the end's are kept beside them).
_AT_START = _state()


def machine_info() -> dict:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem = int(line.split()[1]) * 1024
    except OSError:
        pass
    end = _state()
    return {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu,
        "memory_bytes": mem,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        # where a VM's balloon hands free memory back to the host (free page reporting), blocks of
        # 2**order pages freed are given back, and touching them again costs a fault on the host:
        # writing 100 MB into new files took 0.27 s against 0.023 s (docs/benchmarks.md)
        "page_reporting_order": _page_reporting_order(),
        # other work on the machine skews timings: the load average says how busy it was
        **_AT_START,
        "at_end": end,
        "code_changed_during_run": (end["git_commit"], end["registry_dirty"])
        != (_AT_START["git_commit"], _AT_START["registry_dirty"]),
        "libraries": library_versions(),
    }


def _page_reporting_order() -> int | None:
    """The kernel's free page reporting order, or None where it has none (not a VM with a reporting balloon)."""
    try:
        return int(Path("/sys/module/page_reporting/parameters/page_reporting_order").read_text())
    except (OSError, ValueError):
        return None


def library_versions() -> dict:
    """The installed versions of the libraries whose speed the figures depend on (a fresh install
    may bring a newer zstandard or numpy than the run it is compared with)."""
    from importlib import metadata

    out: dict = {}
    for name in ("zstandard", "numpy", "xxhash", "safetensors", "torch", "boto3", "moto"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        import zstandard

        out["libzstd"] = ".".join(map(str, zstandard.ZSTD_VERSION))
    except ImportError:
        pass
    return out


@contextmanager
def fresh_registry(parent_dir: Path, chunk_size: int | None = None, **settings) -> Iterator:
    """An embedded registry (SQLite + local packs) in a new temp dir under ``parent_dir``, removed after.
    ``settings`` override Settings fields (e.g. ``delta=False``)."""
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    parent_dir.mkdir(parents=True, exist_ok=True)
    home = Path(tempfile.mkdtemp(prefix="mfsreg-bench-", dir=parent_dir))
    overrides = dict(settings) if chunk_size is None else {**settings, "chunk_size": chunk_size}
    reg = Registry(Settings.from_env({"MFSREG_HOME": str(home)}, **overrides))
    try:
        yield reg, home
    finally:
        reg.close()
        shutil.rmtree(home, ignore_errors=True)
        os.sync()  # let the deletes (ext4 with discard) settle before the next timed run


def timed_push(reg, path: Path, version: str, parent: str | None) -> dict:
    t0 = time.perf_counter()
    r = reg.push(path, FAMILY, version, parent=parent)
    wall = time.perf_counter() - t0
    return {
        "version": version,
        "parent": parent,
        "logical_bytes": r.logical_bytes,
        "new_bytes": r.new_bytes,
        "new_chunks": r.new_chunks,
        "reused_chunks": r.reused_chunks,
        "chunks": r.chunks,
        "seconds": wall,
        "reported_seconds": r.seconds,
        "gbps": r.logical_bytes / wall / GB,
    }


def push_family(reg, paths: dict[str, Path]) -> list[dict]:
    """Push every member in order (parents first), as versions named after the members."""
    return [timed_push(reg, paths[m], m, MEMBERS[m]) for m in MEMBERS]


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def median(xs):
    return statistics.median(xs) if xs else None


def spread(xs) -> str:
    return f"{min(xs):.2f}-{max(xs):.2f}" if len(xs) > 1 else ""


def table(headers: list[str], rows: list[list]) -> str:
    def cell(v):
        return (
            v
            if isinstance(v, str)
            else f"{v:,}"
            if isinstance(v, int)
            else f"{v:.3g}"
            if isinstance(v, float)
            else str(v)
        )

    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
    return "\n".join(lines)


def write_json(name: str, doc: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    out = RESULTS / name
    out.write_text(json.dumps(doc, indent=2) + "\n")
    return out


def cpu_seconds() -> float:
    """User + system CPU of this process so far (every thread)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def finish(name: str, doc: dict, report, t_start: float) -> None:
    """Write a benchmark's JSON, print its report and where the results went."""
    doc["seconds_total"] = time.perf_counter() - t_start
    path = write_json(name, doc)
    print()
    print(report(doc))
    if doc.get("machine", {}).get("code_changed_during_run"):
        print("warning: the commit or registry/'s edits changed while this ran: its processes may have run either code")
    print(f"results: {path} (whole benchmark: {doc['seconds_total']:.0f} s)")


POSTGRES = "postgresql+psycopg://postgres@127.0.0.1:5432"  # the tests' server: trust auth


@contextmanager
def scratch_postgres(prefix: str):
    """A new, empty Postgres database on the local server as a registry engine, dropped afterwards."""
    import uuid

    from sqlalchemy import create_engine, text

    from mfsreg.registry.db.engine import create_db_engine

    admin = create_engine(f"{POSTGRES}/postgres", isolation_level="AUTOCOMMIT")
    name = f"{prefix}_{uuid.uuid4().hex[:8]}"
    with admin.connect() as c:
        c.execute(text(f"CREATE DATABASE {name}"))
    engine = create_db_engine(f"{POSTGRES}/{name}")
    try:
        yield engine
    finally:
        engine.dispose()
        with admin.connect() as c:
            c.execute(text(f"DROP DATABASE {name} WITH (FORCE)"))
        admin.dispose()
