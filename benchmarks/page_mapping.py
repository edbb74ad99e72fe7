"""What it costs to map chunk files into one tensor and touch every page, by chunk size and alignment.

    python -m benchmarks.page_mapping [--scale S] [--runs N] [--member lora-chat] [--sizes 1M,2M] [--out F]

load_tensors (registry/client/mapping.py) maps each cached chunk file into its tensor's address
range; its "ready" time is mostly the page faults of the first touch. This measures that part alone,
beside its anchor, the default mmap backend of safetensors.torch.load_file, which maps the member's
one file: the file is mapped (MAP_PRIVATE) and one byte of every 4 KiB page is read.

The member's bytes are cut into chunk files of each size, each written with one write() like the
node cache's, into a scratch directory, and read once. Each pass reserves an anonymous range, maps
every chunk file over its slot with MAP_FIXED and touches every page: once with the range on a
2 MiB boundary (what mapping.Region does), once on a 4 KiB boundary that is not a 64 KiB one.
Reported: the median over ``--runs`` passes, and FilePmdMapped (kB of file pages this process
maps with 2 MiB entries) while the last pass is mapped.

Two more rows read every byte instead of one per page: the aligned chunk files, each hashed with
xxh3-128 as load_tensors checks a chunk against its id, and the one file, hashed in slices of the
same size; both on a thread per core, as load_tensors runs its checks. They show what the check
costs beyond mapping: a pass over the bytes at the memory's speed. Writes results/page_mapping.json
(or --out).
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import shutil
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import xxhash

from benchmarks import anchors
from benchmarks.common import MB, finish, machine_info, median, table
from benchmarks.family import DEFAULT_DIR, generate
from mfsreg.registry.client.mapping import _FAILED, _MAP_FIXED, _PROT, HUGE, PAGE, _libc
from mfsreg.registry.config import parse_size


def _pmd_kb() -> int:
    with open("/proc/self/smaps_rollup") as f:
        return next((int(line.split()[1]) for line in f if line.startswith("FilePmdMapped:")), 0)


def _touch(addr: int, n: int) -> None:
    np.frombuffer((ctypes.c_ubyte * n).from_address(addr), dtype=np.uint8)[::PAGE].sum()


def _hash_all(pool: ThreadPoolExecutor, addr: int, sizes: list[tuple[int, int]]) -> None:
    """xxh3-128 of each (offset, size) span from ``addr``, on the pool's threads (xxhash releases the GIL)."""
    views = [memoryview((ctypes.c_ubyte * n).from_address(addr + off)) for off, n in sizes]
    list(pool.map(xxhash.xxh3_128_hexdigest, views))


def whole_file(path: Path, pool: ThreadPoolExecutor | None = None, slice_size: int = HUGE) -> tuple[float, int]:
    """The anchor: map the file as load_file's mmap backend does and touch every page (with ``pool``,
    hash every byte instead, in slices of ``slice_size``)."""
    t0 = time.perf_counter()
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    if pool is None:
        np.frombuffer(m, dtype=np.uint8)[::PAGE].sum()
    else:
        n = len(m)
        _hash_all(
            pool,
            ctypes.addressof(ctypes.c_ubyte.from_buffer(m)),
            [(o, min(slice_size, n - o)) for o in range(0, n, slice_size)],
        )
    s = time.perf_counter() - t0
    pmd = _pmd_kb()
    del m
    return s, pmd


def cut(path: Path, size: int, into: Path) -> list[tuple[Path, int]]:
    into.mkdir(parents=True)
    out = []
    with open(path, "rb", buffering=0) as f:
        while data := f.read(size):
            p = into / f"{len(out):06d}"
            fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o444)
            os.write(fd, data)
            os.close(fd)
            out.append((p, len(data)))
    return out


