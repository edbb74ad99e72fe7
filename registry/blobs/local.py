"""A BlobStore on a local directory: the embedded default.

Atomic put follows the usual recipe: write a uniquely named temp file in the same directory, fsync,
rename over the final name, fsync the directory; the temp file is removed in ``finally`` if anything
fails. Range reads use pread, so concurrent readers share one descriptor safely.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

from mfsreg.registry.blobs.base import BlobStore, Leftover, check_key
from mfsreg.registry.errors import InvalidRequest, NotFound, StorageError
from mfsreg.registry.format.durable import NO_ROOM, abandoned, hold, make_dirs, sync_dir, temp_beside, what_to_do

PRIVATE_DIR, PRIVATE_FILE = 0o700, 0o600


def _advice(code: int | None) -> str:
    """What to do about a write the blob store's directory refused."""
    if code in NO_ROOM:
        return what_to_do(code)
    if code in (errno.EACCES, errno.EPERM):
        return "this user may not write there; give it write access to the blob store (MFSREG_HOME/blobs or MFSREG_BLOB_URL)"
    return "check that directory and its disk"


class LocalBlobStore(BlobStore):
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.url = self.root.as_uri()
        # Made by the first put, not here: a command that only reads (ls, stats, pull) with
        # MFSREG_BLOB_URL mistyped would otherwise leave an empty store at the wrong name, where the
        # next push would quietly start a second one.
        if self.root.exists() and not self.root.is_dir():
            raise InvalidRequest(f"MFSREG_BLOB_URL names {self.root}, which is a file: give a directory for the packs")

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        if path.exists() and path.stat().st_size == len(data):
            return  # a key names one blob for good: same key and size is a retried put
        tmp = temp_beside(path)
        try:
            # packs/ab/: a directory lost in a crash would lose the pack with it. Packs hold the
            # weights: folders 0700 and files 0600 (less a stricter umask), this user's alone
            make_dirs(path.parent, PRIVATE_DIR)
            with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, PRIVATE_FILE), "wb") as f:
                hold(f.fileno())  # a prune leaves a temp file alone while its writer lives
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            sync_dir(path.parent)
        except OSError as exc:
            raise StorageError(f"cannot write blob {path}: {exc.strerror or exc}: {_advice(exc.errno)}") from None
        finally:
            tmp.unlink(missing_ok=True)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self.get_ranges(key, [(start, end)])[0]

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int | None]]) -> list[bytes]:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFound(f"blob {key} is missing from {self.url}") from None
        try:
            total = os.fstat(fd).st_size
            out = []
            for start, end in ranges:
                end = total if end is None else end
                if start < 0 or end > total or start > end:
                    raise NotFound(f"blob {key}: range {start}-{end} is outside its {total} bytes")
                data = os.pread(fd, end - start, start)
                if len(data) != end - start:
                    raise NotFound(f"blob {key}: short read at {start}")
                out.append(data)
            return out
        finally:
            os.close(fd)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"blob {key} is missing from {self.url}") from None

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def leftovers(self) -> Iterator[Leftover]:
        """Temp files (``.<name>.<uuid>.tmp``) that a killed put left beside its blob: those no live
        writer holds a lock on."""
        now = time.time()
        for p in self.root.rglob(".*.tmp") if self.root.is_dir() else ():
            st = abandoned(p)  # None where its put finished meanwhile, or still runs
            if st is not None:
                yield Leftover(p.relative_to(self.root).as_posix(), st.st_size, max(0.0, now - st.st_mtime))

    def remove_leftover(self, leftover: Leftover) -> None:
        path = self.root / leftover.name
        if not (path.name.startswith(".") and path.name.endswith(".tmp")):  # only ever a temp file
            raise InvalidRequest(f"{leftover.name} is not a temp file of this store")
        path.unlink(missing_ok=True)

    def list(self, prefix: str = "") -> Iterator[str]:
        for p in sorted(self.root.rglob("*")):
            if p.is_file() and not p.name.startswith("."):
                key = p.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    yield key
