"""A renamed file's new name made durable: the directory that holds it synced.

Every atomic write here (the local blob store's puts, a pull's files) renames a synced temp file and
then calls ``sync_dir``; the directories made for such files are made with ``make_dirs``, so that
their names are synced too.
See docs/design/node-cache.md.
"""

from __future__ import annotations

import errno
import os
import re
import stat
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from mfsreg.registry.errors import StorageError

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows: temp files are not locked, and none is swept
    fcntl = None

# Some filesystems (network and FUSE ones among them) cannot sync a directory: nothing more to do there.
_CANNOT = {errno.EINVAL, errno.EBADF, errno.EOPNOTSUPP, errno.ENOTSUP}


def hold(fd: int) -> None:
    """Lock a temp file its writer is filling; the kernel releases it however the writer ends, so a
    temp file no one holds is one a killed writer left (``held``)."""
    if fcntl is not None:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def held(path: Path) -> bool:
    """Whether a live writer holds ``path``'s lock (without flock: never)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:  # gone meanwhile, or not for us to judge
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def temp_beside(dest: Path) -> Path:
    """A new temp name beside ``dest``: ``.<name>.<uuid>.tmp``."""
    return dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.tmp")


def sweep_beside(dest: Path) -> None:
    """Remove the temp files beside ``dest`` that writers killed while writing ``dest`` left (no
    live writer holds them)."""
    pattern = re.compile(rf"\.{re.escape(dest.name)}\.[0-9a-f]{{32}}\.tmp")
    try:
        names = [n for n in os.listdir(dest.parent) if pattern.fullmatch(n)]
    except OSError:  # no folder yet, or not ours to list: nothing to sweep
        return
    for name in names:
        path = dest.parent / name
        if abandoned(path) is not None:
            path.unlink(missing_ok=True)


def abandoned(path: Path) -> os.stat_result | None:
    """The stat of ``path`` if it is a plain file that no live writer holds (``hold``): a temp file
    a killed writer left. None otherwise, or where it is gone already (its writer renamed it)."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return None
    return st if stat.S_ISREG(st.st_mode) and not held(path) else None


