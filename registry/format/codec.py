"""Chunk encodings and their decoders.

The encoding's name is stored with each chunk: ``raw``, ``zstd``, ``zstd-pN`` (byte planes, then
zstd), and deltas against a basis chunk: ``sub-pN``, ``subn-pN`` (lowest plane in nibbles), their
grouped forms ``esub-pN`` and ``esubn-pN`` (written where registry/format/_grouping.c is built), and
``xor-pN`` (decoded, no longer written). Decoders touch no database, so the node client uses them.
See docs/design/format.md and docs/design/deltas.md.
"""

from __future__ import annotations

import threading
import warnings
from types import ModuleType

import numpy as np
import zstandard

_KERNELS = ("sub_grouped", "unsub_grouped", "sparse_split", "sparse_join", "nibble_split", "nibble_join", "join_planes")
_grouping: ModuleType | None
try:
    from mfsreg.registry.format import _grouping  # C, built by setup.py where a compiler is at hand
except ImportError:  # no compiler at install: the numpy versions below (tests run both)
    _grouping = None
if _grouping is not None and not all(hasattr(_grouping, name) for name in _KERNELS):
    # A build left from an older checkout. Without the module, deltas are written ungrouped (larger;
    # every version decodes them) and decoding runs in numpy: say so instead of going on quietly.
    warnings.warn(
        "registry/_grouping was built from an older mfsreg: run `make install` (or reinstall mfsreg) "
        "to rebuild it; until then deltas are stored ungrouped and decoding is slower",
        RuntimeWarning,
        stacklevel=2,
    )
    _grouping = None

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


# Per buffer. A coding thread keeps about 25 named buffers, most of them one stream of a chunk, so
# a few times the largest chunk it has seen (about 8 MiB at the default 2 MiB chunk size).
SCRATCH_MAX = 16 << 20


def _scratch(name: str, n: int) -> np.ndarray:
    """A per-thread uint8 buffer of ``n`` bytes, reused from chunk to chunk. Encoding writes each
    chunk once or twice into temporary arrays; fresh ones cost a page fault and a zeroed page per
    4 KiB, which took more CPU than the numpy work itself (measured in an embedded push).
    Buffers past SCRATCH_MAX are not kept: a thread holds several, for its whole life."""
    if n > SCRATCH_MAX:
        return np.empty(n, dtype=np.uint8)
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


def joined_bytes(planes, itemsize: int) -> bytes:
    """join_planes as bytes: with the C module in one loop straight into the bytes returned (numpy
    widens, ors and then copies into fresh pages: plain chunks decoded about 3x slower)."""
    if _grouping is not None and itemsize > 1:
        return _grouping.join_planes(planes, itemsize)
    return join_planes(planes, itemsize).tobytes()


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


XOR = "xor"  # earlier deltas: still decoded, no longer written
SUB = "sub"
SUBN = "subn"  # sub with the lowest byte plane split into nibbles
ESUB = "esub"  # sub, grouped by the basis's exponent
ESUBN = "esubn"  # subn, grouped by the basis's exponent
DELTA_PREFIXES = (XOR, SUB, SUBN, ESUB, ESUBN)
# Grouped deltas end a zstd block where a group ends, so each group gets its own Huffman table;
# groups smaller than this many elements share a block with the next (a block's tables cost
# about a hundred bytes). 4096 to 65536 come out within 1% of each other on full-medical.
GROUP_MIN = 16384
# Nibbles pay when the differences are small: at most this share of elements may differ by 128
# ulps or more (a nonzero second plane), as in full and LoRA fine-tunes. Heavily retrained tensors
# differ by far more; split into nibbles they come out no smaller (lastlayers-code: 0.651 of raw
# either way) and decode about half as fast.
NIBBLE_MAX_WIDE = 1 / 8
# A delta this much smaller than the raw chunk cannot lose to plain zstd (bf16 weights: about 0.68
# of raw), so plain is not even tried: this keeps ingest of a delta-friendly fine-tune fast.
DELTA_CLEAR_WIN = 0.5
_SIGNED = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
_UNSIGNED = {1: np.uint8, **_WIDE}


