"""CPU tensors mapped from the node cache's chunk files (registry/client/mapping.py), through the Copier."""

from __future__ import annotations

import gc
import os
import shutil
import stat
import sys

import numpy as np
import pytest
import torch

from mfsreg.registry.client import mapping
from mfsreg.registry.client.cache import NodeCache
from mfsreg.registry.client.torch_loader import Copier, Piece
from mfsreg.registry.errors import IntegrityError
from mfsreg.registry.format.chunking import ChunkRef, chunk_id

PAGE = mapping.PAGE
# /proc/self/maps shows what is mapped; the loader itself also runs on macOS (copies elsewhere)
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")


def _pieces(cache: NodeCache, data: bytes, cuts: list[int]) -> list[Piece]:
    """Cache ``data`` cut at ``cuts``; the pieces of a tensor holding it."""
    out = []
    for start, end in zip([0, *cuts], [*cuts, len(data)]):
        raw = data[start:end]
        cid = chunk_id(raw)
        cache.put(cid, raw)
        out.append(Piece(ChunkRef(cid, start, len(raw), 2), start))
    return out


def _files_mapped(cache: NodeCache, pieces: list[Piece]) -> list[bool]:
    """Whether each piece's cache file is mapped into this process."""
    with open("/proc/self/maps") as f:
        maps = f.read()
    return [str(cache.chunk_path(p.chunk.id)) in maps for p in pieces]


@pytest.fixture
def cache(tmp_path):
    c = NodeCache(tmp_path / "cache")
    yield c
    c.close()


def _vm_flags(path: str) -> list[list[str]]:
    """The VmFlags of each mapping of ``path`` in this process (/proc/self/smaps)."""
    out, current = [], None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head) >= 5 and not head[0].endswith(":"):  # a mapping's first line
                current = line.rstrip("\n").endswith(path)
            elif current and line.startswith("VmFlags:"):
                out.append(line.split()[1:])
    return out


@pytest.mark.skipif(not os.path.isdir("/sys/kernel/mm/transparent_hugepage"), reason="a kernel without huge pages")
def test_mapped_chunk_files_ask_for_huge_pages(cache):
    """Each mapped chunk file is advised MADV_HUGEPAGE (smaps shows "hg"): where its pages have left
    the page cache, the first touch reads them back in 2 MiB folios, not readahead's small ones."""
    data = np.random.default_rng(2).integers(0, 256, size=4 * PAGE, dtype=np.uint8).tobytes()
    pieces = _pieces(cache, data, [2 * PAGE])
    t = mapping.empty((len(data),), torch.uint8)
    Copier(cache, torch.device("cpu")).copy(t, pieces)
    for p in pieces:
        flags = _vm_flags(str(cache.chunk_path(p.chunk.id)))
        assert flags and all("hg" in f for f in flags), flags


