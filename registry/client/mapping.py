"""CPU tensors whose bytes are the node cache's chunk files, mapped in place: no copy, no fresh pages.

Each tensor gets one anonymous region aligned for large folios; each chunk that starts on a page
boundary and fills whole pages (or ends the tensor) is mapped over its slot with MAP_FIXED |
MAP_PRIVATE, so writes stay private to the process. Other chunks are copied in. POSIX only.
See docs/design/node-cache.md.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
import threading
import weakref

import torch

from mfsreg.registry.client.cachefiles import CACHE_READ_FLAGS

PAGE = mmap.PAGESIZE
HUGE = 2 << 20  # a PMD-mapped page on x86-64 and arm64 with 4 KiB pages
_PROT = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_FIXED = 0x10  # the same value on Linux and macOS; absent from Python's mmap module

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.restype = ctypes.c_int
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
# Linux only (elsewhere None): see Region._map_one
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)

try:
    from mfsreg.registry.client import _mapfiles  # C, built by setup.py where a compiler is at hand (see map_many)
except ImportError:  # one file at a time through ctypes: the same mappings, slower
    _mapfiles = None
_MAPPED, _HOLE = 0, 3  # _mapfiles' status bytes (see its map_files)
_FAILED = ctypes.c_void_p(-1).value

# data_ptr -> Region, for tensors built here; an entry goes when its tensor (and every view) is freed.
_regions: weakref.WeakValueDictionary[int, Region] = weakref.WeakValueDictionary()


def _map_budget() -> int:
    """Kernel mappings this module may cause at once: half the per-process limit (vm.max_map_count),
    so that a process holding several large models never reaches it (past it, mmap and malloc fail,
    and Linux may leave a hole where an anonymous slot was). Each region counts one, each chunk file
    mapped into it two (it may split the region's anonymous mapping in two). Past the budget, chunks
    are copied instead."""
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read()) // 2
    except (OSError, ValueError):
        return 32768  # half of Linux's default


MAP_BUDGET = _map_budget()
_lock = threading.RLock()  # reentrant: a Region's __del__ may run (garbage collection) while _charge holds it
_mapped = 0  # mappings charged by live regions (see _map_budget)
_PER_FILE = 2


class Region:
    """An anonymous, page-aligned span of address space that backs one tensor. Unmapped (with every
    file mapped into it) when the last tensor over it is freed."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.length = max(PAGE, -(-nbytes // PAGE) * PAGE)
        self.addr = _reserve(self.length)
        self.slots: set[int] = set()  # starts of the chunk files mapped into this region
        _charge(1)

    def __del__(self) -> None:
        if getattr(self, "addr", None) is not None:
            _libc.munmap(self.addr, self.length)
            _charge(-1 - _PER_FILE * len(self.slots))

    def tensor(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        buf = (ctypes.c_ubyte * self.nbytes).from_address(self.addr)
        # an attribute set on purpose (ctypes arrays take any): the buffer keeps the region alive, torch.frombuffer the buffer
        buf._region = self  # type: ignore[attr-defined]  # deliberately dynamic, see above
        t = torch.frombuffer(buf, dtype=dtype).view(shape)
        _regions[self.addr] = self
        return t

    def can_map(self, start: int, size: int) -> bool:
        """Whether a chunk at ``start`` of ``size`` bytes covers whole pages of its own (or ends the tensor)."""
        return start % PAGE == 0 and (size % PAGE == 0 or start + size == self.nbytes)

    def admits(self, start: int, pending: int = 0) -> bool:
        """Whether a file may be mapped at ``start`` within MAP_BUDGET (``pending``: mappings about to be charged)."""
        return start in self.slots or _mapped + pending + _PER_FILE <= MAP_BUDGET

    def map_file(self, start: int, size: int, path: str) -> memoryview | None:
        """Map ``path`` (exactly ``size`` bytes) over bytes [start, start + size); the bytes as a view,
        or None when the file is missing, has another size, or cannot be mapped (the process holds
        MAP_BUDGET mappings already): the caller copies instead. (map_many, for one file.)"""
        return self.view(start, size) if map_many([(self, start, size, path)])[0] else None

    def _map_one(self, start: int, size: int, path: str) -> bool:
        """map_many's way through ctypes, one file at a time, where the C helper is not built."""
        try:
            fd = os.open(
                path, CACHE_READ_FLAGS
            )  # as the cache's readers: a fifo does not block, a link is not followed
        except OSError:
            return False  # missing (evicted by another process), a link, or unreadable: the caller reads or refetches
        try:
            # A short file would raise SIGBUS on first touch, not an error: check its size first.
            # Cache files are written once and renamed into place, never changed in place.
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != size:
                return False
            addr = _libc.mmap(self.addr + start, size, _PROT, mmap.MAP_PRIVATE | _MAP_FIXED, fd, 0)
        finally:
            os.close(fd)
        if addr != self.addr + start:
            self._restore(start, size)
            return False
        if _MADV_HUGEPAGE is not None:
            # Where the file's pages are not in the page cache (a node's first load after a reboot,
            # or after memory pressure dropped them), the first touch reads them in whole 2 MiB
            # folios, mapped by one page-table entry, instead of readahead's smaller ones, which
            # stay small: measured on a 1.16 GB model dropped from the page cache, every later
            # load took 0.13 s instead of 0.02 (benchmarks/compare_load.py --cold). Advice only:
            # a refusal (THP off) changes nothing. (_mapfiles.c advises the same.)
            _libc.madvise(addr, -(-size // PAGE) * PAGE, _MADV_HUGEPAGE)
        return True

    def _holds(self, start: int) -> None:
        """A file is mapped at ``start`` now: charged once per slot."""
        if start not in self.slots:
            self.slots.add(start)
            _charge(_PER_FILE)

    def _restore(self, start: int, size: int) -> None:
        """A failed MAP_FIXED may have unmapped the slot: put fresh anonymous pages back so the caller
        can copy into it. (If even that fails the slot is a hole: the error says so, and the tensor
        must not be used.)"""
        back = _libc.mmap(self.addr + start, size, _PROT, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED, -1, 0)
        if back != self.addr + start:
            raise _hole(os.strerror(ctypes.get_errno()))

    def view(self, start: int, size: int) -> memoryview:
        return memoryview((ctypes.c_ubyte * size).from_address(self.addr + start)).cast("B")


def map_many(jobs: list[tuple[Region, int, int, str]]) -> list[bool]:
    """Map each (region, start, size, path): the file, exactly ``size`` bytes, over [start, start +
    size) of its region, advised MADV_HUGEPAGE, in one call to _mapfiles where it is built. True
    where mapped; False where the file is missing, not a plain file, of another size or unmappable,
    or past MAP_BUDGET (the slot keeps fresh memory to copy into). Raises MemoryError where a slot
    cannot be restored. Threads mapping at once may pass the budget by a few files."""
    admitted, pending = [], 0
    for k, (region, start, _, _) in enumerate(jobs):
        if region.admits(start, pending):
            admitted.append(k)
            pending += 0 if start in region.slots else _PER_FILE
    if _mapfiles is None:
        mapped, hole = [jobs[k][0]._map_one(*jobs[k][1:]) for k in admitted], False  # _map_one raises at a hole
    else:
        status = _mapfiles.map_files(
            [jobs[k][0].addr + jobs[k][1] for k in admitted],
            [jobs[k][2] for k in admitted],
            [jobs[k][3] for k in admitted],
        )
        mapped, hole = [st == _MAPPED for st in status], _HOLE in status
    done = [False] * len(jobs)
    for k, ok in zip(admitted, mapped):
        if ok:
            jobs[k][0]._holds(jobs[k][1])
            done[k] = True
    if hole:  # a failed mapping whose slot not even fresh memory could fill again
        raise _hole("mmap failed")
    return done


def _hole(why: str) -> MemoryError:
    return MemoryError(
        f"cannot map a chunk into a tensor, and its memory could not be restored: {why}; free "
        "memory or raise vm.max_map_count and load again"
    )


def _reserve(length: int) -> int:
    """Anonymous memory of ``length`` bytes (a multiple of PAGE), aligned for large folios (see the
    module's doc): reserved with room to spare, then the slack before and after is unmapped."""
    align = HUGE if length >= HUGE else max(PAGE, 1 << (length.bit_length() - 1))
    spare = align - PAGE
    addr = _libc.mmap(None, length + spare, _PROT, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
    if addr in (None, _FAILED):
        raise MemoryError(f"cannot reserve {length} bytes of address space: {os.strerror(ctypes.get_errno())}")
    start = -(-addr // align) * align
    if start > addr:
        _libc.munmap(addr, start - addr)
    if addr + spare > start:
        _libc.munmap(start + length, addr + spare - start)
    return start


def _charge(n: int) -> None:
    global _mapped
    with _lock:
        _mapped += n


def empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised CPU tensor over its own region, so chunk files can be mapped into it."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    return Region(nbytes).tensor(dtype, shape)


def region_of(tensor: torch.Tensor) -> Region | None:
    """The region under ``tensor`` if it was made by ``empty`` (and is not a view at an offset)."""
    r = _regions.get(tensor.data_ptr()) if tensor.device.type == "cpu" else None
    return r if r is not None and r.nbytes == tensor.nbytes else None
