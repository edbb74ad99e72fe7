"""Which chunk size: stored bytes, metadata and push/pull time of the family per chunk size.

    python -m benchmarks.bench_chunk_size [--scale S] [--runs N] [--data DIR] [--sizes 256K,1M,4M,16M]

For each chunk size a fresh embedded registry gets the whole family of benchmarks/family.py pushed in
order (base first), then lora-chat-v2 pulled to a file. Files are read once beforehand so every
timing runs from the page cache. Reported per size: stored bytes (and their raw, dedup-only
size), chunk rows, the registry's size on disk (packs + SQLite), the push time of the base (new) and
of two mostly-duplicate members pushed after it (lora-chat, vocab-ext), the total push time of the
family and the pull time. Times are medians over ``--runs`` fresh registries.

Keep in mind that the chunk size only matters relative to tensor sizes: at scale 0.25 the largest
layer tensors are 5.8 MB (mlp) and 2 MB (q/o), at scale 1 they are 23 MB and 8 MB, in a 7B model
90 MB and 32 MB. A chunk never spans two tensors, so sizes above the largest tensor all behave alike.

Writes benchmarks/results/chunk_size.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from benchmarks import anchors
from benchmarks.common import (
    FAMILY,
    GB,
    MB,
    dir_bytes,
    fresh_registry,
    machine_info,
    median,
    push_family,
    table,
    write_json,
)
from benchmarks.family import DEFAULT_DIR, Shape, generate
from mfsreg.registry.config import DEFAULT_CHUNK_SIZE, parse_size

DEFAULT_SIZES = "256K,1M,4M,16M"
DUP = ("lora-chat", "vocab-ext")


def one_run(paths: dict[str, Path], data: Path, chunk_size: int) -> dict:
    with fresh_registry(data, chunk_size) as (reg, home):
        t0 = time.perf_counter()
        pushes = push_family(reg, paths)
        push_total = time.perf_counter() - t0
        stats = reg.stats(FAMILY)
        out = home / "pulled.safetensors"
        t0 = time.perf_counter()
        reg.pull(FAMILY, "lora-chat-v2", out)
        pull = time.perf_counter() - t0
        out.unlink()
        disk = dir_bytes(home)
        db = sum(p.stat().st_size for p in home.glob("registry.db*"))
    return {
        "pushes": {p["version"]: p for p in pushes},
        "push_total_seconds": push_total,
        "pull_seconds": pull,
        "stored_bytes": stats["stored_bytes"],
        "raw_distinct_bytes": sum(e["raw_bytes"] for e in stats["encodings"].values()),
        "distinct_chunks": sum(t["chunks"] for t in stats["tiers"].values()),
        "registry_disk_bytes": disk,
        "db_bytes": db,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="stored bytes and push time per chunk size")
    ap.add_argument("--scale", type=float, default=0.25)
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--sizes", default=DEFAULT_SIZES, help="comma-separated sizes, e.g. 256K,1M,4M,16M")
    ap.add_argument("--out", default="chunk_size.json", help="file name under benchmarks/results/")
    args = ap.parse_args(argv)
    sizes = [parse_size(s) for s in args.sizes.split(",")]

    paths = generate(args.data, args.scale, verbose=True)
    files = list(paths.values())
    logical = sum(p.stat().st_size for p in files)
    print(f"pre-read {len(files)} files ({logical / GB:.2f} GB) in {anchors.prewarm(files):.1f} s", flush=True)

    results = []
    for size in sizes:
        runs = []
        for _ in range(args.runs):
            anchors.prewarm(files)
            runs.append(one_run(paths, args.data, size))
        r0 = runs[0]
        row = {
            "chunk_size": size,
            "stored_bytes": r0["stored_bytes"],
            "raw_distinct_bytes": r0["raw_distinct_bytes"],
            "distinct_chunks": r0["distinct_chunks"],
            "registry_disk_bytes": r0["registry_disk_bytes"],
            "db_bytes": r0["db_bytes"],
            "push_total_seconds": median([r["push_total_seconds"] for r in runs]),
            "pull_seconds": median([r["pull_seconds"] for r in runs]),
            "push_seconds": {v: median([r["pushes"][v]["seconds"] for r in runs]) for v in r0["pushes"]},
            "new_bytes": {v: p["new_bytes"] for v, p in r0["pushes"].items()},
            "runs": runs,
        }
        results.append(row)
        print(
            f"chunk {size >> 10} KiB: stored {row['stored_bytes'] / GB:.3f} GB, pushes {row['push_total_seconds']:.1f} s",
            flush=True,
        )

    base_bytes = paths["base"].stat().st_size
    doc = {
        "machine": machine_info(),
        "params": {
            "scale": args.scale,
            "runs": args.runs,
            "sizes": sizes,
            "current_default": DEFAULT_CHUNK_SIZE,
            "page_cache": "pre-warmed",
        },
        "family": {"shape": Shape.for_scale(args.scale).__dict__, "logical_bytes": logical, "base_bytes": base_bytes},
        "results": results,
    }
    path = write_json(args.out, doc)

    rows = []
    for r in results:
        ps = r["push_seconds"]
        rows.append(
            [
                f"{r['chunk_size'] >> 10} KiB",
                f"{r['stored_bytes'] / GB:.4f}",
                f"{r['raw_distinct_bytes'] / GB:.4f}",
                r["distinct_chunks"],
                f"{r['db_bytes'] / MB:.2f}",
                f"{ps['base']:.2f} ({base_bytes / ps['base'] / GB:.2f})",
                *(f"{ps[v]:.2f} ({paths[v].stat().st_size / ps[v] / GB:.2f})" for v in DUP),
                f"{r['new_bytes']['vocab-ext'] / MB:.2f}",
                f"{r['push_total_seconds']:.1f}",
                f"{r['pull_seconds']:.2f}",
            ]
        )
    print()
    print(
        f"## Chunk size (scale {args.scale:g}: {logical / GB:.2f} GB logical in {len(files)} files, base "
        f"{base_bytes / GB:.3f} GB; median of {args.runs} run(s); page cache pre-warmed)"
    )
    print()
    print(
        table(
            [
                "chunk",
                "stored GB",
                "raw distinct GB",
                "chunks",
                "SQLite MB",
                "push base s (GB/s)",
                "push lora-chat s (GB/s)",
                "push vocab-ext s (GB/s)",
                "vocab-ext new MB",
                "all pushes s",
                "pull lora-chat-v2 s",
            ],
            rows,
        )
    )
    print(f"results: {path}")


if __name__ == "__main__":
    main()
