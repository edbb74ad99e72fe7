"""Pull on an inference node: through the node cache, to an exact file or to a directory an engine
(vLLM, transformers) loads, with each materialised file kept once and hardlinked where possible.
Files are assembled from the cached chunk files and checked in place (registry/client/assemble.py)."""

from __future__ import annotations

import os
import threading
import time
import uuid
from pathlib import Path

from mfsreg.registry.client import assemble
from mfsreg.registry.client.cachefiles import directory_in_the_way
from mfsreg.registry.client.fetch import Fetcher, FetchStats, VersionInfo
from mfsreg.registry.errors import IntegrityError, NotFound
from mfsreg.registry.format import rebuild
from mfsreg.registry.format.durable import Placing
from mfsreg.registry.format.filecheck import BATCH_BYTES, bad_chunks, check_tiling
from mfsreg.registry.format.rebuild import PullResult, safe_relpath
from mfsreg.registry.parallel import sized_batches, windowed_map
from mfsreg.registry.progress import NullProgress, Progress


def refetcher(fetcher: Fetcher, info: VersionInfo, stats: FetchStats | None = None):
    """Fetches chunks again (their cache files missing, cut short or found damaged), in one go, and
    writes them over what is there; what crosses the network is added to ``stats``. Call it from a
    thread outside the remote's pool: the fetch decodes on that pool."""

    def refetch(chunk_ids: list[str]) -> None:
        got = fetcher.ensure(info.family, chunk_ids, info.located, info.tiers, again=True)
        if stats is not None:
            stats.fetched_bytes += got.fetched_bytes
            stats.fetched_chunks += got.fetched_chunks
            stats.chunk_ids.extend(chunk_ids)

    return refetch


def gone_meanwhile(
    fetcher: Fetcher,
    info: VersionInfo,
    error: BaseException,
    doing: str = "pulled",
    outcome: str = "nothing was written",
) -> BaseException:
    """The error a failed fetch is reported by: a version deleted on the registry while it was
    being pulled (or loaded: ``doing``) makes its chunks no longer the family's, and the server
    answers that they are not part of it, which names chunks the user never asked for. So a
    NotFound is checked against the version itself. ``outcome``: what the failure left."""
    if not isinstance(error, NotFound):
        return error
    try:
        doc = fetcher.remote.version_doc(info.family, info.version)
    except NotFound:
        return NotFound(f"version {info.family}/{info.version} was deleted while it was being {doing}: {outcome}")
    if doc.get("digest") != info.digest:
        return NotFound(
            f"version {info.family}/{info.version} was pushed again with other bytes while it was being "
            f"{doing}: {outcome}; ask for it again"
        )
    return error


