"""Chunk encodings and their decoders.

Encodings (the name is stored with each chunk):
- ``raw``: the bytes as they are, when nothing smaller was found.
- ``zstd``: zstd over the bytes (headers, side files, one-byte dtypes).
- ``zstd-pN``: the chunk's N-byte elements split into N byte planes, then zstd. Weights of one
  tensor share a narrow range of exponents, so the plane holding sign and exponent bits compresses
  well while the low mantissa planes do not; interleaved, zstd finds much less (bf16: about 0.67 of
  the raw size instead of 0.78, measured in benchmarks/).
- ``xor-pN``: a delta against a basis chunk (the same tensor position in a related version):
  xor of the two, split into N byte planes, then zstd. A fine-tune keeps most sign, exponent and
  high mantissa bits of its base, so the xor is mostly zero bytes and compresses far below plain.
  When the chunk is longer than its basis (appended vocabulary rows), the tail past the basis is
  kept as it is inside the same planes.

Decoders are numpy-vectorised and do not touch the database, so the node-side client uses them too.
"""

from __future__ import annotations

import threading

import numpy as np
import zstandard

RAW = "raw"
ZSTD = "zstd"
ZSTD_LEVEL = 1  # level 1 is ~2x faster than 3 on weights and loses under 1% of the ratio

_local = threading.local()


# Byte planes of weights (and their xor deltas) hold a low-entropy sign/exponent plane, few long
# repeats, and near-random mantissa planes: the work is in entropy coding, not match finding.
# A fast strategy with a long minimum match and a tiny hash table (64 entries) compresses both the
# exponent plane and xor deltas better than level 1 (exponent plane 0.340 vs 0.368 of its size,
# xor planes 0.144 vs 0.148) and two to three times as fast: short matches in near-random
# bytes cost more than they save, and a small table finds fewer of them (measured on bf16 planes).
PLANE_PARAMS = dict(strategy=zstandard.STRATEGY_FAST, min_match=7, hash_log=6, window_log=17, search_log=1)


def _cctx() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _plane_cctx() -> zstandard.ZstdCompressor:
    c = getattr(_local, "plane_cctx", None)
    if c is None:
        params = zstandard.ZstdCompressionParameters(**PLANE_PARAMS)
        c = _local.plane_cctx = zstandard.ZstdCompressor(compression_params=params)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


_WIDE = {2: np.uint16, 4: np.uint32, 8: np.uint64}


def _scratch(name: str, n: int) -> np.ndarray:
    """A per-thread uint8 buffer of ``n`` bytes, reused from chunk to chunk. Encoding writes each
    chunk once or twice into temporary arrays; fresh ones cost a page fault and a zeroed page per
    4 KiB, which took more CPU than the numpy work itself (measured in an embedded push)."""
    buf = getattr(_local, name, None)
    if buf is None or buf.size < n:
        buf = np.empty(n, dtype=np.uint8)
        setattr(_local, name, buf)
    return buf[:n]


def split_planes(data, itemsize: int, out: np.ndarray | None = None) -> np.ndarray:
    """Byte planes of ``data``: all first bytes of each element, then all second bytes, ...
    (into ``out`` when given). Shifting wide little-endian integers runs at several GB/s; a
    strided transpose at under one."""
    a = np.frombuffer(data, dtype=np.uint8)
    if itemsize == 1:
        return a
    w = a.view(_WIDE[itemsize])
    n = w.size
    out = np.empty(a.size, dtype=np.uint8) if out is None else out
    np.copyto(out[:n], w, casting="unsafe")
    for k in range(1, itemsize):
        # shifted and narrowed in one pass, straight into the plane: no wide temporary
        np.right_shift(w, 8 * k, out=out[k * n : (k + 1) * n], casting="unsafe")
    return out


def join_planes(planes, itemsize: int) -> np.ndarray:
    """Inverse of split_planes, as uint8. Shifting planes into wide little-endian integers runs at
    several GB/s; the equivalent strided transpose copy runs at about 0.5 GB/s."""
    p = np.frombuffer(planes, dtype=np.uint8)
    if itemsize == 1:
        return p.copy()
    n = p.size // itemsize
    wide = _WIDE[itemsize]
    out = np.left_shift(p[(itemsize - 1) * n :], 8 * (itemsize - 1), dtype=wide)  # widened and shifted in one pass
    for k in range(itemsize - 2, 0, -1):
        out |= np.left_shift(p[k * n : (k + 1) * n], 8 * k, dtype=wide)
    np.bitwise_or(out, p[:n], out=out)
    return out.view(np.uint8)


