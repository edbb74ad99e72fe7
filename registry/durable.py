"""A renamed file's new name made durable: the directory that holds it synced.

A file synced and then renamed into place has durable bytes, but its new name lives in the
directory, which a crash can lose until that directory is synced too: the file would be gone after
a reboot, though never torn. Every atomic write here (the local blob store's puts, a pull's files)
renames a synced temp file and then calls ``sync_dir``. A directory made for such a file is a name
in its own parent, lost the same way (and the file with it): the blob store makes them with
``make_dirs``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from registry.errors import StorageError

# Some filesystems (network and FUSE ones among them) cannot sync a directory: nothing more to do there.
_CANNOT = {errno.EINVAL, errno.EBADF, errno.EOPNOTSUPP, errno.ENOTSUP}


def sync_dir(dirpath: str | os.PathLike) -> None:
    fd = os.open(Path(dirpath), os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _CANNOT:
            raise
    finally:
        os.close(fd)


def make_dirs(dirpath: str | os.PathLike) -> None:
    """``dirpath`` and whichever of its parents are missing, each new one's name made durable (its
    parent synced once it is made)."""
    path = Path(dirpath)
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for d in reversed(missing):
        try:
            d.mkdir()
        except FileExistsError:  # made meanwhile by another writer, who syncs its parent too
            if not d.is_dir():
                raise
        sync_dir(d.parent)


# What the disk, a quota or a limit says when a file cannot grow or be written there.
_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


@contextmanager
def writing(dest: Path) -> Iterator[None]:
    """A full disk, a quota, a file size limit or a failing disk while ``dest`` is written: one line
    naming it (the OSError names no file, or only the temp one beside it)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in _NO_ROOM:
            raise
        raise StorageError(f"cannot write {dest}: {exc.strerror or exc}: make room there (or write elsewhere), "
                           "then run it again; nothing was renamed into place") from None
