"""A pull to a file, written around the page cache or through it, and a load of that file right after.

    python -m benchmarks.pull_then_load [--scale 1.0] [--runs 5] [--data DIR]

A node pull writes its file through the page cache; with MFSREG_PULL_DIRECT=1 it writes around it
(O_DIRECT, see registry/client/direct.py): the pull is faster and the node keeps one copy of the
bytes in memory, but whoever reads the file next reads it from disk. This measures both halves for
both ways, so the trade is in figures.

Method: one stack as in bench_api.py (moto's S3 server, a scratch Postgres database and `mfsreg
serve`, on loopback) receives base and lora-chat (parent base) through the API, and lora-chat is
also uploaded as one plain object. Each run first times the anchor, one boto3 get_object of that
object streamed to a file (as bench_node's), then, for each way in turn (the order swapped every
run): a fresh node cache is warmed, untimed, with the base tier (registry.client.warm), then
RemoteRegistry.pull of lora-chat into a file is timed, then safetensors.torch.load_file of the
pulled file (default backend, mmap) and a first touch of every page ("ready", as bench_node
times it); the pull's CPU-seconds in this process (the node's side) are recorded too. Medians of
--runs (each column its own median, the totals' too), and the median of each run's pull time over
that run's get_object. Writes results/pull_then_load.json.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path

from safetensors.torch import load_file

from benchmarks import anchors
from benchmarks.bench_api import Stack
from benchmarks.bench_node import DUP, Bench, _touch
from benchmarks.common import FAMILY, MB, cpu_seconds, finish, machine_info, median, table
from benchmarks.family import DEFAULT_DIR, MEMBERS, generate

WAYS = {"around the page cache (MFSREG_PULL_DIRECT=1)": "1", "through the page cache (the default)": "0"}


def one(bench: Bench, setting: str) -> dict:
    from mfsreg.registry.client.cache import NodeCache
    from mfsreg.registry.client.warm import warm_cache

    os.environ["MFSREG_PULL_DIRECT"] = setting  # read by each pull
    cache_dir = bench.fresh_dir("cache")
    cache = NodeCache(cache_dir)
    out = bench.work / "pulled.safetensors"
    try:
        warm_cache(bench.remote(), FAMILY, "base", cache=cache)  # closes the remote it is given
        with bench.remote() as r:
            c0, t0 = cpu_seconds(), time.perf_counter()
            res = r.pull(FAMILY, DUP, out, cache=cache)
            t1, c1 = time.perf_counter(), cpu_seconds()
        tensors = load_file(str(out))
        _touch(tensors)
        t2 = time.perf_counter()
        del tensors
        return {
            "pull_s": t1 - t0,
            "pull_cpu_s": c1 - c0,
            "load_ready_s": t2 - t1,
            "total_s": t2 - t0,
            "fetched_bytes": res.fetched_bytes,
            "logical_bytes": res.logical_bytes,
        }
    finally:
        out.unlink(missing_ok=True)
        cache.close()
        shutil.rmtree(cache_dir, ignore_errors=True)


def get_object_s(stack: Stack, bucket: str, work: Path) -> float:
    """The anchor: one whole-object GET of the member streamed to a new file (moto's fast path)."""
    dest = work / "plain.safetensors"
    try:
        t0 = time.perf_counter()
        body = stack.s3.get_object(Bucket=bucket, Key=DUP)["Body"]
        with open(dest, "wb") as f:
            shutil.copyfileobj(body, f, 8 << 20)
        return time.perf_counter() - t0
    finally:
        dest.unlink(missing_ok=True)


def report(doc: dict) -> str:
    p, s = doc["params"], doc["summary"]
    rows = [
        [
            way,
            f"{v['pull_s']:.3f}",
            f"{v['pull_over_get_object']:.2f}x",
            f"{v['pull_cpu_s']:.3f}",
            f"{v['load_ready_s']:.3f}",
            f"{v['total_s']:.3f}",
        ]
        for way, v in s.items()
    ]
    return "\n".join(
        [
            f"## Pull of {DUP} with the base cached, then load_file of the pulled file (scale {p['scale']:g}, "
            f"{s[next(iter(s))]['logical_bytes'] / MB:,.1f} MB, median of {p['runs']} runs, {doc['machine']['cpu_count']} CPUs)",
            "",
            table(
                [
                    "the pull's file written",
                    "pull s",
                    "pull / get_object (per run)",
                    "pull CPU s (this process)",
                    "load_file + first touch s",
                    "together s (median of the totals)",
                ],
                rows,
            ),
            "",
            f"Anchor: one get_object of the same file streamed to a file, {doc['summary_anchor']['get_object_s']:.3f} s "
            "(median). The pull's CPU is this process's (user + system, all threads); the server's is not counted.",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--out", default="pull_then_load.json", help="file name under benchmarks/results/")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    family = generate(args.data, args.scale, verbose=True)
    paths = {m: family[m] for m in ("base", DUP)}
    anchors.prewarm(paths.values())
    work = Path(tempfile.mkdtemp(prefix="mfsreg-bench-ptl-", dir=args.data))
    stack = Stack(work)
    raw: dict[str, list[dict]] = {way: [] for way in WAYS}
    anchor: list[float] = []
    before = os.environ.get("MFSREG_PULL_DIRECT")
    try:
        url = stack.start_api(f"reg-{uuid.uuid4().hex[:8]}")
        bench = Bench(stack, url, paths, work, "cpu")
        with bench.remote() as client:
            for m in ("base", DUP):
                client.push(paths[m], FAMILY, m, parent=MEMBERS[m])
        bucket = f"plain-{uuid.uuid4().hex[:8]}"
        stack.s3.create_bucket(Bucket=bucket)
        stack.s3.upload_file(str(paths[DUP]), bucket, DUP)
        for i in range(args.runs):
            anchor.append(get_object_s(stack, bucket, work))
            ways = list(WAYS) if i % 2 == 0 else list(WAYS)[::-1]  # alternating, so that both see the same hour
            for way in ways:
                raw[way].append({**one(bench, WAYS[way]), "get_object_s": anchor[-1]})
                r = raw[way][-1]
                print(
                    f"run {i + 1}: {way}: pull {r['pull_s']:.3f} s, load {r['load_ready_s']:.3f} s "
                    f"(get_object {anchor[-1]:.3f} s)",
                    flush=True,
                )
    finally:
        if before is None:
            os.environ.pop("MFSREG_PULL_DIRECT", None)
        else:
            os.environ["MFSREG_PULL_DIRECT"] = before
        stack.close()
        shutil.rmtree(work, ignore_errors=True)
    summary = {
        way: {
            **{k: median([r[k] for r in rows]) for k in ("pull_s", "pull_cpu_s", "load_ready_s", "total_s")},
            "pull_over_get_object": median([r["pull_s"] / r["get_object_s"] for r in rows]),
            "logical_bytes": rows[0]["logical_bytes"],
            "fetched_bytes": rows[0]["fetched_bytes"],
        }
        for way, rows in raw.items()
    }
    doc = {
        "machine": machine_info(),
        "params": {"scale": args.scale, "runs": args.runs, "member": DUP},
        "summary": summary,
        "summary_anchor": {"get_object_s": median(anchor), "all": anchor},
        "runs": raw,
    }
    finish(args.out, doc, report, t_start)


if __name__ == "__main__":
    main()
