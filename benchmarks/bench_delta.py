"""Delta encoding: stored bytes with and without it beside simpler schemes, and its ingest and decode speed.

    python -m benchmarks.bench_delta [--scale S] [--runs N] [--data DIR] [--no-zipnn]

Method. The synthetic family of benchmarks/family.py is generated (or found cached) under DIR and
read once into the page cache. Then, in one process:

- storage: the six members are pushed in MEMBERS order (each with its parent as ``parent``) into a
  fresh embedded registry with delta on (the default), and once more into one with delta off
  (``Settings(delta=False)``: exact dedup + plain encodings). ``Registry.stats`` gives stored bytes,
  bytes per encoding and per version (bytes stored as deltas and as plain chunks). Gate: stored
  bytes with delta / without <= 0.6.
- anchors on the same six files: plain copy, whole-file dedup (sha256), FastCDC 64 KiB dedup (raw
  and + zstd-1 per distinct chunk), zstd level 3 per whole file (zstandard, threads=-1: zstd's
  multithreaded mode on every core), and ZipNN per whole file (bf16 byte grouping, its file
  script's streaming settings; round trip checked) where the package imports. Gate: mfsreg with
  delta stores less than every anchor.
- ingest speed (delta on), from the family push of each run: the base (empty registry: every
  chunk new, stored plain) and full-medical (dense fine-tune: every chunk new, stored as deltas
  against the base). Logical bytes per wall second, that divided by os.cpu_count() (the encoder
  uses every core), and logical bytes per CPU-second of the process (resource.getrusage around
  the push: user + system time of all its threads), the true per-core figure. Gate: >= 300 MB/s
  per core (CPU-time figure) for both. Anchor, in each run after the pushes: the CPU-seconds of
  a 64 KiB CDC + zstd-1 store's ingest of the same file on one thread (anchors.cdc_ingest_cpu:
  cut, xxh3, zstd-1, sha256); the push's CPU-seconds over the anchor's is shown beside, a ratio
  that this VM's swings in speed (up to 1.5x between hours) move much less than the MB/s.
- decode speed, one thread: the stored chunks of full-medical that are deltas, and the plain
  chunks of the base, their payloads read once from the packs (Registry.locate + read_payloads)
  and the bases of the deltas decoded beforehand, outside the timing; then every chunk is decoded
  with registry.format.rebuild.decode_verified (decode + xxh3-128 check against the id, as a pull does)
  on the calling thread, after one untimed warm-up pass. MB/s of raw output = per core. Also
  shown: codec.decode alone (no check).
  Gate: >= 500 MB/s per core for both sets.

Timings are medians over --runs (a fresh registry per run); stored bytes are deterministic and come
from the first run. Writes benchmarks/results/delta.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from benchmarks import anchors
from benchmarks.common import FAMILY, MB, cpu_seconds, finish, fresh_registry, machine_info, median, spread, table
from benchmarks.family import DEFAULT_DIR, MEMBERS, Shape, generate

STORAGE_GATE = 0.6  # stored bytes with delta / without
INGEST_GATE_MBPS = 300.0  # logical MB per CPU-second
DECODE_GATE_MBPS = 500.0  # raw MB per second on one thread
SPEED_PUSHES = {"base": "all new, stored plain", "full-medical": "all new, stored as deltas"}
DELTA_MEMBER, PLAIN_MEMBER = "full-medical", "base"


def push_cpu(reg, path: Path, version: str, parent: str | None) -> dict:
    """Push one member; wall seconds and CPU seconds of the whole process (all threads) around it."""
    c0, t0 = cpu_seconds(), time.perf_counter()
    r = reg.push(path, FAMILY, version, parent=parent)
    wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    return {
        "version": version,
        "parent": parent,
        "logical_bytes": r.logical_bytes,
        "new_bytes": r.new_bytes,
        "new_chunks": r.new_chunks,
        "chunks": r.chunks,
        "seconds": wall,
        "cpu_seconds": cpu,
    }


def push_all(reg, paths: dict[str, Path]) -> dict[str, dict]:
    return {m: push_cpu(reg, paths[m], m, MEMBERS[m]) for m in MEMBERS}


def storage_figures(stats: dict) -> dict:
    return {
        "logical_bytes": stats["logical_bytes"],
        "stored_bytes": stats["stored_bytes"],
        "sharing_ratio": stats["sharing_ratio"],
        "tiers": stats["tiers"],
        "encodings": stats["encodings"],
        "versions": {
            v["version"]: {
                k: v[k] for k in ("logical_bytes", "stored_bytes", "unique_bytes", "delta_bytes", "plain_bytes")
            }
            for v in stats["versions"]
        },
    }


# -- decode ---------------------------------------------------------------------------------------


def decode_sets(reg) -> dict[str, dict]:
    """The two chunk sets to decode, with payloads in memory and delta bases decoded (untimed)."""
    from mfsreg.registry.format import rebuild

    out = {}
    for label, member, want_delta in (
        ("deltas of " + DELTA_MEMBER, DELTA_MEMBER, True),
        ("plain chunks of " + PLAIN_MEMBER, PLAIN_MEMBER, False),
    ):
        _, manifest = reg.manifest(FAMILY, member)
        ids = list(dict.fromkeys(manifest.chunk_ids()))
        located = reg.locate(ids)  # also holds the bases of the deltas, and theirs
        chunks = [located[i] for i in ids if bool(located[i].basis_id) == want_delta]
        payloads = {c.id: bytes(p) for c, p in reg.read_payloads(chunks)}
        basis_ids = list(dict.fromkeys(c.basis_id for c in chunks if c.basis_id))
        bases = rebuild.decode_batch(basis_ids, located, reg.read_payloads, reg.pool) if basis_ids else {}
        encodings: dict[str, int] = {}
        for c in chunks:
            encodings[c.encoding] = encodings.get(c.encoding, 0) + 1
        out[label] = {
            "member": member,
            "chunks": chunks,
            "payloads": payloads,
            "bases": bases,
            "all_chunks": len(ids),
            "encodings": encodings,
        }
    return out


def time_decode(s: dict, verify: bool) -> dict:
    from mfsreg.registry.format import codec
    from mfsreg.registry.format.rebuild import decode_verified

    chunks, payloads, bases = s["chunks"], s["payloads"], s["bases"]
    if verify:

        def fn(c):
            return decode_verified(c, payloads[c.id], bases[c.basis_id] if c.basis_id else None)
    else:

        def fn(c):
            return codec.decode(c.encoding, payloads[c.id], c.size, bases[c.basis_id] if c.basis_id else None)

    c0, t0 = time.process_time(), time.perf_counter()
    for c in chunks:
        fn(c)
    wall, cpu = time.perf_counter() - t0, time.process_time() - c0
    raw = sum(c.size for c in chunks)
    return {"seconds": wall, "cpu_seconds": cpu, "raw_bytes": raw, "mbps": raw / wall / MB}


def measure_decode(reg) -> dict:
    out = {}
    for label, s in decode_sets(reg).items():
        if not s["chunks"]:
            out[label] = {"member": s["member"], "chunks": 0, "all_chunks": s["all_chunks"]}
            continue
        time_decode(s, verify=True)  # warm-up, untimed: first-touch page faults of the output buffers
        checked = time_decode(s, verify=True)
        bare = time_decode(s, verify=False)
        out[label] = {
            "member": s["member"],
            "chunks": len(s["chunks"]),
            "all_chunks": s["all_chunks"],
            "encodings": s["encodings"],
            "raw_bytes": checked["raw_bytes"],
            "payload_bytes": sum(len(p) for p in s["payloads"].values()),
            "seconds": checked["seconds"],
            "cpu_seconds": checked["cpu_seconds"],
            "mbps_per_core": checked["mbps"],
            "decode_only_seconds": bare["seconds"],
            "decode_only_mbps": bare["mbps"],
        }
        s.clear()  # free payloads and bases before the next set
    return out


# -- runs -----------------------------------------------------------------------------------------


def one_run(paths: dict[str, Path], data: Path) -> dict:
    with fresh_registry(data) as (reg, _home):
        pushes = push_all(reg, paths)
        stats = reg.stats(FAMILY)
        decode = measure_decode(reg)
    ingest_anchor = {v: anchors.cdc_ingest_cpu(paths[v]) for v in SPEED_PUSHES}
    return {"pushes": pushes, "stats": stats, "decode": decode, "ingest_anchor": ingest_anchor}


def summarise_speed(runs: list[dict], cores: int) -> dict:
    ingest = {}
    for v, kind in SPEED_PUSHES.items():
        rows = [r["pushes"][v] for r in runs]
        logical = rows[0]["logical_bytes"]
        wall = [x["seconds"] for x in rows]
        cpu = [x["cpu_seconds"] for x in rows]
        per_cpu = [logical / c / MB for c in cpu]
        over_anchor = [x["cpu_seconds"] / r["ingest_anchor"][v]["cpu_seconds"] for x, r in zip(rows, runs)]
        ingest[v] = {
            "kind": kind,
            "logical_bytes": logical,
            "new_bytes": rows[0]["new_bytes"],
            "new_chunks": rows[0]["new_chunks"],
            "chunks": rows[0]["chunks"],
            "seconds_median": median(wall),
            "cpu_seconds_median": median(cpu),
            "mbps_wall": logical / median(wall) / MB,
            "mbps_wall_per_core": logical / median(wall) / MB / cores,
            "mbps_per_cpu_second": median(per_cpu),
            "mbps_per_cpu_second_all": per_cpu,
            "cpu_utilisation": median(cpu) / median(wall),
            "anchor_cpu_seconds_median": median([r["ingest_anchor"][v]["cpu_seconds"] for r in runs]),
            "cpu_over_anchor": median(over_anchor),
            "cpu_over_anchor_all": over_anchor,
        }
    decode = {}
    for label, first in runs[0]["decode"].items():
        if not first.get("chunks"):
            decode[label] = first
            continue
        rows = [r["decode"][label] for r in runs]
        decode[label] = {
            **{k: first[k] for k in ("member", "chunks", "all_chunks", "encodings", "raw_bytes", "payload_bytes")},
            "seconds_median": median([x["seconds"] for x in rows]),
            "mbps_per_core": median([x["mbps_per_core"] for x in rows]),
            "mbps_per_core_all": [x["mbps_per_core"] for x in rows],
            "decode_only_mbps": median([x["decode_only_mbps"] for x in rows]),
        }
    return {"ingest": ingest, "decode": decode}


def schemes(doc: dict) -> list[tuple[str, int | None, str]]:
    """(scheme, stored bytes, note) for every anchor, in the order of the table."""
    anc = doc["anchors"]
    cdc = anc["cdc"]
    zs = anc["zstd_per_file"]
    zn = anc["zipnn_per_file"]
    zn_name = "ZipNN per file (bf16)"
    if zn.get("available"):
        trip = {True: "ok", False: "FAILED", None: "not checked"}[zn["verified"]]
        zn_row = (zn_name, zn["bytes"], f"v{zn['version']}, round trip {trip}")
    else:
        zn_row = (zn_name, None, "unavailable: " + zn.get("reason", "?"))
    return [
        ("plain copy", anc["plain_copy_bytes"], ""),
        (
            "whole-file dedup (sha256)",
            anc["whole_file_dedup"]["bytes"],
            f"{anc['whole_file_dedup']['distinct_files']} distinct files",
        ),
        (f"CDC {cdc['avg_size'] >> 10} KiB dedup, raw", cdc["bytes"], f"{cdc['distinct_chunks']:,} distinct chunks"),
        (f"CDC {cdc['avg_size'] >> 10} KiB dedup + zstd-1", cdc.get("zstd_bytes"), "zstd-1 per distinct chunk"),
        (f"zstd-{zs['level']} per file", zs["bytes"], f"zstandard, threads={zs['threads']}"),
        zn_row,
    ]


def gates(doc: dict) -> dict:
    d, e = doc["storage"]["delta"]["stored_bytes"], doc["storage"]["exact"]["stored_bytes"]
    out = {"delta_over_exact": {"value": d / e, "limit": STORAGE_GATE, "pass": d / e <= STORAGE_GATE}}
    below = {name: (b is None or d < b) for name, b, _ in schemes(doc)}
    out["below_every_anchor"] = {
        "value": below,
        "pass": all(below.values()),
        "skipped": [n for n, b, _ in schemes(doc) if b is None],
    }
    for v, s in doc["summary"]["ingest"].items():
        out[f"ingest_{v}_per_core"] = {
            "value": s["mbps_per_cpu_second"],
            "limit": INGEST_GATE_MBPS,
            "pass": s["mbps_per_cpu_second"] >= INGEST_GATE_MBPS,
        }
    for label, s in doc["summary"]["decode"].items():
        ok = bool(s.get("chunks")) and s["mbps_per_core"] >= DECODE_GATE_MBPS
        out[f"decode_{s['member']}_per_core"] = {
            "value": s.get("mbps_per_core"),
            "limit": DECODE_GATE_MBPS,
            "pass": ok,
            "set": label,
        }
    out["all_pass"] = all(g["pass"] for g in out.values() if isinstance(g, dict))
    return out


def _pf(ok: bool) -> str:
    return "pass" if ok else "FAIL"


def report(doc: dict) -> str:
    p, st, s, g = doc["params"], doc["storage"], doc["summary"], doc["gates"]
    d, e = st["delta"], st["exact"]
    logical = d["logical_bytes"]
    out = [
        f"## mfsreg delta benchmark (scale {p['scale']:g}, {len(MEMBERS)} members, {logical / MB:,.1f} MB logical, "
        f"median of {p['runs']} runs, {doc['machine']['cpu_count']} CPUs, load {doc['machine']['loadavg_1_5_15']})",
        "",
    ]

    rows = []
    for name, b, note in schemes(doc):
        if b is None:
            rows.append([name, "-", "-", "-", "skipped", note])
        else:
            rows.append(
                [
                    name,
                    f"{b / MB:,.1f}",
                    f"{logical / b:.2f}x",
                    f"{d['stored_bytes'] / b:.3f}",
                    _pf(d["stored_bytes"] < b),
                    note,
                ]
            )
    rows.append(
        [
            "mfsreg, delta off (exact dedup + zstd-p2)",
            f"{e['stored_bytes'] / MB:,.1f}",
            f"{logical / e['stored_bytes']:.2f}x",
            f"{d['stored_bytes'] / e['stored_bytes']:.3f}",
            _pf(g["delta_over_exact"]["pass"]) + f" (gate <= {STORAGE_GATE})",
            "",
        ]
    )
    rows.append(
        [
            "**mfsreg, delta on**",
            f"{d['stored_bytes'] / MB:,.1f}",
            f"{logical / d['stored_bytes']:.2f}x",
            "1.000",
            "",
            "",
        ]
    )
    out += [
        "### Stored bytes, whole family",
        "",
        table(["scheme", "stored MB", "logical/stored", "mfsreg delta / scheme", "mfsreg below", "note"], rows),
        "",
    ]

    rows = []
    for label, fig in (("delta on", d), ("delta off", e)):
        for enc, x in fig["encodings"].items():
            rows.append(
                [
                    label,
                    enc,
                    x["chunks"],
                    f"{x['raw_bytes'] / MB:,.1f}",
                    f"{x['bytes'] / MB:,.1f}",
                    f"{x['bytes'] / x['raw_bytes']:.3f}" if x["raw_bytes"] else "-",
                ]
            )
    out += [
        "### Bytes per encoding",
        "",
        table(["registry", "encoding", "chunks", "raw MB", "stored MB", "stored/raw"], rows),
        "",
    ]

    rows = []
    for v, x in d["versions"].items():
        ex = e["versions"].get(v, {})
        rows.append(
            [
                v,
                MEMBERS.get(v) or "-",
                f"{x['logical_bytes'] / MB:,.1f}",
                f"{x['stored_bytes'] / MB:,.1f}",
                f"{x['delta_bytes'] / MB:,.1f}",
                f"{x['plain_bytes'] / MB:,.1f}",
                f"{x['unique_bytes'] / MB:,.1f}",
                f"{ex.get('unique_bytes', 0) / MB:,.1f}",
            ]
        )
    out += [
        "### Per version (delta on; stored = what the version needs, split into delta and plain bytes; "
        "unique = what it alone holds)",
        "",
        table(
            [
                "version",
                "parent",
                "logical MB",
                "stored MB",
                "delta MB",
                "plain MB",
                "unique MB",
                "unique MB, delta off",
            ],
            rows,
        ),
        "",
    ]

    cores = doc["machine"]["cpu_count"]
    rows = []
    for v, x in s["ingest"].items():
        g1 = g[f"ingest_{v}_per_core"]
        rows.append(
            [
                v,
                x["kind"],
                f"{x['logical_bytes'] / MB:,.1f}",
                f"{x['seconds_median']:.2f}",
                f"{x['mbps_wall']:.0f}",
                f"{x['mbps_wall_per_core']:.0f}",
                f"{x['cpu_seconds_median']:.2f}",
                f"{x['cpu_utilisation']:.2f}",
                f"{x['mbps_per_cpu_second']:.0f}",
                spread(x["mbps_per_cpu_second_all"]),
                f"{x['anchor_cpu_seconds_median']:.2f}",
                f"{x['cpu_over_anchor']:.2f}",
                _pf(g1["pass"]),
            ]
        )
    out += [
        f"### Ingest (delta on; gate >= {INGEST_GATE_MBPS:.0f} MB/s per core, on logical bytes per CPU-second)",
        "",
        table(
            [
                "push",
                "kind",
                "logical MB",
                "wall s",
                "MB/s",
                f"MB/s / {cores} cores",
                "CPU s",
                "cores busy",
                "MB per CPU-s",
                "range",
                "CDC-store ingest CPU s",
                "CPU / CDC store",
                "gate",
            ],
            rows,
        ),
        "",
    ]

    rows = []
    for label, x in s["decode"].items():
        if not x.get("chunks"):
            rows.append(
                [label, f"0/{x.get('all_chunks', 0)}", "-", "-", "-", "-", "-", "-", "FAIL (nothing to decode)"]
            )
            continue
        gk = g[f"decode_{x['member']}_per_core"]
        encs = ", ".join(f"{k} {n}" for k, n in x["encodings"].items())
        rows.append(
            [
                label,
                f"{x['chunks']}/{x['all_chunks']}",
                encs,
                f"{x['raw_bytes'] / MB:,.1f}",
                f"{x['payload_bytes'] / MB:,.1f}",
                f"{x['seconds_median']:.3f}",
                f"{x['mbps_per_core']:.0f}",
                f"{x['decode_only_mbps']:.0f}",
                _pf(gk["pass"]),
            ]
        )
    out += [
        f"### Decode, one thread (decode + xxh3-128 check; gate >= {DECODE_GATE_MBPS:.0f} MB/s of raw output per core)",
        "",
        table(
            ["set", "chunks", "encodings", "raw MB", "payload MB", "s", "MB/s per core", "MB/s, decode only", "gate"],
            rows,
        ),
        "",
    ]

    out += [
        f"Gates: {'all pass' if g['all_pass'] else 'FAILED: ' + ', '.join(k for k, v in g.items() if isinstance(v, dict) and not v['pass'])}",
        "",
    ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="delta encoding: stored bytes vs anchors, ingest and decode speed")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR, help="where the family is cached and registries are made")
    ap.add_argument("--no-zipnn", action="store_true", help="skip the ZipNN anchor")
    ap.add_argument("--out", default="delta.json", help="file name under benchmarks/results/")
    args = ap.parse_args(argv)

    from mfsreg.registry.config import DEFAULT_CHUNK_SIZE

    t_start = time.perf_counter()
    print(f"generating / finding the family at scale {args.scale:g} under {args.data} ...", flush=True)
    paths = generate(args.data, args.scale, verbose=True)
    files = list(paths.values())
    print(f"pre-read {len(files)} files into the page cache in {anchors.prewarm(files):.1f} s", flush=True)

    print("anchors: sha256 per file, FastCDC, zstd per file, ZipNN per file ...", flush=True)
    t0 = time.perf_counter()
    anc = anchors.storage_anchors(files)
    anc["zstd_per_file"] = anchors.zstd_per_file(files)
    anc["zipnn_per_file"] = (
        anchors.zipnn_per_file(files) if not args.no_zipnn else {"available": False, "reason": "skipped (--no-zipnn)"}
    )
    print(f"  anchors done in {time.perf_counter() - t0:.1f} s", flush=True)

    anchors.prewarm(files)
    t0 = time.perf_counter()
    with fresh_registry(args.data, delta=False) as (reg, _home):
        exact_pushes = push_all(reg, paths)
        exact_stats = reg.stats(FAMILY)
    print(f"delta-off family push done in {time.perf_counter() - t0:.1f} s", flush=True)

    runs = []
    for i in range(args.runs):
        anchors.prewarm(files)  # the previous registry's packs may have pushed some of the family out
        t0 = time.perf_counter()
        runs.append(one_run(paths, args.data))
        print(
            f"run {i + 1}/{args.runs} (delta on: family push, stats, decode) done in {time.perf_counter() - t0:.1f} s",
            flush=True,
        )
    stored = [r["stats"]["stored_bytes"] for r in runs]
    if len(set(stored)) != 1:
        print(f"warning: stored bytes differ between runs: {stored}")

    cores = os.cpu_count() or 1
    doc = {
        "machine": machine_info(),
        "params": {
            "scale": args.scale,
            "runs": args.runs,
            "chunk_size": DEFAULT_CHUNK_SIZE,
            "page_cache": "pre-warmed",
            "data_dir": str(args.data),
            "zstd_anchor": f"level {anchors.ZSTD_FILE_LEVEL}, zstandard threads=-1 (all cores)",
            "decode": "one thread, payloads in memory, delta bases decoded beforehand",
        },
        "family": {
            "shape": Shape.for_scale(args.scale).__dict__,
            "files": {m: p.stat().st_size for m, p in paths.items()},
        },
        "anchors": anc,
        "storage": {"delta": storage_figures(runs[0]["stats"]), "exact": storage_figures(exact_stats)},
        "summary": summarise_speed(runs, cores),
        "runs": {
            "delta_on": [
                {"pushes": r["pushes"], "decode": r["decode"], "ingest_anchor": r["ingest_anchor"]} for r in runs
            ],
            "delta_off_pushes": exact_pushes,
        },
    }
    doc["storage"]["delta_over_exact"] = (
        doc["storage"]["delta"]["stored_bytes"] / doc["storage"]["exact"]["stored_bytes"]
    )
    doc["gates"] = gates(doc)
    finish(args.out, doc, report, t_start)


if __name__ == "__main__":
    main()
