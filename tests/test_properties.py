"""Property-based tests (hypothesis) of the parsers that take untrusted bytes and of the codec.

- The safetensors header parser: a valid file parses to exactly the tensors written; any bytes at all
  either parse to tensors that tile the data region or are refused with InvalidModel, nothing else.
- The manifest parser: what a push makes round-trips through the stored bytes and through a client's
  document; any JSON document is either a consistent manifest or refused with InvalidRequest.
- The codec: every encoding decodes to the bytes encoded, deltas against any basis included; a
  hostile payload never decodes to a chunk of another size.
"""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mfsreg.registry.errors import InvalidModel, InvalidRequest
from mfsreg.registry.format import codec
from mfsreg.registry.format.manifest import Manifest, parse_doc
from mfsreg.registry.format.safetensors import DTYPE_SIZES, parse_header
from tests.kernels import WAYS, kernel_way

# bounded so that the whole file runs in a few seconds; the deadline is off: CI machines stall
FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

names = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=12)
shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3)


@st.composite
def safetensors_files(draw) -> tuple[bytes, dict, dict]:
    """(file bytes, {name: (dtype, shape)}, metadata) of a valid safetensors file, tensors in a
    drawn order in the data region."""
    tensors = draw(
        st.dictionaries(
            names.filter(lambda n: n != "__metadata__"),
            st.tuples(st.sampled_from(sorted(DTYPE_SIZES)), shapes),
            max_size=6,
        )
    )
    metadata = draw(st.dictionaries(names, st.text(max_size=10), max_size=3))
    order = draw(st.permutations(sorted(tensors)))
    header: dict = {"__metadata__": metadata} if metadata else {}
    pos = 0
    for name in order:
        dtype, shape = tensors[name]
        n = DTYPE_SIZES[dtype] * int(np.prod(shape, dtype=np.int64))
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    head = json.dumps(header).encode()
    head += b" " * draw(st.integers(0, 7))  # the format pads headers with spaces
    data = draw(st.binary(min_size=pos, max_size=pos))
    return struct.pack("<Q", len(head)) + head + data, tensors, metadata


@FAST
@given(safetensors_files())
def test_a_valid_header_parses_to_exactly_its_tensors(made):
    raw, tensors, metadata = made
    parsed = parse_header(raw, len(raw), "f")
    assert {t.name: (t.dtype, list(t.shape)) for t in parsed.tensors} == {k: (d, s) for k, (d, s) in tensors.items()}
    assert parsed.metadata == metadata
    assert [t.start for t in parsed.tensors] == sorted(t.start for t in parsed.tensors)


def _tiles(parsed, size: int) -> bool:
    pos = parsed.header_size
    for t in parsed.tensors:
        if t.start != pos or t.end < t.start:
            return False
        pos = t.end
    return pos == size


@FAST
@given(safetensors_files(), st.data())
def test_any_bytes_parse_to_a_tiling_or_are_refused_as_invalid_model(made, data):
    """Valid files, each mutated: bytes flipped, the length prefix changed, the file cut or grown."""
    raw = bytearray(made[0])
    for _ in range(data.draw(st.integers(0, 4))):
        how = data.draw(st.sampled_from(["flip", "cut", "grow", "prefix"]))
        if how == "flip" and raw:
            raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
        elif how == "cut":
            raw = raw[: data.draw(st.integers(0, len(raw)))]
        elif how == "grow":
            raw += data.draw(st.binary(max_size=16))
        elif how == "prefix" and len(raw) >= 8:
            raw[:8] = struct.pack("<Q", data.draw(st.integers(0, 2**64 - 1)))
    try:
        parsed = parse_header(bytes(raw), len(raw), "f")
    except InvalidModel as exc:
        assert "\n" not in str(exc) and str(exc).startswith("f: ")
    else:
        assert _tiles(parsed, len(raw))


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_never_raise_anything_but_invalid_model(raw):
    try:
        parse_header(raw, len(raw), "f")
    except InvalidModel:
        pass


# -- manifests --------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**40), 2**40) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)


@st.composite
def manifests(draw) -> Manifest:
    """A manifest as a push makes it: the hash of a drawn safetensors file, cut at a drawn size."""
    import tempfile
    from pathlib import Path

    from mfsreg.registry.format.hashing import hash_source
    from mfsreg.registry.format.source import open_source
    from mfsreg.registry.progress import NullProgress

    raw, _, _ = draw(safetensors_files())
    chunk = draw(st.sampled_from([4 << 10, 8 << 10]))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "m.safetensors"
        path.write_bytes(raw)
        return hash_source(open_source(path), chunk, NullProgress())


@SLOW
@given(manifests())
def test_a_pushed_manifest_round_trips_through_storage_and_a_clients_document(m):
    assert Manifest.from_bytes(m.to_bytes()) == m
    assert parse_doc(json.loads(json.dumps(m.to_doc()))) == m
    assert m.digest == Manifest.from_bytes(m.to_bytes()).digest


