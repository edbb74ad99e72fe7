"""The node cache's eviction policy: ranks (materialised files, then unique, group and base chunks),
pins of a family's base tier, leases on what a running operation uses, and the size limit, least
recently used first within a rank.

A lease holds while its holder keeps an flock on its file in ``holders/`` or, where that cannot be
tested, until it is LEASE_MAX_SECONDS old.
See docs/design/node-cache.md.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
import uuid
from collections.abc import Iterable, Iterator
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from mfsreg.registry.client.indexdb import forget_rows
from mfsreg.registry.errors import StorageError
from mfsreg.registry.store.tiers import EVICTION_ORDER

if TYPE_CHECKING:  # (cacheindex.py imports the ranks from here)
    from mfsreg.registry.client.cacheindex import CacheIndex
    from mfsreg.registry.client.layout import CacheLayout

fcntl: ModuleType | None
try:
    import fcntl
except ImportError:  # Windows: leases hold by their age alone
    fcntl = None

# Lower ranks go first. Materialised files can be rebuilt from chunks, so they go before any chunk.
FILE_RANK = -1
RANK = {tier: i for i, tier in enumerate(EVICTION_ORDER)}  # unique 0, group 1, base 2
UNKNOWN_RANK = RANK["unique"]
LEASE_MAX_SECONDS = 24 * 3600  # past this a lease holds nothing, its holder alive or not (see above)
_HOST = socket.gethostname()
HOLDERS_DIR = "holders"  # in the cache's root: one lock file per live holder, named by a uuid
TRASH_DIR = "evicted"  # in the cache's root: evicted files, moved out of their names, until unlinked
EVICT_BATCH = 64  # files one eviction transaction moves: other processes' writes wait for one batch at most
_LOCKED = "flock:"  # the start of a holder with a lock file: flock:<uuid hex>@<host>:<pid>
_LOCKED_HOLDER = re.compile(r"flock:([0-9a-f]{32})@")
_UUID_HEX = re.compile(r"[0-9a-f]{32}")


def _new_holder() -> tuple[str, str]:
    """A holder's name (host and pid in it for whoever reads the rows) and its lock file's name."""
    name = uuid.uuid4().hex
    return f"{_LOCKED}{name}@{_HOST}:{os.getpid()}", name


def _alive(pid: int) -> bool:
    """For rows of the release before lock files: whether a process with this pid runs on this host."""
    if os.name == "nt":  # os.kill there ends the process: the age limit alone frees such leases
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process (EPERM): alive
        return True
    return True


def _hold(path: Path) -> int | None:
    """A new lock file at ``path``, flocked (exclusive) while its fd stays open: None where it
    cannot be made, or where an eviction took it for a dead holder's in the instant before it was
    locked (it then tested the lock first, and removed the file). A lock the filesystem refuses
    still leaves the file: its holder is then taken for alive until the age limit."""
    try:
        path.parent.mkdir(exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    except OSError:
        return None
    try:
        if fcntl is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # an eviction holds it to test it, and removes it
                os.close(fd)
                return None
            except OSError:  # no locks on this filesystem
                pass
            if os.stat(path).st_ino != os.fstat(fd).st_ino:  # removed as a dead holder's before it was locked
                os.close(fd)
                return None
    except OSError:
        os.close(fd)
        return None
    return fd


def _take_holder(root: Path) -> tuple[str, Path, int] | None:
    """A new holder: its name, its lock file in ``root`` and that file's locked fd; None where no
    lock file could be made."""
    for _ in range(3):  # a new file an eviction took for a dead holder's as it was made: another name
        holder, name = _new_holder()
        lock_file = root / HOLDERS_DIR / name
        fd = _hold(lock_file)  # locked before the rows exist: no eviction finds rows without a live lock
        if fd is not None:
            return holder, lock_file, fd
    return None


def _unhold(path: Path, fd: int) -> None:
    if fcntl is None:  # no lock to keep, and Windows removes no open file
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
        return
    with contextlib.suppress(OSError):
        os.unlink(path)  # before the lock goes: no one finds the file unlocked while its rows stand
    os.close(fd)


_TEST_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)


def _gone(path: Path) -> bool:
    """Whether the holder of the lock file ``path`` has ended: no file there (its rows outlived it),
    or a file no process holds locked, which then goes. False where the lock cannot be tested. The
    test is a shared lock on a read-only open (another user's file opens so too, and a link or a
    fifo put there is not followed or waited on)."""
    if fcntl is None:
        return False
    try:
        fd = os.open(path, _TEST_FLAGS)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError:  # held: its process runs (or the lock cannot be tested here)
        return False
    else:
        with contextlib.suppress(OSError):
            os.unlink(path)
        return True
    finally:
        os.close(fd)


class Lease:
    """What ``leased`` yields: ``add`` leases more keys under the same holder (one lock file and one
    row however many times it is called: a warm adds each recent member's chunks)."""

    def __init__(self, index: CacheIndex, holder: str | None):
        self._index, self.holder = index, holder

    def add(self, keys: Iterable[str]) -> None:
        if self.holder is None:
            return
        try:
            with self._index.db() as db:
                _insert_leases(db, self.holder, keys)
        except StorageError:
            pass  # best effort, as the lease itself


def _insert_leases(db, holder: str, keys: Iterable[str]) -> None:
    db.executemany(
        "INSERT OR IGNORE INTO leases (holder, key) VALUES (?, ?)", [(holder, k) for k in dict.fromkeys(keys)]
    )


class Leases:
    """What keeps entries from every process's eviction while a pull or load uses them: a lock file
    per holder under holders/ and its rows in the index (see the module docstring)."""

    def __init__(self, index: CacheIndex, layout: CacheLayout):
        self.index, self.layout = index, layout

    @contextlib.contextmanager
    def leased(self, keys: Iterable[str]) -> Iterator[Lease]:
        """Keep ``keys`` (chunk ids, or 'file:<sha256>') from every process's eviction while the block
        runs (see the module docstring); the block can lease more through what it is given. Best
        effort: where the index cannot be written (a full disk) or no lock file made, the block runs
        unleased, as before leases, and another process's eviction may take a chunk, which is then
        fetched again."""
        holder: str | None = None
        taken = _take_holder(self.layout.root)
        if taken is not None:
            holder, lock_file, fd = taken
            try:
                with self.index.db() as db:
                    db.execute(
                        "INSERT INTO holders (holder, host, pid, since) VALUES (?, ?, ?, ?)",
                        (holder, _HOST, os.getpid(), time.time()),
                    )
                    _insert_leases(db, holder, keys)
            except StorageError:
                _unhold(lock_file, fd)
                holder = None
            except BaseException:
                _unhold(lock_file, fd)
                raise
        try:
            yield Lease(self.index, holder)
        finally:
            if holder is not None:
                try:
                    with self.index.db() as db:
                        _release(db, [holder])
                except StorageError:
                    pass  # its rows hold nothing once its lock file is unlocked
                finally:
                    _unhold(lock_file, fd)

    def leased_bytes(self) -> int:
        """The bytes of cached entries some holder leases now (kept over the limit by evictions)."""
        return (
            self.index.conn()
            .execute("SELECT COALESCE(SUM(size), 0) FROM entries WHERE key IN (SELECT key FROM leases)")
            .fetchone()[0]
        )

    def leased_keys(self) -> set[str]:
        """The keys some holder leases now, its process alive or not."""
        return {r[0] for r in self.index.conn().execute("SELECT DISTINCT key FROM leases")}


class Eviction:
    """A node cache's pins and size limit: its rows in the index (through the index's ``conn`` and
    ``db``), its files at the layout's paths; leased entries (Leases' rows) are never taken."""

    def __init__(self, index: CacheIndex, layout: CacheLayout, max_bytes: int | None):
        self.index, self.layout, self.max_bytes = index, layout, max_bytes

    # -- pins -------------------------------------------------------------------------------------

    def pin(self, family: str) -> None:
        with self.index.db() as db:
            db.execute("INSERT OR IGNORE INTO pins (family) VALUES (?)", (family,))

    def unpin(self, family: str) -> None:
        with self.index.db() as db:
            db.execute("DELETE FROM pins WHERE family = ?", (family,))

    def pinned(self) -> list[str]:
        return [r[0] for r in self.index.conn().execute("SELECT family FROM pins ORDER BY family")]

    # -- size limit -------------------------------------------------------------------------------

    def total_bytes(self) -> int:
        return self.index.conn().execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]

    def evict(self, max_bytes: int | None = None, protect: Iterable[str] = ()) -> tuple[int, int]:
        """Drop entries until the cache fits ``max_bytes`` (default: its limit); returns (entries, bytes)."""
        # (over 60 lines: one pass under the write lock that picks, removes and counts; its steps
        # share the lock's state)
        limit = self.max_bytes if max_bytes is None else max_bytes
        if limit is None:
            return 0, 0
        if self.total_bytes() <= limit:  # the common case, without taking the write lock
            return 0, 0
        keep = set(protect)
        removed = freed = 0
        q = (
            "SELECT key, size FROM entries WHERE NOT EXISTS (SELECT 1 FROM family_base b JOIN pins p "
            "ON p.family = b.family WHERE b.key = entries.key) "
            "AND NOT EXISTS (SELECT 1 FROM leases l WHERE l.key = entries.key) ORDER BY rank, last_used"
        )
        trash = self.layout.root / TRASH_DIR
        _empty(trash)  # what an eviction killed between its two steps left
        # In batches of EVICT_BATCH, each one write transaction: the total, the choice, the files
        # moved out of their names (a rename each, into trash/) and the rows deleted. Two pulls
        # finishing together would otherwise each count the other's chunks as still there and both
        # evict, emptying the cache far below its limit; and a process that found a victim cached
        # and records it as used waits for the lock, then finds no file and makes no row. The
        # files' space is given back (the unlinks, slow for big files) after the lock is released,
        # so another process waits for one batch's renames at most; a chunk fetched again meanwhile
        # is written at its name anew and stays. A reader that finds no file fetches it again.
        first, first_move, failed = True, True, None
        while failed is None:
            moved: list[str] = []
            with self.index.db() as db:
                total = db.execute("SELECT COALESCE(SUM(size), 0) FROM entries").fetchone()[0]
                if total <= limit:
                    break
                if first:
                    _release(db, _lapsed(db, self.layout.root))
                    first = False
                victims: list[str] = []
                for key, size in db.execute(q):
                    if total <= limit or len(victims) >= EVICT_BATCH:
                        break
                    if key in keep:
                        continue
                    path = (
                        str(self.layout.file_path(key[5:])) if key.startswith("file:") else self.layout.chunk_file(key)
                    )
                    gone = str(trash / uuid.uuid4().hex)
                    try:
                        if first_move:
                            trash.mkdir(exist_ok=True)
                            first_move = False
                        os.rename(path, gone)
                        moved.append(gone)
                    except FileNotFoundError:
                        pass
                    except OSError as exc:  # the rows of the files that went still go; this one's stays
                        failed = exc
                        break
                    victims.append(key)
                    total -= size
                    removed += 1
                    freed += size
                forget_rows(db, victims)
            _unlink_all(moved)
            if not victims:
                break  # all that is left is protected, pinned or leased
        if failed is not None:
            raise failed
        return removed, freed


