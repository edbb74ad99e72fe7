"""What prune gives back after deletes, and what it costs beside a plain copy of the bytes it moves.

    python -m benchmarks.bench_prune [--scale 1.0] [--runs 3] [--data DIR]

Method. Each run: a fresh embedded registry (SQLite, local packs) receives the synthetic family
(benchmarks/family.py, deltas on, each member with base as parent) without lora-chat-v2, plus
lora-half: base with the LoRA merge of lora-chat in the first half of the tensors it changes, made
here once. Then lastlayers-code (its retrained layers are its own: whole packs go) and lora-chat
(lora-half still needs half of its new chunks: its packs are left half used, and repacked) are
deleted. Timed: `prune --dry-run`, then `prune --min-age 0` with the default
--max-unused (0.1), both through Registry.prune (wall and CPU seconds of the process). Recorded:
pack bytes before and after, the stored bytes of the chunks it deleted, packs repacked and the bytes
moved, blobs deleted. Anchor, in the same run after the prune: copying the same number of bytes
from the registry's pack files into one new file, fsynced (what moving bytes costs at the least). On the first run every remaining member is pulled and compared
with its source by sha256. Figures are medians over --runs. Writes results/prune.json.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks import anchors
from benchmarks.common import FAMILY, MB, cpu_seconds, finish, fresh_registry, machine_info, median, table
from benchmarks.family import DEFAULT_DIR, _save, generate
from mfsreg.registry.store.prune import DEFAULT_MAX_UNUSED

PUSHED = ("base", "lora-chat", "lora-half", "lastlayers-code", "full-medical", "vocab-ext")
DELETED = ("lastlayers-code", "lora-chat")


def lora_half(paths: dict[str, Path]) -> Path:
    """base, with lora-chat's changed tensors in the first half (by name) of those it changes."""
    out = paths["lora-chat"].with_name("prune-lora-half.safetensors")
    if out.exists():
        return out
    base, chat = load_file(str(paths["base"])), load_file(str(paths["lora-chat"]))
    changed = sorted(n for n in base if not torch.equal(base[n], chat[n]))
    for n in changed[: len(changed) // 2]:
        base[n] = chat[n]
    _save(base, out)
    return out


def copy_anchor(blob_root: Path, nbytes: int, work: Path) -> float:
    """Seconds to copy ``nbytes`` read from the registry's pack files into one new file, fsynced."""
    dst = work / "copy.bin"
    t0, left = time.perf_counter(), nbytes
    with open(dst, "wb") as out:
        for src in sorted(blob_root.rglob("*.pack")):
            if left <= 0:
                break
            with open(src, "rb") as f:
                while left > 0 and (block := f.read(min(left, 16 << 20))):
                    out.write(block)
                    left -= len(block)
        out.flush()
        os.fsync(out.fileno())
    seconds = time.perf_counter() - t0
    dst.unlink()
    return seconds


def one_run(paths: dict[str, Path], data: Path, verify: bool) -> dict:
    with fresh_registry(data) as (reg, home):
        for member in PUSHED:
            reg.push(paths[member], FAMILY, member, parent=None if member == "base" else "base")
        for member in DELETED:
            reg.delete(FAMILY, member)
        before = reg.stats()
        t0 = time.perf_counter()
        dry = reg.prune(min_age=0, dry_run=True)
        dry_s = time.perf_counter() - t0
        c0, t0 = cpu_seconds(), time.perf_counter()
        res = reg.prune(min_age=0)
        wall, cpu = time.perf_counter() - t0, cpu_seconds() - c0
        after = reg.stats()
        work = Path(tempfile.mkdtemp(prefix="copy-", dir=home))
        anchor = copy_anchor(home / "blobs", res.moved_bytes, work) if res.moved_bytes else 0.0
        checked = {}
        if verify:
            for member in PUSHED:
                if member in DELETED:
                    continue
                out = work / f"{member}.safetensors"
                reg.pull(FAMILY, member, out)
                checked[member] = anchors.file_sha256(out) == anchors.file_sha256(paths[member])
                out.unlink()
        return {
            "pack_bytes_before": before["pack_bytes"],
            "pack_bytes_after": after["pack_bytes"],
            "unreferenced_before": before["unreferenced_bytes"],
            "stored_after": after["stored_bytes"],
            "result": res.to_dict(),
            "dry_run_seconds": dry_s,
            "dry_run_agrees": {
                k: getattr(dry, k) == getattr(res, k) for k in ("deleted_chunks", "moved_bytes", "freed_bytes")
            },
            "seconds": wall,
            "cpu_seconds": cpu,
            "copy_anchor_seconds": anchor,
            "pulled_identical": checked,
        }


def summarise(runs: list[dict]) -> dict:
    first = runs[0]
    res = first["result"]
    return {
        "pack_bytes_before": first["pack_bytes_before"],
        "pack_bytes_after": first["pack_bytes_after"],
        "freed_fraction": 1 - first["pack_bytes_after"] / first["pack_bytes_before"],
        "deleted_chunk_bytes": res["deleted_chunk_bytes"],
        "moved_bytes": res["moved_bytes"],
        "repacked_packs": res["repacked_packs"],
        "deleted_packs": res["deleted_packs"],
        "unused_after": first["pack_bytes_after"] - first["stored_after"],
        "seconds": median([r["seconds"] for r in runs]),
        "seconds_all": [r["seconds"] for r in runs],
        "cpu_seconds": median([r["cpu_seconds"] for r in runs]),
        "dry_run_seconds": median([r["dry_run_seconds"] for r in runs]),
        "copy_anchor_seconds": median([r["copy_anchor_seconds"] for r in runs]),
        "over_copy": median(
            [r["seconds"] / r["copy_anchor_seconds"] for r in runs if r["copy_anchor_seconds"]] or [0.0]
        ),
        "dry_run_agrees": all(all(r["dry_run_agrees"].values()) for r in runs),
        "pulled_identical": first["pulled_identical"],
    }


def report(doc: dict) -> str:
    s, p = doc["summary"], doc["params"]
    out = [f"## Prune (scale {p['scale']}, median of {p['runs']} runs; deleted: {', '.join(DELETED)})", ""]
    rows = [
        [
            "pack bytes before / after",
            f"{s['pack_bytes_before'] / MB:,.1f} / {s['pack_bytes_after'] / MB:,.1f} MB",
            f"{s['freed_fraction']:.1%} given back",
        ],
        ["chunks no version needs, deleted", f"{s['deleted_chunk_bytes'] / MB:,.1f} MB", ""],
        [
            "packs repacked / bytes moved",
            f"{s['repacked_packs']} / {s['moved_bytes'] / MB:,.1f} MB",
            f"{s['deleted_packs']} blobs deleted",
        ],
        [
            "unused bytes left in packs",
            f"{s['unused_after'] / MB:,.1f} MB",
            f"prune repacks a pack over --max-unused {DEFAULT_MAX_UNUSED} unused",
        ],
        [
            "prune --dry-run",
            f"{s['dry_run_seconds']:.2f} s",
            "agrees with the run" if s["dry_run_agrees"] else "DISAGREES",
        ],
        [
            "prune --min-age 0",
            f"{s['seconds']:.2f} s ({s['cpu_seconds']:.2f} CPU s)",
            f"{s['over_copy']:.2f}x a plain copy of the moved bytes ({s['copy_anchor_seconds']:.2f} s)",
        ],
        [
            "remaining members pulled byte-identical",
            ", ".join(f"{m}: {'yes' if ok else 'NO'}" for m, ok in s["pulled_identical"].items()),
            "",
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
    paths["lora-half"] = lora_half(paths)
    anchors.prewarm(paths[m] for m in PUSHED)
    runs = []
    for i in range(args.runs):
        runs.append(one_run(paths, args.data, verify=i == 0))
        print(f"run {i + 1}/{args.runs}: prune {runs[-1]['seconds']:.2f} s", flush=True)
    doc = {
        "machine": machine_info(),
        "params": {"scale": args.scale, "runs": args.runs, "pushed": list(PUSHED), "deleted": list(DELETED)},
        "runs": runs,
        "summary": summarise(runs),
    }
    finish("prune.json", doc, report, t_start)


if __name__ == "__main__":
    main()
