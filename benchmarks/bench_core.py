"""Core figures: push and pull throughput, and stored bytes beside simpler schemes, on one family.

    python -m benchmarks.bench_core [--scale S] [--runs N] [--data DIR] [--chunk-size BYTES]

Method. The synthetic family of benchmarks/family.py is generated (or found cached) under DIR, and
every file is read once before anything is timed, so that all timings run from the page cache (the
registry still writes and fsyncs its packs and database). Each run uses a fresh embedded registry
(SQLite + local packs, in a temp dir on the same disk as the family) and pushes, in order:

    base             into the empty registry               (new member)
    lora-chat        q/v LoRA over base                    (mostly duplicate)
    lastlayers-code  last 4 of 10 layers retrained         (partly new)
    full-medical     dense small updates on every tensor   (new member: no chunk is shared)
    vocab-ext        256 token rows appended               (mostly duplicate, shifted offsets)
    lora-chat-v2     o_proj LoRA over lora-chat            (mostly duplicate)
    base-copy        the base file again, a new name       (identical)

then pulls lora-chat-v2 and base to a file each (verified against the source's sha256 on the first
run). Figures are medians over the runs; GB/s is logical (file) bytes per wall second of the call.
Stored bytes come from ``Registry.stats`` after the six members (before base-copy) and sit beside
the anchors of benchmarks/anchors.py computed over the same six files.

Writes benchmarks/results/core.json and prints markdown tables.
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
    spread,
    table,
    timed_push,
    write_json,
)
from benchmarks.family import DEFAULT_DIR, MEMBERS, Shape, generate

KINDS = {
    "base": "new (empty registry)",
    "lora-chat": "mostly duplicate",
    "lastlayers-code": "partly new",
    "full-medical": "new (dense fine-tune)",
    "vocab-ext": "mostly duplicate (shifted)",
    "lora-chat-v2": "mostly duplicate (ft of ft)",
    "base-copy": "identical re-push",
}
PULLS = ("lora-chat-v2", "base")


def one_run(paths: dict[str, Path], data: Path, chunk_size: int | None, verify: bool) -> dict:
    with fresh_registry(data, chunk_size) as (reg, home):
        pushes = push_family(reg, paths)
        stats = reg.stats(FAMILY)
        pushes.append(timed_push(reg, paths["base"], "base-copy", None))
        pulls = []
        for v in PULLS:
            out = home / "pulled" / f"{v}.safetensors"
            out.parent.mkdir(exist_ok=True)
            t0 = time.perf_counter()
            r = reg.pull(FAMILY, v, out)
            wall = time.perf_counter() - t0
            ok = None
            if verify:
                ok = anchors.file_sha256(out) == anchors.file_sha256(paths[v])
                if not ok:
                    raise SystemExit(f"pulled {v} differs from its source file")
            pulls.append(
                {
                    "version": v,
                    "logical_bytes": r.logical_bytes,
                    "seconds": wall,
                    "gbps": r.logical_bytes / wall / GB,
                    "verified": ok,
                }
            )
            out.unlink()
        disk = dir_bytes(home)
    return {"pushes": pushes, "pulls": pulls, "stats": stats, "registry_disk_bytes": disk}


def summarise(runs: list[dict]) -> dict:
    pushes = {}
    for p in runs[0]["pushes"]:
        v = p["version"]
        rows = [next(x for x in r["pushes"] if x["version"] == v) for r in runs]
        pushes[v] = {
            "kind": KINDS[v],
            "logical_bytes": p["logical_bytes"],
            "new_bytes": p["new_bytes"],
            "new_chunks": p["new_chunks"],
            "chunks": p["chunks"],
            "seconds_median": median([x["seconds"] for x in rows]),
            "gbps_median": median([x["gbps"] for x in rows]),
            "gbps_all": [x["gbps"] for x in rows],
        }
    pulls = {}
    for p in runs[0]["pulls"]:
        v = p["version"]
        rows = [next(x for x in r["pulls"] if x["version"] == v) for r in runs]
        pulls[v] = {
            "logical_bytes": p["logical_bytes"],
            "seconds_median": median([x["seconds"] for x in rows]),
            "gbps_median": median([x["gbps"] for x in rows]),
            "gbps_all": [x["gbps"] for x in rows],
        }
    return {"pushes": pushes, "pulls": pulls}


def report(doc: dict) -> str:
    s, anc, st = doc["summary"], doc["anchors"], doc["mfsreg_stats"]
    out = [
        f"## mfsreg core benchmark (scale {doc['params']['scale']:g}, base {doc['family']['base_bytes'] / GB:.2f} GB, "
        f"chunk {doc['params']['chunk_size'] >> 10} KiB, median of {doc['params']['runs']} runs, "
        f"{doc['machine']['cpu_count']} CPUs, files pre-read into the page cache)",
        "",
    ]
    rows = []
    for v, p in s["pushes"].items():
        rows.append(
            [
                v,
                p["kind"],
                f"{p['logical_bytes'] / GB:.3f}",
                f"{p['new_bytes'] / MB:.1f}",
                f"{p['chunks'] - p['new_chunks']}/{p['chunks']}",
                f"{p['seconds_median']:.2f}",
                f"{p['gbps_median']:.2f}",
                spread(p["gbps_all"]),
            ]
        )
    out += [
        "### Push",
        "",
        table(["version", "kind", "logical GB", "new stored MB", "reused/chunks", "s", "GB/s", "GB/s range"], rows),
        "",
    ]
    rows = [
        [
            v,
            f"{p['logical_bytes'] / GB:.3f}",
            f"{p['seconds_median']:.2f}",
            f"{p['gbps_median']:.2f}",
            spread(p["gbps_all"]),
        ]
        for v, p in s["pulls"].items()
    ]
    out += ["### Pull (to a file, verified)", "", table(["version", "logical GB", "s", "GB/s", "GB/s range"], rows), ""]

    logical = anc["plain_copy_bytes"]
    mf = st["stored_bytes"]
    cdc = anc["cdc"]
    schemes = [
        ("plain copy", logical),
        ("whole-file dedup (sha256)", anc["whole_file_dedup"]["bytes"]),
        (f"CDC {cdc['avg_size'] >> 10} KiB dedup, raw", cdc["bytes"]),
        (f"CDC {cdc['avg_size'] >> 10} KiB dedup + zstd-1", cdc.get("zstd_bytes")),
        ("mfsreg distinct chunks, raw (dedup only)", st["raw_distinct_bytes"]),
        ("mfsreg stored (dedup + encoding)", mf),
    ]
    rows = [[name, f"{b / GB:.3f}", f"{logical / b:.2f}x", f"{mf / b:.3f}"] for name, b in schemes if b]
    out += [
        f"### Stored bytes, whole family ({len(MEMBERS)} files, {logical / GB:.2f} GB logical)",
        "",
        table(["scheme", "stored GB", "logical/stored", "mfsreg / scheme"], rows),
        "",
    ]
    tiers = ", ".join(f"{t} {v['bytes'] / GB:.3f} GB ({v['chunks']} chunks)" for t, v in st["tiers"].items())
    out += [
        f"Tiers: {tiers}. Registry on disk after all pushes (packs + SQLite): "
        f"{doc['registry_disk_bytes'] / GB:.3f} GB.",
        "",
    ]

    sp = anc["speed"]
    push = s["pushes"]
    rows = [
        ["shutil.copyfile, same disk (page cache)", sp["copy_gbps"]],
        ["shutil.copyfile + fsync", sp["copy_fsync_gbps"]],
        ["FastCDC 64 KiB cut, 1 thread", sp["cdc_cut_gbps"]],
        ["FastCDC 64 KiB cut + xxh3-128, 1 thread", cdc["cut_hash_gbps"]],
        ["xxh3-128, 1 thread", sp["xxh3_128_gbps"]],
        ["sha256, 1 thread", sp["sha256_gbps"]],
    ]
    out += [
        "### Speed anchors (GB/s, base file)",
        "",
        table(["anchor", "GB/s"], [[a, f"{b:.2f}"] for a, b in rows]),
        "",
    ]
    ratios = [
        ["push base (new) / copy+fsync", push["base"]["gbps_median"] / sp["copy_fsync_gbps"]],
        ["push full-medical (new) / copy+fsync", push["full-medical"]["gbps_median"] / sp["copy_fsync_gbps"]],
        ["push lora-chat (mostly dup) / copy+fsync", push["lora-chat"]["gbps_median"] / sp["copy_fsync_gbps"]],
        ["push lora-chat (mostly dup) / CDC cut+hash", push["lora-chat"]["gbps_median"] / cdc["cut_hash_gbps"]],
        ["push base-copy (identical) / CDC cut+hash", push["base-copy"]["gbps_median"] / cdc["cut_hash_gbps"]],
        ["pull lora-chat-v2 / copy+fsync", s["pulls"]["lora-chat-v2"]["gbps_median"] / sp["copy_fsync_gbps"]],
    ]
    out += ["Ratios:", "", table(["ratio", "x"], [[a, f"{b:.2f}"] for a, b in ratios]), ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="push/pull throughput and stored bytes vs anchors")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR, help="where the family is cached and registries are made")
    ap.add_argument("--chunk-size", type=int, default=None, help="bytes; default: the registry's DEFAULT_CHUNK_SIZE")
    ap.add_argument("--no-cdc-zstd", action="store_true", help="skip the CDC + zstd anchor (saves a pass)")
    ap.add_argument("--out", default="core.json", help="file name under benchmarks/results/")
    args = ap.parse_args(argv)

    from mfsreg.registry.config import DEFAULT_CHUNK_SIZE

    chunk_size = args.chunk_size or DEFAULT_CHUNK_SIZE
    print(f"generating / finding the family at scale {args.scale:g} under {args.data} ...", flush=True)
    paths = generate(args.data, args.scale, verbose=True)
    files = list(paths.values())
    warm = anchors.prewarm(files)
    print(f"pre-read {len(files)} files into the page cache in {warm:.1f} s", flush=True)

    print("anchors: sha256 per file, FastCDC over the family, copy and hash speed ...", flush=True)
    storage = anchors.storage_anchors(files, compress=not args.no_cdc_zstd)
    speed = {
        **anchors.copy_gbps(paths["base"], args.data, runs=args.runs),
        "cdc_cut_gbps": anchors.cdc_cut_gbps(paths["base"], runs=args.runs),
        **anchors.hash_gbps(paths["base"]),
    }
    storage["speed"] = speed

    runs = []
    for i in range(args.runs):
        anchors.prewarm(files)  # the previous run's packs may have pushed some of the family out
        t0 = time.perf_counter()
        runs.append(one_run(paths, args.data, chunk_size, verify=(i == 0)))
        print(f"run {i + 1}/{args.runs} done in {time.perf_counter() - t0:.1f} s", flush=True)
    stored = [r["stats"]["stored_bytes"] for r in runs]
    if len(set(stored)) != 1:
        print(f"warning: stored bytes differ between runs: {stored}")
    stats = runs[0]["stats"]
    stats["raw_distinct_bytes"] = sum(e["raw_bytes"] for e in stats["encodings"].values())

    doc = {
        "machine": machine_info(),
        "params": {
            "scale": args.scale,
            "runs": args.runs,
            "chunk_size": chunk_size,
            "page_cache": "pre-warmed",
            "data_dir": str(args.data),
        },
        "family": {
            "shape": Shape.for_scale(args.scale).__dict__,
            "base_bytes": paths["base"].stat().st_size,
            "files": {m: p.stat().st_size for m, p in paths.items()},
        },
        "anchors": storage,
        "mfsreg_stats": stats,
        "mfsreg_vs_cdc": stats["stored_bytes"] / storage["cdc"]["bytes"],
        "mfsreg_vs_cdc_zstd": stats["stored_bytes"] / storage["cdc"]["zstd_bytes"]
        if storage["cdc"].get("zstd_bytes")
        else None,
        "registry_disk_bytes": runs[0]["registry_disk_bytes"],
        "summary": summarise(runs),
        "runs": [{k: v for k, v in r.items() if k != "stats"} for r in runs],
    }
    path = write_json(args.out, doc)
    print()
    print(report(doc))
    print(f"results: {path}")


if __name__ == "__main__":
    main()
