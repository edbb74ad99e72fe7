"""Pull on an inference node: through the node cache, to an exact file or to a directory an engine
(vLLM, transformers) loads, with each materialised file kept once and hardlinked where possible."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

from registry import rebuild
from registry.blobs.packs import StoredChunk
from registry.client.cache import NodeCache
from registry.client.fetch import Fetcher, VersionInfo
from registry.errors import IntegrityError
from registry.progress import NullProgress, Progress
from registry.rebuild import PullResult, safe_relpath


def cached_source(cache: NodeCache, refetch=None):
    """A payload source over the cache: raw chunks, re-checked against their ids as they are read.
    A chunk that another process evicted meanwhile is fetched again through ``refetch(id)``."""

    def payloads(chunks: list[StoredChunk]):
        for c in chunks:
            data = cache.get(c.id)
            if data is None and refetch is not None:
                refetch(c.id)
                data = cache.get(c.id)
            if data is None:
                raise IntegrityError(f"chunk {c.id} keeps leaving the node cache: raise MFSREG_CACHE_MAX")
            yield StoredChunk(c.id, len(data), "raw", len(data), "", 0), data

    return payloads


def refetcher(fetcher: Fetcher, info: VersionInfo):
    return lambda chunk_id: fetcher.ensure(info.family, [chunk_id], info.located, info.tiers)


def _raw_located(info: VersionInfo) -> dict[str, StoredChunk]:
    return {i: StoredChunk(i, c.size, "raw", c.size, "", 0) for i, c in info.located.items()}


def pull(fetcher: Fetcher, family: str, version: str, out: Path, progress: Progress | None = None,
         to_dir: bool = False) -> PullResult:
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    cache = fetcher.cache
    info = fetcher.version(family, version)
    ids = info.manifest.chunk_ids()
    stats = fetcher.ensure(family, ids, info.located, info.tiers, progress)
    cache.record_pull(family, version)
    located = _raw_located(info)
    out = Path(out)
    if to_dir:
        _materialise_dir(fetcher, info, out, located, progress)
    else:
        rebuild.rebuild(info.manifest, out, located, cached_source(cache, refetcher(fetcher, info)), fetcher.remote.pool, progress)
    cache.evict(protect=ids)
    return PullResult(
        family=family, version=version, digest=info.digest, path=str(out), logical_bytes=info.logical_bytes,
        files=len(info.manifest.files), seconds=time.perf_counter() - t0,
        fetched_bytes=stats.fetched_bytes, cached_bytes=stats.cached_bytes,
    )


def _materialise_dir(fetcher: Fetcher, info: VersionInfo, out: Path, located, progress: Progress) -> None:
    """Every file of the version under ``out`` (a single-file version keeps its file name), each
    built once in the cache's files/ store and hardlinked into place; copied where links fail."""
    cache = fetcher.cache
    out.mkdir(parents=True, exist_ok=True)
    progress.start("write", info.logical_bytes)
    for entry in info.manifest.files:
        dest = out.joinpath(*safe_relpath(entry.path).parts)
        source = cached_source(cache, refetcher(fetcher, info))
        stored = cache.file_path(entry.sha256)
        # A materialised file is shared by hardlinks; one that was changed in place (its size or
        # write time moved) is rebuilt rather than handed on.
        if not stored.exists() or stored.stat().st_size != entry.size or stored.stat().st_mode & 0o222:
            stored.unlink(missing_ok=True)
            rebuild.write_file(entry, stored, located, source, fetcher.remote.pool, progress)
            stored.chmod(0o444)  # read-only: engines only read, and an edit through one link would hit all
            cache.add_file(entry.sha256, entry.size)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex}.link")
        try:
            os.link(stored, tmp)
        except OSError:  # another filesystem, or links not allowed: fall back to one verified copy
            rebuild.write_file(entry, dest, located, source, fetcher.remote.pool, progress)
            continue
        os.replace(tmp, dest)