def is_delta(encoding: str) -> bool:
    return encoding.startswith(tuple(p + "-p" for p in DELTA_PREFIXES))


def _nibble_split(plane: np.ndarray, out: np.ndarray) -> None:
    """``plane`` (n bytes) as the low nibbles of its byte pairs, then their high nibbles (and an odd
    last byte as it is), into ``out``. The C module writes the same bytes in one loop (numpy: eight
    passes).
    See docs/design/deltas.md."""
    if _grouping is not None:
        _grouping.nibble_split(plane, out)
        return
    k = plane.size // 2
    w = plane[: 2 * k].view(np.uint16)  # element pairs, little-endian: e0 | e1 << 8
    t = _scratch("nib_a", 2 * k).view(np.uint16)
    u = _scratch("nib_b", 2 * k).view(np.uint16)
    np.bitwise_and(w, 0x0F0F, out=t)  # e0 & 15 | (e1 & 15) << 8
    np.right_shift(t, 4, out=u)
    np.bitwise_or(t, u, out=t)  # low byte: e0 & 15 | (e1 & 15) << 4
    np.copyto(out[:k], t, casting="unsafe")
    np.right_shift(w, 4, out=t)
    np.bitwise_and(t, 0x0F0F, out=t)  # e0 >> 4 | (e1 >> 4) << 8
    np.right_shift(t, 4, out=u)
    np.bitwise_or(t, u, out=t)  # low byte: e0 >> 4 | (e1 >> 4) << 4
    np.copyto(out[k : 2 * k], t, casting="unsafe")
    out[2 * k :] = plane[2 * k :]


def _nibble_join(packed: np.ndarray, out: np.ndarray) -> None:
    """Inverse of _nibble_split, into ``out``."""
    if _grouping is not None:
        _grouping.nibble_join(packed, out)
        return
    k = packed.size // 2
    lo = _scratch("nib_a", 2 * k).view(np.uint16)
    hi = _scratch("nib_b", 2 * k).view(np.uint16)
    w = out[: 2 * k].view(np.uint16)
    # with L, H the low- and high-nibble bytes: e0 = L & 15 | (H & 15) << 4, e1 = L >> 4 | H & 0xF0,
    # so w = L & 0x0F | (H & 0x0F) << 4 | (L & 0xF0) << 4 | (H & 0xF0) << 8
    np.copyto(lo, packed[:k])
    np.copyto(hi, packed[k : 2 * k])
    np.bitwise_and(lo, 0x0F, out=w)
    np.left_shift(hi, 8, out=hi)
    np.bitwise_and(hi, 0xF000, out=lo)  # (H & 0xF0) << 8
    np.bitwise_or(w, lo, out=w)
    np.right_shift(hi, 4, out=hi)
    np.bitwise_and(hi, 0x00F0, out=hi)  # (H & 0x0F) << 4
    np.bitwise_or(w, hi, out=w)
    np.copyto(lo, packed[:k])
    np.left_shift(lo, 4, out=lo)
    np.bitwise_and(lo, 0x0F00, out=lo)  # (L & 0xF0) << 4
    np.bitwise_or(w, lo, out=w)
    out[2 * k :] = packed[2 * k :]


def _nibbles_if_small(planes: np.ndarray, itemsize: int) -> tuple[bool, np.ndarray]:
    """(nibbles, planes): for bf16/fp16 whose differences are mostly small (NIBBLE_MAX_WIDE), the
    lowest plane split into nibbles (in this thread's buffer); otherwise the planes as they are."""
    n = planes.size // itemsize
    if itemsize != 2 or np.count_nonzero(planes[n : 2 * n]) > NIBBLE_MAX_WIDE * n:
        return False, planes
    out = _scratch("sub_out", planes.size)
    _nibble_split(planes[:n], out[:n])
    out[n:] = planes[n:]
    return True, out