class _Arrivals:
    """Chunks landing in the cache from the fetch that runs beside a file's assembly: the assembly
    copies what is cached and waits only at a chunk still on its way."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._landed: set[str] = set()
        self._coming: set[str] | None = None  # what the fetch will bring, once it has looked
        self._over = False
        self.error: BaseException | None = None

    def plan(self, ids) -> None:
        """The chunks the fetch found missing and will bring: a chunk it will not bring (cached when
        it looked, evicted by another process since) is not waited for, but fetched again at once."""
        with self._cond:
            self._coming = set(ids)
            self._cond.notify_all()

    def land(self, ids) -> None:
        with self._cond:
            self._landed.update(ids)
            self._cond.notify_all()

    def finish(self, error: BaseException | None = None) -> None:
        with self._cond:
            self._over, self.error = True, error
            self._cond.notify_all()

    def wait(self, chunk_id: str) -> None:
        """Until ``chunk_id`` has landed or the fetch is over; a failed fetch raises its error here."""
        with self._cond:
            self._cond.wait_for(
                lambda: (
                    chunk_id in self._landed or self._over or self._coming is not None and chunk_id not in self._coming
                )
            )
            if self.error is not None:
                raise self.error


def pull(
    fetcher: Fetcher, family: str, version: str, out: Path, progress: Progress | None = None, to_dir: bool = False
) -> PullResult:
    """Fetch what the cache lacks and, at the same time, assemble the files from what it holds."""
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    cache = fetcher.cache
    info = fetcher.version(family, version)
    ids = info.manifest.chunk_ids()
    out = Path(out)
    # a bad output path fails before any fetch
    owned = [(cache.root, "the node cache")]
    if to_dir:
        rebuild.check_dir(out, info.manifest, owned)
    plan = [] if to_dir else rebuild.targets(info.manifest, out, owned)
    arrivals = _Arrivals()
    fetched: dict = {}

    stop = threading.Event()  # set when the assembly fails: the fetch stops after the batches in flight

    refetched = FetchStats()
    refetch = refetcher(fetcher, info, refetched)
    # what a pull brought stays, over the limit if need be: its chunks, and the files it materialised
    # (evicted first otherwise, they would be rebuilt by every --to-dir pull, never shared by links)
    protect = ids + ([f"file:{f.sha256}" for f in info.manifest.files] if to_dir else [])
    # and, while it runs, leased: another process's eviction passes them over (cache eviction.py)
    with cache.leased(protect):
        worker = threading.Thread(
            target=_fetch,
            args=(fetcher, info, ids, progress, arrivals, stop, fetched),
            name="mfsreg-pull-fetch",
            daemon=True,
        )
        worker.start()
        assembled, failed = False, None
        try:
            _assemble(fetcher, info, out, plan, to_dir, progress, refetch, arrivals.wait)
            assembled = True
        except NotFound as exc:  # the fetch's error, raised where the assembly waited, or a refetch's
            failed = exc
        finally:
            if not assembled:  # an error or an interrupt: what is still to fetch is not needed now
                stop.set()
            worker.join()  # the fetch writes into the cache: let its batches in flight land first
            if not assembled or arrivals.error is not None:
                evict_quietly(cache, protect)  # the limit holds after a failed pull too (what it fetched stays)
        error = failed or arrivals.error
        if error is not None:
            raise gone_meanwhile(fetcher, info, error) from None
        stats = fetched["stats"]
        cache.record_pull(family, version)
        cache.evict(protect=protect)
    return _pulled(family, version, info, out, stats, refetched, t0)


def _pulled(
    family: str, version: str, info, out: Path, stats: FetchStats, refetched: FetchStats, t0: float
) -> PullResult:
    """A pull's result. A chunk found cached and then fetched again (damaged, or evicted by another
    process) counts as fetched only."""
    recounted = stats.cached.intersection(refetched.chunk_ids)
    return PullResult(
        family=family,
        version=version,
        digest=info.digest,
        path=str(rebuild.written_path(info.manifest, out)),
        logical_bytes=info.logical_bytes,
        files=len(info.manifest.files),
        seconds=time.perf_counter() - t0,
        fetched_bytes=stats.fetched_bytes + refetched.fetched_bytes,
        cached_bytes=stats.cached_bytes - sum(info.located[i].size for i in recounted),
    )


def _fetch(
    fetcher: Fetcher, info, ids: list[str], progress: Progress, arrivals: _Arrivals, stop, fetched: dict
) -> None:
    """A pull's fetch, on its own thread: what the cache lacks, each batch announced to the assembly
    as it lands; an error is handed to the assembly, which raises it."""
    try:
        fetched["stats"] = fetcher.ensure(
            info.family,
            ids,
            info.located,
            info.tiers,
            progress,
            landed=arrivals.land,
            cancel=stop,
            planned=arrivals.plan,
        )
    except BaseException as exc:
        arrivals.finish(exc)
    else:
        arrivals.finish()


def _assemble(fetcher: Fetcher, info, out: Path, plan, to_dir: bool, progress: Progress, refetch, wait) -> None:
    """Write the version's files from the cache as their chunks arrive (``wait``); they appear
    together, once all are written."""
    with Placing() as placing:
        if to_dir:
            _materialise_dir(fetcher, info, out, progress, refetch, wait, placing)
            return
        progress.start("write", info.logical_bytes)
        for entry, dest in plan:
            assemble.write_file(
                entry, dest, fetcher.cache, refetch, fetcher.remote.pool, progress, wait, placing=placing
            )


def evict_quietly(cache, protect) -> None:
    """Evict down to the limit on the way out of a failure, which is the error to report."""
    try:
        cache.evict(protect=protect)
    except Exception:  # noqa: BLE001  (say, the disk that failed the pull fails this too)
        pass


def _intact(stored: Path, entry, pool) -> bool:
    """Whether the materialised file ``stored`` is still read-only, of its size, and every chunk of
    it hashes to its id where it lies (the check the embedded pull makes of a file it writes)."""
    try:
        fd = os.open(stored, os.O_RDONLY)
    except FileNotFoundError:  # not built yet, or evicted by another process
        return False
    try:
        st = os.fstat(fd)
        if st.st_size != entry.size or st.st_mode & 0o222:
            return False
        batches = list(sized_batches(check_tiling(entry), lambda c: c.size, BATCH_BYTES))
        # every check runs to its end (no early exit) before the descriptor it maps is closed
        bad = [c for found in windowed_map(pool, lambda b: bad_chunks(fd, b), batches) for c in found]
        return not bad
    finally:
        os.close(fd)


def _materialise_dir(
    fetcher: Fetcher, info: VersionInfo, out: Path, progress: Progress, refetch, arriving, placing: Placing
) -> None:
    """Every file of the version under ``out`` (a single-file version keeps its file name), each
    built once in the cache's files/ store and hardlinked into place; copied where links fail. The
    links and copies are renamed into place by ``placing``, together, once all are made."""
    cache = fetcher.cache
    placing.make_dirs(out)
    progress.start("write", info.logical_bytes)
    for entry in info.manifest.files:
        if entry.sha256 is None:  # only a draft lacks it, and a version's document is none (parse_doc)
            raise IntegrityError(f"{entry.path}: the version's manifest gives the file no sha256")
        dest = out.joinpath(*safe_relpath(entry.path).parts)
        stored = cache.file_path(entry.sha256)
        if os.path.isdir(stored) and not os.path.islink(stored):  # the rename onto it would name its temp file
            raise directory_in_the_way(stored)
        # A materialised file is shared by hardlinks and kept read-only; one that is writable again,
        # has another size or fails its chunks' check (root writes through a read-only mode) was
        # changed in place, and is rebuilt rather than handed on.
        if _intact(stored, entry, fetcher.remote.pool):
            cache.add_file(entry.sha256, entry.size)  # used now (and recorded, if its writer died before it)
        else:
            # Built under a temp name and renamed over whatever is there, already read-only (engines
            # only read, and an edit through one link would hit all): another process pulling the
            # same file never sees it writable, so never takes it for a changed one and deletes it.
            assemble.write_file(entry, stored, cache, refetch, fetcher.remote.pool, progress, arriving, mode=0o444)
            cache.add_file(entry.sha256, entry.size)
        placing.make_dirs(dest.parent)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.link")
        try:
            os.link(stored, tmp)
        except OSError:  # another filesystem, or links not allowed: fall back to one verified copy
            assemble.write_file(entry, dest, cache, refetch, fetcher.remote.pool, progress, arriving, placing=placing)
            continue
        placing.add(tmp, dest)
