"""Lossless deltas: near-duplicate chunks stored as zigzagged differences against a basis chunk, in byte planes."""

from __future__ import annotations

import filecmp
import functools
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from mfsreg.registry.blobs.packs import StoredChunk, pack_key
from mfsreg.registry.errors import IntegrityError, StorageError
from mfsreg.registry.format import codec
from mfsreg.registry.format.chunking import chunk_id
from mfsreg.registry.format.rebuild import decode_batch, decode_landed, decode_verified
from mfsreg.registry.format.wire import Located
from mfsreg.registry.store.deltas import MAX_DEPTH
from tests import synth
from tests.dialects import sqlite_only
from tests.kernels import WAYS, kernel_way


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("basis_len", [0.5, 1.0, 1.5])
def test_codec_round_trip(itemsize, basis_len):
    rng = np.random.default_rng(itemsize)
    data = rng.integers(0, 255, 4096 * itemsize, dtype=np.uint8)
    basis = data.copy()
    basis[::7] ^= 1  # near-duplicate
    basis = (
        basis[: int(basis.size * basis_len) // itemsize * itemsize]
        if basis_len <= 1
        else np.concatenate([basis, basis[: 100 * itemsize]])
    )
    enc, payload, is_delta = codec.best_encoding(data.tobytes(), itemsize, basis.tobytes())
    assert codec.decode(enc, payload, data.size, basis.tobytes() if is_delta else None) == data.tobytes()
    plain_enc, plain = codec.encode(data.tobytes(), itemsize)
    assert codec.decode(plain_enc, plain, data.size) == data.tobytes()


@pytest.mark.parametrize("itemsize", [1, 2, 4, 8])
@pytest.mark.parametrize("elements", [1, 3, 4097])
@pytest.mark.parametrize("change", ["small", "large"])
@pytest.mark.parametrize("basis_len", [0.0, 0.5, 1.0, 1.5])
def test_delta_round_trip(itemsize, elements, change, basis_len, monkeypatch):
    """Every width, odd element counts (a nibble pair short), differences that wrap around and flip
    signs, and bases shorter or longer than the chunk."""
    rng = np.random.default_rng(itemsize * 100 + elements)
    data = rng.integers(0, 256, elements * itemsize, dtype=np.uint8)
    basis = data.copy()
    if change == "small":
        basis[:: itemsize * 3] ^= 1  # one lowest byte in three: a difference of +-1
    else:
        basis[::3] = rng.integers(0, 256, basis[::3].size, dtype=np.uint8)
    basis = (
        basis[: int(elements * basis_len) * itemsize]
        if basis_len <= 1
        else np.concatenate([basis, basis[: 5 * itemsize]])
    )
    enc, payload = codec.encode_delta(data.tobytes(), basis.tobytes(), itemsize)
    assert codec.is_delta(enc) and codec.is_known(enc)
    assert codec.decode(enc, payload, data.size, basis.tobytes()) == data.tobytes()
    monkeypatch.setattr(codec, "_grouping", None)  # a node without the C module decodes it too
    assert codec.decode(enc, payload, data.size, basis.tobytes()) == data.tobytes()


def test_delta_of_unaligned_read_only_views(tmp_path):
    """Chunks reach the encoder as slices of a file's mmap at any offset (read-only, unaligned)."""
    import mmap

    w = (torch.randn(4097) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    moved = bytearray(w)
    moved[::6] = bytes(b ^ 1 for b in moved[::6])
    path = tmp_path / "blob"
    path.write_bytes(b"x" + bytes(moved) + b"y" + w)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
        view = memoryview(mm)
        data, basis = view[1 : 1 + len(w)], view[2 + len(w) :]
        enc, payload, is_delta = codec.best_encoding(data, 2, basis)
        assert is_delta and codec.decode(enc, payload, len(w), basis) == bytes(moved)
        del data, basis, view


def test_chunks_past_the_scratch_limit_round_trip(monkeypatch):
    """Buffers for chunks larger than SCRATCH_MAX are fresh arrays, not kept per thread."""
    monkeypatch.setattr(codec, "SCRATCH_MAX", 1024)
    w = (torch.randn(4097) * 0.02).to(torch.bfloat16)
    base = w.view(torch.uint8).numpy().tobytes()
    moved = (w.float() * 1.001).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    enc, payload, is_delta = codec.best_encoding(moved, 2, base)
    assert is_delta and codec.decode(enc, payload, len(moved), base) == moved
    enc, payload = codec.encode(moved, 2)
    assert codec.decode(enc, payload, len(moved)) == moved


def test_delta_without_its_basis_is_refused():
    base = (torch.randn(1 << 12) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    enc, payload = codec.encode_delta(base[::-1], base, 2)
    with pytest.raises(ValueError, match="needs its basis"):
        codec.decode(enc, payload, len(base))


def test_a_basis_found_damaged_or_lost_gives_way_to_the_one_below_it():
    """cap_depth steps down a chain past a basis that cannot be read: in a lost pack, or read and
    found damaged by the push itself (--mend-damaged), or leaning on such a chunk; a chunk below
    the bad one still serves, and with none below the new chunk goes plain."""
    from mfsreg.registry.store.deltas import cap_depth

    plain = StoredChunk("p", 8, "raw", 8, "pack-a", 0)
    mid = StoredChunk("m", 8, "xor", 4, "pack-b", 0, "p", 1)
    top = StoredChunk("t", 8, "xor", 4, "pack-c", 0, "m", 2)
    located = {c.id: c for c in (plain, mid, top)}
    assert cap_depth("t", located) == "t"
    assert cap_depth("t", located, damaged={"m"}) == "p"  # t leans on the damaged m
    assert cap_depth("t", located, damaged={"t"}) == "m"
    assert cap_depth("t", located, damaged={"p"}) is None  # everything leans on p: plain
    assert cap_depth("t", located, lost={"pack-b"}) == cap_depth("t", located, damaged={"m"})  # the same rule
    assert cap_depth("t", located, {"pack-c"}, {"m"}) == "p"


def test_small_bf16_differences_use_nibbles_and_large_ones_do_not():
    w = torch.randn(1 << 16) * 0.02
    base = w.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    for rel, expected in ((1e-3, "esubn-p2"), (0.5, "esub-p2")):
        moved = (w + torch.randn_like(w) * 0.02 * rel).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
        enc, payload = codec.encode_delta(moved, base, 2)
        assert enc == expected and codec.decode(enc, payload, len(moved), base) == moved


@pytest.mark.skipif(not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler: the numpy versions run")
def test_grouping_module_is_built():
    """setup.py builds registry/format/_grouping.c optionally, so a broken build would only show as slow,
    ungrouped deltas: where a compiler is at hand (as in CI) the module must be there, or the
    tests that compare it with numpy would compare numpy with itself."""
    assert codec._grouping is not None, (
        "registry/format/_grouping.c is not built, or built from an older checkout: make install"
    )


@pytest.mark.parametrize("itemsize", [2, 4, 8])
@pytest.mark.parametrize("elements", [1, 4, 7, 4099, 50_001])
def test_grouping_module_writes_what_numpy_writes(itemsize, elements, monkeypatch):
    """The C kernels and the numpy fallback give the same planes, group sizes and inverse, on
    unaligned read-only input and a plane stride wider than the elements. The C loops walk four
    quarters side by side: the counts cover quarters of none, one and over one block of
    elements, with and without a remainder."""
    rng = np.random.default_rng(itemsize + elements)
    raw = rng.integers(0, 256, 2 * elements * itemsize + 1, dtype=np.uint8)
    raw.flags.writeable = False
    a, b = raw[1 : 1 + elements * itemsize], raw[1 + elements * itemsize :]  # odd offsets
    stride = elements + 3
    results = []
    for module in (codec._grouping, None):
        monkeypatch.setattr(codec, "_grouping", module)
        planes = np.zeros(itemsize * stride, dtype=np.uint8)
        sizes = codec._sub_grouped(a, b, itemsize, planes, stride)
        assert codec._unsub_grouped(planes, stride, b, itemsize, b"tail") == a.tobytes() + b"tail"
        results.append((planes, sizes))
    assert (results[0][0] == results[1][0]).all() and (results[0][1] == results[1][1]).all()
    assert results[0][1].sum() == elements


def _bf16_weights(n: int, rng: np.random.Generator) -> np.ndarray:
    """n bf16 weights of N(0, 0.02), as two-byte integers: keys crowd into a band of exponents."""
    w = torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 0.02)
    return w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


@functools.cache
def _two_byte_bases() -> dict[str, np.ndarray]:
    """Bases for the ways the two-byte ungrouping goes (see _grouping.c, unsub16_avx512): made once,
    read only."""
    rng = np.random.default_rng(0)
    outliers = _bf16_weights(50_001, rng)
    outliers[rng.integers(0, outliers.size, 300)] = rng.integers(0, 1 << 16, 300)  # keys far outside the band
    spread = rng.integers(0, 1 << 16, 4096).astype(np.uint16)
    spread[::61] = _bf16_weights(spread[::61].size, rng)  # every key the band is chosen from is in it
    return {
        "too small for the vector path": _bf16_weights(1023, rng),
        "the smallest it takes": _bf16_weights(1024, rng),
        "a partial last vector": _bf16_weights(4099, rng),
        "a 2 MiB chunk": _bf16_weights(1 << 20, rng),
        "keys far outside the band": outliers,
        "random bytes: no band": rng.integers(0, 1 << 16, 50_001).astype(np.uint16),
        "a band the sample misjudged": spread,
    }


@pytest.mark.skipif(codec._grouping is None, reason="no C module")
@pytest.mark.parametrize("case", list(_two_byte_bases()))
def test_two_byte_ungrouping_matches_on_and_off_the_vector_path(case, monkeypatch):
    """Two-byte elements (bf16, fp16) ungroup through AVX-512 expand loads where the processor has
    them and the keys crowd into a band; elsewhere (too few elements, no band, a band the sample
    chose wrongly) through the plain loop. Each way writes the same bytes as numpy, with a tail."""
    b = _two_byte_bases()[case]
    rng = np.random.default_rng(1)
    a = b + rng.integers(-3, 4, b.size).astype(np.uint16)  # wrapping differences of a few ulps
    a[rng.integers(0, a.size, 50)] = rng.integers(0, 1 << 16, 50)  # and a few wide ones
    stride = b.size + 5
    planes = np.zeros(2 * stride, dtype=np.uint8)
    codec._sub_grouped(a.view(np.uint8), b.view(np.uint8), 2, planes, stride)
    expected = a.tobytes() + b"tail"
    for way in WAYS:
        with kernel_way(way, monkeypatch):
            assert way != "plain" or codec._grouping.vector_paths() == ()
            assert codec._unsub_grouped(planes, stride, b.view(np.uint8), 2, b"tail") == expected


@pytest.mark.skipif(codec._grouping is None, reason="no C module")
def test_grouping_refuses_a_short_or_shared_scratch():
    a, b = np.arange(64, dtype=np.uint8), np.arange(64, dtype=np.uint8)[::-1].copy()
    planes = np.zeros(64, dtype=np.uint8)  # two planes of 32 two-byte elements
    sizes = np.zeros(256, dtype=np.int64)
    codec._grouping.sub_grouped(a, b, 2, planes, 32, sizes, np.empty(64, dtype=np.uint8))
    assert codec._grouping.unsub_grouped(planes, 32, b, 2, b"", np.empty(64, dtype=np.uint8)) == a.tobytes()
    tail = np.zeros(8, dtype=np.uint8)
    for scratch in (np.empty(63, dtype=np.uint8), planes, b):
        with pytest.raises(ValueError, match="scratch"):
            codec._grouping.unsub_grouped(planes, 32, b, 2, tail, scratch)
        with pytest.raises(ValueError, match="scratch"):
            codec._grouping.sub_grouped(a, b, 2, planes, 32, sizes, scratch)
    for args in ((a, b, 2, planes, 32, sizes, sizes), (a, b, 2, planes, 32, sizes, a)):
        with pytest.raises(ValueError, match="scratch"):
            codec._grouping.sub_grouped(*args)
    wide = np.zeros(128, dtype=np.uint8)
    with pytest.raises(ValueError, match="scratch"):
        codec._grouping.unsub_grouped(planes, 32, b, 2, wide[:8], wide[4:])  # shares bytes with the tail


def test_grouping_makes_a_full_fine_tune_smaller():
    """Grouped by the basis's exponent, the deltas of a full fine-tune (every weight moved by about
    1e-3 of the weights' scale) come out well below the same deltas ungrouped."""
    w = torch.randn(1 << 19) * 0.02
    base = w.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    moved = (w + torch.randn_like(w) * 2e-5).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    enc, grouped = codec.encode_delta(moved, base, 2)
    ungrouped_enc, planes = codec.sub_planes(moved, base, 2)
    ungrouped = codec._plane_cctx().compress(planes)
    assert (enc, ungrouped_enc) == ("esubn-p2", "subn-p2")
    assert len(grouped) < 0.8 * len(ungrouped)
    assert codec.decode(enc, grouped, len(moved), base) == moved


def test_without_the_grouping_module_deltas_are_ungrouped_and_grouped_ones_still_decode(monkeypatch):
    w = torch.randn(1 << 14) * 0.02
    base = w.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    moved = (w * 1.001).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    grouped = codec.encode_delta(moved, base, 2)
    monkeypatch.setattr(codec, "_grouping", None)
    assert codec.decode(*grouped, len(moved), base) == moved
    enc, payload = codec.encode_delta(moved, base, 2)
    assert enc == "subn-p2" and codec.decode(enc, payload, len(moved), base) == moved


@pytest.mark.parametrize("length", [0, 1, 2, 7, 4099, 65536])
def test_nibbles_and_plane_joins_match_numpy(length, monkeypatch):
    """The C nibble split and join and the C plane join write what numpy writes, for odd and even
    lengths, and each inverts its split."""
    rng = np.random.default_rng(length)
    plane = rng.integers(0, 256, length, dtype=np.uint8)
    results = []
    for module in (codec._grouping, None):
        monkeypatch.setattr(codec, "_grouping", module)
        packed = np.full(length, 7, dtype=np.uint8)
        codec._nibble_split(plane, packed)
        back = np.full(length, 7, dtype=np.uint8)
        codec._nibble_join(packed, back)
        assert (back == plane).all()
        joined = {k: codec.joined_bytes(plane[: length - length % k], k) for k in (2, 4, 8)}
        for k, raw in joined.items():
            assert codec.split_planes(raw, k).tobytes() == plane[: length - length % k].tobytes()
        results.append((packed, joined))
    assert (results[0][0] == results[1][0]).all() and results[0][1] == results[1][1]


@pytest.mark.skipif(codec._grouping is None, reason="no C module: numpy's versions take no output buffer to check")
def test_nibble_kernels_refuse_short_or_overlapping_output():
    plane = np.arange(64, dtype=np.uint8)
    for kernel in (codec._grouping.nibble_split, codec._grouping.nibble_join):
        with pytest.raises(ValueError, match="apart from it"):
            kernel(plane, plane)  # in place: the loops would read bytes they already wrote
        with pytest.raises(ValueError, match="apart from it"):
            kernel(plane[:32], plane[16:48])
        with pytest.raises(ValueError, match="as long as"):
            kernel(plane[:32], np.empty(31, dtype=np.uint8))


@pytest.mark.parametrize("length", [0, 1, 7, 8, 9, 15, 16, 17, 31, 33, 4099])
@pytest.mark.parametrize("density", [0.0, 0.02, 0.3, 1.0])  # 0.02: runs of zero flag bytes between set ones
def test_sparse_streams_match_numpy_and_round_trip(length, density, monkeypatch):
    rng = np.random.default_rng(length)
    stream = np.where(rng.random(length) < density, rng.integers(1, 256, length), 0).astype(np.uint8)
    ends = sorted({0, length, *rng.integers(0, length + 1, 5).tolist()})
    expected = [int(np.count_nonzero(stream[:e])) for e in ends]
    results = []
    for way in WAYS:  # split each way, then joined each way of its module
        with kernel_way(way, monkeypatch):
            flags, values, counts = codec._sparse_split(stream, 0, ends)
        flags, values = flags.copy(), values.copy()
        assert values.size == np.count_nonzero(stream)
        assert counts == expected
        buf = np.concatenate([[7], flags, values, [1, 2]]).astype(np.uint8)  # between other bytes
        for join_way in ("numpy",) if way == "numpy" else WAYS[:2]:
            out = np.full(length, 99, dtype=np.uint8)
            with kernel_way(join_way, monkeypatch):
                assert codec._sparse_join(buf, 1, out) == 1 + flags.size + values.size
            assert (out == stream).all()
        results.append((flags, values))
    for flags, values in results[1:]:
        assert (results[0][0] == flags).all() and (results[0][1] == values).all()


@pytest.mark.skipif(codec._grouping is None, reason="no C module")
def test_sparse_split_refuses_ends_out_of_order():
    stream = np.zeros(32, dtype=np.uint8)
    flags, values = np.empty(4, dtype=np.uint8), np.empty(32, dtype=np.uint8)
    for ends in ([5, 3], [40], [-1]):
        with pytest.raises(ValueError, match="ascend"):
            codec._grouping.sparse_split(
                stream, flags, values, np.array(ends, dtype=np.int64), np.empty(len(ends), dtype=np.int64)
            )


@pytest.mark.parametrize("values", [2, 63, 100])
def test_sparse_stream_with_too_few_values_is_refused(values, monkeypatch):
    """A stream whose flags ask for more values than follow them is refused on each path: the
    vector path (64 bytes a step) stops where the values would run out, in its first step or later."""
    buf = np.concatenate([np.full(25, 0xFF), np.arange(values)]).astype(np.uint8)  # 200 flags set
    for way in WAYS:
        with kernel_way(way, monkeypatch), pytest.raises(ValueError, match="more values"):
            codec._sparse_join(buf, 0, np.empty(200, dtype=np.uint8))


def test_mostly_zero_planes_are_sent_sparse_and_smaller(monkeypatch):
    """A retrained layer's high plane is about 60% zeros: as flag bits plus its nonzero bytes it
    costs less than zstd's Huffman stage spends on it directly."""
    w = torch.randn(1 << 18) * 0.02
    base = w.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    moved = (w + torch.randn_like(w) * 0.01).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    enc, sparse = codec.encode_delta(moved, base, 2)
    assert enc == "esub-p2" and codec._dctx().decompress(sparse)[0] == 0b10  # the high plane only
    monkeypatch.setattr(codec, "SPARSE_MAX_DENSITY", -1.0)
    enc, dense = codec.encode_delta(moved, base, 2)
    assert enc == "esub-p2" and codec._dctx().decompress(dense)[0] == 0
    assert len(sparse) < 0.98 * len(dense)
    for payload in (sparse, dense):
        assert codec.decode(enc, payload, len(moved), base) == moved


@pytest.mark.parametrize("with_module", [True, False])
def test_malformed_grouped_deltas_are_refused(with_module, monkeypatch):
    """Frames that decompress to a wrong header, too few or too many bytes: a clear ValueError
    (decode_verified turns it into a damaged-pack error), never a crash or wrong bytes."""
    import zstandard

    w = torch.randn(1 << 14) * 0.02
    base = w.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    moved = (w * 1.001).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    enc, payload = codec.encode_delta(moved, base, 2)
    body = codec._dctx().decompress(payload)
    if not with_module:
        monkeypatch.setattr(codec, "_grouping", None)
    for bad, says in (
        (bytes([0x80]) + body[1:], "names streams"),
        (body + b"x", "past its streams"),
        (body[:-1], "cut short|more values"),
        (body + bytes(len(moved)), "declares"),
        (b"", "no header"),
    ):
        with pytest.raises(ValueError, match=says):
            codec.decode(enc, zstandard.ZstdCompressor().compress(bad), len(moved), base)
    with pytest.raises(ValueError, match="cannot hold"):  # a size the element width does not divide
        codec.decode(enc, payload, len(moved) - 1, base)


def test_plain_planes_of_a_small_chunk_get_blocks_of_their_own():
    """A bf16 chunk of 64K elements fits one zstd block; its two planes each get one (so their
    own Huffman tables): 0.67 of raw instead of 0.78 with one block for both."""
    t = (torch.randn(1 << 16) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    enc, payload = codec.encode(t, 2)
    one_block = codec._plane_cctx().compress(codec.split_planes(t, 2))
    assert enc == "zstd-p2" and len(payload) < 0.9 * len(one_block)
    assert codec.decode(enc, payload, len(t)) == t


def test_xor_deltas_stored_before_sub_still_decode():
    """Chunks written as xor-p2 (the earlier delta: xor, byte planes, zstd) stay readable."""
    import zstandard

    t = (torch.randn(1 << 14) * 0.02).to(torch.bfloat16)
    near = (t.float() * 1.001).to(torch.bfloat16)
    a, b = near.view(torch.uint8).numpy(), t.view(torch.uint8).numpy()
    payload = zstandard.ZstdCompressor().compress(codec.split_planes(np.bitwise_xor(a, b), 2))
    assert codec.decode("xor-p2", payload, a.size, b.tobytes()) == a.tobytes()


@pytest.mark.skipif(codec._grouping is None, reason="no C module")
def test_grouping_writes_into_a_given_output_or_refuses_it():
    """unsub_grouped's ``out``: the bytes it would return, written there (their length returned),
    every one of them on each way, a partial last vector and keys far outside the band included;
    one too short, or sharing bytes with another buffer, is refused."""
    b = _two_byte_bases()["keys far outside the band"]  # 50,001 elements: a partial last vector too
    a = b + np.random.default_rng(2).integers(-3, 4, b.size).astype(np.uint16)
    planes = np.zeros(2 * b.size, dtype=np.uint8)
    codec._sub_grouped(a.view(np.uint8), b.view(np.uint8), 2, planes, b.size)
    scratch = np.empty(2 * b.nbytes + 512, dtype=np.uint8)
    tail = np.frombuffer(b"tail", dtype=np.uint8)
    want = a.tobytes() + b"tail"
    for way in ("vector", "plain"):
        with kernel_way(way):
            out = np.full(len(want) + 9, 7, dtype=np.uint8)  # (not zeroed: every byte must be written)
            assert codec._grouping.unsub_grouped(planes, b.size, b, 2, tail, scratch, out) == len(want)
            assert out[: len(want)].tobytes() == want and (out[len(want) :] == 7).all()
    shared = np.zeros(len(want) + 2, dtype=np.uint8)  # an out whose last bytes are the tail's first
    wide_planes = np.zeros(len(want) + 8, dtype=np.uint8)
    wide_planes[: planes.size] = planes
    for p, t, out in (
        (planes, tail, np.empty(len(want) - 1, dtype=np.uint8)),
        (planes, tail, scratch),
        (planes, shared[-4:], shared[:-2]),
        (wide_planes, tail, wide_planes),
    ):
        with pytest.raises(ValueError, match="out must hold"):
            codec._grouping.unsub_grouped(p, b.size, b, 2, t, scratch, out)


def test_decode_reusing_writes_what_decode_writes_in_one_buffer_per_thread(monkeypatch):
    """codec.decode_reusing: a grouped delta's bytes in the thread's own buffer (a view, written over
    by the next call), every other encoding, a chunk past SCRATCH_MAX, and any chunk without the C
    module, as decode() gives them; what decode refuses, it refuses."""
    rng = np.random.default_rng(3)
    base = _bf16_weights(1 << 16, rng)
    chunks = []
    for k in range(3):
        moved = base + rng.integers(-2, 3, base.size).astype(np.uint16) * (k + 1)
        enc, payload = codec.encode_delta(moved.tobytes(), base.tobytes(), 2)
        chunks.append((enc, payload, moved.tobytes()))
    plain_enc, plain = codec.encode(chunks[0][2], 2)
    grouped = codec._grouping is not None
    assert not grouped or {enc for enc, _, _ in chunks} <= {"esub-p2", "esubn-p2"}
    views = []
    for enc, payload, raw in chunks:
        got = codec.decode_reusing(enc, payload, len(raw), base.tobytes())
        assert bytes(got) == raw == codec.decode(enc, payload, len(raw), base.tobytes())
        views.append(got)
    if grouped:  # one buffer: each view now shows the last chunk's bytes
        assert all(isinstance(v, memoryview) and bytes(v) == chunks[-1][2] for v in views)
    assert codec.decode_reusing(plain_enc, plain, len(chunks[0][2])) == chunks[0][2]
    with pytest.raises(ValueError, match="needs its basis"):
        codec.decode_reusing(chunks[0][0], chunks[0][1], len(chunks[0][2]))
    if grouped:  # each thread its own buffer: two threads' views, made at once, both stay intact
        barrier = threading.Barrier(2)

        def decode_and_hold(k: int) -> bool:
            enc, payload, raw = chunks[k]
            got = codec.decode_reusing(enc, payload, len(raw), base.tobytes())
            barrier.wait()  # both have decoded before either looks
            intact = bytes(got) == raw
            barrier.wait()
            return intact

        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(decode_and_hold, (0, 2))) == [True, True]
    for name, value in (("SCRATCH_MAX", 1024), ("_grouping", None)):
        with monkeypatch.context() as m:
            m.setattr(codec, name, value)
            enc, payload, raw = chunks[1]
            got = codec.decode_reusing(enc, payload, len(raw), base.tobytes())
            assert isinstance(got, bytes) and got == raw


def _chain(n: int, size: int = 4096) -> tuple[dict[str, Located], dict[str, bytes], dict[str, bytes]]:
    """``n`` chunks, each after the first a delta against the one before: (located, raw, payloads)."""
    rng = np.random.default_rng(n)
    data = rng.integers(0, 256, size, dtype=np.uint8)
    located, raw, payloads = {}, {}, {}
    prev = None
    for k in range(n):
        if k:
            data = data.copy()
            data[k::97] ^= 1
        b = data.tobytes()
        i = chunk_id(b)
        enc, payload = codec.encode_delta(b, raw[prev], 4) if prev else codec.encode(b, 4)
        located[i] = Located(i, size, enc, len(payload), prev)
        raw[i], payloads[i] = b, payload
        prev = i
    return located, raw, payloads


def test_a_batch_decodes_as_it_arrives_in_any_order_and_fetches_an_unreadable_basis_once():
    """decode_batch decodes each payload once it and its basis are in: a stream that sends a chain's
    deltas before their bases still decodes; bases held elsewhere are read, not fetched; one held
    but found unreadable is fetched in a second request, without asking for the rest again."""
    located, raw, payloads = _chain(6)
    ids = list(located)
    asked: list[list[str]] = []

    def source(chunks):
        asked.append([c.id for c in chunks])
        for c in reversed(chunks):  # deltas before their bases
            yield c, payloads[c.id]

    with ThreadPoolExecutor(2) as pool:
        assert decode_batch(ids[3:], located, source, pool) == {i: raw[i] for i in ids}
        assert asked == [ids]
        asked.clear()
        # ids[2] is held elsewhere: it is read there, and neither fetched nor returned
        got = decode_batch(
            ids[3:], located, source, pool, known={ids[2]: raw[ids[2]]}.get, cached={ids[2]}.__contains__
        )
        assert got == {i: raw[i] for i in ids[3:]} and asked == [ids[3:]]
        asked.clear()
        # said to be held, but unreadable: fetched (with what it needs) in a second request
        got = decode_batch(ids[3:], located, source, pool, known=lambda i: None, cached={ids[2]}.__contains__)
        assert got == {i: raw[i] for i in ids} and asked == [ids[3:], ids[:3]]
        asked.clear()

        def short(chunks):
            asked.append([c.id for c in chunks])
            yield from ((c, payloads[c.id]) for c in chunks[1:])

        with pytest.raises(IntegrityError, match=f"chunk {ids[0]} was not delivered"):
            decode_batch(ids, located, short, pool)
        bad = dict(payloads)
        bad[ids[1]] = codec.encode(b"x" * 4096, 4)[1]
        with pytest.raises(IntegrityError, match=ids[1]):
            decode_batch(ids, located, lambda chunks: ((c, bad[c.id]) for c in chunks), pool)


def test_each_chunk_lands_as_it_is_decoded_and_all_have_landed_when_the_batch_ends():
    """decode_batch's ``landed`` (a node writes each chunk to its cache there) is told of every
    chunk it returns, once, each with its checked bytes, and of a second request's too, before
    decode_batch returns; where the batch fails, of those decoded before the failure, and none is
    told after decode_batch raised."""
    located, raw, payloads = _chain(6)
    ids = list(located)
    landed: list[tuple[str, bytes]] = []
    lock = threading.Lock()

    def land(i: str, data: bytes) -> None:
        with lock:
            landed.append((i, bytes(data)))

    def source(chunks):
        yield from ((c, payloads[c.id]) for c in chunks)

    with ThreadPoolExecutor(2) as pool:
        got = decode_batch(ids[3:], located, source, pool, landed=land)
        assert sorted(landed) == sorted(got.items()) and got == {i: raw[i] for i in ids}
        landed.clear()
        # a basis said to be held but unreadable: fetched in a second request, and landed there
        got = decode_batch(
            ids[3:], located, source, pool, known=lambda i: None, cached={ids[2]}.__contains__, landed=land
        )
        assert sorted(landed) == sorted(got.items()) and set(got) == set(ids)
        landed.clear()
        bad = dict(payloads)
        bad[ids[4]] = codec.encode(b"x" * 4096, 4)[1]
        with pytest.raises(IntegrityError, match=ids[4]):
            decode_batch(ids, located, lambda chunks: ((c, bad[c.id]) for c in chunks), pool, landed=land)
        after = list(landed)
        assert after == [(i, raw[i]) for i in ids[:4]]  # the chain up to the damaged one, in order
        time.sleep(0.05)
        assert landed == after


def test_decode_landed_hands_over_every_chunk_and_holds_only_bases():
    """decode_landed (a node's fetch): every chunk of the batch goes to ``landed`` with its checked
    bytes, a chain's links decoded from the link before them (held until the batch ends), chunks
    against a basis held elsewhere from that basis; it returns their ids. An unreadable basis is
    fetched in a second request; a damaged payload raises as decode_batch does."""
    located, raw, payloads = _chain(5, size=8192)
    ids = list(located)
    rng = np.random.default_rng(4)
    base = _bf16_weights(4096, rng).tobytes()
    base_id = chunk_id(base)
    enc, payloads[base_id] = codec.encode(base, 2)
    located[base_id] = Located(base_id, len(base), enc, len(payloads[base_id]))
    for k in range(4):  # leaves against a basis held elsewhere (a node's cached base)
        moved = (np.frombuffer(base, dtype=np.uint16) + np.uint16(k + 1)).tobytes()
        enc, payload = codec.encode_delta(moved, base, 2)
        i = chunk_id(moved)
        located[i], raw[i], payloads[i] = Located(i, len(moved), enc, len(payload), base_id), moved, payload
        ids.append(i)
    landed: dict[str, bytes] = {}
    kinds: dict[str, type] = {}
    lock = threading.Lock()

    def land(i: str, data) -> None:
        with lock:
            assert i not in landed  # each chunk lands once
            landed[i] = bytes(data)  # a view is only good during the call
            kinds[i] = type(data)

    def source(chunks):
        yield from ((c, payloads[c.id]) for c in reversed(chunks))

    with ThreadPoolExecutor(2) as pool:
        got = decode_landed(ids, located, source, pool, land, known={base_id: base}.get, cached={base_id}.__contains__)
        assert sorted(got) == sorted(ids) and landed == {i: raw[i] for i in ids}
        # the chain's links are bases of the next: kept as bytes; the leaves (the chain's last
        # included) come from the decoding thread's buffer where the C module is built
        assert all(kinds[i] is bytes for i in ids[:4])
        assert all(kinds[i] is (bytes if codec._grouping is None else memoryview) for i in ids[4:])
        landed.clear()
        # a chunk of the batch that an unreadable cached basis leans on: decoded again for the
        # second request, landed once (ids[:3] a chain; ids[1] said to be cached, not readable)
        got = decode_landed(
            [ids[0], ids[2]], located, source, pool, land, known=lambda i: None, cached={ids[1]}.__contains__
        )
        assert sorted(got) == sorted(ids[:3]) and landed == {i: raw[i] for i in ids[:3]}
        landed.clear()
        # the held basis unreadable after all: fetched in a second request, and landed too
        got = decode_landed(ids[-4:], located, source, pool, land, known=lambda i: None, cached={base_id}.__contains__)
        assert sorted(got) == sorted([*ids[-4:], base_id]) and landed == {i: (raw | {base_id: base})[i] for i in got}
        bad = dict(payloads)
        bad[ids[2]] = codec.encode(b"x" * 8192, 4)[1]
        with pytest.raises(IntegrityError, match=ids[2]):
            decode_landed(ids[:5], located, lambda chunks: ((c, bad[c.id]) for c in chunks), pool, land)


def test_unrelated_basis_falls_back_to_plain():
    t = (torch.randn(1 << 16) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    other = (torch.randn(1 << 16) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    enc, payload, is_delta = codec.best_encoding(t, 2, other)
    assert not is_delta and enc.startswith("zstd")
    near = (
        (torch.frombuffer(bytearray(t), dtype=torch.bfloat16).float() * 1.001)
        .to(torch.bfloat16)
        .view(torch.uint8)
        .numpy()
        .tobytes()
    )
    enc, payload, is_delta = codec.best_encoding(near, 2, t)
    assert is_delta and enc == "esubn-p2" and len(payload) < len(codec.encode(near, 2)[1]) / 2


def test_plain_candidate_at_hand_is_not_encoded_again():
    """The server passes the client's compressed upload as the plain candidate: it is kept when the
    delta is larger, and loses to a smaller delta."""
    t = (torch.randn(1 << 16) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    other = (torch.randn(1 << 16) * 0.02).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    uploaded = codec.encode(t, 2)
    assert codec.best_encoding(t, 2, other, plain=uploaded) == (uploaded[0], uploaded[1], False)
    near = (
        (torch.frombuffer(bytearray(t), dtype=torch.bfloat16).float() * 1.001)
        .to(torch.bfloat16)
        .view(torch.uint8)
        .numpy()
        .tobytes()
    )
    enc, payload, is_delta = codec.best_encoding(near, 2, t, plain=codec.encode(near, 2))
    assert is_delta and codec.decode(enc, payload, len(near), basis=t) == near


def test_unknown_encoding_asks_for_an_upgrade():
    """A chunk written by a newer registry in an encoding this code lacks is not reported as damage."""
    chunk = Located(chunk_id(b"x" * 64), 64, "future-p2", 10)
    with pytest.raises(IntegrityError, match="does not know: upgrade mfsreg"):
        decode_verified(chunk, b"0123456789")


def test_corrupt_delta_is_detected():
    base = bytes(range(256)) * 64
    near = bytearray(base)
    near[100] ^= 0xFF
    enc, payload, _ = codec.best_encoding(bytes(near), 2, base)
    chunk = Located(chunk_id(bytes(near)), len(near), enc, len(payload), "b" * 32)
    assert decode_verified(chunk, payload, base) == bytes(near)
    with pytest.raises(IntegrityError):
        decode_verified(chunk, payload, base[::-1])  # wrong basis: bytes do not match the id
    with pytest.raises(IntegrityError):
        decode_verified(chunk, payload[:-3] + b"xyz", base)


@sqlite_only
def test_a_push_whose_bases_are_damaged_in_storage_stores_its_chunks_plain(reg, fam, tmp_path, caplog):
    """Bases whose stored bytes no longer decode to their ids (every chunk of base damaged in its
    pack): the push stored nothing and stopped with that error, for bytes it does not store. Now
    its chunks are stored plain, with one warning for the push, and it pulls byte for byte."""
    reg.push(fam["base"], "fam", "base")
    for c in reg.locate(reg.manifest("fam", "base")[1].chunk_ids()).values():
        with open(reg.blobs.root / pack_key(c.pack_id), "r+b") as f:
            f.seek(c.offset + c.stored_size // 2)
            byte = f.read(1)[0]
            f.seek(-1, 1)
            f.write(bytes([byte ^ 0xFF]))
    with caplog.at_level("WARNING", logger="mfsreg"):
        res = reg.push(fam["full-med"], "fam", "full-med")
    assert [v.name for v in reg.versions("fam")] == ["base", "full-med"]
    said = [r.getMessage() for r in caplog.records if "cannot be read back" in r.getMessage()]
    assert len(said) == 1 and "--mend-damaged" in said[0], caplog.text
    assert res.new_chunks == res.chunks  # every chunk of full-med is new: none was a delta's to share
    stored = reg.locate(reg.manifest("fam", "full-med")[1].chunk_ids()).values()
    assert not any(codec.is_delta(c.encoding) or c.basis_id for c in stored)  # plain: no basis read back
    reg.pull("fam", "full-med", tmp_path / "med.out")
    assert filecmp.cmp(tmp_path / "med.out", fam["full-med"], shallow=False)


def _lose_packs_of(reg, ids) -> set[str]:
    """Delete from the blob store, by hand, every pack that holds one of ``ids`` (storage that lost data)."""
    packs = {c.pack_id for i, c in reg.locate(ids).items() if i in ids}  # not their bases' packs
    for p in packs:
        reg.blobs.delete(pack_key(p))
    return packs


@sqlite_only
@pytest.mark.parametrize("when", ["before the push", "while it encodes"])
def test_a_push_whose_basis_pack_is_lost_from_storage_stores_its_chunks_without_it(when, reg, fam, tmp_path, caplog):
    """Packs gone from storage while their chunks are still recorded (deleted by hand): a push whose
    new chunks would be deltas against chunks there stopped with exit 5. Lost before the push, the
    basis is not chosen; lost after the choice, it is found unreadable when read: either way the
    chunks are stored plain, with a warning naming the pack, and the version pulls byte for byte."""
    from tests.hooks import OnSend

    reg.push(fam["base"], "fam", "base")
    base_ids = set(reg.manifest("fam", "base")[1].chunk_ids())
    if when == "before the push":
        lost, progress = _lose_packs_of(reg, base_ids), None
    else:
        progress = OnSend(lambda: _lose_packs_of(reg, base_ids))
    res = reg.push(fam["full-med"], "fam", "full-med", parent="base", progress=progress)
    lost = lost if progress is None else progress.results[0]
    assert res.new_chunks > 0 and [v.name for v in reg.versions("fam")] == ["base", "full-med"]
    located = reg.locate(reg.manifest("fam", "full-med")[1].chunk_ids())
    assert not {c.basis_id for c in located.values() if c.basis_id} & base_ids
    assert not {c.pack_id for c in located.values()} & lost
    reg.pull("fam", "full-med", tmp_path / "out")
    assert filecmp.cmp(tmp_path / "out", fam["full-med"], shallow=False)
    assert any(
        "is lost from the blob store" in r.getMessage() and r.getMessage().split()[1] in lost for r in caplog.records
    ), caplog.text


@sqlite_only
def test_a_push_that_mends_a_lost_pack_and_leans_on_no_basis_there_warns_once(reg, fam, tmp_path, caplog):
    """A push that reuses chunks of a lost pack (stored again) and whose new chunks would be deltas
    against chunks there (stored without them) warned twice, naming the pack each time: once now,
    saying both."""
    reg.push(fam["base"], "fam", "base")
    lost = _lose_packs_of(reg, set(reg.manifest("fam", "base")[1].chunk_ids()))
    with caplog.at_level("WARNING", logger="mfsreg"):
        res = reg.push(fam["lora-chat"], "fam", "chat", parent="base")
    said = [r.getMessage() for r in caplog.records if "is lost from the blob store" in r.getMessage()]
    assert len(said) == 1 and said[0].split()[1] in lost, said
    assert "stores its" in said[0] and "without deltas" in said[0], said
    assert res.reused_chunks < res.chunks // 2  # the lost chunks were sent again
    reg.pull("fam", "chat", tmp_path / "out")
    assert filecmp.cmp(tmp_path / "out", fam["lora-chat"], shallow=False)


@sqlite_only
def test_a_basis_in_a_lost_pack_gives_way_to_a_readable_one_down_its_chain(reg, tmp_path):
    """v1 is stored as deltas against base, and v1's packs are lost: v2 (parent v1) is stored as
    deltas against base's chunks, which still decode, instead of stopping or going plain."""
    t = synth.base_tensors()
    paths = []
    for i in range(3):
        paths.append(synth.write(tmp_path / f"v{i}.safetensors", t))
        t = synth.dense_update(t, seed=100 + i)
    reg.push(paths[0], "fam", "v0")
    reg.push(paths[1], "fam", "v1", parent="v0")
    v0 = set(reg.manifest("fam", "v0")[1].chunk_ids())
    v1 = set(reg.manifest("fam", "v1")[1].chunk_ids()) - v0
    assert any(c.basis_id in v0 for c in reg.locate(v1).values())
    _lose_packs_of(reg, v1)
    reg.push(paths[2], "fam", "v2", parent="v1")
    located = reg.locate(set(reg.manifest("fam", "v2")[1].chunk_ids()) - v0 - v1)
    bases = {c.basis_id for c in located.values() if c.basis_id}
    assert bases and bases <= v0, bases  # down the chain, not plain
    reg.pull("fam", "v2", tmp_path / "out")
    assert filecmp.cmp(tmp_path / "out", paths[2], shallow=False)


@sqlite_only
def test_full_fine_tune_is_stored_as_small_deltas(reg, fam, tmp_path):
    base = reg.push(fam["base"], "fam", "base")
    full = reg.push(fam["full-med"], "fam", "full-med", parent="base")
    assert full.new_chunks >= full.chunks - 2  # every weight moved: no exact chunk is shared
    assert full.new_bytes < 0.5 * base.new_bytes  # ...yet it costs less than half of the base
    s = reg.stats("fam")
    assert s["encodings"]["esubn-p2"]["chunks"] > 0
    v = {x["version"]: x for x in s["versions"]}
    assert v["full-med"]["delta_bytes"] > 0 and v["base"]["delta_bytes"] == 0
    assert v["full-med"]["delta_bytes"] + v["full-med"]["plain_bytes"] == v["full-med"]["stored_bytes"]
    reg.pull("fam", "full-med", tmp_path / "out")
    assert filecmp.cmp(tmp_path / "out", fam["full-med"], shallow=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_chain_of_fine_tunes_round_trips_with_bounded_depth(reg, tmp_path, dtype):
    t = synth.base_tensors(dtype)
    paths = []
    for i in range(MAX_DEPTH + 3):
        paths.append(synth.write(tmp_path / f"v{i}.safetensors", t))
        t = synth.dense_update(t, seed=100 + i)
    for i, p in enumerate(paths):
        reg.push(p, "fam", f"v{i}", parent=f"v{i - 1}" if i else None)
    depths = [c.depth for c in reg.locate(reg.manifest("fam", f"v{len(paths) - 1}")[1].chunk_ids()).values()]
    assert max(depths) == MAX_DEPTH  # the chain grew to the bound and no further
    for i, p in enumerate(paths):
        out = tmp_path / f"out{i}.safetensors"
        reg.pull("fam", f"v{i}", out)
        assert filecmp.cmp(out, p, shallow=False), f"v{i}"


@sqlite_only
def test_vocab_extended_tail_changes_size(reg, tmp_path):
    base = synth.base_tensors()
    ext = synth.dense_update(synth.extend_vocab(base, rows=8), seed=8)  # the last chunk grows, no new chunk
    a = synth.write(tmp_path / "a.safetensors", base)
    b = synth.write(tmp_path / "b.safetensors", ext)
    reg.push(a, "fam", "a")
    reg.push(b, "fam", "b", parent="a")
    _, m = reg.manifest("fam", "b")
    _, ma = reg.manifest("fam", "a")
    f, fa = m.files[0], ma.files[0]
    emb = next(t for t in f.tensors if t.name == "model.embed_tokens.weight")
    emb_a = next(t for t in fa.tensors if t.name == "model.embed_tokens.weight")
    tail = [c for c in f.chunks if emb.start <= c.offset < emb.end][-1]
    tail_a = [c for c in fa.chunks if emb_a.start <= c.offset < emb_a.end][-1]
    assert tail.size > tail_a.size
    stored = reg.locate([tail.id])[tail.id]
    assert stored.basis_id == tail_a.id and codec.is_delta(stored.encoding)
    reg.pull("fam", "b", tmp_path / "b.out")
    assert filecmp.cmp(tmp_path / "b.out", b, shallow=False)


def test_deleting_a_basis_version_keeps_what_deltas_need(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    reg.push(fam["full-med"], "fam", "full-med", parent="base")
    reg.delete("fam", "base")
    tiers = reg.chunk_tiers("fam")
    _, m = reg.manifest("fam", "full-med")
    needed = reg.locate(m.chunk_ids())
    assert any(c.basis_id for c in needed.values())
    assert set(needed) == set(tiers)  # the bases stay in the family, owned by the member that needs them
    reg.pull("fam", "full-med", tmp_path / "out")
    assert filecmp.cmp(tmp_path / "out", fam["full-med"], shallow=False)


def test_basis_is_the_most_similar_member_without_parent(reg, fam, tmp_path):
    other = synth.write(tmp_path / "other.safetensors", synth.base_tensors(seed=99))  # same shapes, unrelated
    reg.push(other, "fam", "other")  # the family's first version: the fallback basis
    reg.push(fam["base"], "fam", "base")
    reg.push(fam["lora-chat"], "fam", "chat")  # no --parent: the member sharing most chunks is the basis
    _, base = reg.manifest("fam", "base")
    _, chat = reg.manifest("fam", "chat")
    located = reg.locate(chat.chunk_ids())
    deltas = [c for c in located.values() if c.basis_id]
    assert deltas and {c.basis_id for c in deltas} <= set(base.chunk_ids())


@sqlite_only
def test_a_commit_whose_stored_chunk_lost_its_basis_is_a_storage_error(reg, fam):
    """A delta whose basis has no row is damage (prune keeps every basis in use): a push that would
    use it gets a storage error, not "upload them", which no upload of its own chunks could mend."""
    from sqlalchemy import update

    from mfsreg.registry.db.engine import write_tx
    from mfsreg.registry.db.models import chunks

    reg.push(fam["base"], "fam", "base")
    reg.push(fam["full-med"], "fam", "med", parent="base")
    _, manifest = reg.manifest("fam", "med")
    delta = min(i for i, c in reg.locate(manifest.chunk_ids()).items() if c.basis_id)
    with write_tx(reg.engine) as conn:
        conn.execute(update(chunks).where(chunks.c.id == delta).values(basis_id="f" * 32))
    with pytest.raises(StorageError, match="lost the basis of a stored chunk of fam/med-again"):
        reg.push(fam["full-med"], "fam", "med-again")
    assert sorted(v.name for v in reg.versions("fam")) == ["base", "med"]


@sqlite_only
def test_a_header_an_uploader_stored_as_a_delta_still_passes_the_commit_check(reg, fam, tmp_path):
    """An uploader may name any chunk its family uses as a basis, a header's too. The server then
    stores that header as a delta when it is smaller; the commit's check of each header against the
    manifest decodes it against its basis (it read the payload as if plain, and every commit of a
    model with that header, in any family, failed with 'the stored pack is damaged')."""
    from mfsreg.registry.db import chunks as chunk_db
    from mfsreg.registry.db.engine import read_tx
    from mfsreg.registry.format.hashing import HashJob
    from mfsreg.registry.format.source import open_source
    from mfsreg.registry.format.wire import Entry, build_batch
    from mfsreg.registry.progress import NullProgress
    from mfsreg.registry.store import service

    reg.push(fam["base"], "fam", "base")
    _, base_manifest = reg.manifest("fam", "base")
    base_head = base_manifest.files[0].chunks[0].id
    with HashJob(open_source(fam["lora-chat"]), 64 << 10, NullProgress()) as job:
        manifest = job.manifest()
        plan = service.negotiate(reg, "fam", "lora", manifest.to_doc(), "base")
        head = manifest.files[0].chunks[0]
        items = []
        for c in manifest.files[0].chunks:
            if c.id in plan["missing"]:
                raw = bytes(job.views[0][c.offset : c.offset + c.size])
                hint = base_head if c.offset == 0 else plan["bases"].get(c.id)
                items.append((Entry(c.id, c.size, "raw", len(raw), hint, c.itemsize), raw))
    assert head.id in plan["missing"]
    service.receive_batch(reg, "fam", build_batch(items))
    with read_tx(reg.engine) as conn:
        assert chunk_db.locate(conn, [head.id])[head.id].basis_id == base_head  # the case: a header stored as a delta
    service.commit(reg, "fam", "lora", "base", manifest.to_doc())
    reg.push(fam["lora-chat"], "other", "copy")  # another family's model with that header
    for family, version in (("fam", "lora"), ("other", "copy")):
        reg.pull(family, version, tmp_path / f"{family}.safetensors")
        assert filecmp.cmp(tmp_path / f"{family}.safetensors", fam["lora-chat"], shallow=False)


def test_the_most_shared_member_is_the_one_a_full_count_names(reg, fam):
    """most_shared_version leaves out the chunks every member uses (they add the same to every
    count, at one row per member); it names the member a count of every shared chunk names, and
    when only such chunks are shared, none, so that the push falls back to the first version,
    the oldest of the tie."""
    from mfsreg.registry.db import versions as version_db
    from mfsreg.registry.db.engine import read_tx

    for name in ("base", "lora-chat", "last-code", "vocab-ext"):
        reg.push(fam[name], "fam", name)
    with read_tx(reg.engine) as conn:
        family = version_db.get_family(conn, "fam")
        uses = {}
        for name in ("base", "lora-chat", "last-code", "vocab-ext"):
            vid = version_db.find_version(conn, "fam", name).id
            uses[vid] = set(version_db.version_chunk_ids(conn, vid))
        everyone = set.intersection(*uses.values())
        assert everyone and all(u - everyone for u in uses.values())
        probes = [*uses.values(), everyone] + [everyone | {c} for u in uses.values() for c in sorted(u - everyone)[:1]]
        for ids in probes:
            counts = {vid: len(ids & u) for vid, u in uses.items()}
            full = max(counts, key=lambda v: (counts[v], -v))
            named = version_db.most_shared_version(conn, family.id, sorted(ids), family.member_count)
            assert (named or version_db.first_version(conn, family.id)) == full
            assert (named is None) == (ids <= everyone)
