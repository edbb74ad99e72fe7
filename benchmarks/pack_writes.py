"""Writing packs to a local blob store: around the page cache (O_DIRECT, the default) or through it.

    python -m benchmarks.pack_writes [--rounds N] [--packs K] [--out pack_writes.json]

Method. K packs of 64 MiB (the default pack size) are cut from the bench family's base file, read
into memory first. Each round puts all K into a fresh LocalBlobStore once each way, the two ways
taking turns at going first, after an ``os.sync()`` so that neither waits on the other's
writeback; it times the puts (wall seconds, and user + system CPU-seconds of this process, all
threads) and then the first read of every pack back (``get``, as a pull reads a pack: from the
disk after a direct put, from the page cache after one through it). The anchor is the way through
the page cache: a plain ``write`` of the whole blob, fsync, rename, the recipe the store used
before. Medians over the rounds; the per-round ratios are kept in the JSON.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks.common import cpu_seconds, finish, machine_info, median, spread, table
from benchmarks.family import DEFAULT_DIR, generate
from registry.blobs.local import LocalBlobStore
from registry.config import DEFAULT_PACK_SIZE

WAYS = {"direct": True, "page cache": False}


def one_way(packs: list[bytes], work: Path, direct: bool) -> dict:
    root = Path(tempfile.mkdtemp(prefix="mfsreg-packs-", dir=work))
    try:
        store = LocalBlobStore(root, direct=direct)
        os.sync()
        c0, t0 = cpu_seconds(), time.perf_counter()
        for i, data in enumerate(packs):
            store.put(f"packs/{i:02x}/{i:064x}", data)
        put_s, put_cpu = time.perf_counter() - t0, cpu_seconds() - c0
        c0, t0 = cpu_seconds(), time.perf_counter()
        for i, data in enumerate(packs):
            if len(store.get(f"packs/{i:02x}/{i:064x}")) != len(data):
                raise SystemExit("a pack read back short")
        read_s, read_cpu = time.perf_counter() - t0, cpu_seconds() - c0
        return {"put_seconds": put_s, "put_cpu_seconds": put_cpu, "read_seconds": read_s, "read_cpu_seconds": read_cpu}
    finally:
        shutil.rmtree(root, ignore_errors=True)


def report(doc: dict) -> str:
    s = doc["summary"]
    gb = doc["params"]["bytes"] / 1e9
    rows = []
    for way in WAYS:
        x = s[way]
        rows.append([way, f"{x['put_seconds']:.2f}", f"{x['put_cpu_seconds']:.2f}", spread(x["put_cpu_all"]),
                     f"{gb / x['put_cpu_seconds']:.1f}" if x["put_cpu_seconds"] else "-",
                     f"{x['read_seconds']:.2f}", f"{x['read_cpu_seconds']:.2f}"])
    r = s["ratios"]
    return "\n".join([
        f"### Pack writes, {doc['params']['packs']} packs of {doc['params']['pack_size'] >> 20} MiB ({gb:.2f} GB), "
        f"median of {doc['params']['rounds']} rounds", "",
        table(["way", "put s", "put CPU-s", "range", "GB per CPU-s", "first read s", "read CPU-s"], rows), "",
        f"direct / page cache: put time {r['put_seconds']:.2f}x, put CPU {r['put_cpu_seconds']:.3f}x, "
        f"first read {r['read_seconds']:.2f}x (medians of the per-round ratios)",
    ])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--packs", type=int, default=12)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--out", default="pack_writes.json", help="file name under benchmarks/results/")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    source = generate(args.data, 1.0)["base"]
    size = DEFAULT_PACK_SIZE
    with open(source, "rb") as f:
        packs = [f.read(size) for _ in range(args.packs)]
    packs = [p for p in packs if len(p) == size]
    rounds = []
    for i in range(args.rounds):
        order = list(WAYS) if i % 2 == 0 else list(WAYS)[::-1]
        rounds.append({way: one_way(packs, args.data, WAYS[way]) for way in order})
        print(f"round {i + 1}/{args.rounds}: " + ", ".join(
            f"{w} put {rounds[-1][w]['put_seconds']:.2f} s / {rounds[-1][w]['put_cpu_seconds']:.2f} CPU-s" for w in WAYS), flush=True)
    keys = ["put_seconds", "put_cpu_seconds", "read_seconds", "read_cpu_seconds"]
    summary: dict = {way: {k: median([r[way][k] for r in rounds]) for k in keys} for way in WAYS}
    for way in WAYS:
        summary[way]["put_cpu_all"] = [r[way]["put_cpu_seconds"] for r in rounds]
    ratios = {k: [r["direct"][k] / r["page cache"][k] for r in rounds] for k in keys if k != "read_cpu_seconds"}
    summary["ratios"] = {k: median(v) for k, v in ratios.items()}
    summary["ratios_all"] = ratios
    doc = {"machine": machine_info(),
           "params": {"rounds": args.rounds, "packs": len(packs), "pack_size": size, "bytes": size * len(packs),
                      "source": str(source)},
           "summary": summary, "rounds": rounds}
    finish(args.out, doc, report, t_start)


if __name__ == "__main__":
    main()
