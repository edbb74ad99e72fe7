"""A file written around the page cache (O_DIRECT), in order, from aligned staging buffers.

Chunk files are read into page-aligned buffers, where the caller checks them; full buffers go to the
disk on a writer thread only at ``settle``, so a chunk that failed its check is taken back
(``rollback``) before any of it is written. The last write is padded to ALIGN and the file cut to
its size.
See docs/design/node-cache.md.
"""

from __future__ import annotations

import errno
import mmap
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

from mfsreg.registry.format.durable import Placing, create_beside, replaced_mode, sync_dir, temp_beside

ALIGN = 4096  # covers 512-byte and 4 KiB logical blocks
BUFFER_BYTES = 8 << 20  # one write; a few of these are the whole staging memory
IN_FLIGHT = 2  # writes queued at once: the disk works on one while the next is ready

# open() or the first aligned write fails with these where the filesystem does not take O_DIRECT
_REFUSED = {errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EPERM}


def taken(dirpath: Path) -> bool:
    """Whether the filesystem under ``dirpath`` takes O_DIRECT writes, probed as a pull probes it."""
    probe = DirectFile.open(Path(dirpath) / "probe", 0)
    if probe is None:
        return False
    probe.close()  # (removes its temp file)
    return True


class DirectFile:
    """A new file under a temp name beside ``dest``, written with O_DIRECT. ``open`` returns None
    where the filesystem (or the platform) does not take it; the caller then writes through the
    page cache. Fill in order with ``stage_from``, call ``settle`` after each checked chunk (or
    ``rollback`` to its ``mark``), then ``commit``; leaving the ``with`` block otherwise removes
    the file."""

    @classmethod
    def open(cls, dest: Path, size: int, mode: int | None = None) -> DirectFile | None:
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_beside(dest)
        fd = -1
        try:  # from the open: a SIGTERM's KeyboardInterrupt lands the moment the file appears
            fd = create_beside(tmp, dest, os.O_WRONLY | flag)
            f = cls(dest, tmp, fd, size, mode)
        except BaseException as exc:
            tmp.unlink(missing_ok=True)
            if fd >= 0:
                os.close(fd)
            elif isinstance(exc, OSError) and exc.errno in _REFUSED:
                return None
            raise
        try:
            # Some filesystems accept the flag at open and refuse the writes: try one block now,
            # before any byte of the file is staged (it is written over by the file's first buffer).
            with mmap.mmap(-1, ALIGN) as probe:
                os.pwrite(fd, probe, 0)
        except BaseException as exc:
            f.close()
            if isinstance(exc, OSError) and exc.errno in _REFUSED:
                return None
            raise
        return f

    def __init__(self, dest: Path, tmp: Path, fd: int, size: int, mode: int | None):
        self.dest, self.tmp, self.fd, self.size, self.mode = dest, tmp, fd, size, mode
        self.renamed = False
        self.written = 0  # file offset of the first staged buffer
        self.staged: list[mmap.mmap] = []  # buffers not yet handed to the writer, the last one filling
        self.fill = 0  # bytes in the last staged buffer
        self.free: list[mmap.mmap] = []
        self.made = 0
        self.flights: deque[tuple[Future, mmap.mmap]] = deque()
        self.writer = ThreadPoolExecutor(1, thread_name_prefix="mfsreg-direct")

    # -- staging ------------------------------------------------------------------------------

    def _buffer(self) -> mmap.mmap:
        """A buffer to fill: a free one; else a new one while few exist; else the oldest write's
        once it is done. A chunk longer than every buffer together makes more, never waits on itself."""
        if not self.free:
            if self.made >= IN_FLIGHT + 1 and self.flights:
                self._land()
            else:
                self.free.append(mmap.mmap(-1, BUFFER_BYTES))
                self.made += 1
        return self.free.pop()

    def _land(self) -> None:
        fut, buf = self.flights[0]
        try:
            fut.result()
        finally:
            if fut.done():  # (an interrupt while waiting leaves it in flight, for close to wait on)
                self.flights.popleft()
                self.free.append(buf)

    def stage_from(self, src: int, length: int, seen=None) -> int:
        """Append up to ``length`` bytes read from the start of the open file ``src``; ``seen(view)``
        is called on each stretch as it lands (the caller's check). Returns the bytes read: fewer
        than ``length`` when the file is shorter."""
        done = 0
        while done < length:
            if not self.staged or self.fill == BUFFER_BYTES:
                self.staged.append(self._buffer())
                self.fill = 0
            n = min(length - done, BUFFER_BYTES - self.fill)
            with memoryview(self.staged[-1])[self.fill : self.fill + n] as view:
                got = os.preadv(src, [view], done)
                if seen is not None and got:
                    with view[:got] as landed:
                        seen(landed)
            self.fill += got
            done += got
            if got < n:
                break  # the file ended
        return done

    @property
    def staged_to(self) -> int:
        """The file offset the next staged byte lands at."""
        return self.written + max(len(self.staged) - 1, 0) * BUFFER_BYTES + (self.fill if self.staged else 0)

    def mark(self) -> tuple[int, int]:
        return len(self.staged), self.fill

    def rollback(self, mark: tuple[int, int]) -> None:
        """Take back what was staged since ``mark`` (nothing of it was written: see ``settle``)."""
        count, fill = mark
        self.free.extend(self.staged[count:])
        del self.staged[count:]
        self.fill = fill

    def settle(self) -> None:
        """Hand every full staged buffer to the writer: what they hold has been checked."""
        full = len(self.staged) if self.fill == BUFFER_BYTES else len(self.staged) - 1
        for buf in self.staged[:full]:
            self._send(buf, BUFFER_BYTES)
        del self.staged[:full]
        if not self.staged:
            self.fill = 0

    def _send(self, buf: mmap.mmap, length: int) -> None:
        self.flights.append((self.writer.submit(self._write, buf, length, self.written), buf))
        self.written += length
        while len(self.flights) > IN_FLIGHT:
            self._land()

    def _write(self, buf: mmap.mmap, length: int, offset: int) -> None:
        with memoryview(buf) as whole:
            done = 0
            while done < length:
                with whole[done:length] as piece:  # released even if an error's traceback keeps it
                    n = os.pwrite(self.fd, piece, offset + done)
                if n == length - done:
                    return
                # A short write (the disk filling up) may end mid-block, where O_DIRECT cannot go on
                # (EINVAL would hide the cause): go on from the block's start, so that the next call
                # either gets further or raises the real error.
                if n < ALIGN:
                    raise OSError(
                        errno.EIO, f"the disk took only {n} bytes of a {length - done}-byte write (is it full?)"
                    )
                done += n // ALIGN * ALIGN

    # -- the end ------------------------------------------------------------------------------

    def commit(self, placing: Placing | None = None) -> None:
        """Write the rest, cut the file to its size, sync it and rename it into place (or hand it to
        ``placing``, which renames it with the pull's other files)."""
        if self.staged_to != self.size:  # a caller's bug, not the user's: never renamed into place
            raise AssertionError(f"staged {self.staged_to} bytes of a {self.size}-byte file")
        self.settle()
        if self.staged:  # the tail: padded to a whole block, cut off again below
            buf = self.staged.pop()
            pad = -self.fill % ALIGN
            buf[self.fill : self.fill + pad] = bytes(pad)
            self._send(buf, self.fill + pad)
        while self.flights:
            self._land()
        os.ftruncate(self.fd, self.size)
        mode = self.mode if self.mode is not None else replaced_mode(self.dest)  # as CheckedFile's
        if mode is not None:
            os.fchmod(self.fd, mode)
        os.fsync(self.fd)
        if placing is not None:
            placing.add(self.tmp, self.dest, self.fd)  # which keeps its lock until it is renamed
        else:
            os.replace(self.tmp, self.dest)
            sync_dir(self.dest.parent)
        self.renamed = True  # or handed on: either way no longer this object's to remove
        self.close()

    def close(self) -> None:
        for fut, _ in self.flights:  # a write still running reads its buffer: wait before unmapping
            fut.cancel()
        wait([f for f, _ in self.flights])
        self.writer.shutdown(wait=True)
        for buf in (*self.staged, *self.free, *(b for _, b in self.flights)):
            buf.close()
        self.staged.clear()
        self.free.clear()
        self.flights.clear()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
        if not self.renamed:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> DirectFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