def _unnibble(planes: np.ndarray, itemsize: int) -> np.ndarray:
    """Inverse of _nibbles_if_small's split (in this thread's buffer)."""
    n = planes.size // itemsize
    unpacked = _scratch("unsub", planes.size)
    _nibble_join(planes[:n], unpacked[:n])
    unpacked[n:] = planes[n:]
    return unpacked


def sub_planes(data, basis, itemsize: int) -> tuple[str, np.ndarray]:
    """(encoding, planes) of a delta; the planes live in this thread's reusable buffers (use them
    before the next call).

    Each N-byte element of ``data`` minus the basis's, as wrapping N-byte integers, zigzagged, then
    split into byte planes; for bf16 and fp16 the lowest plane is also split into nibbles (``subn``)
    when most differences are small (NIBBLE_MAX_WIDE). Bytes past the end of the basis are kept as
    they are.
    See docs/design/deltas.md."""
    a = np.frombuffer(data, dtype=np.uint8)
    b = np.frombuffer(basis, dtype=np.uint8)
    m = min(a.size, b.size)
    m -= m % itemsize
    z = _scratch("sub", a.size)
    zw = z[:m].view(_UNSIGNED[itemsize])
    np.subtract(a[:m].view(_UNSIGNED[itemsize]), b[:m].view(_UNSIGNED[itemsize]), out=zw)
    sign = _scratch("sub_sign", m).view(_SIGNED[itemsize])
    np.right_shift(zw.view(_SIGNED[itemsize]), 8 * itemsize - 1, out=sign)  # 0 or all ones
    np.left_shift(zw, 1, out=zw)
    np.bitwise_xor(zw, sign.view(_UNSIGNED[itemsize]), out=zw)
    z[m:] = a[m:]
    if itemsize == 1:
        return f"{SUB}-p1", z
    nibbles, planes = _nibbles_if_small(split_planes(z, itemsize, _scratch("planes", a.size)), itemsize)
    return f"{SUBN if nibbles else SUB}-p{itemsize}", planes


def _unsub(planes: np.ndarray, basis, itemsize: int, nibbles: bool) -> np.ndarray:
    """Inverse of sub_planes: the raw bytes (a new array)."""
    size = planes.size
    if nibbles:
        planes = _unnibble(planes, itemsize)
    z = join_planes(planes, itemsize) if itemsize > 1 else planes.copy()
    b = np.frombuffer(basis, dtype=np.uint8)
    m = min(size, b.size)
    m -= m % itemsize
    zw = z[:m].view(_UNSIGNED[itemsize])
    neg = _scratch("unsub_sign", m).view(_UNSIGNED[itemsize])
    np.bitwise_and(zw, 1, out=neg)
    np.negative(neg, out=neg)  # 0 or all ones (unsigned wrap)
    np.right_shift(zw, 1, out=zw)
    np.bitwise_xor(zw, neg, out=zw)
    np.add(zw, b[:m].view(_UNSIGNED[itemsize]), out=zw)
    return z


def _compress_blocks(parts, size: int) -> bytes:
    """One zstd frame of the concatenated ``parts`` (``size`` bytes in all), each part ending a
    block (zstd also ends one every 128 KiB): each stretch gets its own Huffman tables instead of
    sharing them with bytes of another kind. Same frame format, so decoding needs nothing else."""
    cobj = _plane_cctx().compressobj(size=size)
    out = []
    for part in parts:
        if len(part):
            out.append(cobj.compress(part))
            out.append(cobj.flush(zstandard.COMPRESSOBJ_FLUSH_BLOCK))
    out.append(cobj.flush())
    return b"".join(out)


def _group_keys(b: np.ndarray, itemsize: int) -> np.ndarray:
    """Each basis element's key: the 8 bits after its sign (bf16 and fp32: the exponent)."""
    return ((b.view(_UNSIGNED[itemsize]) >> (8 * itemsize - 9)) & 0xFF).astype(np.uint8)


