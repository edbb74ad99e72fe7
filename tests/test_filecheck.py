"""The check every pull makes of the file it wrote: chunks that tile it, each hashing to its id
where it lies in the file."""

from __future__ import annotations

import os

import pytest

from registry.chunking import ChunkRef, chunk_id
from registry.errors import IntegrityError
from registry.filecheck import bad_chunks, check_tiling
from registry.manifest import BLOB, FileEntry


def _entry(data: bytes, cuts: list[tuple[int, int]], size: int | None = None) -> FileEntry:
    refs = tuple(ChunkRef(chunk_id(data[o : o + n]), o, n) for o, n in cuts)
    return FileEntry(path="f.bin", kind=BLOB, size=len(data) if size is None else size, sha256=None, chunks=refs)


def test_tiling_orders_the_chunks_and_refuses_gaps_overlaps_and_short_covers():
    data = os.urandom(300)
    assert [c.offset for c in check_tiling(_entry(data, [(200, 100), (0, 100), (100, 100)]))] == [0, 100, 200]
    for cuts, size in (([(0, 100), (150, 150)], None),   # a gap
                       ([(0, 150), (100, 200)], None),   # an overlap
                       ([(0, 100), (100, 100)], None),   # the end left uncovered
                       ([(0, 300)], 400)):               # a file longer than its chunks
        with pytest.raises(IntegrityError, match="damaged"):
            check_tiling(_entry(data, cuts, size))


def test_bad_chunks_reads_the_file_as_it_lies(tmp_path):
    data = os.urandom(3 * 65536 + 123)
    cuts = [(0, 65536), (65536, 65536), (131072, 65536), (196608, 123)]
    entry = _entry(data, cuts)
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    chunks = check_tiling(entry)
    with open(path, "rb") as f:
        assert bad_chunks(f.fileno(), chunks) == []
        assert bad_chunks(f.fileno(), chunks[2:]) == []  # a batch that starts past the first page
    damaged = bytearray(data)
    damaged[65536 + 7] ^= 1
    damaged[-1] ^= 0x80
    path.write_bytes(damaged)
    with open(path, "rb") as f:
        assert [c.offset for c in bad_chunks(f.fileno(), chunks)] == [65536, 196608]
        assert bad_chunks(f.fileno(), []) == []