def mapped(
    files: list[tuple[Path, int]], size: int, aligned: bool, pool: ThreadPoolExecutor | None = None
) -> tuple[float, int]:
    """Reserve, map every chunk file at multiples of ``size``, touch every page (with ``pool``, hash
    each chunk file's bytes instead); seconds and FilePmdMapped."""
    length = len(files) * size
    t0 = time.perf_counter()
    raw = _libc.mmap(None, length + 2 * HUGE, _PROT, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if raw in (None, _FAILED):
        raise SystemExit(f"cannot reserve {length} bytes of address space")
    base = -(-raw // HUGE) * HUGE + (0 if aligned else 17 * PAGE)  # 17 pages: aligned to nothing larger
    for k, (p, n) in enumerate(files):
        fd = os.open(p, os.O_RDONLY)
        got = _libc.mmap(base + k * size, n, _PROT, mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
        os.close(fd)
        if got != base + k * size:
            raise SystemExit("mmap of a chunk file failed")
    if pool is None:
        _touch(base, sum(n for _, n in files))
    else:
        _hash_all(pool, base, [(k * size, n) for k, (_, n) in enumerate(files)])
    s = time.perf_counter() - t0
    pmd = _pmd_kb()
    _libc.munmap(raw, length + 2 * HUGE)
    return s, pmd


def report(doc: dict) -> str:
    r = doc["results"]
    total = doc["bytes"]
    anchor = r["whole_file"]["seconds"]
    rows = [
        [
            "one file (load_file's mmap backend)",
            "",
            f"{anchor * 1e3:.1f}",
            f"{total / anchor / MB:,.0f}",
            "1.00",
            f"{r['whole_file']['pmd_kb']:,}",
        ]
    ]
    for row in r["chunks"]:
        rows.append(
            [
                f"{row['chunk_size'] >> 10} KiB chunk files ({row['files']:,})",
                "2 MiB" if row["aligned"] else "4 KiB",
                f"{row['seconds'] * 1e3:.1f}",
                f"{total / row['seconds'] / MB:,.0f}",
                f"{anchor / row['seconds']:.2f}",
                f"{row['pmd_kb']:,}",
            ]
        )
    return "\n".join(
        [
            f"## Map and touch {total / MB:,.1f} MB of {doc['params']['member']} (median of {doc['params']['runs']} passes, "
            f"{doc['machine']['cpu_model']}, Linux {os.uname().release})",
            "",
            table(["mapped", "range aligned to", "ms", "MB/s", "speed / one file", "FilePmdMapped kB"], rows),
            "",
            *_read_rows(doc),
        ]
    )


def _read_rows(doc: dict) -> list[str]:
    rd = doc["results"].get("read")
    if not rd:
        return []
    total, touch = doc["bytes"], doc["results"]["whole_file"]["seconds"]
    rows = [
        [
            f"one file, {rd['chunk_size'] >> 10} KiB slices",
            f"{rd['whole_file'] * 1e3:.1f}",
            f"{total / rd['whole_file'] / MB:,.0f}",
            f"{touch / rd['whole_file']:.2f}",
        ],
        [
            f"{rd['chunk_size'] >> 10} KiB chunk files, mapped aligned, each checked against its id",
            f"{rd['chunks'] * 1e3:.1f}",
            f"{total / rd['chunks'] / MB:,.0f}",
            f"{touch / rd['chunks']:.2f}",
        ],
    ]
    return [
        f"### Map and read every byte (xxh3-128 on {rd['threads']} threads), as load_tensors' id check does",
        "",
        table(["mapped", "ms", "MB/s", "speed / one file touched"], rows),
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--data", type=Path, default=DEFAULT_DIR)
    ap.add_argument("--member", default="lora-chat")
    ap.add_argument("--sizes", default="1M,2M")
    ap.add_argument("--out", default="page_mapping.json", help="file name under benchmarks/results/")
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    path = generate(args.data, args.scale)[args.member]
    anchors.prewarm([path])
    work = Path(tempfile.mkdtemp(prefix="mfsreg-page-mapping-", dir=args.data))
    try:
        runs = [whole_file(path) for _ in range(args.runs)]
        results = {"whole_file": {"seconds": median([s for s, _ in runs]), "pmd_kb": runs[-1][1]}, "chunks": []}
        for size in (parse_size(s) for s in args.sizes.split(",")):
            files = cut(path, size, work / str(size))
            anchors.prewarm(p for p, _ in files)
            for aligned in (True, False):
                runs = [mapped(files, size, aligned) for _ in range(args.runs)]
                results["chunks"].append(
                    {
                        "chunk_size": size,
                        "files": len(files),
                        "aligned": aligned,
                        "seconds": median([s for s, _ in runs]),
                        "pmd_kb": runs[-1][1],
                    }
                )
        # every byte read, with the chunk files of the last of --sizes (the default's 2 MiB): what the id check adds
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            runs = [whole_file(path, pool, size) for _ in range(args.runs)]
            checked = [mapped(files, size, True, pool) for _ in range(args.runs)]
        results["read"] = {
            "threads": os.cpu_count() or 1,
            "chunk_size": size,
            "whole_file": median([s for s, _ in runs]),
            "chunks": median([s for s, _ in checked]),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {
        "machine": machine_info(),
        "params": {
            "scale": args.scale,
            "runs": args.runs,
            "member": args.member,
            "sizes": args.sizes,
            "kernel": os.uname().release,
        },
        "bytes": path.stat().st_size,
        "results": results,
    }
    finish(args.out, doc, report, t_start)


if __name__ == "__main__":
    main()