@FAST
@given(
    st.one_of(
        json_values,
        st.fixed_dictionaries(
            {
                "format": st.just(1),
                "single_file": st.booleans(),
                "files": st.lists(
                    st.dictionaries(
                        st.sampled_from(["path", "kind", "size", "sha256", "chunks", "tensors"]), json_values
                    ),
                    max_size=3,
                ),
            }
        ),
    )
)
def test_any_json_document_is_a_consistent_manifest_or_refused_in_one_line(doc):
    try:
        m = parse_doc(doc, draft=True)
    except InvalidRequest as exc:
        assert "\n" not in str(exc)
    else:
        for f in m.files:  # chunks tile each file from 0 to its size
            pos = 0
            for c in f.chunks:
                assert c.offset == pos
                pos += c.size
            assert pos == f.size


# -- codec ------------------------------------------------------------------------------------------

itemsizes = st.sampled_from([1, 2, 4, 8])


@st.composite
def chunks_and_bases(draw) -> tuple[bytes, bytes, int]:
    """A chunk and a basis of the same element size: a basis the chunk is a small change of (as a
    fine-tune is of its base), or one unrelated to it, of equal or other length."""
    itemsize = draw(itemsizes)
    n = draw(st.integers(0, 600)) * itemsize
    basis = draw(st.binary(min_size=n, max_size=n))
    how = draw(st.sampled_from(["near", "unrelated", "other length"]))
    if how == "near":
        data = bytearray(basis)
        for _ in range(draw(st.integers(0, 10))):
            if data:
                data[draw(st.integers(0, len(data) - 1))] ^= 1 << draw(st.integers(0, 7))
        data = bytes(data)
    elif how == "unrelated":
        data = draw(st.binary(min_size=n, max_size=n))
    else:
        m = draw(st.integers(0, 600)) * itemsize
        data = draw(st.binary(min_size=m, max_size=m))
    return data, basis, itemsize


@FAST
@given(st.binary(max_size=5000), itemsizes)
def test_every_plain_encoding_decodes_to_the_bytes_encoded(data, itemsize):
    encoding, payload = codec.encode(data, itemsize)
    assert codec.is_known(encoding) and not codec.is_delta(encoding)
    assert codec.decode(encoding, payload, len(data)) == data


@FAST
@given(chunks_and_bases())
def test_every_delta_decodes_against_its_basis_to_the_bytes_encoded(made):
    data, basis, itemsize = made
    encoding, payload, is_delta = codec.best_encoding(data, itemsize, basis)
    assert codec.is_known(encoding) and codec.is_delta(encoding) == is_delta
    assert codec.decode(encoding, payload, len(data), basis if is_delta else None) == data
    if itemsize > 1 and data and len(data) == len(basis):  # a delta proper, whichever is smaller
        encoding, payload = codec.encode_delta(data, basis, itemsize)
        assert codec.decode(encoding, payload, len(data), basis) == data


@pytest.mark.skipif(codec._grouping is None, reason="no C module: numpy alone, nothing to compare")
@SLOW
@given(
    st.integers(1024, 20_000),  # elements: the vector path takes 1024 and more
    st.integers(0, 255),  # the key most elements share (their exponent, for bf16)
    st.integers(0, 30),  # how far the others spread below it and above it (wrapping past 0 and 255)
    st.integers(0, 30),
    st.floats(0, 0.5),  # the share of elements with any key at all
    st.integers(0, 2**32 - 1),
)
def test_two_byte_deltas_decode_alike_on_and_off_the_vector_path(n, key, below, above, stray, seed):
    """The AVX-512 ungrouping (where the processor has it) and the plain loop give the same bytes
    for any spread of keys: a band at either end of the key range, keys outside it, and shares of
    them past what its list of strays has room for (then it gives way to the plain loop)."""
    rng = np.random.default_rng(seed)
    keys = (key + rng.integers(-below, above + 1, n)) % 256
    keys = np.where(rng.random(n) < stray, rng.integers(0, 256, n), keys)
    basis = (keys << 7 | rng.integers(0, 128, n) | rng.integers(0, 2, n) << 15).astype(np.uint16)
    data = basis + rng.integers(-4, 5, n).astype(np.uint16)
    data[rng.integers(0, n, 20)] = rng.integers(0, 1 << 16, 20)
    encoding, payload = codec.encode_delta(data.tobytes(), basis.tobytes(), 2)
    for way in WAYS[:2]:
        with kernel_way(way):
            assert codec.decode(encoding, payload, 2 * n, basis.tobytes()) == data.tobytes()


@FAST
@given(chunks_and_bases(), st.binary(max_size=200), st.data())
def test_a_hostile_payload_never_decodes_to_a_chunk_of_another_size(made, junk, data):
    """A stored payload damaged or forged: decode raises (the callers turn that into an integrity
    error), or gives exactly the size the chunk's row records."""
    chunk, basis, itemsize = made
    encoding, payload, is_delta = codec.best_encoding(chunk, itemsize, basis)
    payload = bytearray(payload)
    if payload and data.draw(st.booleans()):
        payload[data.draw(st.integers(0, len(payload) - 1))] ^= data.draw(st.integers(1, 255))
    else:
        payload = bytearray(junk)
    size = data.draw(st.sampled_from([len(chunk), len(chunk) + itemsize, max(0, len(chunk) - itemsize)]))
    assume(encoding != codec.RAW or len(payload) == size)  # raw bytes carry no frame to check
    try:
        out = codec.decode(encoding, bytes(payload), size, basis if is_delta else None)
    except Exception:  # noqa: BLE001 - zstd raises its own error types; every caller catches them all
        return
    assert len(out) == size