def test_aligned_chunks_are_mapped_and_writes_stay_private(cache):
    data = np.random.default_rng(1).integers(0, 2**16, size=(3 * PAGE + 1000) // 2, dtype=np.uint16).tobytes()
    pieces = _pieces(cache, data, [PAGE, 3 * PAGE])  # two whole-page chunks and a short last one
    t = mapping.empty((len(data) // 2,), torch.bfloat16)
    region = mapping.region_of(t)
    assert region is not None and region.can_map(0, PAGE) and region.can_map(3 * PAGE, 1000)
    assert Copier(cache, torch.device("cpu")).copy(t, pieces) == len(data)
    assert _files_mapped(cache, pieces) == [True, True, True]  # each chunk file is mapped in place: nothing was copied
    assert t.view(torch.uint8).numpy().tobytes() == data
    t.view(torch.uint8)[0:PAGE] = 0  # private: the cached chunk keeps its bytes
    assert cache.get(pieces[0].chunk.id) == data[:PAGE]
    tail = t[-500:]  # a view keeps the region (and its mappings) alive after its base is dropped
    del t, region
    gc.collect()
    assert _files_mapped(cache, pieces) == [True, True, True]
    assert tail.view(torch.uint8).numpy().tobytes() == data[-1000:]
    del tail
    gc.collect()
    assert _files_mapped(cache, pieces) == [False, False, False]  # the region and its mappings went with the tensor


# The C helper's path where it is built (test_mapfiles_module_is_built says whether it must be), and
# always the ctypes one it falls back to.
MAPPERS = ["c", "ctypes"] if mapping._mapfiles is not None else ["ctypes"]


@pytest.fixture(params=MAPPERS)
def mapper(request, monkeypatch):
    """Chunk files are mapped in one call to the C helper (registry/client/_mapfiles.c), or one at a
    time through ctypes where it is not built: both, with the same outcomes."""
    if request.param == "ctypes":
        monkeypatch.setattr(mapping, "_mapfiles", None)
    return request.param


@pytest.mark.skipif(
    not (shutil.which("cc") or shutil.which("gcc")), reason="no C compiler: mapping goes through ctypes"
)
def test_mapfiles_module_is_built():
    """setup.py builds registry/client/_mapfiles.c optionally, so a broken build would only show as
    slower loads: where a compiler is at hand (as in CI) the module must be there, or the tests
    above would run the ctypes path twice."""
    assert mapping._mapfiles is not None, (
        "registry/client/_mapfiles.c is not built, or built from an older checkout: make install"
    )


def test_an_unchecked_copy_maps_what_it_can_and_reads_the_rest(cache, mapper, monkeypatch):
    data = np.random.default_rng(3).integers(0, 256, size=5 * PAGE + 1000, dtype=np.uint8).tobytes()
    pieces = _pieces(cache, data, [PAGE, 3 * PAGE, 3 * PAGE + 6])  # the third starts off a page: read
    t = mapping.empty((len(data),), torch.uint8)
    assert Copier(cache, torch.device("cpu"), verify=False).copy(t, pieces) == len(data)
    assert _files_mapped(cache, pieces) == [True, True, False, False]
    assert t.numpy().tobytes() == data
    if os.path.isdir("/sys/kernel/mm/transparent_hugepage"):  # a kernel with huge pages takes the advice
        assert all("hg" in f for p in pieces[:2] for f in _vm_flags(str(cache.chunk_path(p.chunk.id))))
    t[:PAGE] = 0  # private: the cached chunk keeps its bytes
    assert cache.get(pieces[0].chunk.id) == data[:PAGE]
    # past the budget (room for one more file here), the rest are read
    u = mapping.empty((len(data),), torch.uint8)
    monkeypatch.setattr(mapping, "MAP_BUDGET", mapping._mapped + 2)
    assert Copier(cache, torch.device("cpu"), verify=False).copy(u, pieces) == len(data)
    assert u.numpy().tobytes() == data and mapping._mapped == mapping.MAP_BUDGET
    assert mapping.region_of(u).slots == {0}  # the one file that fit, charged once
    # a file mapped again over its own slot is not charged again; one more slot is charged once
    held = mapping._mapped
    monkeypatch.setattr(mapping, "MAP_BUDGET", 1 << 30)
    files = [(mapping.region_of(u), p.start, p.chunk.size, str(cache.chunk_path(p.chunk.id))) for p in pieces[:2]]
    assert mapping.map_many(files) == [True, True] and mapping._mapped == held + 2
    assert mapping.map_many(files) == [True, True] and mapping._mapped == held + 2
    # a file of another size is not mapped, nor charged; with nothing to fetch it from, the copy fails
    path = cache.chunk_path(pieces[0].chunk.id)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.truncate(PAGE // 2)
    v = mapping.empty((len(data),), torch.uint8)
    held = mapping._mapped
    assert mapping.map_many([(mapping.region_of(v), 0, PAGE, str(path))]) == [False] and mapping._mapped == held
    with pytest.raises(IntegrityError, match="missing or damaged"):
        Copier(cache, torch.device("cpu"), verify=False).copy(v, pieces)


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"), reason="needs a sysfs file")
def test_a_file_that_cannot_be_mapped_leaves_its_slot_usable(mapper):
    """A sysfs file has a page's size but refuses mmap: the failed MAP_FIXED may have unmapped the
    slot, so fresh memory is put back there, and the tensor can take the bytes by copy."""
    t = mapping.empty((2 * PAGE,), torch.uint8)
    region = mapping.region_of(t)
    held = mapping._mapped
    sysfs = "/sys/kernel/mm/transparent_hugepage/enabled"
    if mapper == "c":  # the mapping failed, and fresh memory is back in the slot (not merely skipped)
        assert mapping._mapfiles.map_files([region.addr], [PAGE], [sysfs]) == b"\x02"
    assert mapping.map_many([(region, 0, PAGE, sysfs)]) == [False]
    assert mapping._mapped == held
    t.fill_(7)  # no hole: this would fault
    assert int(t.sum()) == 7 * 2 * PAGE


def test_chunks_off_page_boundaries_are_copied(cache):
    data = os.urandom(3 * PAGE)
    pieces = _pieces(cache, data, [PAGE, PAGE + 6])  # only the first chunk starts on a page and fills whole pages
    t = mapping.empty((len(data),), torch.uint8)
    assert not mapping.region_of(t).can_map(PAGE + 6, PAGE)
    assert Copier(cache, torch.device("cpu")).copy(t, pieces) == len(data)
    assert _files_mapped(cache, pieces) == [True, False, False]
    assert t.numpy().tobytes() == data


def test_a_short_cache_file_is_not_mapped(cache):
    """Mapping a short file would end in SIGBUS on first touch; it is refused and read instead."""
    data = os.urandom(2 * PAGE)
    (piece,) = _pieces(cache, data, [])
    os.chmod(cache.chunk_path(piece.chunk.id), 0o644)
    with open(cache.chunk_path(piece.chunk.id), "r+b") as f:
        f.truncate(PAGE)
    t = mapping.empty((len(data),), torch.uint8)
    held = mapping._mapped
    assert mapping.region_of(t).map_file(0, len(data), str(cache.chunk_path(piece.chunk.id))) is None
    assert mapping._mapped == held  # a refused mapping is not charged to the budget
    with pytest.raises(IntegrityError, match="missing or damaged"):
        Copier(cache, torch.device("cpu")).copy(t, [piece])


def test_cache_chunk_files_are_read_only(cache):
    """Mapped tensors read straight from these files: nobody should edit them in place."""
    (piece,) = _pieces(cache, os.urandom(PAGE), [])
    assert stat.S_IMODE(cache.chunk_path(piece.chunk.id).stat().st_mode) & 0o222 == 0


def test_a_damaged_mapped_chunk_is_refused(cache):
    data = os.urandom(PAGE)
    (piece,) = _pieces(cache, data, [])
    path = cache.chunk_path(piece.chunk.id)
    os.chmod(path, 0o644)
    with open(path, "r+b") as f:
        f.write(b"\x00" * 8)
    t = mapping.empty((len(data),), torch.uint8)
    with pytest.raises(IntegrityError, match="missing or damaged"):
        Copier(cache, torch.device("cpu")).copy(t, [piece])


def test_empty_and_scalar_tensors(cache):
    assert mapping.empty((0, 4), torch.float32).shape == (0, 4)
    s = mapping.empty((), torch.float32)
    s.fill_(2.5)
    assert s.item() == 2.5 and mapping.region_of(s) is not None


def test_past_the_mapping_budget_chunks_are_copied(cache, monkeypatch):
    """A process never holds more file mappings than MAP_BUDGET (half of vm.max_map_count): past it, chunks are copied."""
    gc.collect()  # regions earlier tests left in garbage cycles go now, not while the count is compared
    data = os.urandom(2 * PAGE)
    pieces = _pieces(cache, data, [PAGE])
    t = mapping.empty((len(data),), torch.uint8)
    monkeypatch.setattr(mapping, "MAP_BUDGET", mapping._mapped + 2)  # room for one chunk file
    assert Copier(cache, torch.device("cpu")).copy(t, pieces) == len(data)
    assert _files_mapped(cache, pieces) == [True, False]
    assert t.numpy().tobytes() == data
    held = mapping._mapped
    del t
    gc.collect()
    assert mapping._mapped == held - 3  # the region and its one file mapping, freed with the tensor


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_regions_are_aligned_for_large_folios_and_return_their_slack():
    """A tensor's region starts on a 2 MiB boundary (a smaller one on its size's power of two), so
    chunk files mapped into it line up with their page cache folios; the room reserved to align it
    is given back, so each region costs only its own length of address space."""
    big = mapping.empty((3 * 2**20 + 5,), torch.uint8)
    small = mapping.empty((5 * PAGE,), torch.uint8)
    assert big.data_ptr() % mapping.HUGE == 0 and small.data_ptr() % (4 * PAGE) == 0
    length = mapping.region_of(big).length
    before = _vm_size()
    held = [mapping.empty((3 * 2**20 + 5,), torch.uint8) for _ in range(20)]
    grown = _vm_size() - before
    assert all(t.data_ptr() % mapping.HUGE == 0 for t in held)
    # without giving the slack back this would be 20 * (length + 2 MiB - PAGE); allow 4 MiB of other allocations
    assert grown <= 20 * length + (4 << 20), grown