def _sub_grouped(a: np.ndarray, b: np.ndarray, itemsize: int, planes: np.ndarray, stride: int) -> np.ndarray:
    """Zigzagged differences a - b, grouped stably by the key of b's element, written as byte
    planes (byte k of each at planes[k * stride + position]); returns the 256 group sizes. The C
    module and numpy write the same bytes (tests compare them)."""
    sizes = np.empty(256, dtype=np.int64)
    if _grouping is not None:
        _grouping.sub_grouped(a, b, itemsize, planes, stride, sizes, _scratch("sub_joined", b.size))
        return sizes
    u, s = _UNSIGNED[itemsize], _SIGNED[itemsize]
    keys = _group_keys(b, itemsize)
    d = a.view(u) - b.view(u)
    z = ((d << u(1)) ^ (d.view(s) >> (8 * itemsize - 1)).view(u))[np.argsort(keys, kind="stable")]
    for k in range(itemsize):
        np.copyto(planes[k * stride : k * stride + z.size], z >> u(8 * k), casting="unsafe")
    sizes[:] = np.bincount(keys, minlength=256)
    return sizes


def _unsub_grouped(planes: np.ndarray, stride: int, b: np.ndarray, itemsize: int, tail=b"") -> bytes:
    """Inverse of _sub_grouped: b plus the ungrouped differences, then ``tail`` (new bytes)."""
    if _grouping is not None:
        return _grouping.unsub_grouped(
            planes, stride, b, itemsize, tail, _scratch("unsub_joined", _joined_room(b, itemsize))
        )
    u = _UNSIGNED[itemsize]
    n = b.size // itemsize
    zz = np.zeros(n, dtype=u)
    for k in range(itemsize):
        zz |= planes[k * stride : k * stride + n].astype(u) << u(8 * k)
    z = np.empty_like(zz)
    z[np.argsort(_group_keys(b, itemsize), kind="stable")] = zz
    return (b.view(u) + ((z >> u(1)) ^ (u(0) - (z & u(1))))).tobytes() + bytes(tail)


def _joined_room(b: np.ndarray, itemsize: int) -> int:
    """Scratch bytes unsub_grouped needs: two-byte elements leave room for the vector path's keys
    and list too (_grouping.c, unsub16_avx512)."""
    return 2 * b.size + 512 if itemsize == 2 else b.size


def _block_ends(counts: np.ndarray, n: int) -> list[int]:
    """Element offsets where blocks of grouped differences end: at group ends, once a block holds
    GROUP_MIN elements. Only the encoder uses them (the decoder reads one zstd frame)."""
    ends, last = [], 0
    for end in np.cumsum(counts).tolist():
        if end - last >= GROUP_MIN and end < n:
            ends.append(end)
            last = end
    return ends + [n]


# A stream of a grouped delta is sent sparse (flag bits, then its nonzero bytes) when at most
# this share of its bytes is nonzero; denser, the flags cost more than Huffman loses on zeros.
SPARSE_MAX_DENSITY = 0.5


