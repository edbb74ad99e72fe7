"""Files written around the page cache (registry/client/direct.py): the bytes in order, whatever
the buffers' edges, a staged chunk taken back before any of it is written, nothing left behind
on failure, and a filesystem that refuses O_DIRECT reported as such (the pull then writes through
the page cache)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from mfsreg.registry.client.direct import BUFFER_BYTES, IN_FLIGHT, DirectFile
from tests.pagecache import resident_fraction


def _source(dirpath: Path, name: str, size: int, seed: int) -> tuple[Path, bytes]:
    data = np.random.default_rng(seed).bytes(size)
    path = dirpath / name
    path.write_bytes(data)
    return path, data


def _open(dest: Path, size: int, mode: int | None = None) -> DirectFile:
    out = DirectFile.open(dest, size, mode)
    assert out is not None, "the tests' temp directory should be on a filesystem that takes O_DIRECT"
    return out


def _stage(out: DirectFile, path: Path, length: int | None = None) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        return out.stage_from(fd, os.path.getsize(path) if length is None else length)
    finally:
        os.close(fd)


def test_staged_bytes_land_in_order_across_buffers_and_taken_back_ones_never(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    # odd sizes, a piece that crosses a buffer's edge, and one longer than every buffer together
    sizes = [1, 4095, BUFFER_BYTES - 5000, 3 * 4096 + 17, (IN_FLIGHT + 2) * BUFFER_BYTES + 123, 777_777]
    parts = [_source(src, f"p{i}", n, i) for i, n in enumerate(sizes)]
    junk, _ = _source(src, "junk", BUFFER_BYTES + 99, 99)  # crosses an edge wherever it starts
    total = sum(sizes)
    dest = tmp_path / "out" / "file.bin"
    out = _open(dest, total, mode=0o444)
    with out:
        for i, (path, _) in enumerate(parts):
            if i in (2, 4):  # a chunk that failed its check: staged, then taken back
                mark = out.mark()
                assert _stage(out, junk) == os.path.getsize(junk)
                out.rollback(mark)
            seen = []
            fd = os.open(path, os.O_RDONLY)
            try:
                assert out.stage_from(fd, sizes[i], lambda v: seen.append(bytes(v))) == sizes[i]
            finally:
                os.close(fd)
            assert b"".join(seen) == parts[i][1]  # the check sees exactly what is staged
            out.settle()
        assert not dest.exists()  # only a commit names the file
        out.commit()
    assert dest.read_bytes() == b"".join(d for _, d in parts)
    assert os.stat(dest).st_mode & 0o777 == 0o444
    assert [p.name for p in dest.parent.iterdir()] == ["file.bin"]


def test_a_direct_file_bypasses_the_page_cache(tmp_path):
    path, data = _source(tmp_path, "src", 3 * BUFFER_BYTES + 5, 1)
    dest = tmp_path / "out.bin"
    with _open(dest, len(data)) as out:
        _stage(out, path)
        out.settle()
        out.commit()
    assert resident_fraction(dest) < 0.01  # the disk has the bytes; the page cache never did
    assert dest.read_bytes() == data


def test_a_short_source_and_a_short_file_are_reported(tmp_path):
    path, data = _source(tmp_path, "src", 10_000, 2)
    dest = tmp_path / "out.bin"
    with _open(dest, 20_000) as out:
        assert _stage(out, path, 20_000) == 10_000  # the file ended: fewer bytes than asked for
        with pytest.raises(AssertionError, match="staged 10000 bytes of a 20000-byte file"):
            out.commit()
    assert not dest.exists() and list(tmp_path.iterdir()) == [path]


def test_a_file_left_uncommitted_leaves_the_old_one_and_no_temp(tmp_path):
    path, data = _source(tmp_path, "src", 2 * BUFFER_BYTES + 1, 3)
    dest = tmp_path / "out.bin"
    dest.write_bytes(b"the old file")
    with pytest.raises(RuntimeError, match="stopped"):
        with _open(dest, len(data)) as out:
            _stage(out, path)
            out.settle()  # two buffers go to the writer
            raise RuntimeError("stopped")
    assert dest.read_bytes() == b"the old file"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin", "src"]


@pytest.mark.parametrize("refused_at", ["open", "first write"])
def test_a_filesystem_that_refuses_o_direct_gets_none_and_keeps_nothing(tmp_path, monkeypatch, refused_at):
    """Some filesystems refuse O_DIRECT at open, others (FUSE, network) at the first write."""
    real_open, real_pwrite = os.open, os.pwrite

    def refusing_open(path, flags, *args, **kwargs):
        if refused_at == "open" and flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    def refusing_pwrite(fd, data, offset):
        if refused_at == "first write":
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "open", refusing_open)
    monkeypatch.setattr(os, "pwrite", refusing_pwrite)
    assert DirectFile.open(tmp_path / "out.bin", 10) is None
    assert list(tmp_path.iterdir()) == []


def test_a_failed_write_is_raised_and_leaves_nothing(tmp_path, monkeypatch):
    """A write the disk refuses (full, failing) after the file opened: its error, and no file."""
    path, data = _source(tmp_path, "src", 3 * BUFFER_BYTES, 4)
    dest = tmp_path / "out.bin"
    out = _open(dest, len(data))
    real_pwrite = os.pwrite

    def full(fd, view, offset):
        if offset >= BUFFER_BYTES:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, view, offset)

    monkeypatch.setattr(os, "pwrite", full)
    with pytest.raises(OSError, match="No space left"):
        with out:
            _stage(out, path)
            out.settle()
            out.commit()
    assert not dest.exists() and list(tmp_path.iterdir()) == [path]


def test_a_failed_rename_leaves_no_temp_file(tmp_path):
    """The last step can fail too (here the name is taken by a directory): the error, and the temp
    file gone with it."""
    path, data = _source(tmp_path, "src", BUFFER_BYTES + 1, 5)
    dest = tmp_path / "taken"
    (dest / "inside").mkdir(parents=True)
    with _open(dest, len(data)) as out:
        _stage(out, path)
        out.settle()
        with pytest.raises(IsADirectoryError):  # the rename over a directory, and nothing before it
            out.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src", "taken"]


def test_a_short_write_goes_on_from_the_block_it_ended_in(tmp_path, monkeypatch):
    """A write the disk takes only in part may end mid-block, where O_DIRECT cannot go on: the
    writer goes on from that block's start (the bytes come out whole), and where the disk takes
    less than a block it says so, instead of a misleading EINVAL from the unaligned next write."""
    path, data = _source(tmp_path, "src", 2 * BUFFER_BYTES + 3, 6)
    real_pwrite = os.pwrite
    short = []  # what the next writes past the first buffer report taking, once each

    def partly(fd, view, offset):
        n = real_pwrite(fd, view, offset)
        return min(n, short.pop()) if short and offset > 0 else n  # the probe's write at 0 goes through

    monkeypatch.setattr(os, "pwrite", partly)
    dest = tmp_path / "out.bin"
    short.append(3 * 4096 + 100)
    with _open(dest, len(data)) as out:
        _stage(out, path)
        out.settle()
        out.commit()
    assert not short and dest.read_bytes() == data
    short.append(100)
    with pytest.raises(OSError, match="the disk took only 100 bytes"):
        with _open(tmp_path / "again.bin", len(data)) as out:
            _stage(out, path)
            out.settle()
            out.commit()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.bin", "src"]
