"""The check every pull makes of the file it wrote: chunks that tile it, each hashing to its id
where it lies in the file."""

from __future__ import annotations

import os

import pytest

from mfsreg.registry.errors import IntegrityError
from mfsreg.registry.format.chunking import ChunkRef, chunk_id
from mfsreg.registry.format.filecheck import bad_chunks, check_tiling
from mfsreg.registry.format.manifest import BLOB, FileEntry


def _entry(data: bytes, cuts: list[tuple[int, int]], size: int | None = None) -> FileEntry:
    refs = tuple(ChunkRef(chunk_id(data[o : o + n]), o, n) for o, n in cuts)
    return FileEntry(path="f.bin", kind=BLOB, size=len(data) if size is None else size, sha256=None, chunks=refs)


def test_tiling_orders_the_chunks_and_refuses_gaps_overlaps_and_short_covers():
    data = os.urandom(300)
    assert [c.offset for c in check_tiling(_entry(data, [(200, 100), (0, 100), (100, 100)]))] == [0, 100, 200]
    for cuts, size in (
        ([(0, 100), (150, 150)], None),  # a gap
        ([(0, 150), (100, 200)], None),  # an overlap
        ([(0, 100), (100, 100)], None),  # the end left uncovered
        ([(0, 300)], 400),
    ):  # a file longer than its chunks
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


@pytest.mark.parametrize("committed", [True, False])
def test_a_big_file_starts_its_writeback_on_a_thread_that_ends_with_it(tmp_path, committed):
    """A file of more than one stretch hands its writeback calls to a thread of its own (they block
    while the disk's queue is full); committed or abandoned, the thread is done before the file's
    descriptor closes, and the bytes are whole."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from mfsreg.registry.format.filecheck import BATCH_BYTES, CheckedFile, _sync_file_range

    size = 2 * BATCH_BYTES + 4096
    data = os.urandom(1 << 20) * (size // (1 << 20)) + os.urandom(size % (1 << 20))
    stretches = [[ChunkRef("0" * 32, o, min(BATCH_BYTES, size - o))] for o in range(0, size, BATCH_BYTES)]
    dest = tmp_path / "big.bin"
    with ThreadPoolExecutor(1) as pool:
        with CheckedFile(dest, size, pool) as out:
            for batch in stretches:
                c = batch[0]
                os.pwrite(out.fd, data[c.offset : c.offset + c.size], c.offset)
                out.start_writeback(batch)
            helpers = [t for t in threading.enumerate() if t.name.startswith("mfsreg-writeback")]
            assert len(helpers) == (1 if _sync_file_range is not None else 0)
            if committed:
                out.commit()
        assert not any(t.is_alive() for t in helpers)
    assert dest.exists() == committed and not list(tmp_path.glob(".*.tmp"))
    if committed:
        assert dest.read_bytes() == data
