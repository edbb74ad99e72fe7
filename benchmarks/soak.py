"""Soak: a server with 2 workers on Postgres and S3 under concurrent pulls and pushes for minutes.

One run starts moto's S3 server and `mfsreg serve --workers 2` as processes on loopback, on a
scratch Postgres database, pushes a small family, then for ``--minutes`` (or until ``--max-requests``)
runs ``--pullers`` threads that pull members as a node with an empty cache does (the version
document, then every chunk it needs in download batches, read to the end and dropped) and
``--pushers`` threads that push new versions (a member with a few tensors changed: negotiate,
upload, commit). It reports requests, errors (the goal is none), the latency of each kind of
request (p50 and p99) and the servers' memory (the RSS of the uvicorn processes) after the warm-up
and at the end: the goal is memory flat within 20%.

Loopback only, bounded in time and requests. Everything it makes is removed afterwards.

    python -m benchmarks.soak [--minutes 10] [--pullers 32] [--pushers 4] [--max-requests 1000000]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
import uuid
from collections import defaultdict
from pathlib import Path

import httpx
import numpy as np
from safetensors.numpy import save_file

from benchmarks.bench_api import Stack
from benchmarks.common import finish, machine_info, table

FAMILY = "soak"


def make_member(path: Path, seed: int, changed: int) -> Path:
    """A 16-tensor model (8 MiB of f32): tensors of the shared base, ``changed`` of them perturbed."""
    base = np.random.default_rng(0)
    tensors = {f"layer{i}.weight": base.standard_normal((256, 512), dtype=np.float32) for i in range(16)}
    rng = np.random.default_rng(seed)
    for i in rng.choice(16, size=changed, replace=False):
        tensors[f"layer{i}.weight"] = (
            tensors[f"layer{i}.weight"] + rng.standard_normal((256, 512), dtype=np.float32) * 1e-3
        )
    save_file(tensors, str(path))
    return path


def server_rss(stack: Stack) -> int:
    """Bytes resident in the API's processes: the uvicorn supervisor and its workers."""
    pids = [stack.api.pid]
    try:
        children = Path(f"/proc/{stack.api.pid}/task/{stack.api.pid}/children").read_text().split()
        pids += [int(p) for p in children]
    except OSError:
        pass
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


class Load:
    """The clients' threads and what they saw: latencies by kind of request, errors by message."""

    def __init__(self, url: str, token: str, members: list[str], deadline: float, max_requests: int):
        self.url, self.headers = url, {"Authorization": f"Bearer {token}"}
        self.members, self.deadline, self.max_requests = members, deadline, max_requests
        self.latency: dict[str, list[float]] = defaultdict(list)
        self.errors: dict[str, int] = defaultdict(int)
        self.lock = threading.Lock()
        self.requests = 0

    def going(self) -> bool:
        return time.monotonic() < self.deadline and self.requests < self.max_requests

    def note(self, kind: str, seconds: float, error: str | None = None) -> None:
        with self.lock:
            self.requests += 1
            self.latency[kind].append(seconds)
            if error:
                self.errors[f"{kind}: {error[:120]}"] += 1

    def timed(self, kind: str, fn):
        t0 = time.perf_counter()
        try:
            out = fn()
        except Exception as exc:  # noqa: BLE001 - every failure is counted, none stops the soak
            self.note(kind, time.perf_counter() - t0, f"{type(exc).__name__}: {exc}")
            return None
        self.note(kind, time.perf_counter() - t0)
        return out

    def puller(self, n: int) -> None:
        with httpx.Client(base_url=self.url, headers=self.headers, timeout=120) as http:
            k = n
            while self.going():
                member = self.members[k % len(self.members)]
                k += 1
                doc = self.timed(
                    "version document", lambda m=member: _ok(http.get(f"/v1/families/{FAMILY}/versions/{m}")).json()
                )
                if doc is None:
                    continue
                ids = list(doc["chunks"])
                for i in range(0, len(ids), 64):
                    batch = ids[i : i + 64]
                    self.timed(
                        "download batch", lambda b=batch: _drain(http, f"/v1/families/{FAMILY}/chunks/download", b)
                    )

    def pusher(self, n: int, work: Path) -> None:
        from mfsreg.registry.client.remote import RemoteRegistry

        with RemoteRegistry(self.url, token=self.headers["Authorization"].split()[1]) as remote:
            k = 0
            while self.going():
                path = make_member(work / f"push{n}.safetensors", seed=1000 * n + k, changed=2)
                name = f"p{n}-{k}-{uuid.uuid4().hex[:6]}"
                self.timed("push (whole)", lambda p=path, v=name: remote.push(p, FAMILY, v, parent="base"))
                k += 1


