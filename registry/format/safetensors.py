"""Safetensors headers read as untrusted input, and the tensor spans they describe.

parse_header checks the format's rules (a bounded header length, a JSON object of tensors and
optional string metadata, known dtypes, sizes, offsets, a data region the tensors cover exactly) and
raises InvalidModel naming the first one broken; the header's bytes are kept verbatim on push.
See docs/design/format.md.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

from mfsreg.registry.errors import InvalidModel

# Real checkpoints have headers well under 1 MiB even for thousands of tensors; the reference
# implementation caps at 100 MB. We stay lower: a larger claim is an attack or a broken file.
MAX_HEADER_BYTES = 16 << 20
MAX_TENSORS = 1_000_000

DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
    "C64": 8,
}


@dataclass(frozen=True)
class TensorSpan:
    """One tensor of a safetensors file: its absolute byte range in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start

    @property
    def itemsize(self) -> int:
        return DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class SafetensorsHeader:
    """The parsed header: ``header_size`` bytes (length prefix included) kept verbatim on push."""

    header_size: int
    tensors: tuple[TensorSpan, ...]  # ordered by offset in the file
    metadata: dict[str, str]


def parse_header(head: bytes, file_size: int, where: str) -> SafetensorsHeader:
    """Validate a safetensors header. ``head`` holds at least the first 8 + n bytes of the file.

    Raises InvalidModel naming the file (``where``) and the first rule it breaks.
    """
    if file_size < 8 or len(head) < 8:
        raise InvalidModel(f"{where}: truncated file ({file_size} bytes): not a safetensors file")
    (n,) = struct.unpack("<Q", head[:8])
    if n > MAX_HEADER_BYTES:
        raise InvalidModel(
            f"{where}: header claims {n} bytes, over the {MAX_HEADER_BYTES} byte limit: corrupted or not a safetensors file"
        )
    if 8 + n > file_size:
        raise InvalidModel(f"{where}: truncated file: header needs {8 + n} bytes, file has {file_size}")
    raw = head[8 : 8 + n]
    try:
        obj = json.loads(bytes(raw).decode("utf-8"))
    except (ValueError, RecursionError) as exc:  # bad UTF-8 or JSON, an over-long integer, nesting too deep
        raise InvalidModel(f"{where}: corrupted header: not valid JSON ({exc.__class__.__name__})") from None
    if not isinstance(obj, dict):
        raise InvalidModel(f"{where}: corrupted header: expected a JSON object of tensors")
    metadata = obj.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise InvalidModel(f"{where}: corrupted header: __metadata__ must map strings to strings")
    if len(obj) > MAX_TENSORS:
        raise InvalidModel(f"{where}: header lists {len(obj)} tensors, over the {MAX_TENSORS} limit")
    data_start = 8 + n
    data_len = file_size - data_start
    spans = [_tensor(name, info, data_start, data_len, where) for name, info in obj.items()]
    spans.sort(key=lambda s: (s.start, s.end))
    _check_layout(spans, data_start, file_size, where)
    return SafetensorsHeader(header_size=data_start, tensors=tuple(spans), metadata=dict(metadata))


def _tensor(name: str, info: object, data_start: int, data_len: int, where: str) -> TensorSpan:
    if not isinstance(info, dict):
        raise InvalidModel(f"{where}: tensor {name!r}: entry is not an object")
    dtype = info.get("dtype")
    if not isinstance(dtype, str) or dtype not in DTYPE_SIZES:  # a list or object is not hashable
        raise InvalidModel(
            f"{where}: tensor {name!r}: unknown dtype {dtype!r} (known: {', '.join(sorted(DTYPE_SIZES))})"
        )
    shape = info.get("shape")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise InvalidModel(f"{where}: tensor {name!r}: shape must be a list of non-negative integers")
    offsets = info.get("data_offsets")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
        or offsets[0] > offsets[1]
    ):
        raise InvalidModel(f"{where}: tensor {name!r}: data_offsets must be [begin, end] with 0 <= begin <= end")
    begin, end = offsets
    if end > data_len:
        raise InvalidModel(
            f"{where}: tensor {name!r}: offset {end} is past the end of the data ({data_len} bytes): truncated or corrupted file"
        )
    expected = _nbytes(shape, DTYPE_SIZES[dtype], data_len)
    if expected != end - begin:
        size = f"{expected} bytes" if expected <= data_len else f"more than the data's {data_len} bytes"
        raise InvalidModel(
            f"{where}: tensor {name!r}: shape {_brief(shape)} x {dtype} is {size} but its offsets span {end - begin}"
        )
    return TensorSpan(name, dtype, tuple(shape), data_start + begin, data_start + end)


def _nbytes(shape: list[int], itemsize: int, most: int) -> int:
    """The tensor's byte length, or the first partial product past ``most``: a hostile shape (hundreds
    of huge dimensions) would otherwise make a number too long to compute quickly or to print."""
    if 0 in shape:
        return 0
    n = itemsize
    for d in shape:
        n *= d
        if n > most:
            break
    return n


def _brief(shape: list[int]) -> str:
    return str(shape) if len(shape) <= 8 else f"[{', '.join(map(str, shape[:8]))}, ... ({len(shape)} dimensions)]"


def _check_layout(spans: list[TensorSpan], data_start: int, file_size: int, where: str) -> None:
    """The tensors must tile the data region exactly: no overlap, no hole, no trailing bytes."""
    pos = data_start
    prev: TensorSpan | None = None
    for s in spans:
        if prev is not None and s.start < pos:  # (the first starts at data_start or later: offsets are >= 0)
            raise InvalidModel(f"{where}: tensors {prev.name!r} and {s.name!r} overlap")
        if s.start > pos:
            raise InvalidModel(f"{where}: {s.start - pos} bytes before tensor {s.name!r} belong to no tensor")
        pos, prev = s.end, s
    if pos != file_size:
        raise InvalidModel(f"{where}: {file_size - pos} trailing bytes after the last tensor belong to no tensor")


def read_header(path: Path, where: str | None = None) -> SafetensorsHeader:
    """Read and validate the header of the safetensors file at ``path``."""
    where = where or str(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) == 8:
            (n,) = struct.unpack("<Q", prefix)
            if n <= MAX_HEADER_BYTES and 8 + n <= size:
                prefix += f.read(n)
    return parse_header(prefix, size, where)
