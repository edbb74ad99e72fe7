"""A renamed file's new name made durable: the directory that holds it synced.

A file synced and then renamed into place has durable bytes, but its new name lives in the
directory, which a crash can lose until that directory is synced too: the file would be gone after
a reboot, though never torn. Every atomic write here (the local blob store's puts, a pull's files)
renames a synced temp file and then calls ``sync_dir``.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

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