def sync_dir(dirpath: str | os.PathLike) -> None:
    fd = os.open(Path(dirpath), os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in _CANNOT:
            raise
    finally:
        os.close(fd)


def make_dirs(dirpath: str | os.PathLike, mode: int = 0o777) -> None:
    """``dirpath`` and whichever of its parents are missing (``mode``, less the umask), each new one's
    name made durable (its parent synced once it is made)."""
    for d in _make_missing(Path(dirpath), mode):
        sync_dir(d.parent)


def _make_missing(path: Path, mode: int = 0o777) -> list[Path]:
    """Make ``path`` and whichever of its parents are missing (``mode``, less the umask); the folders
    this call made, parents first (one made meanwhile by another writer is that writer's to sync)."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    made = []
    for d in reversed(missing):
        try:
            d.mkdir(mode)
        except FileExistsError:
            if not d.is_dir():
                raise
            continue
        made.append(d)
    return made


# What the disk, a quota or a limit says when a file cannot grow or be written there.
NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EIO}


@contextmanager
def writing(dest: Path) -> Iterator[None]:
    """A full disk, a quota, a file size limit or a failing disk while ``dest`` is written: one line
    naming it (the OSError names no file, or only the temp one beside it)."""
    try:
        yield
    except OSError as exc:
        if exc.errno not in NO_ROOM:
            raise
        raise StorageError(
            f"cannot write {dest}: {exc.strerror or exc}: {what_to_do(exc.errno)}, then run it "
            "again; nothing was renamed into place"
        ) from None


def create_beside(tmp: Path, dest: Path, flags: int) -> int:
    """Opens ``tmp``, a new temp file beside ``dest``, with ``flags``, and locks it (``hold``): keep
    the descriptor, or a dup of it, open until the file is renamed or removed. Temp files of
    ``dest`` that killed writers left are removed first. An error names ``dest``'s
    folder and ``dest``, not the temp name, which the user never gave (``-o /sys/x`` said
    "/sys/.x.<hex>.tmp: Permission denied"); a full disk stays as it is, for ``writing``."""
    sweep_beside(dest)  # what a pull of ``dest`` killed before left
    try:
        fd = os.open(tmp, flags | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        if exc.errno in NO_ROOM or exc.strerror is None:
            raise
        raise type(exc)(exc.errno, f"{exc.strerror} (making {dest.name} there)", str(dest.parent)) from None
    hold(fd)
    return fd


def replaced_mode(dest: Path) -> int | None:
    """The permission bits a new file renamed over ``dest`` is to take: those of the file there
    (through a link, its target's), as cp keeps an existing file's, so that an output made
    read-only stays read-only; None where no file is there (the umask's then). Set-id and sticky
    bits are not carried onto the new bytes (the kernel drops them from a file written to)."""
    try:
        st = os.stat(dest)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return stat.S_IMODE(st.st_mode) & 0o777 if stat.S_ISREG(st.st_mode) else None


def what_to_do(code: int | None) -> str:
    """The advice for a write the filesystem refused with ``code`` (one of NO_ROOM)."""
    if code == errno.EROFS:
        return "that filesystem is mounted read-only; write elsewhere, or remount it read-write"
    if code == errno.EIO:
        return "the disk failed the write; check it (dmesg), or write elsewhere"
    return "make room there (or write elsewhere)"


class Placing:
    """The files of one pull, each written and synced under a temp name, renamed into place together
    once every one has passed its check, so a pull that fails leaves the files there as they were.
    Use as a ``with`` block: leaving it on an error removes the temp files, and the folders
    ``make_dirs`` made for them while they are empty. The renames, the last step, can still fail
    partway; each is atomic for its own file."""

    def __init__(self) -> None:
        self.pending: list[tuple[Path, Path]] = []
        self.made: list[Path] = []  # folders made for the files, parents first
        self.locks: list[int] = []  # descriptors holding the temp files' locks until they are placed

    def make_dirs(self, dirpath: str | os.PathLike) -> None:
        """``dirpath`` and whichever of its parents are missing; their names are made durable with
        the files (a file renamed into a new folder is lost in a crash with the folder's name)."""
        self.made += _make_missing(Path(dirpath))

    def add(self, tmp: Path, dest: Path, fd: int | None = None) -> None:
        """``tmp``, written and synced, goes to ``dest`` when the block ends without an error. ``fd``:
        its open descriptor, whose lock (``hold``) is kept until then: the caller may close its own."""
        self.pending.append((Path(tmp), Path(dest)))
        if fd is not None:
            self.locks.append(os.dup(fd))

    def place(self) -> None:
        folders: dict[Path, None] = {
            d.parent: None for d in reversed(self.made)
        }  # a new folder's name lives in its parent
        total, placed = len(self.pending), 0
        try:
            while self.pending:
                tmp, dest = self.pending[0]
                try:
                    os.replace(tmp, dest)
                except OSError as exc:
                    raise StorageError(
                        f"cannot rename {tmp.name} over {dest}: {exc.strerror or exc}: check that disk; "
                        f"{placed} of the pull's {total} files were renamed into place before it, "
                        "the rest removed: pull again"
                    ) from None
                # a rename between two links of one inode (a pull into the same directory again) does
                # nothing and leaves ``tmp``: no stray link stays beside the file, holding old files' space
                tmp.unlink(missing_ok=True)
                self.pending.pop(0)
                placed += 1
                folders[dest.parent] = None
            self.made.clear()  # placed: they stay
        finally:  # after a failed rename too: the files renamed before it are synced in their folders
            for folder in folders:  # each folder once, however many of the files it holds
                try:
                    sync_dir(folder)
                except OSError as exc:
                    raise StorageError(
                        f"cannot sync folder {folder}: {exc.strerror or exc}: check that disk, then pull again"
                    ) from None

    def discard(self) -> None:
        for tmp, _ in self.pending:
            tmp.unlink(missing_ok=True)
        self.pending.clear()
        for fd in self.locks:  # placed or removed: the locks go
            os.close(fd)
        self.locks.clear()
        for d in reversed(self.made):  # deepest first; one another writer put something in stays
            try:
                d.rmdir()
            except OSError:
                pass
        self.made.clear()

    def __enter__(self) -> Placing:
        return self

    def __exit__(self, kind, *exc) -> None:
        if kind is None:
            try:
                self.place()
            finally:
                self.discard()  # what a failed rename left unplaced
        else:
            self.discard()
