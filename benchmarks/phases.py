"""Where push and pull time goes: wall time per phase, measured by wrapping registry functions.

    python -m benchmarks.phases [--scale S] [--runs N] [--data DIR]

Push phases: upload (encode + packs + chunk rows: ingest.upload_missing), digest wait (time spent
waiting for the whole-file sha256 after the upload: hashing.HashJob.manifest, where the digest runs
beside the encoding; older trees hash first, in ingest.hash_source, reported as "hash"), commit
(version row + tiers: ingest.commit_version), and the rest (chunk ids, checks, the missing-id
query). A pull is one phase (read packs, decode, verify, pwrite, fsync): it no longer re-reads the
written file for a sha256, the phase this script once split out.

The wrappers are installed on the module attributes that push looks up at call time; if the
registry is refactored and a name moves, that phase reads 0 and a warning is printed. Measurement
only: nothing in registry/ is changed on disk. Prints a table; writes results/phases.json.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from benchmarks import anchors
from benchmarks.common import GB, fresh_registry, machine_info, median, table, write_json
from benchmarks.family import DEFAULT_DIR, generate

CLOCK: dict[str, float] = defaultdict(float)


def _wrap(module, name: str, phase: str) -> bool:
    fn = getattr(module, name, None)
    if fn is None:
        print(f"warning: {module.__name__}.{name} not found: phase {phase!r} will read 0")
        return False

    def timed(*a, **kw):
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            CLOCK[phase] += time.perf_counter() - t0

    setattr(module, name, timed)
    return True


def install() -> None:
    from mfsreg.registry.format import hashing
    from mfsreg.registry.store import ingest

    if hasattr(ingest, "hash_source"):
        _wrap(ingest, "hash_source", "hash")
    else:
        _wrap(hashing.HashJob, "manifest", "digest_wait")
    _wrap(ingest, "upload_missing", "upload")
    _wrap(ingest, "commit_version", "commit")


def measure(reg, label: str, fn) -> dict:
    CLOCK.clear()
    t0 = time.perf_counter()
    fn()
    wall = time.perf_counter() - t0
    out = {"op": label, "wall": wall, **CLOCK}
    if label.startswith("push"):
        out["other"] = wall - sum(CLOCK.get(k, 0.0) for k in ("hash", "digest_wait", "upload", "commit"))
    else:
        out["other"] = wall
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="push/pull wall time per phase")
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args(argv)
    install()
    paths = generate(args.data, args.scale, verbose=True)
    size = paths["base"].stat().st_size
    results = defaultdict(list)
    for _ in range(args.runs):
        anchors.prewarm(paths.values())
        with fresh_registry(args.data) as (reg, home):
            ops = [
                ("push base (new)", lambda: reg.push(paths["base"], "bench", "base")),
                (
                    "push lora-chat (mostly dup)",
                    lambda: reg.push(paths["lora-chat"], "bench", "lora-chat", parent="base"),
                ),
                ("push base-copy (identical)", lambda: reg.push(paths["base"], "bench", "base-copy")),
                ("pull base", lambda: reg.pull("bench", "base", home / "out.safetensors")),
            ]
            for label, fn in ops:
                results[label].append(measure(reg, label, fn))
    cols = ["hash", "upload", "digest_wait", "commit", "other"]
    rows, doc = [], {}
    for label, rs in results.items():
        med = {k: median([r.get(k, 0.0) for r in rs]) for k in ["wall", *cols]}
        doc[label] = {"median": med, "runs": rs}
        rows.append(
            [
                label,
                f"{med['wall']:.2f}",
                f"{size / med['wall'] / GB:.2f}",
                *(f"{med[k]:.2f}" if med[k] else "" for k in cols),
            ]
        )
    print(f"\n## Phases (scale {args.scale:g}, {size / GB:.2f} GB file, median of {args.runs}; seconds)\n")
    print(table(["op", "wall s", "GB/s", "hash", "upload", "digest wait", "commit", "other"], rows))
    path = write_json("phases.json", {"machine": machine_info(), "scale": args.scale, "runs": args.runs, "ops": doc})
    print(f"results: {path}")


if __name__ == "__main__":
    main()
