"""The node cache's files on disk: reading a cache file without being fooled by what may stand at its
name (a fifo, a link, a directory), writing one atomically, temp names, and the one-line errors for
a cache directory or disk that cannot take a file. No index here: these work on paths alone.
"""

from __future__ import annotations

import errno
import mmap
import os
import re
import stat
import uuid
from pathlib import Path

from mfsreg.registry.errors import InvalidRequest, StorageError
from mfsreg.registry.format.durable import NO_ROOM, what_to_do

STALE_TEMP_SECONDS = 3600  # temp files older than this were left by a writer that died

# Opened without blocking: a fifo at a chunk's name made the open wait for a writer forever (and a
# load or pull hang); without following a link (no writer makes one: it is damage, written over).
CACHE_READ_FLAGS = (
    os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
)


def open_plain(path: str) -> tuple[int, os.stat_result] | None:
    """A descriptor of the plain file at ``path`` (a cache file), open for reading, and its stat;
    None where nothing is there, or something that is not a plain file (a directory, a link, a fifo,
    a socket or a device), or a file this user may not read but may replace: what a cache's readers
    take for a missing or damaged entry, fetched again and written over. A file this user may
    neither read nor replace is a one-line StorageError."""
    try:
        fd = os.open(path, CACHE_READ_FLAGS)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO, errno.EISDIR, errno.EMLINK):  # a link (EMLINK on BSD); a socket
            return None
        if exc.errno in (errno.EACCES, errno.EPERM) and may_replace(path):
            # cache files are written 0444, so one without read permission was changed after (a
            # chmod by hand, a restore that lost modes): damage a rename over it repairs
            return None
        raise unreadable(path, exc) from None
    try:
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        return None
    return fd, st


def may_replace(path: str) -> bool:
    """Whether this user may rename a file over ``path`` (and unlink it): its directory writable."""
    return os.access(os.path.dirname(path), os.W_OK | os.X_OK)


def unreadable(path: str, exc: OSError) -> StorageError:
    """The one line for a cache file this user may neither read nor replace (a shared cache another
    user owns)."""
    return StorageError(
        f"cannot read {path} in the node cache: {exc.strerror}: check its permissions, or set "
        "MFSREG_CACHE_DIR to a cache of your own"
    )


def read_plain(path: str) -> tuple[bytes, os.stat_result] | None:
    """The bytes of the plain file at ``path`` and its stat (see open_plain)."""
    opened = open_plain(path)
    if opened is None:
        return None
    fd, st = opened
    with open(fd, "rb", buffering=0) as f:  # closes fd
        return f.readall(), st


def map_plain(path: str) -> tuple[memoryview | bytes, os.stat_result] | None:
    """The bytes of the plain file at ``path`` as a read-only view of a private map, and its stat
    (see open_plain); its bytes read into memory where it cannot be mapped. For the bases a delta
    is decoded against: read, a 1.16 GB member's 50 bases of 2 MiB were copied into fresh memory
    that the decoder read once (mapped: 0.524 -> 0.466 s, medians of 8 alternating loads). As
    registry/client/mapping.py's tensors, a map relies on cache files never changing in place
    (written once, read-only, renamed into place): the size is checked before it is mapped."""
    opened = open_plain(path)
    if opened is None:
        return None
    fd, st = opened
    with open(fd, "rb", buffering=0) as f:  # closes fd (a map keeps its own)
        if st.st_size and hasattr(mmap, "MAP_PRIVATE"):  # (POSIX)
            try:
                return memoryview(mmap.mmap(fd, st.st_size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ)), st
            except (OSError, ValueError):  # past the process's map limit, or no mmap for this file
                pass
        return f.readall(), st


def holds_any(path: str | os.PathLike[str]) -> bool:
    """Whether the directory at ``path`` has any entry at all (one read of it)."""
    try:
        with os.scandir(path) as it:
            return next(it, None) is not None
    except (FileNotFoundError, NotADirectoryError):
        return False


def is_plain(path: str) -> bool:
    """Whether a plain file stands at ``path`` (not following a link): one lstat."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except (FileNotFoundError, NotADirectoryError):
        return False


def make_dir(path: Path) -> None:
    """A directory of the cache, made if missing; what stands in its way is one line."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # exist_ok covers a directory there only
        blocker = next((p for p in (path, *path.parents) if os.path.lexists(p) and not p.is_dir()), path)
        raise InvalidRequest(
            f"the node cache cannot use {path} ({blocker} is a file): a file is where a directory is "
            "needed; move it away, or set MFSREG_CACHE_DIR (or cache_dir=) to a directory"
        ) from None
    except OSError as exc:
        no_room(str(path), exc)
        raise StorageError(
            f"the node cache cannot make {path}: {exc.strerror}: check its permissions, or set "
            "MFSREG_CACHE_DIR to a cache of your own"
        ) from None


def temp_name(path: str) -> str:
    """A unique hidden temp name beside ``path`` (what is_temp knows, and sweep_temps removes once
    an hour old: one a killed process left)."""
    head, _, name = path.rpartition("/")
    return f"{head}/.{name}.{uuid.uuid4().hex}.tmp"


def is_temp(name: str) -> bool:
    """Whether a file name is one of atomic_write's temp names (hidden, ending in .tmp)."""
    return name.startswith(".") and name.endswith(".tmp")


SHARD_NAME = re.compile(r"[0-9a-f]{2}")
CHUNK_NAME = re.compile(r"[0-9a-f]{32}")
FILE_NAME = re.compile(r"[0-9a-f]{64}")


def atomic_write(path: str, data, mode: int = 0o644) -> None:
    """Write ``data`` to ``path`` (a string with "/") under a unique hidden temp name beside it,
    then rename it into place.

    A cold pull writes a thousand or more chunk files a gigabyte: this keeps to five system calls
    a file (open, chmod, write, close, rename), making the directory only when the open finds it
    missing. The temp name is random, not the pid: processes in other pid namespaces (containers)
    may share the cache. The mode is set exactly, whatever the umask, so every user of a shared
    cache can read its files."""
    tmp = temp_name(path)
    head = tmp.rpartition("/")[0]
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0)
    try:
        try:
            fd = os.open(tmp, flags, 0o600)
        except FileNotFoundError:
            os.makedirs(head, exist_ok=True)
            fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        no_room(path, exc)
        raise
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data).cast("B")
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
        try:
            os.replace(tmp, path)
        except IsADirectoryError:  # the error would name the temp file, which is gone by then
            raise directory_in_the_way(path) from None
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError):
            no_room(path, exc)
        raise


def directory_in_the_way(path: str | os.PathLike) -> StorageError:
    """The error for a directory standing where a cache file is to be renamed into place."""
    return StorageError(
        f"cannot write {path}: a directory stands at that name in the node cache; `mfsreg cache verify` removes it"
    )


def no_room(path: str, exc: OSError) -> None:
    # a pull writes its output too: the error must say it was the cache that had no room (a disk
    # full, read-only or failing), not the output
    if exc.errno in NO_ROOM:
        full = exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
        raise StorageError(
            f"the node cache cannot take {path}: {exc.strerror}: {what_to_do(exc.errno)}"
            + (
                ", or set MFSREG_CACHE_MAX to a size it has room for"
                if full
                else ", or set MFSREG_CACHE_DIR to a cache on another disk"
            )
        ) from None
