"""A BlobStore on a local directory: the embedded default.

Atomic put follows the usual recipe: write a uniquely named temp file in the same directory, fsync,
rename over the final name, fsync the directory; the temp file is removed in ``finally`` if anything
fails. Range reads use pread, so concurrent readers share one descriptor safely.

Direct I/O. Packs are written once and then read range by range, each range about once per pull;
passed through the page cache, every byte is first copied into freshly allocated cache pages, which
cost more CPU than encoding them (an embedded push of the bench family's base: 4.1 CPU-seconds
buffered, 3.0 direct, most of the difference in the kernel's copy into new cache pages; see
README). So blobs and ranges of DIRECT_MIN bytes or more move with O_DIRECT, through a per-thread
page-aligned staging buffer (O_DIRECT wants aligned buffers, offsets and lengths), as storage
servers do for bulk objects. Small ones, and filesystems that refuse O_DIRECT (tmpfs, some network
filesystems: EINVAL), use ordinary buffered I/O; MFSREG_DIRECT_IO=0 turns direct I/O off.
"""

from __future__ import annotations

import errno
import mmap
import os
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path

from registry.blobs.base import BlobStore, check_key
from registry.errors import NotFound, StorageError


DIRECT_MIN = 1 << 20  # blobs and ranges at least this long bypass the page cache
_ALIGN = 4096  # what O_DIRECT asks of buffers, offsets and lengths: the largest logical block size in use
_STAGE = 8 << 20  # each I/O thread's staging buffer
_local = threading.local()


class _Refused(Exception):
    """The filesystem does not take O_DIRECT (or not with this alignment): use buffered I/O."""


def _stage() -> mmap.mmap:
    """This thread's staging buffer: an anonymous mapping, so page-aligned; kept for the thread's life."""
    stage = getattr(_local, "stage", None)
    if stage is None:
        stage = _local.stage = mmap.mmap(-1, _STAGE)
    return stage


def _open_direct(path: Path, flags: int) -> int:
    try:
        return os.open(path, flags | os.O_DIRECT, 0o666)
    except OSError as exc:
        if exc.errno == errno.EINVAL:
            raise _Refused from None
        raise


def _write_direct(path: Path, data) -> None:
    """Write ``data`` to the new file ``path`` with O_DIRECT and fsync it: whole aligned blocks from
    the staging buffer, the last one zero-padded, then the file cut back to its length."""
    fd = _open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        stage, n = _stage(), len(data)
        with memoryview(data).cast("B") as src, memoryview(stage) as buf:
            for off in range(0, n, _STAGE):
                k = min(_STAGE, n - off)
                buf[:k] = src[off : off + k]
                padded = -(-k // _ALIGN) * _ALIGN
                buf[k:padded] = bytes(padded - k)
                try:
                    written = os.pwrite(fd, buf[:padded], off)
                except OSError as exc:
                    if exc.errno == errno.EINVAL:
                        raise _Refused from None
                    raise
                if written != padded:
                    raise OSError(errno.EIO, f"short write ({written} of {padded} bytes)")
        if n % _ALIGN:
            os.ftruncate(fd, n)
        os.fsync(fd)
    finally:
        os.close(fd)


def _read_direct(fd: int, start: int, end: int) -> bytearray:
    """Bytes [start, end) of the O_DIRECT descriptor ``fd``: aligned blocks read into the staging
    buffer and copied out. The caller has checked the range lies inside the file."""
    out = bytearray(end - start)
    stage, pos = _stage(), start
    with memoryview(stage) as buf:
        while pos < end:
            base = pos - pos % _ALIGN
            want = min(_STAGE, -(-(end - base) // _ALIGN) * _ALIGN)
            try:
                got = os.preadv(fd, [buf[:want]], base)
            except OSError as exc:
                if exc.errno == errno.EINVAL:
                    raise _Refused from None
                raise
            k = min(got - (pos - base), end - pos)
            if k <= 0:
                raise OSError(errno.EIO, f"short read at {pos}")
            out[pos - start : pos - start + k] = buf[pos - base : pos - base + k]
            pos += k
    return out


class LocalBlobStore(BlobStore):
    def __init__(self, root: str | os.PathLike, direct: bool = True):
        self.root = Path(root)
        # False from the start where the platform lacks O_DIRECT, or after the filesystem refused it
        self.direct = direct and hasattr(os, "O_DIRECT")
        self.url = self.root.as_uri()
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create blob directory {self.root}: {exc.strerror}") from None

    def _path(self, key: str) -> Path:
        return self.root / check_key(key)

    def put(self, key: str, data: bytes | memoryview) -> None:
        path = self._path(key)
        if path.exists() and path.stat().st_size == len(data):
            return  # content-addressed keys: same key and size means the same bytes are there
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
        try:
            if not (self.direct and len(data) >= DIRECT_MIN and self._put_direct(tmp, data)):
                with open(tmp, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
            os.replace(tmp, path)
            dirfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dirfd)
            finally:
                os.close(dirfd)
        except OSError as exc:
            raise StorageError(f"cannot write blob {key}: {exc.strerror}") from None
        finally:
            tmp.unlink(missing_ok=True)

    def _put_direct(self, tmp: Path, data) -> bool:
        """Write ``tmp`` with O_DIRECT; False (and nothing left at ``tmp``) where the filesystem refuses."""
        try:
            _write_direct(tmp, data)
            return True
        except _Refused:
            self.direct = False
            tmp.unlink(missing_ok=True)
            return False

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self.get_ranges(key, [(start, end)])[0]

    def get_ranges(self, key: str, ranges: list[tuple[int, int | None]]) -> list[bytes]:
        path = self._path(key)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise NotFound(f"blob {key} is missing from {self.url}") from None
        direct_fd = None
        try:
            total = os.fstat(fd).st_size
            out = []
            for start, end in ranges:
                end = total if end is None else end
                if start < 0 or end > total or start > end:
                    raise NotFound(f"blob {key}: range {start}-{end} is outside its {total} bytes")
                if self.direct and end - start >= DIRECT_MIN:
                    try:
                        if direct_fd is None:
                            direct_fd = _open_direct(path, os.O_RDONLY)
                        out.append(_read_direct(direct_fd, start, end))
                        continue
                    except _Refused:
                        self.direct = False
                data = os.pread(fd, end - start, start)
                if len(data) != end - start:
                    raise NotFound(f"blob {key}: short read at {start}")
                out.append(data)
            return out
        finally:
            os.close(fd)
            if direct_fd is not None:
                os.close(direct_fd)

    def size(self, key: str) -> int:
        try:
            return self._path(key).stat().st_size
        except FileNotFoundError:
            raise NotFound(f"blob {key} is missing from {self.url}") from None

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def list(self, prefix: str = "") -> Iterator[str]:
        for p in sorted(self.root.rglob("*")):
            if p.is_file() and not p.name.startswith("."):
                key = p.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    yield key
