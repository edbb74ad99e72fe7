"""What prune gives back after deletes, and what it costs beside a plain copy of the bytes it moves.

    python -m benchmarks.bench_prune [--scale 1.0] [--runs 3] [--data DIR]

Method. Each run: a fresh embedded registry (SQLite, local packs) receives the synthetic family
(benchmarks/family.py, every member with its parent, deltas on); then lastlayers-code (its retrained
layers are its own) and lora-chat (lora-chat-v2's parent: its chunks stay as v2's bases and shared
chunks) are deleted. Timed: `prune --dry-run`, then `prune --min-age 0` with the default
--max-unused (0.1), both through Registry.prune (wall and CPU seconds of the process). Recorded:
pack bytes before and after, the stored bytes of the chunks it deleted, packs repacked and the bytes
moved, blobs deleted. Anchor, in the same run after the prune: copying the same number of bytes
with shutil.copyfile from the registry's pack files to new files, each fsynced (what moving bytes
costs at the least on this disk). On the first run every remaining member is pulled and compared
with its source by sha256. Figures are medians over --runs. Writes results/prune.json.
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import tempfile
import time
from pathlib import Path

from benchmarks import anchors
from benchmarks.common import FAMILY, MB, finish, fresh_registry, machine_info, median, table
from benchmarks.family import DEFAULT_DIR, MEMBERS, generate

DELETED = ("lastlayers-code", "lora-chat")


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def copy_anchor(blob_root: Path, nbytes: int, work: Path) -> float:
    """Seconds to copy ``nbytes`` of pack files (whole files, the last one may overshoot) with fsync."""
    t0, done, i = time.perf_counter(), 0, 0
    for src in sorted(blob_root.rglob("*.pack")):
        if done >= nbytes:
            break
        dst = work / f"copy-{i}.pack"
        shutil.copyfile(src, dst)
        with open(dst, "rb+") as f:
            os.fsync(f.fileno())
        done += src.stat().st_size
        i += 1
    seconds = time.perf_counter() - t0
    for p in work.glob("copy-*.pack"):
        p.unlink()
    return seconds


def one_run(paths: dict[str, Path], data: Path, verify: bool) -> dict:
    with fresh_registry(data) as (reg, home):
        for member, parent in MEMBERS.items():
            reg.push(paths[member], FAMILY, member, parent=parent)
        for member in DELETED:
            reg.delete(FAMILY, member)
        before = reg.stats()
        t0 = time.perf_counter()
        dry = reg.prune(min_age=0, dry_run=True)
        dry_s = time.perf_counter() - t0
        c0, t0 = _cpu(), time.perf_counter()
        res = reg.prune(min_age=0)
        wall, cpu = time.perf_counter() - t0, _cpu() - c0
        after = reg.stats()
        work = Path(tempfile.mkdtemp(prefix="copy-", dir=home))
        anchor = copy_anchor(home / "blobs", res.moved_bytes, work) if res.moved_bytes else 0.0
        checked = {}
        if verify:
            for member in MEMBERS:
                if member in DELETED:
                    continue
                out = work / f"{member}.safetensors"
                reg.pull(FAMILY, member, out)
                checked[member] = anchors.file_sha256(out) == anchors.file_sha256(paths[member])
                out.unlink()
        return {"pack_bytes_before": before["pack_bytes"], "pack_bytes_after": after["pack_bytes"],
                "unreferenced_before": before["unreferenced_bytes"], "stored_after": after["stored_bytes"],
                "result": res.to_dict(), "dry_run_seconds": dry_s, "dry_run_agrees": {
                    k: getattr(dry, k) == getattr(res, k) for k in ("deleted_chunks", "moved_bytes", "freed_bytes")},
                "seconds": wall, "cpu_seconds": cpu, "copy_anchor_seconds": anchor, "pulled_identical": checked}


def summarise(runs: list[dict]) -> dict:
    first = runs[0]
    res = first["result"]
    return {
        "pack_bytes_before": first["pack_bytes_before"], "pack_bytes_after": first["pack_bytes_after"],
        "freed_fraction": 1 - first["pack_bytes_after"] / first["pack_bytes_before"],
        "deleted_chunk_bytes": res["deleted_chunk_bytes"], "moved_bytes": res["moved_bytes"],
        "repacked_packs": res["repacked_packs"], "deleted_packs": res["deleted_packs"],
        "unused_after": first["pack_bytes_after"] - first["stored_after"],
        "seconds": median([r["seconds"] for r in runs]), "seconds_all": [r["seconds"] for r in runs],
        "cpu_seconds": median([r["cpu_seconds"] for r in runs]),
        "dry_run_seconds": median([r["dry_run_seconds"] for r in runs]),
        "copy_anchor_seconds": median([r["copy_anchor_seconds"] for r in runs]),
        "over_copy": median([r["seconds"] / r["copy_anchor_seconds"] for r in runs if r["copy_anchor_seconds"]] or [0.0]),
        "dry_run_agrees": all(all(r["dry_run_agrees"].values()) for r in runs),
        "pulled_identical": first["pulled_identical"],
    }


def report(doc: dict) -> str:
    s, p = doc["summary"], doc["params"]
    out = [f"## Prune (scale {p['scale']}, median of {p['runs']} runs; deleted: {', '.join(DELETED)})", ""]
    rows = [
        ["pack bytes before / after", f"{s['pack_bytes_before'] / MB:,.1f} / {s['pack_bytes_after'] / MB:,.1f} MB",
         f"{s['freed_fraction']:.1%} given back"],
        ["chunks no version needs, deleted", f"{s['deleted_chunk_bytes'] / MB:,.1f} MB", ""],
        ["packs repacked / bytes moved", f"{s['repacked_packs']} / {s['moved_bytes'] / MB:,.1f} MB",
         f"{s['deleted_packs']} blobs deleted"],
        ["unused bytes left in packs", f"{s['unused_after'] / MB:,.1f} MB", "under --max-unused 0.1 per pack"],
        ["prune --dry-run", f"{s['dry_run_seconds']:.2f} s", "agrees with the run" if s["dry_run_agrees"] else "DISAGREES"],
        ["prune --min-age 0", f"{s['seconds']:.2f} s ({s['cpu_seconds']:.2f} CPU s)",
         f"{s['over_copy']:.2f}x a plain copy of the moved bytes ({s['copy_anchor_seconds']:.2f} s)"],
        ["remaining members pulled byte-identical", ", ".join(f"{m}: {'yes' if ok else 'NO'}" for m, ok in s["pulled_identical"].items()), ""],
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
    anchors.prewarm(paths.values())
    runs = []
    for i in range(args.runs):
        runs.append(one_run(paths, args.data, verify=i == 0))
        print(f"run {i + 1}/{args.runs}: prune {runs[-1]['seconds']:.2f} s", flush=True)
    doc = {"machine": machine_info(), "params": {"scale": args.scale, "runs": args.runs, "deleted": list(DELETED)},
           "runs": runs, "summary": summarise(runs)}
    finish("prune.json", doc, report, t_start)


if __name__ == "__main__":
    main()
