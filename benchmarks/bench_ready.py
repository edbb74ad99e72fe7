"""Time to ready on an inference node: how long until a member's weights are in memory, every byte read.

    python -m benchmarks.bench_ready [--scales 1,0.09] [--runs 3] [--requests 200] [--device cpu|cuda]

One stack as in bench_api.py (moto's S3 server, a scratch Postgres database and `mfsreg serve`, on
loopback) receives the six members of benchmarks/family.py at each scale (1: 1.16 GB members;
0.09: 84 MB members, where fixed costs dominate), pushed through the API with their parents, and
the same files into a plain bucket. Source files lie in the page cache. "Ready" means every tensor
is in memory on the device and every byte of it has been read: `load_tensors` reads and checks
each chunk against its id; the anchors read every byte after `load_file` (xxh3-64 over each
tensor's bytes on the CPU, the fastest whole read at hand; on a GPU the copy itself reads them).
Medians of --runs, anchors timed in the same run:

Every timed step starts with no dirty pages (os.sync() after the untimed set-up before it): on
this VM, writeback of a gigabyte an earlier step wrote (moto's objects, a warmed cache, a
download) throttled the next step's writes tenfold (105 MB of chunk files in 0.26-0.33 s against
0.03 s), whichever side of a ratio it fell on.

- **new member, base cached:** a fresh node cache warmed with the base tier (untimed), a fresh
  `Node`, then `load_tensors(member)` until ready, beside (a) one `get_object` of the member's file
  streamed to local disk, then `load_file` and every byte read (an engine that downloads files) and
  (b) the file already on local disk: `load_file` and every byte read. lora-chat is gated;
  full-medical, which shares no chunk with the base, is reported beside it. Beside the seconds,
  the CPU-seconds each way costs the node (or the anchor's client), the server and moto together
  (Postgres left out): on 2 cores the node and the stack share the CPU, so a load that needs less
  CPU than the download still waits on the cores.
- **warm:** `load_tensors(lora-chat)` from a warm node cache beside (b), both in the page cache,
  interleaved rounds.
- **switch fixed cost:** a `ResidentModel` switched between base and base-copy (the same file
  pushed under another name: nothing differs), with the version documents fresh and after their
  freshness window (MFSREG_NODE_FRESH_S) has passed (one round trip to the registry each), and a
  profile of where the fresh switch's time goes.
- **serving trace:** 200 requests over the six members (Zipf 1.1 over a fixed shuffled order,
  fixed seed); each waits until its member's weights are resident in the one model the node holds.
  Three ways: `ResidentModel.switch` on a node whose cache starts empty (it fetches what it
  lacks), reloading the member from its local safetensors file into the same tensors (files all on
  local disk beforehand), and downloading the member's file (one `get_object`) the first time it is
  needed, then reloading from it. Reports the mean and p99 wait and the bytes each way moved.

Writes benchmarks/results/ready.json and prints a table with the gates.
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import os
import pstats
import random
import shutil
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import torch
import xxhash
from boto3.s3.transfer import TransferConfig
from safetensors import safe_open
from safetensors.torch import load_file

from benchmarks.anchors import prewarm
from benchmarks.bench_api import Stack
from benchmarks.common import MB, finish, machine_info, median, table
from benchmarks.family import DEFAULT_DIR, MEMBERS, generate

NEW = "lora-chat"  # the gated new member: most of its bytes are the base's
NEW_ALONE = "full-medical"  # reported beside it: no chunk in common with the base
WARM = "lora-chat"
SAME = "base-copy"  # the base's file under another version name: a switch that moves nothing
ZIPF_S = 1.1
TRACE_SEED = 7
WARM_REPS = 5
FIXED_REPS = 50
GATES = {"new": 0.25, "new_small": 0.5, "warm": 0.9, "trace": 0.5, "fixed_ms": 1.0}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def read_all(tensors: dict[str, torch.Tensor]) -> int:
    """Read every byte of every tensor (xxh3-64 on the CPU; a GPU's copy has read them): what a
    loader that maps lazily still owes before its weights are ready."""
    n = 0
    for t in tensors.values():
        if t.device.type == "cpu" and t.numel():
            xxhash.xxh3_64_intdigest(t.reshape(-1).view(torch.uint8).numpy())
        n += t.nbytes
    return n


def _proc_cpu(pid: int) -> float:
    """CPU-seconds (user + system) a process of the stack has used, from /proc (0 where unreadable)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return 0.0


def family_name(scale: float) -> str:
    return f"ready-s{scale:g}".replace(".", "p")


class Bench:
    def __init__(self, stack: Stack, paths: dict[str, Path], scale: float, work: Path, device: str):
        self.stack, self.paths, self.scale, self.work, self.device = stack, paths, scale, work, device
        self.family = family_name(scale)
        self.bucket = f"plain-{uuid.uuid4().hex[:8]}"

    def node(self, cache_dir: Path):
        from mfsreg.registry.client import Node

        return Node(self.stack.api_url, self.stack.token, str(cache_dir))

    def cpu(self) -> dict[str, float]:
        """CPU-seconds used so far: this process (the node, or the anchor's client), the server, moto."""
        t = os.times()
        return {
            "client": t.user + t.system,
            "server": _proc_cpu(self.stack.api.pid),
            "moto": _proc_cpu(self.stack.moto.pid),
        }

    @staticmethod
    def spent(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
        out = {k: after[k] - before[k] for k in before}
        return out | {"total": sum(out.values())}

    def fresh_dir(self, what: str) -> Path:
        return Path(tempfile.mkdtemp(prefix=f"{what}-", dir=self.work))

    def setup(self) -> dict:
        from mfsreg.registry.client.remote import RemoteRegistry

        self.stack.s3.create_bucket(Bucket=self.bucket)
        pushed = {}
        with RemoteRegistry(self.stack.api_url, token=self.stack.token) as r:
            for m, parent in [*MEMBERS.items(), (SAME, "base")]:
                path = self.paths["base" if m == SAME else m]
                r.push(path, self.family, m, parent=parent)
                pushed[m] = path.stat().st_size
        for m in MEMBERS:
            self.stack.s3.upload_file(str(self.paths[m]), self.bucket, m, Config=TransferConfig())
        prewarm(self.paths.values())
        os.sync()
        return pushed

    # -- anchors ------------------------------------------------------------------------------

    def local_ready(self, member: str) -> float:
        t0 = time.perf_counter()
        tensors = load_file(str(self.paths[member]), device=self.device)
        _sync(self.device)
        read_all(tensors)
        return time.perf_counter() - t0

    def download_ready(self, member: str) -> dict:
        dest = self.work / f"downloaded-{member}.safetensors"
        try:
            os.sync()  # no dirty pages from earlier steps (see the module's doc)
            c0 = self.cpu()
            t0 = time.perf_counter()
            self._download(member, dest)
            t1 = time.perf_counter()
            tensors = load_file(str(dest), device=self.device)
            _sync(self.device)
            read_all(tensors)
            t2 = time.perf_counter()
            cpu = self.spent(c0, self.cpu())
            del tensors
        finally:
            dest.unlink(missing_ok=True)
        return {"get_object_s": t1 - t0, "ready_s": t2 - t0, "cpu_s": cpu}

    def _download(self, member: str, dest: Path) -> int:
        body = self.stack.s3.get_object(Bucket=self.bucket, Key=member)["Body"]
        with open(dest, "wb") as f:
            shutil.copyfileobj(body, f, 8 << 20)
        return dest.stat().st_size

    # -- measurements -------------------------------------------------------------------------

    def new_member(self, member: str) -> dict:
        """load_tensors(member) on a node whose cache holds the base tier only."""
        from mfsreg.registry.client import load_tensors
        from mfsreg.registry.client.cache import NodeCache
        from mfsreg.registry.client.remote import RemoteRegistry
        from mfsreg.registry.client.warm import warm_cache

        cache_dir = self.fresh_dir("new-cache")
        try:
            cache = NodeCache(str(cache_dir))
            try:
                warm_cache(RemoteRegistry(self.stack.api_url, token=self.stack.token), self.family, "base", cache=cache)
            finally:
                cache.close()
            node = self.node(cache_dir)
            try:
                os.sync()  # the warm's writes are flushed, as the download's are (see download_ready)
                c0 = self.cpu()
                t0 = time.perf_counter()
                tensors = load_tensors(self.family, member, device=self.device, node=node)
                _sync(self.device)
                ready = time.perf_counter() - t0
                cpu = self.spent(c0, self.cpu())
                stats = node.cache.stats()
                del tensors
            finally:
                node.close()
        finally:
            shutil.rmtree(cache_dir, ignore_errors=True)
        return {"ready_s": ready, "cache_bytes": stats.get("bytes"), "cpu_s": cpu}

    def warm(self, node) -> dict:
        from mfsreg.registry.client import load_tensors

        load_tensors(self.family, WARM, device=self.device, node=node)  # untimed: the node cache warm
        self.local_ready(WARM)
        lt, lf = [], []
        for _ in range(WARM_REPS):
            gc.collect()
            t0 = time.perf_counter()
            tensors = load_tensors(self.family, WARM, device=self.device, node=node)
            _sync(self.device)
            lt.append(time.perf_counter() - t0)
            del tensors
            gc.collect()
            lf.append(self.local_ready(WARM))
        return {"load_tensors_s": median(lt), "local_ready_s": median(lf)}

    def fixed_cost(self, node) -> dict:
        """switch between base and base-copy: the same bytes under two names."""
        from mfsreg.registry.client import ResidentModel

        rm = ResidentModel(self.family, "base", device=self.device, node=node)
        try:
            rm.switch(SAME)
            rm.switch("base")
            fresh, names = [], [SAME, "base"]
            for k in range(FIXED_REPS):
                t0 = time.perf_counter()
                moved = rm.switch(names[k % 2])
                fresh.append(time.perf_counter() - t0)
                assert moved == 0, moved
            prof = cProfile.Profile()
            prof.enable()
            for k in range(FIXED_REPS):
                rm.switch(names[k % 2])
            prof.disable()
            where = _profile_top(prof, FIXED_REPS)
            stale = []
            for k in range(5):
                node.fetcher.expire()  # as when the freshness window has passed: one round trip each
                t0 = time.perf_counter()
                rm.switch(names[k % 2])
                stale.append(time.perf_counter() - t0)
        finally:
            rm.close()
        return {"fresh_s": median(fresh), "revalidated_s": median(stale), "profile": where}

    def trace(self, requests: int) -> dict:
        order = list(MEMBERS)
        random.Random(TRACE_SEED).shuffle(order)
        weights = [1 / (k + 1) ** ZIPF_S for k in range(len(order))]
        seq = random.Random(TRACE_SEED + 1).choices(order, weights=weights, k=requests)
        out = {"order": order, "requests": requests, "distinct": len(set(seq)), "sequence": seq}
        os.sync()
        ways = {
            "switch": lambda: self._trace_switch(seq, warm_base=True),
            "switch_cold": lambda: self._trace_switch(seq, warm_base=False),
            "switch_unverified": lambda: self._trace_switch(seq, warm_base=True, verify=False),
            "reload_local": lambda: self._trace_reload(seq, download=False),
            "download_on_miss": lambda: self._trace_reload(seq, download=True),
        }
        for way, run in ways.items():
            gc.collect()
            os.sync()
            out[way] = run()
        return out

    def _trace_switch(self, seq: list[str], warm_base: bool, verify: bool = True) -> dict:
        """``warm_base``: the node cache starts with the family's base tier (`mfsreg cache warm`,
        untimed), as a node serving the family keeps it pinned; else empty. ``verify=False``: the
        cache's files trusted as fetched (as the local files are), not hashed again at each switch."""
        from mfsreg.registry.client import ResidentModel
        from mfsreg.registry.client.warm import warm_cache

        cache_dir = self.fresh_dir("trace-cache")
        node = self.node(cache_dir)
        if warm_base:
            from mfsreg.registry.client.remote import RemoteRegistry

            warm_cache(
                RemoteRegistry(self.stack.api_url, token=self.stack.token), self.family, "base", cache=node.cache
            )
            os.sync()
        waits, moved, fetched = [], 0, 0
        rm = None
        try:
            for member in seq:
                before = node.cache.stats().get("bytes") or 0
                t0 = time.perf_counter()
                if rm is None:
                    rm = ResidentModel(self.family, member, device=self.device, node=node, verify=verify)
                    moved += rm.loaded_bytes
                elif rm.version != member:
                    moved += rm.switch(member)
                _sync(self.device)
                waits.append(time.perf_counter() - t0)
                fetched += max(0, (node.cache.stats().get("bytes") or 0) - before)
        finally:
            if rm is not None:
                rm.close()
            node.close()
            shutil.rmtree(cache_dir, ignore_errors=True)
        return _waits(waits) | {"copied_bytes": moved, "fetched_raw_bytes": fetched}

    def _trace_reload(self, seq: list[str], download: bool) -> dict:
        """The resident tensors refilled from the member's local file (copied in; reallocated where
        the shape changed); with ``download``, the file is fetched with one get_object first time."""
        files = self.fresh_dir("trace-files")
        local: dict[str, Path] = {} if download else dict(self.paths)
        waits, copied, downloaded = [], 0, 0
        tensors: dict[str, torch.Tensor] = {}
        current = None
        try:
            for member in seq:
                t0 = time.perf_counter()
                if member != current:
                    if member not in local:
                        local[member] = files / f"{member}.safetensors"
                        downloaded += self._download(member, local[member])
                    copied += _refill(tensors, local[member], self.device)
                    current = member
                _sync(self.device)
                waits.append(time.perf_counter() - t0)
        finally:
            shutil.rmtree(files, ignore_errors=True)
        return _waits(waits) | {"copied_bytes": copied, "downloaded_bytes": downloaded}


def _refill(tensors: dict[str, torch.Tensor], path: Path, device: str) -> int:
    """Copy a file's tensors into ``tensors`` in place (new ones where the name or shape is new)."""
    n = 0
    with safe_open(str(path), framework="pt") as f:
        names = list(f.keys())
        for name in names:
            src = f.get_tensor(name)
            dst = tensors.get(name)
            if dst is None or dst.shape != src.shape or dst.dtype != src.dtype:
                tensors[name] = src.to(device, copy=True)
            else:
                dst.copy_(src)
            n += src.nbytes
    for name in set(tensors) - set(names):
        del tensors[name]
    return n


def _waits(waits: list[float]) -> dict:
    arr = np.array(waits)
    return {
        "waits_s": [round(w, 6) for w in waits],
        "mean_s": float(arr.mean()),
        "p99_s": float(np.percentile(arr, 99)),
        "max_s": float(arr.max()),
        "first_s": waits[0],
        "waits": len(waits),
        "stalls": int((arr > 1e-4).sum()),
    }


def _profile_top(prof: cProfile.Profile, calls: int, n: int = 12) -> list[dict]:
    """The functions a fresh switch spends its time in (own time, per switch)."""
    st = pstats.Stats(prof)
    rows = []
    for (file, line, fn), (_, _, tt, ct, _) in st.stats.items():  # type: ignore[attr-defined]
        rows.append(
            {"function": f"{Path(file).name}:{line}({fn})", "own_ms": tt / calls * 1e3, "cum_ms": ct / calls * 1e3}
        )
    rows.sort(key=lambda r: -r["own_ms"])
    return [{k: round(v, 4) if isinstance(v, float) else v for k, v in r.items()} for r in rows[:n]]


def run_scale(stack: Stack, scale: float, runs: int, requests: int, device: str, data: Path, work: Path) -> dict:
    paths = generate(data, scale, verbose=True)
    bench = Bench(stack, paths, scale, work, device)
    doc: dict = {"scale": scale, "member_bytes": {m: p.stat().st_size for m, p in paths.items()}}
    doc["pushed"] = bench.setup()
    new = {m: {"load_tensors": [], "download": [], "local": []} for m in (NEW, NEW_ALONE)}
    for i in range(runs):
        t0 = time.perf_counter()
        for m, rec in new.items():
            rec["download"].append(bench.download_ready(m))
            rec["local"].append(bench.local_ready(m))
            rec["load_tensors"].append(bench.new_member(m))
        print(f"  scale {scale:g}: new-member run {i + 1}/{runs} in {time.perf_counter() - t0:.1f} s", flush=True)
    doc["new_member"] = {
        m: {
            "ready_s": median([r["ready_s"] for r in rec["load_tensors"]]),
            "download_ready_s": median([r["ready_s"] for r in rec["download"]]),
            "get_object_s": median([r["get_object_s"] for r in rec["download"]]),
            "local_ready_s": median(rec["local"]),
            # CPU-seconds of the node (or the anchor's client), the server and moto together: on
            # these 2 cores the stack and the node share the CPU, so this, not the wall clock, is
            # what each way costs (see docs/benchmarks.md)
            "cpu_s": median([r["cpu_s"]["total"] for r in rec["load_tensors"]]),
            "download_cpu_s": median([r["cpu_s"]["total"] for r in rec["download"]]),
            "runs": rec,
        }
        for m, rec in new.items()
    }
    for rec in doc["new_member"].values():
        rec["vs_download"] = rec["ready_s"] / rec["download_ready_s"]
        rec["vs_local"] = rec["ready_s"] / rec["local_ready_s"]
        rec["cpu_vs_download"] = rec["cpu_s"] / rec["download_cpu_s"]
    warm_dir = bench.fresh_dir("warm-cache")
    node = bench.node(warm_dir)
    try:
        doc["warm"] = [bench.warm(node) for _ in range(runs)]
        w = {k: median([r[k] for r in doc["warm"]]) for k in ("load_tensors_s", "local_ready_s")}
        doc["warm_summary"] = w | {"speed_vs_local": w["local_ready_s"] / w["load_tensors_s"]}
        doc["fixed"] = bench.fixed_cost(node)
        print(f"  scale {scale:g}: warm and fixed cost done", flush=True)
    finally:
        node.close()
        shutil.rmtree(warm_dir, ignore_errors=True)
    doc["trace"] = bench.trace(requests)
    t = doc["trace"]
    t["switch_vs_reload_local"] = t["switch"]["mean_s"] / t["reload_local"]["mean_s"]
    print(f"  scale {scale:g}: trace done", flush=True)
    return doc


def gates(doc: dict) -> list[list]:
    rows = []
    for s in doc["scales"]:
        big = s["scale"] >= 0.5
        nm = s["new_member"][NEW]
        limit = GATES["new"] if big else GATES["new_small"]
        rows.append(
            [
                f"{s['scale']:g}",
                f"{NEW} ready, base cached / download + load_file (a)",
                f"<= {limit}x",
                f"{nm['vs_download']:.3f}x",
                nm["vs_download"] <= limit,
            ]
        )
        rows.append([f"{s['scale']:g}", "the same / local load_file (b)", "reported", f"{nm['vs_local']:.2f}x", ""])
        rows.append(
            [
                f"{s['scale']:g}",
                "CPU-seconds (node, server, moto): the same / (a)",
                "reported",
                f"{nm['cpu_vs_download']:.3f}x",
                "",
            ]
        )
        if big:
            w = s["warm_summary"]
            rows.append(
                [
                    f"{s['scale']:g}",
                    "warm load_tensors speed / load_file + read",
                    f">= {GATES['warm']}x",
                    f"{w['speed_vs_local']:.2f}x",
                    w["speed_vs_local"] >= GATES["warm"],
                ]
            )
            r = s["trace"]["switch_vs_reload_local"]
            rows.append(
                [
                    f"{s['scale']:g}",
                    "trace: mean wait, switch / reload local",
                    f"<= {GATES['trace']}x",
                    f"{r:.3f}x",
                    r <= GATES["trace"],
                ]
            )
        else:
            t = s["trace"]
            ok = t["switch"]["mean_s"] <= t["reload_local"]["mean_s"]
            rows.append(
                [
                    f"{s['scale']:g}",
                    "trace: switch never slower than reload local",
                    "<= 1x",
                    f"{t['switch_vs_reload_local']:.3f}x",
                    ok,
                ]
            )
            f = s["fixed"]["fresh_s"] * 1e3
            rows.append(
                [
                    f"{s['scale']:g}",
                    "switch fixed cost (nothing differs), ms",
                    f"<= {GATES['fixed_ms']}",
                    f"{f:.3f}",
                    f <= GATES["fixed_ms"],
                ]
            )
    return rows


def report(doc: dict) -> str:
    out = [table(["scale", "gate", "goal", "measured", "met"], gates(doc)), ""]
    for s in doc["scales"]:
        rows = []
        for m, rec in s["new_member"].items():
            rows.append([f"{m}: ready, base cached", rec["ready_s"]])
            rows.append([f"{m}: (a) get_object + load_file + read", rec["download_ready_s"]])
            rows.append([f"{m}: (b) local load_file + read", rec["local_ready_s"]])
            rows.append(
                [
                    f"{m}: CPU-s, ready / (a) (node or client, server, moto)",
                    f"{rec['cpu_s']:.3f} / {rec['download_cpu_s']:.3f}",
                ]
            )
        w = s["warm_summary"]
        rows += [
            [f"warm {WARM}: load_tensors", w["load_tensors_s"]],
            [f"warm {WARM}: load_file + read", w["local_ready_s"]],
        ]
        rows += [
            ["switch, nothing differs, fresh", s["fixed"]["fresh_s"]],
            ["the same, revalidated", s["fixed"]["revalidated_s"]],
        ]
        for way in ("switch", "switch_cold", "switch_unverified", "reload_local", "download_on_miss"):
            t = s["trace"][way]
            moved = t["copied_bytes"] + t.get("fetched_raw_bytes", 0) + t.get("downloaded_bytes", 0)
            rows.append(
                [f"trace {way}: mean / p99 wait, MB moved", f"{t['mean_s']:.4f} / {t['p99_s']:.4f}, {moved / MB:,.0f}"]
            )
        out += [
            f"scale {s['scale']:g} ({s['member_bytes']['base'] / MB:,.0f} MB base), seconds",
            table(["", "s"], rows),
            "",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scales", default="1,0.09", help="family scales, comma-separated (1: 1.16 GB members)")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--out", default="ready.json")
    args = ap.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: this process sees no CUDA device")
    t_start = time.perf_counter()
    args.data.mkdir(parents=True, exist_ok=True)  # a fresh checkout has no bench-data/ yet
    work = Path(tempfile.mkdtemp(prefix="bench-ready-", dir=args.data))
    stack = Stack(work)
    doc: dict = {
        "params": {**vars(args), "data": str(args.data), "zipf_s": ZIPF_S, "seed": TRACE_SEED},
        "device": args.device if not args.device.startswith("cuda") else torch.cuda.get_device_name(),
        "gates": GATES,
        "scales": [],
    }
    try:
        stack.start_api(f"ready-{uuid.uuid4().hex[:8]}")
        for scale in (float(s) for s in args.scales.split(",")):
            doc["scales"].append(run_scale(stack, scale, args.runs, args.requests, args.device, args.data, work))
    finally:
        stack.close()
        shutil.rmtree(work, ignore_errors=True)
    doc["machine"] = machine_info()
    doc["gate_rows"] = gates(doc)
    finish(args.out, doc, report, t_start)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