def _ok(resp: httpx.Response) -> httpx.Response:
    if resp.status_code >= 400:
        raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
    return resp


def _drain(http: httpx.Client, path: str, ids: list[str]) -> int:
    with http.stream("POST", path, json={"ids": ids}) as resp:
        if resp.status_code >= 400:
            resp.read()
            raise RuntimeError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        return sum(len(b) for b in resp.iter_raw())


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) >= 2 else (xs[0] if xs else float("nan"))


def report(doc: dict) -> str:
    rows = [[k, v["count"], v["p50_ms"], v["p99_ms"]] for k, v in doc["latency"].items()]
    mem = doc["server_rss_bytes"]
    lines = [
        f"soak: {doc['seconds']:.0f} s, {doc['pullers']} pullers, {doc['pushers']} pushers, 2 server workers; "
        f"{doc['requests']} requests, {doc['error_count']} errors",
        "",
        table(["request", "count", "p50 ms", "p99 ms"], rows),
        "",
        f"server RSS: {mem['after_warm_up'] / 2**20:.0f} MiB after the warm-up, {mem['end'] / 2**20:.0f} MiB at the end "
        f"({doc['memory_growth']:+.1%}; goal within 20%)",
    ]
    lines += [f"error: {e} x{n}" for e, n in doc["errors"].items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--pullers", type=int, default=32)
    ap.add_argument("--pushers", type=int, default=4)
    ap.add_argument("--max-requests", type=int, default=1_000_000)
    ap.add_argument("--warm-up", type=float, default=30.0, help="seconds of load before the first memory reading")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="mfsreg-soak-") as tmp:
        work = Path(tmp)
        stack = Stack(work)
        try:
            url = stack.start_api(f"soak-{uuid.uuid4().hex[:8]}", workers=2)
            from mfsreg.registry.client.remote import RemoteRegistry

            members = ["base", *(f"m{i}" for i in range(4))]
            with RemoteRegistry(url, token=stack.token) as remote:
                for i, name in enumerate(members):
                    remote.push(
                        make_member(work / f"{name}.safetensors", seed=i, changed=0 if i == 0 else 4),
                        FAMILY,
                        name,
                        parent=None if i == 0 else "base",
                    )
            deadline = time.monotonic() + args.minutes * 60
            load = Load(url, stack.token, members, deadline, args.max_requests)
            threads = [threading.Thread(target=load.puller, args=(n,), daemon=True) for n in range(args.pullers)]
            threads += [threading.Thread(target=load.pusher, args=(n, work), daemon=True) for n in range(args.pushers)]
            t0 = time.monotonic()
            for t in threads:
                t.start()
            time.sleep(min(args.warm_up, args.minutes * 60 / 4))
            warm_rss = server_rss(stack)
            for t in threads:
                t.join()
            end_rss = server_rss(stack)
            seconds = time.monotonic() - t0
        finally:
            stack.close()
    doc = {
        "benchmark": "soak",
        "seconds": seconds,
        "pullers": args.pullers,
        "pushers": args.pushers,
        "requests": load.requests,
        "error_count": sum(load.errors.values()),
        "errors": dict(load.errors),
        "latency": {
            k: {"count": len(v), "p50_ms": round(pct(v, 50) * 1e3, 1), "p99_ms": round(pct(v, 99) * 1e3, 1)}
            for k, v in sorted(load.latency.items())
        },
        "server_rss_bytes": {"after_warm_up": warm_rss, "end": end_rss},
        "memory_growth": end_rss / warm_rss - 1 if warm_rss else None,
        "machine": machine_info(),
    }
    finish("soak.json", doc, report, t_start)


if __name__ == "__main__":
    main()
