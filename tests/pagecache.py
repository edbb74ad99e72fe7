"""How much of a file the page cache holds (Linux mincore), to tell a file written around the page
cache (O_DIRECT) from one written through it."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
_libc.mincore.restype = ctypes.c_int


def resident_fraction(path: Path | str) -> float:
    """The share of ``path``'s pages in the page cache, read without touching them."""
    size = os.path.getsize(path)
    if size == 0:
        return 0.0
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) as m:
        # a private mapping is writable, so ctypes can take its address; mincore reads the file's
        # pages as the page cache holds them (nothing here writes to the mapping)
        buf = (ctypes.c_char * size).from_buffer(m)
        try:
            pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
            vec = ctypes.create_string_buffer(pages)
            if _libc.mincore(ctypes.addressof(buf), size, vec) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
            return sum(b & 1 for b in vec.raw) / pages
        finally:
            del buf
