"""Pull on an inference node: through the node cache, to an exact file or to a directory an engine
(vLLM, transformers) loads, with each materialised file kept once and hardlinked where possible.
Files are assembled from the cached chunk files and checked in place (registry/client/assemble.py)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from registry import rebuild
from registry.client import assemble
from registry.client.cache import NodeCache
from registry.client.fetch import Fetcher, FetchStats, VersionInfo
from registry.progress import NullProgress, Progress
from registry.rebuild import PullResult, safe_relpath


def refetcher(fetcher: Fetcher, info: VersionInfo, stats: FetchStats | None = None):
    """Fetches one chunk into the cache again (evicted by another process, or found damaged);
    what crosses the network is added to ``stats``."""

    def refetch(chunk_id: str) -> None:
        got = fetcher.ensure(info.family, [chunk_id], info.located, info.tiers)
        if stats is not None:
            stats.fetched_bytes += got.fetched_bytes
            stats.fetched_chunks += got.fetched_chunks

    return refetch


def pull(fetcher: Fetcher, family: str, version: str, out: Path, progress: Progress | None = None,
         to_dir: bool = False) -> PullResult:
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    cache = fetcher.cache
    info = fetcher.version(family, version)
    ids = info.manifest.chunk_ids()
    stats = fetcher.ensure(family, ids, info.located, info.tiers, progress)
    cache.record_pull(family, version)
    out = Path(out)
    if to_dir:
        _materialise_dir(fetcher, info, out, progress, stats)
    else:
        progress.start("write", info.logical_bytes)
        for entry, dest in rebuild.targets(info.manifest, out):
            assemble.write_file(entry, dest, cache, refetcher(fetcher, info, stats), fetcher.remote.pool, progress)
    cache.evict(protect=ids)
    return PullResult(
        family=family, version=version, digest=info.digest, path=str(out), logical_bytes=info.logical_bytes,
        files=len(info.manifest.files), seconds=time.perf_counter() - t0,
        fetched_bytes=stats.fetched_bytes, cached_bytes=stats.cached_bytes,
    )


def _materialise_dir(fetcher: Fetcher, info: VersionInfo, out: Path, progress: Progress, stats: FetchStats) -> None:
    """Every file of the version under ``out`` (a single-file version keeps its file name), each
    built once in the cache's files/ store and hardlinked into place; copied where links fail."""
    cache = fetcher.cache
    out.mkdir(parents=True, exist_ok=True)
    progress.start("write", info.logical_bytes)
    for entry in info.manifest.files:
        dest = out.joinpath(*safe_relpath(entry.path).parts)
        stored = cache.file_path(entry.sha256)
        # A materialised file is shared by hardlinks; one that was changed in place (its size or
        # write time moved) is rebuilt rather than handed on.
        if not stored.exists() or stored.stat().st_size != entry.size or stored.stat().st_mode & 0o222:
            stored.unlink(missing_ok=True)
            assemble.write_file(entry, stored, cache, refetcher(fetcher, info, stats), fetcher.remote.pool, progress)
            stored.chmod(0o444)  # read-only: engines only read, and an edit through one link would hit all
            cache.add_file(entry.sha256, entry.size)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.link")
        try:
            os.link(stored, tmp)
        except OSError:  # another filesystem, or links not allowed: fall back to one verified copy
            assemble.write_file(entry, dest, cache, refetcher(fetcher, info, stats), fetcher.remote.pool, progress)
            continue
        os.replace(tmp, dest)


