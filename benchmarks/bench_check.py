"""What `mfsreg check` costs beside the least a scrub of the store costs, and beside pulling everything.

    python -m benchmarks.bench_check [--scale 1.0] [--runs 3] [--data DIR]

Method. One embedded registry (SQLite, local packs) receives the synthetic family
(benchmarks/family.py, deltas on, each member with its parent). Each run then times, in this order
and in one process: `check` (one size lookup per pack), `check --read-data` (every chunk read,
decoded and hashed against its id), and two anchors measured in the same run: reading every pack
file whole and hashing its bytes with xxh3-128 (what any scrub of these bytes costs at the least:
the same reads, no decoding), and pulling every version to a file (what finding a damaged chunk by
pulls would cost: the way to know before check). The pack files stay in the page cache throughout
(a first untimed read puts them there), so the figures are CPU costs, not the disk's. Wall seconds
and CPU seconds of the process; medians over --runs. After the timed runs one pack is deleted and
one byte of another flipped, and the verdict of `check --read-data` is compared with what pulls of
every version do. Writes results/check.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import xxhash

from benchmarks.common import FAMILY, MB, cpu_seconds, finish, fresh_registry, machine_info, median, push_family, table
from benchmarks.family import DEFAULT_DIR, MEMBERS, generate
from mfsreg.registry.blobs.packs import pack_key
from mfsreg.registry.errors import RegistryError


def read_packs(blob_root: Path) -> int:
    """Read every pack file whole, hashing it: the scrub anchor. Returns the bytes read."""
    n = 0
    for path in sorted(blob_root.rglob("*.pack")):
        h = xxhash.xxh3_128()
        with open(path, "rb") as f:
            while block := f.read(16 << 20):
                h.update(block)
                n += len(block)
    return n


def timed(fn) -> tuple[float, float, object]:
    c0, t0 = cpu_seconds(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, cpu_seconds() - c0, out


def pull_all(reg, work: Path) -> int:
    n = 0
    for member in MEMBERS:
        out = work / f"{member}.safetensors"
        n += reg.pull(FAMILY, member, out).logical_bytes
        out.unlink()
    return n


def one_run(reg, home: Path, work: Path) -> dict:
    lookup = timed(lambda: reg.check())
    read = timed(lambda: reg.check(read_data=True))
    scrub = timed(lambda: read_packs(home / "blobs"))
    pulls = timed(lambda: pull_all(reg, work))
    assert lookup[2].ok and read[2].ok, "the fresh registry should check clean"
    return {
        "check_seconds": lookup[0],
        "check_cpu": lookup[1],
        "read_data_seconds": read[0],
        "read_data_cpu": read[1],
        "read_bytes": read[2].read_bytes,
        "stored_bytes": read[2].stored_bytes,
        "chunks": read[2].chunks,
        "packs": read[2].packs,
        "scrub_seconds": scrub[0],
        "scrub_cpu": scrub[1],
        "scrub_bytes": scrub[2],
        "pull_all_seconds": pulls[0],
        "pull_all_cpu": pulls[1],
        "pull_all_bytes": pulls[2],
    }


def damage_agrees(reg, home: Path, work: Path) -> dict:
    """Delete one pack, flip a byte inside another's chunk; does check name exactly the versions pulls fail on?"""
    uses = {m: set(reg.manifest(FAMILY, m)[1].chunk_ids()) for m in MEMBERS}
    located = reg.locate(set().union(*uses.values()))

    def own(member: str) -> list[str]:
        """The chunks only ``member`` uses: losing one should break few versions."""
        return sorted(uses[member] - set().union(*(ids for m, ids in uses.items() if m != member)))

    lost = located[own("lora-chat-v2")[0]].pack_id
    victim = next(located[i] for i in own("vocab-ext") if located[i].pack_id != lost)
    hurt = victim.pack_id
    reg.blobs.delete(pack_key(lost))
    path = home / "blobs" / pack_key(hurt)
    with open(path, "r+b") as f:
        f.seek(victim.offset + victim.stored_size // 2)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0xFF]))
    res = reg.check(read_data=True)
    failed = []
    for member in MEMBERS:
        try:
            reg.pull(FAMILY, member, work / "out.safetensors")
        except RegistryError:
            failed.append(f"{FAMILY}/{member}")
    (work / "out.safetensors").unlink(missing_ok=True)
    return {
        "lost_pack": lost,
        "damaged_pack": hurt,
        "check_lost": list(res.lost_packs),
        "check_damaged_packs": list(res.damaged_packs),
        "check_broken": res.broken_versions,
        "pulls_failed": failed,
        "agrees": res.broken_versions == failed and list(res.lost_packs) == [lost] and hurt in res.damaged_packs,
    }


def summarise(runs: list[dict]) -> dict:
    m = {k: median([r[k] for r in runs]) for k in runs[0]}
    m["read_data_over_scrub"] = median([r["read_data_seconds"] / r["scrub_seconds"] for r in runs])
    m["read_data_over_pull_all"] = median([r["read_data_seconds"] / r["pull_all_seconds"] for r in runs])
    m["read_data_mb_per_s"] = median([r["stored_bytes"] / r["read_data_seconds"] / MB for r in runs])
    m["read_data_all"] = [r["read_data_seconds"] for r in runs]
    return m


def report(doc: dict) -> str:
    s, p, d = doc["summary"], doc["params"], doc["damage"]
    out = [
        f"## Check (scale {p['scale']}, median of {p['runs']} runs; {s['chunks']:,} chunks in {s['packs']} packs, "
        f"{s['stored_bytes'] / MB:,.1f} MB stored, page cache warm)",
        "",
    ]
    rows = [
        ["check (a size lookup per pack)", f"{s['check_seconds']:.3f} s", ""],
        [
            "check --read-data",
            f"{s['read_data_seconds']:.2f} s ({s['read_data_cpu']:.2f} CPU s)",
            f"{s['read_data_mb_per_s']:,.0f} MB/s of stored bytes, {s['read_bytes'] / MB:,.1f} MB read (bases again "
            f"included); {s['raw_bytes'] / MB:,.0f} MB decoded, {s['decoded_mb_per_cpu_s']:,.0f} MB per CPU-second",
        ],
        [
            "anchor: read + xxh3 every pack file",
            f"{s['scrub_seconds']:.2f} s",
            f"check --read-data {s['read_data_over_scrub']:.2f}x it",
        ],
        [
            "anchor: pull every version to a file",
            f"{s['pull_all_seconds']:.2f} s ({s['pull_all_bytes'] / MB:,.0f} MB)",
            f"check --read-data {s['read_data_over_pull_all']:.2f}x it",
        ],
        [
            "one pack deleted, one byte flipped: check names the versions pulls fail on",
            "yes" if d["agrees"] else "NO",
            ", ".join(d["pulls_failed"]),
        ],
    ]
    return "\n".join(out + [table(["what", "figure", "beside"], rows)])


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    paths = generate(args.data, args.scale)
    with fresh_registry(args.data) as (reg, home):
        push_family(reg, paths)
        work = Path(tempfile.mkdtemp(prefix="check-", dir=home))
        read_packs(home / "blobs")  # into the page cache: every timed run finds them there
        runs = []
        for i in range(args.runs):
            runs.append(one_run(reg, home, work))
            print(
                f"run {i + 1}/{args.runs}: check --read-data {runs[-1]['read_data_seconds']:.2f} s, "
                f"scrub anchor {runs[-1]['scrub_seconds']:.2f} s",
                flush=True,
            )
        located = reg.locate({i for m in MEMBERS for i in reg.manifest(FAMILY, m)[1].chunk_ids()})
        raw = sum(c.size for c in located.values())  # what --read-data decodes and hashes, once each
        damage = damage_agrees(reg, home, work)
    summary = summarise(runs)
    summary["raw_bytes"] = raw
    summary["decoded_mb_per_cpu_s"] = median([raw / r["read_data_cpu"] / MB for r in runs])
    doc = {
        "machine": machine_info(),
        "params": {"scale": args.scale, "runs": args.runs},
        "runs": runs,
        "summary": summary,
        "damage": damage,
    }
    finish("check.json", doc, report, t_start)


if __name__ == "__main__":
    main()
