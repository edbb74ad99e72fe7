"""Storage and speed anchors: what simpler schemes achieve on the same files.

- plain copy: every file stored as it is (the sum of their sizes)
- whole-file dedup: identical files stored once (distinct sha256)
- 64 KiB CDC: FastCDC content-defined chunks (pyfastcdc, avg_size 64 KiB, min 16 KiB, max 256 KiB;
  pyfastcdc's mean chunk is about avg + min, see its docs), each distinct chunk stored once, keyed
  by xxh3-128. Reported raw (``bytes``) and, as a second figure, with each distinct chunk
  compressed by zstd level 1 (``zstd_bytes``), since mfsreg stores its chunks compressed too.
- per-file compressors (no dedup across files): zstd level 3 over each whole file, and ZipNN
  (bf16 byte grouping + entropy coding) over each whole file where the package is installed.

Speed anchors: plain file copy (shutil.copyfile to the same disk, with and without fsync) and CDC
chunking (cut only, and cut + xxh3-128 per chunk, which is what a CDC store must at least do), and
the CPU time of a CDC store's whole ingest of one file (cut, xxh3, zstd-1, sha256: cdc_ingest_cpu).
pyfastcdc runs on one thread; the figures are per process, not per core.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import statistics
import time
from collections.abc import Iterable
from pathlib import Path

import xxhash
import zstandard
from pyfastcdc import FastCDC

CDC_AVG = 64 << 10


def plain_copy_bytes(paths: Iterable[Path]) -> int:
    return sum(Path(p).stat().st_size for p in paths)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb", buffering=0) as f:
        while block := f.read(16 << 20):
            h.update(block)
    return h.hexdigest()


def whole_file_dedup_bytes(paths: Iterable[Path]) -> dict:
    seen: dict[str, int] = {}
    for p in paths:
        seen.setdefault(file_sha256(Path(p)), Path(p).stat().st_size)
    return {"bytes": sum(seen.values()), "distinct_files": len(seen)}


def cdc_dedup(paths: Iterable[Path], avg_size: int = CDC_AVG, compress: bool = True) -> dict:
    """Distinct-chunk bytes under FastCDC, plus chunk counts and the time of the cut+hash pass.

    Compression (when asked) runs after the timed pass, on the distinct chunks only.
    """
    cdc = FastCDC(avg_size)
    sizes: dict[bytes, int] = {}
    total_chunks = 0
    total_bytes = 0
    paths = [Path(p) for p in paths]
    t0 = time.perf_counter()
    for p in paths:
        for c in cdc.cut_file(str(p)):
            sizes.setdefault(xxhash.xxh3_128_digest(c.data), c.length)
            total_chunks += 1
            total_bytes += c.length
    seconds = time.perf_counter() - t0
    out = {
        "avg_size": avg_size,
        "min_size": cdc.min_size,
        "max_size": cdc.max_size,
        "chunks": total_chunks,
        "distinct_chunks": len(sizes),
        "bytes": sum(sizes.values()),
        "mean_chunk": round(total_bytes / max(1, total_chunks)),
        "input_bytes": total_bytes,
        "cut_hash_seconds": seconds,
        "cut_hash_gbps": total_bytes / seconds / 1e9,
    }
    if compress:
        out["zstd_bytes"] = _cdc_zstd_bytes(paths, cdc)
    return out


def _cdc_zstd_bytes(paths: list[Path], cdc: FastCDC) -> int:
    cctx = zstandard.ZstdCompressor(level=1)
    seen: set[bytes] = set()
    total = 0
    for p in paths:
        for c in cdc.cut_file(str(p)):
            key = xxhash.xxh3_128_digest(c.data)
            if key in seen:
                continue
            seen.add(key)
            total += min(c.length, len(cctx.compress(c.data)))
    return total


def cdc_cut_gbps(path: Path, avg_size: int = CDC_AVG, runs: int = 3) -> float:
    """Throughput of the cut alone (no hashing), median of ``runs`` passes over one file."""
    cdc = FastCDC(avg_size)
    size = Path(path).stat().st_size
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        for _c in cdc.cut_file(str(path)):
            pass
        times.append(time.perf_counter() - t0)
    return size / statistics.median(times) / 1e9


def cdc_ingest_cpu(path: Path, avg_size: int = CDC_AVG) -> dict:
    """CPU-seconds one thread spends to ingest ``path`` as new bytes into the 64 KiB CDC + zstd-1
    store of the storage anchors: FastCDC cut, xxh3-128 and zstd level 1 per chunk, and the
    whole-file sha256 that any registry keeps to verify a rebuilt file. A same-run measure of this
    machine's speed, so that an ingest's CPU time can be read as a ratio (time.process_time)."""
    cdc = FastCDC(avg_size)
    cctx = zstandard.ZstdCompressor(level=1)
    size = Path(path).stat().st_size
    digest = hashlib.sha256()
    stored = 0
    c0 = time.process_time()
    for c in cdc.cut_file(str(path)):
        digest.update(c.data)
        xxhash.xxh3_128_digest(c.data)
        stored += len(cctx.compress(c.data))
    cpu = time.process_time() - c0
    return {
        "cpu_seconds": cpu,
        "bytes": size,
        "stored_bytes": stored,
        "mbps_per_cpu_second": size / cpu / 1e6,
    }  # MB as in common.MB


def _copy_synced(path: Path, dest: Path) -> tuple[float, float]:
    """shutil.copyfile of ``path`` to ``dest``, then fsync: seconds to the copy's end and to the sync's."""
    t0 = time.perf_counter()
    shutil.copyfile(path, dest)
    t1 = time.perf_counter()
    fd = os.open(dest, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return t1 - t0, time.perf_counter() - t0


def copy_gbps(path: Path, dest_dir: Path, runs: int = 3) -> dict:
    """shutil.copyfile to ``dest_dir`` (same disk as the registry): GB/s without and with fsync."""
    size = Path(path).stat().st_size
    plain, synced = [], []
    dest = Path(dest_dir) / f".copy-anchor-{os.getpid()}"
    try:
        for _ in range(runs):
            dest.unlink(missing_ok=True)
            copied, total = _copy_synced(path, dest)
            plain.append(copied)
            synced.append(total)
    finally:
        dest.unlink(missing_ok=True)
    return {
        "copy_gbps": size / statistics.median(plain) / 1e9,
        "copy_fsync_gbps": size / statistics.median(synced) / 1e9,
    }


def write_anchors(path: Path, dest_dir: Path) -> dict:
    """Seconds to write ``path``'s bytes (in the page cache) to a new file in ``dest_dir`` and sync
    it, two plain ways with no check: shutil.copyfile (the kernel copies into the page cache, then
    writeback), and O_DIRECT from one 8 MiB aligned buffer, read into and then written, on one
    thread (no page cache filled; None where the filesystem refuses O_DIRECT). What writing the
    file durably costs, each way, for a pull to be set beside; a pull that overlaps its reads and
    writes may beat the second."""
    import mmap

    dest = Path(dest_dir) / f".write-anchor-{os.getpid()}"
    out = {}
    try:
        out["copy_fsync_s"] = _copy_synced(path, dest)[1]
        dest.unlink()
        size, piece = Path(path).stat().st_size, 8 << 20
        buf = mmap.mmap(-1, piece)
        t0 = time.perf_counter()
        src = os.open(path, os.O_RDONLY)
        try:
            fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        except OSError:  # a filesystem without O_DIRECT (EINVAL)
            os.close(src)
            buf.close()
            out["direct_fsync_s"] = None
            return out
        try:
            for at in range(0, size, piece):
                n = os.preadv(src, [buf], at)
                os.pwrite(fd, memoryview(buf)[: -(-n // 4096) * 4096], at)  # whole blocks; cut below
            os.ftruncate(fd, size)
            os.fsync(fd)
        finally:
            os.close(fd)
            os.close(src)
        out["direct_fsync_s"] = time.perf_counter() - t0
        buf.close()
    finally:
        dest.unlink(missing_ok=True)
    return out


def storage_anchors(paths: Iterable[Path], cdc_avg: int = CDC_AVG, compress: bool = True) -> dict:
    paths = [Path(p) for p in paths]
    return {
        "plain_copy_bytes": plain_copy_bytes(paths),
        "whole_file_dedup": whole_file_dedup_bytes(paths),
        "cdc": cdc_dedup(paths, cdc_avg, compress),
    }


def prewarm(paths: Iterable[Path]) -> float:
    """Read every file once so that timed passes find it in the page cache; returns seconds taken."""
    t0 = time.perf_counter()
    buf = bytearray(16 << 20)
    view = memoryview(buf)
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.readinto(view):
                pass
    return time.perf_counter() - t0


def drop_from_page_cache(paths: Iterable[Path | str]) -> None:
    """Drop files' pages from the page cache, as a reboot or memory pressure would: their next reader
    reads them from disk, and the page cache keeps them in whatever folios that reader's faults or
    readahead make. Dirty pages are written first (they cannot be dropped); pages a live mapping holds
    stay, so callers free their tensors (and collect garbage) first."""
    os.sync()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def page_cache_resident(paths: Iterable[Path | str]) -> tuple[int, int]:
    """(bytes of the files in the page cache, their bytes in all), by mincore(2) over a private
    mapping of each (which reports the file's cached pages until it is written): says whether a
    timed read found its files in memory or read them from disk. Neither the standard library nor
    a kept package asks the kernel this, so it goes through ctypes; (0, total) where it cannot."""
    import ctypes
    import mmap

    page = mmap.PAGESIZE
    libc = ctypes.CDLL(None, use_errno=True)
    resident = total = 0
    for p in paths:
        size = os.stat(p).st_size
        total += size
        if not size or not hasattr(libc, "mincore"):
            continue
        with open(p, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as mm:
            pages = (size + page - 1) // page
            vec = (ctypes.c_ubyte * pages)()
            anchor = ctypes.c_char.from_buffer(mm)
            try:
                if libc.mincore(ctypes.c_void_p(ctypes.addressof(anchor)), ctypes.c_size_t(size), vec) == 0:
                    resident += min(size, page * sum(b & 1 for b in vec))
            finally:
                del anchor  # the buffer export must end before the mapping closes
    return resident, total


def hash_gbps(path: Path) -> dict:
    """Single-thread xxh3-128 (per 1 MiB piece) and sha256 (whole file) over a cached file.

    The floor under any content-addressed push: every byte must be hashed at least once.
    """
    import mmap

    size = Path(path).stat().st_size
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        try:
            t0 = time.perf_counter()
            for o in range(0, size, 1 << 20):
                xxhash.xxh3_128_digest(view[o : o + (1 << 20)])
            t1 = time.perf_counter()
            h = hashlib.sha256()
            for o in range(0, size, 16 << 20):
                h.update(view[o : o + (16 << 20)])
            t2 = time.perf_counter()
        finally:
            view.release()
    return {"xxh3_128_gbps": size / (t1 - t0) / 1e9, "sha256_gbps": size / (t2 - t1) / 1e9}


# -- per-file compressors (bench_delta): what compressing each file on its own achieves -------------

ZSTD_FILE_LEVEL = 3


class _Counter:
    """A write-only sink that keeps only the number of bytes written."""

    def __init__(self):
        self.n = 0

    def write(self, data) -> int:
        self.n += len(data)
        return len(data)


def zstd_per_file(paths: Iterable[Path], level: int = ZSTD_FILE_LEVEL, threads: int = -1) -> dict:
    """zstd over each whole file (streamed; ``threads=-1``: zstd's multithreaded mode on every core)."""
    cctx = zstandard.ZstdCompressor(level=level, threads=threads)
    total = size = 0
    t0 = time.perf_counter()
    for p in paths:
        sink = _Counter()
        with open(p, "rb") as f:
            cctx.copy_stream(f, sink, read_size=16 << 20, write_size=16 << 20)
        total += sink.n
        size += Path(p).stat().st_size
    seconds = time.perf_counter() - t0
    return {
        "bytes": total,
        "level": level,
        "threads": threads,
        "input_bytes": size,
        "seconds": seconds,
        "mbps": size / seconds / 1e6,
    }


def zipnn_per_file(paths: Iterable[Path], dtype: str = "bfloat16", verify: bool = True) -> dict:
    """ZipNN over each whole file as bf16 bytes, the way its own file script does it (streaming in
    1 MiB pieces, byte grouping + Huffman/zstd chosen per piece, its default thread count).

    ZipNN (0.5.4) reorders bits of its input buffer in place, so each file is read into a private
    bytearray; ``verify`` decompresses and checks the sha256 against the file. Returns
    ``{"available": False, "reason": ...}`` when the package cannot be imported.
    """
    try:
        import zipnn
    except Exception as exc:  # not installed, or its C extension fails to load
        return {"available": False, "reason": f"{exc.__class__.__name__}: {exc}"}
    settings = dict(input_format="byte", bytearray_dtype=dtype, is_streaming=True, streaming_chunk=1 << 20)
    total = size = 0
    seconds = 0.0
    verified = True if verify else None
    for p in paths:
        data = bytearray(Path(p).read_bytes())
        t0 = time.perf_counter()
        comp = zipnn.ZipNN(**settings).compress(data)
        seconds += time.perf_counter() - t0
        del data
        total += len(comp)
        size += Path(p).stat().st_size
        if verify:
            out = zipnn.ZipNN(**settings).decompress(bytes(comp))
            if hashlib.sha256(out).hexdigest() != file_sha256(Path(p)):
                verified = False
            del out
        del comp
    version = getattr(zipnn, "__version__", None)
    if version is None:
        from importlib.metadata import version as _v

        version = _v("zipnn")
    return {
        "available": True,
        "bytes": total,
        "input_bytes": size,
        "seconds": seconds,
        "mbps": size / seconds / 1e6,
        "verified": verified,
        "version": version,
        "settings": settings,
    }
