"""The chunk batch format shared by the API and the node-side client.

A batch is a 4-byte little-endian length, a JSON index (a list of entries), then the entries'
payloads back to back in index order. Entry keys: ``id`` (xxh3-128 hex), ``size`` (raw bytes),
``encoding``, ``length`` (payload bytes), and optionally ``basis_id`` and ``itemsize``.
See docs/design/format.md.
"""

from __future__ import annotations

import json
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from mfsreg.registry.errors import InvalidRequest, StorageError, TooLarge, shown

MAX_INDEX_BYTES = 16 << 20
# chunks in one upload: a client cuts its batches here (registry/client/remote.py); a server refuses
# more (413). Each is hashed, looked up and recorded: 200,000 chunks of 3 bytes took 29 s of one request.
MAX_UPLOAD_CHUNKS = 4096
# An upload batch's chunks may add up to this many times the server's body limit once decoded: the
# server holds a batch's raw bytes while it verifies them, and compressed chunks (a tensor of
# zeros) could otherwise name far more than any body. A client cuts its batches at this many times
# its own batch size, which is below the body limit.
RAW_PER_BODY = 4
_ID = re.compile(r"^[0-9a-f]{32}$")


@dataclass(frozen=True)
class Located:
    """A chunk as a node knows it (a row of a version document, an entry of a download): what
    decoding it needs (blobs/packs.ChunkForm), without the pack and offset that only the registry
    holds."""

    id: str
    size: int  # raw bytes
    encoding: str
    stored_size: int  # encoded bytes, as sent
    basis_id: str | None = None


@dataclass(frozen=True)
class Entry:
    id: str
    size: int
    encoding: str
    length: int
    basis_id: str | None = None
    itemsize: int = 1

    def to_doc(self) -> dict:
        d = {"id": self.id, "size": self.size, "encoding": self.encoding, "length": self.length}
        if self.basis_id:
            d["basis_id"] = self.basis_id
        if self.itemsize != 1:
            d["itemsize"] = self.itemsize
        return d


def check_id(value: str) -> str:
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise InvalidRequest(f"invalid chunk id {shown(value, 40)}: expected 32 lowercase hex digits")
    return value


def encode_index(entries: Iterable[Entry]) -> bytes:
    doc = json.dumps([e.to_doc() for e in entries], separators=(",", ":")).encode()
    return struct.pack("<I", len(doc)) + doc


def build_batch(items: Iterable[tuple[Entry, bytes]]) -> bytes:
    items = list(items)
    return encode_index(e for e, _ in items) + b"".join(p for _, p in items)


def parse_index(data: bytes | memoryview, max_entries: int | None = None) -> tuple[list[Entry], int]:
    """The entries of a batch and the offset where payloads start; InvalidRequest if malformed,
    TooLarge for more than ``max_entries`` (counted before the index is parsed)."""
    if len(data) < 4:
        raise InvalidRequest("malformed chunk batch: shorter than its length prefix")
    (n,) = struct.unpack("<I", bytes(data[:4]))
    if n > MAX_INDEX_BYTES or 4 + n > len(data):
        raise InvalidRequest("malformed chunk batch: index length is out of range")
    index = bytes(data[4 : 4 + n])
    # each entry is one JSON object, and nothing in one holds a brace: an upper bound of the entries,
    # taken before parsing builds an object per value (about 20 bytes of memory per byte of a flood)
    if max_entries is not None and index.count(b"{") + index.count(b"[") > max_entries + 1:
        raise TooLarge(
            f"a chunk batch may hold at most {max_entries} chunks: send fewer per request (this one holds more)"
        )
    try:
        doc = json.loads(index)
    except (ValueError, RecursionError) as exc:  # not JSON, bad UTF-8, nested too deep
        raise InvalidRequest(f"malformed chunk batch index: not JSON ({exc.__class__.__name__})") from None
    if not isinstance(doc, list):
        raise InvalidRequest("malformed chunk batch index: expected a JSON list of entries")
    entries = [_entry(i, d) for i, d in enumerate(doc)]
    return entries, 4 + n


def _count(i: int, d: dict, key: str, default: int | None = None) -> int:
    # json.loads gives bool for true (an int subclass) and float for 4096.9 or Infinity: a count
    # is a JSON integer, nothing else, so a client's bug is named here rather than rounded away
    value = d.get(key, default)
    if type(value) is not int or value < 0:
        raise InvalidRequest(
            f"malformed chunk batch index: entry {i}'s {key!r} must be a non-negative integer, not {_json_shown(value)}"
        )
    return value


def _json_shown(value: object) -> str:
    # as the client wrote it ("1", true), which repr would not say; a float as Python reads it (inf)
    text = json.dumps(value) if not isinstance(value, float) else repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _entry(i: int, d: object) -> Entry:
    if not isinstance(d, dict):
        raise InvalidRequest(f"malformed chunk batch index: entry {i} is not an object")
    for key in ("id", "size", "encoding", "length"):
        if key not in d:
            raise InvalidRequest(f"malformed chunk batch index: entry {i} has no {key!r}")
    if not isinstance(d["encoding"], str):
        raise InvalidRequest(f"malformed chunk batch index: entry {i}'s 'encoding' must be a string")
    itemsize = _count(i, d, "itemsize", 1)
    if itemsize not in (1, 2, 4, 8):
        raise InvalidRequest(f"malformed chunk batch index: entry {i}'s itemsize {itemsize} is not 1, 2, 4 or 8")
    try:
        ids = check_id(d["id"]), check_id(d["basis_id"]) if d.get("basis_id") is not None else None
    except InvalidRequest as exc:
        raise InvalidRequest(f"malformed chunk batch index: entry {i}: {exc}") from None
    return Entry(ids[0], _count(i, d, "size"), d["encoding"], _count(i, d, "length"), ids[1], itemsize)


def parse_batch(data: bytes, max_entries: int | None = None) -> Iterator[tuple[Entry, memoryview]]:
    entries, pos = parse_index(data, max_entries)
    if pos + sum(e.length for e in entries) != len(data):
        raise InvalidRequest("malformed chunk batch: payload lengths do not add up to the body")
    view = memoryview(data)
    for e in entries:
        yield e, view[pos : pos + e.length]
        pos += e.length


class StreamBrokeOff(StorageError):
    """A streamed batch ended before the bytes its index promised."""


def read_stream(chunks: Iterator[bytes]) -> Iterator[tuple[Entry, bytes]]:
    """Parse a streamed batch (an iterator of byte pieces) as payloads arrive."""
    buf = bytearray()
    it = iter(chunks)

    def fill(n: int) -> None:
        while len(buf) < n:
            piece = next(it, None)
            if piece is None:
                # never the reader's mistake: the sender broke it off (its store failed), or the link did
                raise StreamBrokeOff("chunk stream ended early")
            buf.extend(piece)

    fill(4)
    (n,) = struct.unpack("<I", bytes(buf[:4]))
    if n > MAX_INDEX_BYTES:
        raise InvalidRequest("malformed chunk stream: index length is out of range")
    fill(4 + n)
    entries, pos = parse_index(bytes(buf[: 4 + n]))
    del buf[:pos]
    for e in entries:
        fill(e.length)
        with memoryview(buf) as view:  # one copy: a slice of buf, then bytes of it, made two
            payload = bytes(view[: e.length])
        del buf[: e.length]  # (a bytearray drops its front without moving the rest)
        yield e, payload
