"""The fetcher: makes a version's chunks present in the node cache, fetching only what is missing.

Missing chunks are requested in batches of encoded payloads (concurrent requests, one stream each),
decoded on a thread pool and checked against their ids, then written to the cache. A delta whose
basis is not cached brings its basis along, and the basis is cached too (it is usually a base-tier
chunk that the next member needs as well).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from mfsreg.registry.blobs.packs import ChunkForm
from mfsreg.registry.client.cache import NodeCache
from mfsreg.registry.config import age_from_env
from mfsreg.registry.errors import StorageError
from mfsreg.registry.format.manifest import Manifest
from mfsreg.registry.format.rebuild import decode_landed
from mfsreg.registry.format.wire import Located
from mfsreg.registry.parallel import sized_batches
from mfsreg.registry.progress import NullProgress, Progress


class ChunkSource(Protocol):
    """Where a fetcher gets documents and chunks: a server (client/remote.RemoteRegistry) or the
    embedded registry (client/embedded.EmbeddedSource)."""

    url: str
    pool: ThreadPoolExecutor

    def version_doc(self, family: str, version: str) -> dict: ...

    def version_doc_if(self, family: str, version: str, tag: str | None = None) -> tuple[dict | None, str | None]: ...

    def chunk_table(self, doc: dict) -> tuple[dict[str, Located], dict[str, str | None]]: ...

    def manifest_of(self, doc: dict) -> Manifest: ...

    def fetch(self, family: str, chunks: list[Located]) -> Iterator[tuple[ChunkForm, bytes]]: ...


BATCH_BYTES = 32 << 20  # raw bytes per request at most: several requests run at once
MIN_BATCH_BYTES = 16 << 20  # raw bytes per request at least, where the missing ones are spread over requests
# (at most the server's EAGER_BYTES: it reads each request's payloads whole before answering, with no
# HEAD per pack first)
KEPT_VERSIONS = 16  # version documents a fetcher keeps (a 7B model's lists about 7,000 chunks at 2 MiB)
MAX_AGE = 30.0  # seconds a confirmed document is trusted without asking (MFSREG_VERSION_MAX_AGE)


def batch_limit(total: int, requests: int) -> int:
    """Raw bytes per request for ``total`` missing bytes: spread evenly over ``requests`` requests
    that run at once and end together, between MIN_BATCH_BYTES and BATCH_BYTES. Cut at BATCH_BYTES
    alone, a member's 105 MB went as 32, 32, 32 and 9 MB, and its load waited on the three large
    ones (0.406 -> 0.380 s, medians of 8 interleaved loads); at 8 MiB, four requests of 2 MiB
    instead of one made an 84 MB member's load slower (43 -> 63 ms: each request's fixed cost, on
    2 cores), so fewer bytes than MIN_BATCH_BYTES go as one request."""
    return max(MIN_BATCH_BYTES, min(BATCH_BYTES, -(-total // max(requests, 1))))


class FetchCancelled(Exception):
    """A fetch stopped because its caller gave up (the pull it served failed or was interrupted)."""


@dataclass
class FetchStats:
    fetched_bytes: int = 0  # payload bytes received over the network
    fetched_chunks: int = 0
    cached_bytes: int = 0  # raw bytes that were already in the cache
    cached_chunks: int = 0
    chunk_ids: list[str] = field(default_factory=list)
    cached: set[str] = field(default_factory=set)  # the ids counted in cached_bytes


@dataclass(frozen=True)
class VersionInfo:
    """What a node knows of a version: its manifest and, per chunk it needs, where and what it is."""

    family: str
    version: str
    digest: str
    logical_bytes: int
    manifest: Manifest
    located: dict[str, Located]
    tiers: dict[str, str | None]
    named: str = ""  # the version's own name where ``version`` is a tag of it (prod, latest); else ""


class Fetcher:
    def __init__(
        self,
        remote: ChunkSource,
        cache: NodeCache,
        concurrency: int = 4,
        max_age: float | None = None,
    ):
        self.remote = remote
        self.cache = cache
        self.concurrency = concurrency
        # seconds a document the registry confirmed is used without asking again: a serving node
        # switching between members it holds pays no round trip per switch (see version)
        self.max_age = age_from_env("MFSREG_VERSION_MAX_AGE", MAX_AGE) if max_age is None else max_age
        # (family, version) -> (tag, VersionInfo, when confirmed): the documents read last, asked for
        # again with If-None-Match. A current one comes back as a 304 after one query on the server,
        # and skips the manifest's parse here: about half of a switch between two members.
        self._versions: OrderedDict[tuple[str, str], tuple[str, VersionInfo, float]] = OrderedDict()
        self._versions_lock = threading.Lock()

    def kept(self, family: str, version: str) -> VersionInfo | None:
        """The document of this version that this fetcher holds (read before), not asked for again:
        possibly out of date."""
        with self._versions_lock:
            kept = self._versions.get((family, version))
        return kept[1] if kept else None

    def fresh(self, family: str, version: str) -> VersionInfo | None:
        """The kept document, where the registry confirmed it less than ``max_age`` seconds ago."""
        with self._versions_lock:
            kept = self._versions.get((family, version))
        if kept is not None and time.monotonic() - kept[2] < self.max_age:
            return kept[1]
        return None

    def expire(self) -> None:
        """Ask the registry again before any kept document is used (as when max_age has passed)."""
        with self._versions_lock:
            for key, (tag, info, _) in self._versions.items():
                self._versions[key] = (tag, info, float("-inf"))

    def version(self, family: str, version: str, fresh: bool = False) -> VersionInfo:
        """The version's document, asked of the registry (with the kept one's tag: a 304 is cheap);
        with ``fresh``, a kept one confirmed within ``max_age`` seconds is used without asking."""
        key = (family, version)
        if fresh and (info := self.fresh(family, version)) is not None:
            return info
        with self._versions_lock:
            kept = self._versions.get(key)
        asked = time.monotonic()
        doc, tag = self.remote.version_doc_if(family, version, kept[0] if kept else None)
        if doc is None:  # a 304: only ever the answer to the tag of a kept document
            if kept is None:
                raise StorageError(
                    f"{self.remote.url} answered 304 Not Modified to a request that named no tag: "
                    "check the proxy in front of the registry"
                )
            info = kept[1]
        else:
            located, tiers = self.remote.chunk_table(doc)
            info = VersionInfo(
                family=family,
                version=version,
                digest=doc["digest"],
                logical_bytes=doc["logical_bytes"],
                manifest=self.remote.manifest_of(doc),
                located=located,
                tiers=tiers,
                named=doc["version"] if doc["version"] != version else "",
            )
        if info.named:  # a tag moves: asked again every time (a 304 while it has not), never kept max_age
            asked = float("-inf")
        with self._versions_lock:
            if tag:
                self._versions[key] = (tag, info, asked)
                self._versions.move_to_end(key)
                while len(self._versions) > KEPT_VERSIONS:
                    self._versions.popitem(last=False)
            else:
                self._versions.pop(key, None)
        return info

    def ensure(
        self,
        family: str,
        ids: list[str],
        located: dict[str, Located],
        tiers: dict[str, str | None],
        progress: Progress | None = None,
        landed: Callable[[Iterable[str]], None] | None = None,
        cancel: threading.Event | None = None,
        again: bool = False,
        planned: Callable[[list[str]], None] | None = None,
        sending: Callable[[], None] | None = None,
    ) -> FetchStats:
        """Make ``ids`` present in the cache; returns what came from the network and from the cache.
        ``landed(ids)`` is called (on a fetch thread) as each batch of chunks is written to the cache.
        Once ``cancel`` is set, batches not yet started are dropped and FetchCancelled is raised.
        ``again``: fetch every one of ``ids``, cached or not, and write it over what is there (files
        found missing, cut short or damaged: nothing is deleted by name first, which could delete a
        good copy another process has just written). ``planned(ids)`` is told which chunks it will
        fetch, before it fetches any; ``sending()`` is called (on a fetch thread) as each request is
        about to go out."""
        progress = progress or NullProgress()
        stats = FetchStats(chunk_ids=list(ids))
        missing = []
        for i in dict.fromkeys(ids):
            if not again and self.cache.has(i):
                stats.cached_bytes += located[i].size
                stats.cached_chunks += 1
                stats.cached.add(i)
            else:
                missing.append(i)
        if planned is not None:
            planned(missing)
        progress.start("fetch", sum(located[i].size for i in missing))
        if not missing:
            self.note_used(family, stats.cached, located, tiers)
            return stats
        limit = batch_limit(sum(located[i].size for i in missing), self.concurrency)
        batches = list(sized_batches(missing, lambda i: located[i].size, limit))
        with ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="mfsreg-fetch") as requests:
            results = requests.map(
                lambda b: (self._fetch_batch(family, b, located, tiers, landed, cancel, again, sending), b), batches
            )
            # the requests are on their way: the cached chunks' use is recorded meanwhile
            self.note_used(family, stats.cached, located, tiers)
            for (received, got), batch in results:
                stats.fetched_bytes += received
                stats.fetched_chunks += got
                progress.advance("fetch", sum(located[i].size for i in batch))
        return stats

    def note_used(
        self, family: str, ids: Iterable[str], located: dict[str, Located], tiers: dict[str, str | None]
    ) -> None:
        """Record cached chunks as used now, and in this family's tiers: a chunk cached through another
        family is marked base of this one too (a pin of either keeps it), and a file whose writer
        died before its row was written gets one, so that the size limit counts it."""
        self.cache.record((i, located[i].size, tiers.get(i), family) for i in ids)

    def _fetch_batch(
        self,
        family: str,
        batch: list[str],
        located,
        tiers,
        landed=None,
        cancel=None,
        replace: bool = False,
        sending: Callable[[], None] | None = None,
    ) -> tuple[int, int]:
        if cancel is not None and cancel.is_set():
            raise FetchCancelled("the fetch was called off")
        received = 0

        def payloads(chunks: list[Located]) -> Iterator[tuple[ChunkForm, bytes]]:
            nonlocal received
            if sending is not None:
                sending()
            for c, p in self.remote.fetch(family, chunks):
                received += len(p)
                yield c, p

        # Bases whose cache file stands but could not be used (one this user may not read: a damaged
        # one is dropped by get_verified itself) come back with the batch, and are written over that
        # file: passed over as "already there", it would be fetched again by every later decode.
        stale: set[str] = set()

        def known(i: str) -> bytes | memoryview | None:
            data = self.cache.get_verified(i, mapped=True)
            if data is None and self.cache.has(i):
                stale.add(i)
            return data

        # Each chunk is written to the cache on the pool as soon as it is decoded (decode_landed:
        # from the decoding thread's own buffer, no new memory per chunk), and the batch's rows
        # recorded in one go at its end (NodeCache.placing).
        with self.cache.placing() as place:
            got = decode_landed(
                batch,
                located,
                payloads,
                self.remote.pool,
                lambda i, data: place(i, data, tiers.get(i), family, replace or i in stale),
                known=known,
                cached=self.cache.has,
            )
        if landed is not None:
            landed(got)
        return received, len(got)