def _unlink_all(paths: list[str]) -> None:
    for p in paths:
        with contextlib.suppress(OSError):
            os.unlink(p)


def _empty(trash: Path) -> None:
    """Remove what evictions moved to ``trash`` and did not get to unlink (another process's running
    eviction may unlink the same files: whichever comes second finds none)."""
    with contextlib.suppress(OSError), os.scandir(trash) as it:
        _unlink_all([e.path for e in it if _UUID_HEX.fullmatch(e.name)])


def _lapsed(db, root: Path) -> list[str]:
    """Holders whose leases hold nothing: their lock file is gone or unlocked (their process ended),
    or they are older than LEASE_MAX_SECONDS; rows of the release before lock files, once their pid
    is gone from this host. Lock files no row names and no process holds (a holder killed between
    making its file and writing its rows, or between its release's two steps) go too."""
    now = time.time()
    lapsed, named = [], set()
    for holder, host, pid, since in db.execute("SELECT holder, host, pid, since FROM holders").fetchall():
        if now - since > LEASE_MAX_SECONDS:
            lapsed.append(holder)
        elif holder.startswith(_LOCKED):  # only a uuid from the name reaches a path; a row naming anything else lapses
            m = _LOCKED_HOLDER.match(holder)
            if m:
                named.add(m[1])
            if not m or _gone(root / HOLDERS_DIR / m[1]):
                lapsed.append(holder)
        elif host == _HOST and not _alive(pid):  # the release before lock files: its pid
            lapsed.append(holder)
    with contextlib.suppress(OSError), os.scandir(root / HOLDERS_DIR) as it:
        for e in it:
            if e.name not in named and _UUID_HEX.fullmatch(e.name):
                _gone(Path(e.path))
    return lapsed


def _release(db, holders: list[str]) -> None:
    db.executemany("DELETE FROM leases WHERE holder = ?", [(h,) for h in holders])
    db.executemany("DELETE FROM holders WHERE holder = ?", [(h,) for h in holders])
