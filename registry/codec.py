"""Chunk encodings and their decoders.

Encodings (the name is stored with each chunk):
- ``raw``: the bytes as they are, when nothing smaller was found.
- ``zstd``: zstd over the bytes (headers, side files, one-byte dtypes).
- ``zstd-pN``: the chunk's N-byte elements split into N byte planes, then zstd. Weights of one
  tensor share a narrow range of exponents, so the plane holding sign and exponent bits compresses
  well while the low mantissa planes do not; interleaved, zstd finds much less (bf16: about 0.68 of
  the raw size instead of 0.78, measured in benchmarks/).
Delta encodings against a basis chunk come in a later step; ``basis`` is already part of the API.

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


def _cctx() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def split_planes(data, itemsize: int) -> np.ndarray:
    """Byte planes of ``data``: all first bytes of each element, then all second bytes, ..."""
    a = np.frombuffer(data, dtype=np.uint8)
    return np.ascontiguousarray(a.reshape(-1, itemsize).T)


def join_planes(planes, itemsize: int, out: np.ndarray | None = None) -> np.ndarray:
    p = np.frombuffer(planes, dtype=np.uint8)
    if out is None:
        out = np.empty(p.size, dtype=np.uint8)
    out.reshape(-1, itemsize)[...] = p.reshape(itemsize, -1).T
    return out


def encode(data, itemsize: int = 1) -> tuple[str, bytes]:
    """Encode a chunk's raw bytes; returns (encoding, payload), the smallest that was tried."""
    n = len(data)
    if itemsize > 1 and n % itemsize == 0 and n >= 4 * itemsize:
        payload = _cctx().compress(split_planes(data, itemsize))
        encoding = f"{ZSTD}-p{itemsize}"
    else:
        payload = _cctx().compress(data)
        encoding = ZSTD
    if len(payload) >= n:
        return RAW, bytes(data)
    return encoding, payload


def decode(encoding: str, payload, size: int, basis=None) -> bytes:
    """Rebuild a chunk's raw bytes from its stored payload. Raises ValueError on unknown encodings."""
    if encoding == RAW:
        return bytes(payload)
    if encoding == ZSTD:
        return _dctx().decompress(payload, max_output_size=size)
    if encoding.startswith(ZSTD + "-p"):
        itemsize = int(encoding[len(ZSTD) + 2 :])
        planes = _dctx().decompress(payload, max_output_size=size)
        return join_planes(planes, itemsize).tobytes()
    raise ValueError(f"unknown chunk encoding {encoding!r}")