XOR = "xor"
# A delta this much smaller than the raw chunk cannot lose to plain zstd (bf16 weights: about 0.68
# of raw), so plain is not even tried: this keeps ingest of a delta-friendly fine-tune fast.
DELTA_CLEAR_WIN = 0.5


def xor_planes(data, basis, itemsize: int, scratch: bool = False) -> np.ndarray:
    """Byte planes of xor(data, basis); bytes past the basis are kept as they are. With
    ``scratch`` the result lives in this thread's reusable buffers: use it before the next call."""
    a = np.frombuffer(data, dtype=np.uint8)
    b = np.frombuffer(basis, dtype=np.uint8)
    m = min(a.size, b.size)
    m -= m % itemsize
    x = _scratch("xor", a.size) if scratch else np.empty(a.size, dtype=np.uint8)
    np.bitwise_xor(a[:m], b[:m], out=x[:m])
    x[m:] = a[m:]
    if itemsize == 1:
        return x
    return split_planes(x, itemsize, _scratch("planes", a.size) if scratch else None)


def encode_delta(data, basis, itemsize: int) -> bytes:
    return _plane_cctx().compress(xor_planes(data, basis, itemsize, scratch=True))


def best_encoding(data, itemsize: int, basis=None, plain: tuple[str, bytes] | None = None) -> tuple[str, bytes, bool]:
    """The smallest of plain and (with a basis) delta; returns (encoding, payload, is_delta).
    ``plain``: a plain (encoding, payload) of ``data`` already at hand, such as the compressed
    payload a client uploaded; it is used as the plain candidate instead of encoding again."""
    n = len(data)
    if basis is not None and n % itemsize == 0:
        delta = encode_delta(data, basis, itemsize)
        if len(delta) <= DELTA_CLEAR_WIN * n:
            return f"{XOR}-p{itemsize}", delta, True
        encoding, payload = plain or encode(data, itemsize)
        if len(delta) < len(payload):
            return f"{XOR}-p{itemsize}", delta, True
        return encoding, payload, False
    encoding, payload = encode(data, itemsize)
    return encoding, payload, False


def encode(data, itemsize: int = 1) -> tuple[str, bytes]:
    """Encode a chunk's raw bytes; returns (encoding, payload), the smallest that was tried."""
    n = len(data)
    if itemsize > 1 and n % itemsize == 0 and n >= 4 * itemsize:
        payload = _plane_cctx().compress(split_planes(data, itemsize, _scratch("planes", n)))
        encoding = f"{ZSTD}-p{itemsize}"
    else:
        payload = _cctx().compress(data)
        encoding = ZSTD
    if len(payload) >= n:
        return RAW, bytes(data)
    return encoding, payload


def _decompress(payload, size: int) -> bytes:
    # zstd trusts a frame's declared content size over max_output_size: check it first, or a tiny
    # hostile frame could claim gigabytes.
    declared = zstandard.frame_content_size(payload)
    if declared != size:
        raise ValueError(f"zstd frame declares {declared} bytes, the chunk has {size}")
    return _dctx().decompress(payload, max_output_size=size)


def decode(encoding: str, payload, size: int, basis=None) -> bytes:
    """Rebuild a chunk's raw bytes from its stored payload. Raises ValueError on unknown encodings
    and on frames that do not declare exactly ``size`` bytes."""
    if encoding == RAW:
        return bytes(payload)
    if encoding == ZSTD:
        return _decompress(payload, size)
    if encoding.startswith(ZSTD + "-p"):
        itemsize = int(encoding[len(ZSTD) + 2 :])
        planes = _decompress(payload, size)
        return join_planes(planes, itemsize).tobytes()
    if encoding.startswith(XOR + "-p"):
        if basis is None:
            raise ValueError(f"a {encoding} chunk needs its basis to decode")
        itemsize = int(encoding[len(XOR) + 2 :])
        planes = _decompress(payload, size)
        x = join_planes(planes, itemsize)
        b = np.frombuffer(basis, dtype=np.uint8)
        m = min(x.size, b.size)
        m -= m % itemsize
        np.bitwise_xor(x[:m], b[:m], out=x[:m])
        return x.tobytes()
    raise ValueError(f"unknown chunk encoding {encoding!r}")


def is_known(encoding: str) -> bool:
    if encoding in (RAW, ZSTD):
        return True
    for prefix in (ZSTD, XOR):
        if encoding.startswith(prefix + "-p") and encoding[len(prefix) + 2 :] in ("1", "2", "4", "8"):
            return True
    return False