def _sparse_split(
    stream: np.ndarray, slot: int, ends: list[int] | None = None
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """(flag bits, least significant first; the nonzero bytes; how many bytes before each of
    ``ends`` are nonzero) of a byte stream, in this thread's buffers for ``slot``. The C module
    and numpy write the same bytes (tests compare them)."""
    ends = list(ends or [])
    flags = _scratch(f"sparse_flags{slot}", (stream.size + 7) // 8)
    if _grouping is not None:
        values = _scratch(f"sparse_values{slot}", stream.size)
        counts = np.empty(len(ends), dtype=np.int64)
        nnz = _grouping.sparse_split(stream, flags, values, np.asarray(ends, dtype=np.int64), counts)
        return flags, values[:nnz], counts.tolist()
    nonzero = stream != 0
    flags[:] = np.packbits(nonzero, bitorder="little")
    before = np.concatenate([[0], np.cumsum(nonzero, dtype=np.int64)])
    return flags, stream[nonzero], before[ends].tolist()


def _sparse_join(buf: np.ndarray, pos: int, out: np.ndarray) -> int:
    """Fill ``out`` from the sparse stream at buf[pos:]; returns the position after it."""
    nflags = (out.size + 7) // 8
    flags, values = buf[pos : pos + nflags], buf[pos + nflags :]
    if flags.size < nflags:
        raise ValueError("sparse stream cut short")
    if _grouping is not None:
        used = _grouping.sparse_join(flags, values, out)
    else:
        nonzero = np.unpackbits(flags, count=out.size, bitorder="little").view(bool)
        used = int(np.count_nonzero(nonzero))
        if used > values.size:
            raise ValueError("sparse stream: the flags ask for more values than it holds")
        out[:] = 0
        out[nonzero] = values[:used]
    return pos + nflags + used


def _grouped_streams(itemsize: int, total: int, nibbles: bool) -> list[tuple[int, int]]:
    """(start, end) in the planes of each stream of a grouped delta: with nibbles the low
    nibbles of element pairs, their high nibbles (and an odd last byte), then the upper planes;
    without, each plane."""
    planes = [(p * total, (p + 1) * total) for p in range(1 if nibbles else 0, itemsize)]
    return [(0, total // 2), (total // 2, total)] + planes if nibbles else planes


def _encode_grouped(data, basis, itemsize: int) -> tuple[str, bytes]:
    """esub-pN / esubn-pN: sub_planes with the differences grouped by their basis element's key
    (_grouping.c says why). The payload decompresses to one header byte (bit i set: stream i is
    sparse, see _sparse_split) and the streams of _grouped_streams in turn; in every stream a zstd
    block ends at the end of a group once it holds GROUP_MIN elements (_block_ends)."""
    a = np.frombuffer(data, dtype=np.uint8)
    b = np.frombuffer(basis, dtype=np.uint8)
    m = min(a.size, b.size)
    m -= m % itemsize
    total, n = a.size // itemsize, m // itemsize
    planes = _scratch("planes", a.size)
    sizes = _sub_grouped(a[:m], b[:m], itemsize, planes, total)
    if total > n:  # appended rows: kept as they are, after the groups of each plane
        tail = split_planes(a[m:], itemsize)
        for k in range(itemsize):
            planes[k * total + n : (k + 1) * total] = tail[k * (total - n) : (k + 1) * (total - n)]
    ends = _block_ends(sizes, n)  # group ends inside the part the basis covers
    nibbles, planes = _nibbles_if_small(planes, itemsize)
    header = 0
    parts: list[np.ndarray | bytes] = []
    for i, (start, end) in enumerate(_grouped_streams(itemsize, total, nibbles)):
        stream = planes[start:end]
        # where the groups end in this stream (nibble streams hold two elements a byte)
        local = sorted({min(e // 2 if nibbles and i < 2 else e, stream.size) for e in ends} | {stream.size})
        segments = list(zip([0] + local, local))
        eligible = nibbles or i > 0  # the low plane of wide differences is near-random: never sparse
        # split first (one pass, counting each block's nonzero bytes), then keep it if sparse enough
        split = _sparse_split(stream, i, local) if eligible else None
        if split is not None and len(split[1]) <= SPARSE_MAX_DENSITY * stream.size:
            flags, values, counts = split
            header |= 1 << i
            parts += [flags[(x + 7) // 8 : (y + 7) // 8] for x, y in segments]
            parts += [values[x:y] for x, y in zip([0] + counts, counts)]
        else:
            parts += [stream[x:y] for x, y in segments]
    parts.insert(0, bytes([header]))
    encoding = f"{ESUBN}-p2" if nibbles else f"{ESUB}-p{itemsize}"
    return encoding, _compress_blocks(parts, sum(len(p) for p in parts))


def _decode_grouped(payload, size: int, basis, itemsize: int, nibbles: bool) -> bytes:
    """Inverse of _encode_grouped: the raw bytes."""
    planes, stride, b, tail = _grouped_parts(payload, size, basis, itemsize, nibbles)
    return _unsub_grouped(planes, stride, b, itemsize, tail)


def _grouped_parts(
    payload, size: int, basis, itemsize: int, nibbles: bool
) -> tuple[np.ndarray, int, np.ndarray, bytes]:
    """A grouped delta's (planes, stride, basis bytes it covers, appended bytes): _unsub_grouped's arguments."""
    if size % itemsize:
        raise ValueError(f"a {size}-byte chunk cannot hold {itemsize}-byte elements")
    total = size // itemsize
    # flags add at most one byte in eight, plus the header byte and a partial flag byte per stream
    buf = np.frombuffer(_decompress(payload, size, most=size + size // 8 + 16), dtype=np.uint8)
    if buf.size == 0:
        raise ValueError("grouped delta holds no header")
    streams = _grouped_streams(itemsize, total, nibbles)
    header, pos = int(buf[0]), 1
    if header >> len(streams):
        raise ValueError(f"grouped delta header {header:#x} names streams this encoding lacks")
    planes = _scratch("unsub_planes", size)
    for i, (start, end) in enumerate(streams):
        if header >> i & 1:
            pos = _sparse_join(buf, pos, planes[start:end])
        else:
            if buf.size - pos < end - start:
                raise ValueError("grouped delta cut short")
            planes[start:end] = buf[pos : pos + end - start]
            pos += end - start
    if pos != buf.size:
        raise ValueError(f"grouped delta has {buf.size - pos} bytes past its streams")
    if nibbles:
        planes = _unnibble(planes, itemsize)
    b = np.frombuffer(basis, dtype=np.uint8)
    m = min(size, b.size)
    m -= m % itemsize
    n = m // itemsize
    tail = b""
    if total > n:  # appended rows
        tail = joined_bytes(
            np.concatenate([planes[k * total + n : (k + 1) * total] for k in range(itemsize)]), itemsize
        )
    return planes, total, b[:m], tail


def encode_delta(data, basis, itemsize: int) -> tuple[str, bytes]:
    """(encoding, payload) of ``data`` as a delta against ``basis``: grouped by the exponent of each
    basis element (``esub``, ``esubn``) where the C module is built and elements are wider than a
    byte, else ungrouped (``sub``, ``subn``).
    See docs/design/deltas.md."""
    if _grouping is not None and itemsize > 1:
        return _encode_grouped(data, basis, itemsize)
    encoding, planes = sub_planes(data, basis, itemsize)
    return encoding, _plane_cctx().compress(planes.data)


def best_encoding(data, itemsize: int, basis=None, plain: tuple[str, bytes] | None = None) -> tuple[str, bytes, bool]:
    """The smallest of plain and (with a basis) delta; returns (encoding, payload, is_delta).
    ``plain``: a plain (encoding, payload) of ``data`` already at hand, such as the compressed
    payload a client uploaded; it is used as the plain candidate instead of encoding again."""
    n = len(data)
    if basis is not None and n % itemsize == 0:
        delta_encoding, delta = encode_delta(data, basis, itemsize)
        if len(delta) <= DELTA_CLEAR_WIN * n:
            return delta_encoding, delta, True
        encoding, payload = plain or encode(data, itemsize)
        if len(delta) < len(payload):
            return delta_encoding, delta, True
        return encoding, payload, False
    encoding, payload = encode(data, itemsize)
    return encoding, payload, False


def encode(data, itemsize: int = 1) -> tuple[str, bytes]:
    """Encode a chunk's raw bytes; returns (encoding, payload), the smallest that was tried."""
    n = len(data)
    if itemsize > 1 and n % itemsize == 0 and n >= 4 * itemsize:
        # a block ends where each plane ends: in a chunk under 128 KiB a plane would otherwise
        # share its Huffman table with the next (bf16: 0.78 of raw instead of 0.67 at 64K elements)
        planes = split_planes(data, itemsize, _scratch("planes", n))
        plane = n // itemsize
        payload = _compress_blocks([planes[k * plane : (k + 1) * plane] for k in range(itemsize)], n)
        encoding = f"{ZSTD}-p{itemsize}"
    else:
        payload = _cctx().compress(data)
        encoding = ZSTD
    if len(payload) >= n:
        return RAW, bytes(data)
    return encoding, payload


def _decompress(payload, size: int, most: int | None = None) -> bytes:
    """The frame's bytes, which must number exactly ``size`` (or, given ``most``, no more than it).
    zstd trusts a frame's declared content size over max_output_size: check it first, or a tiny
    hostile frame could claim gigabytes."""
    declared = zstandard.frame_content_size(payload)
    if most is None and declared != size or most is not None and not 0 <= declared <= most:
        expected = size if most is None else f"at most {most}"
        raise ValueError(f"zstd frame declares {declared} bytes, expected {expected}")
    return _dctx().decompress(payload, max_output_size=declared)


def decode(encoding: str, payload, size: int, basis=None) -> bytes:
    """Rebuild a chunk's raw bytes from its stored payload. Raises ValueError on unknown encodings,
    on a delta without its basis, and on frames that do not declare exactly ``size`` bytes."""
    if encoding == RAW:
        return bytes(payload)
    if encoding == ZSTD:
        return _decompress(payload, size)
    if not is_known(encoding):
        raise ValueError(f"unknown chunk encoding {encoding!r}")
    prefix, _, width = encoding.rpartition("-p")
    itemsize = int(width)
    if prefix != ZSTD and basis is None:
        raise ValueError(f"a {encoding} chunk needs its basis to decode")
    if prefix in (ESUB, ESUBN):
        return _decode_grouped(payload, size, basis, itemsize, nibbles=prefix == ESUBN)
    planes = _decompress(payload, size)
    if prefix == ZSTD:
        return joined_bytes(planes, itemsize)
    if prefix == XOR:
        x = join_planes(planes, itemsize)
        b = np.frombuffer(basis, dtype=np.uint8)
        m = min(x.size, b.size)
        m -= m % itemsize
        np.bitwise_xor(x[:m], b[:m], out=x[:m])
        return x.tobytes()
    return _unsub(np.frombuffer(planes, dtype=np.uint8), basis, itemsize, nibbles=prefix == SUBN).tobytes()


def decode_reusing(encoding: str, payload, size: int, basis=None) -> bytes | memoryview:
    """decode(), except that a grouped delta (most chunks of a fine-tune) is written into this
    thread's reusable buffer and comes back as a view of it, valid until the thread's next call:
    for a caller that only writes the bytes on, as a node writes a fetched chunk to its cache file.
    A new bytes object per chunk is fresh memory, faulted in page by page: 105 MB of it in a
    1.16 GB member's load with the base cached."""
    prefix, _, width = encoding.rpartition("-p")
    if (
        _grouping is None
        or prefix not in (ESUB, ESUBN)
        or size > SCRATCH_MAX
        or basis is None
        or not is_known(encoding)
    ):
        return decode(encoding, payload, size, basis)  # (which raises where it must)
    itemsize = int(width)
    planes, stride, b, tail = _grouped_parts(payload, size, basis, itemsize, nibbles=prefix == ESUBN)
    out = _scratch("decoded", size)
    n = _grouping.unsub_grouped(
        planes, stride, b, itemsize, tail, _scratch("unsub_joined", _joined_room(b, itemsize)), out
    )
    return out[:n].data


def is_known(encoding: str) -> bool:
    if encoding in (RAW, ZSTD):
        return True
    prefix, _, width = encoding.rpartition("-p")
    if prefix in (ESUB, ESUBN):  # grouping needs a sign and an exponent: two bytes or more
        return width in ("2", "4", "8")
    return prefix in (ZSTD, *DELTA_PREFIXES) and width in ("1", "2", "4", "8")
