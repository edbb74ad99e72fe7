"""Decoding deltas with the C module's vector paths on and off, on one thread.

    python -m benchmarks.decode_kernels [--scale 1] [--rounds 11] [--chunks 64]

For lora-chat and full-medical of the synthetic family, up to --chunks of the chunks that differ
from the base's at the same place (tensor-aligned cuts of 2 MiB, as a push makes them, spread over
the file) are encoded as deltas against the base's (untimed). Each round then decodes every one
with `codec.decode` and checks it against its xxh3-128 id, as a pull does, once with the vector
paths (where the processor has them: AVX-512 with VBMI2 for the two-byte ungrouping and the sparse
join) and once with the plain loops (`_grouping.simd(False)`), taking turns. Reports the medians of
the rounds, and the speed-up as the median of each round's ratio. Writes
benchmarks/results/decode_kernels.json.
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

from benchmarks.common import MB, finish, machine_info, table
from benchmarks.family import DEFAULT_DIR, generate
from mfsreg.registry.format import codec
from mfsreg.registry.format.chunking import chunk_id, plan_cuts
from mfsreg.registry.format.safetensors import read_header

MEMBERS = ("lora-chat", "full-medical")
CHUNK = 2 << 20


def delta_chunks(base_path, member_path, most: int) -> list[tuple[str, bytes, memoryview, str, int]]:
    """(encoding, payload, basis, id, size) of up to ``most`` chunks of the member that differ from
    the base's at the same cut, spread evenly over those that do."""
    cuts = plan_cuts(member_path.stat().st_size, read_header(member_path), CHUNK)
    with open(base_path, "rb") as fb, open(member_path, "rb") as fm:
        base = memoryview(mmap.mmap(fb.fileno(), 0, access=mmap.ACCESS_READ))
        member = memoryview(mmap.mmap(fm.fileno(), 0, access=mmap.ACCESS_READ))
    changed = [
        c for c in cuts if c.itemsize > 1 and base[c.offset : c.offset + c.size] != member[c.offset : c.offset + c.size]
    ]
    step = max(1, len(changed) // most)
    out = []
    for c in changed[::step][:most]:
        data, basis = bytes(member[c.offset : c.offset + c.size]), bytes(base[c.offset : c.offset + c.size])
        encoding, payload = codec.encode_delta(data, basis, c.itemsize)
        out.append((encoding, payload, basis, chunk_id(data), c.size))
    return out


def decode_round(chunks) -> float:
    t0 = time.perf_counter()
    for encoding, payload, basis, cid, size in chunks:
        if chunk_id(codec.decode(encoding, payload, size, basis)) != cid:
            raise SystemExit("a decoded chunk does not match its id")
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=11)
    ap.add_argument("--chunks", type=int, default=64, help="chunks per member at most")
    ap.add_argument("--out", default="decode_kernels.json")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if codec._grouping is None:
        raise SystemExit("registry/format/_grouping.c is not built: make install")
    paths = generate(DEFAULT_DIR, args.scale, verbose=True)
    doc: dict = {"params": vars(args), "vector_paths": list(codec._grouping.vector_paths()), "members": {}}
    for member in MEMBERS:
        chunks = delta_chunks(paths["base"], paths[member], args.chunks)
        raw = sum(c[4] for c in chunks)
        times: dict[str, list[float]] = {"vector": [], "plain": []}
        try:
            for r in range(args.rounds + 1):  # the first round untimed: first touches of buffers
                for way in ("vector", "plain") if r % 2 else ("plain", "vector"):
                    codec._grouping.simd(way == "vector")
                    seconds = decode_round(chunks)
                    if r:
                        times[way].append(seconds)
        finally:
            codec._grouping.simd(True)
        rec = {
            "chunks": len(chunks),
            "encodings": sorted({c[0] for c in chunks}),
            "raw_mb": raw / MB,
            "stored_mb": sum(len(c[1]) for c in chunks) / MB,
        }
        for way, ts in times.items():
            rec[way] = {
                "ms_per_chunk": statistics.median(ts) / len(chunks) * 1e3,
                "mbps": raw / MB / statistics.median(ts),
            }
        # the median of each round's ratio: the two ways of one round ran seconds apart, while this
        # VM's speed drifts between rounds by more than the difference
        rec["speedup"] = statistics.median(p / v for p, v in zip(times["plain"], times["vector"]))
        doc["members"][member] = rec
        print(f"  {member}: {len(chunks)} chunks done", flush=True)
    doc["machine"] = machine_info()
    finish(args.out, doc, report, t_start)


def report(doc: dict) -> str:
    rows = [
        [
            m,
            f"{r['chunks']} ({', '.join(r['encodings'])})",
            f"{r['plain']['ms_per_chunk']:.2f} / {r['plain']['mbps']:,.0f}",
            f"{r['vector']['ms_per_chunk']:.2f} / {r['vector']['mbps']:,.0f}",
            f"{r['speedup']:.2f}x",
        ]
        for m, r in doc["members"].items()
    ]
    paths = ", ".join(doc["vector_paths"]) or "none"
    head = f"decode + xxh3 check, one thread (vector paths on this processor: {paths})"
    return head + "\n" + table(["member", "chunks", "plain: ms a chunk / MB/s", "vector: ms / MB/s", "speed-up"], rows)


if __name__ == "__main__":
    main()
