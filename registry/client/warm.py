"""Prefetch: bring a family's tier, and the members a node pulled recently, into the node cache."""

from __future__ import annotations

from mfsreg.registry.client.cache import NodeCache
from mfsreg.registry.client.fetch import Fetcher
from mfsreg.registry.client.node import evict_quietly
from mfsreg.registry.client.remote import RemoteRegistry
from mfsreg.registry.errors import InvalidRequest, NotFound
from mfsreg.registry.store.tiers import TIERS

MAX_RECENT = 100_000  # a node keeps far fewer members; the index's LIMIT takes no more than 2**63 - 1


def warm_cache(
    remote: RemoteRegistry,
    family: str,
    tier: str | None = "base",
    recent: int = 0,
    pin: bool = True,
    cache: NodeCache | None = None,
) -> dict:
    if not 0 <= recent <= MAX_RECENT:
        remote.close()
        raise InvalidRequest(
            f"--recent {recent} is out of range: give how many recently pulled members to keep warm, 0 to {MAX_RECENT}"
        )
    if tier is not None and tier not in TIERS:  # '' asked for every tier and kept none
        remote.close()
        raise InvalidRequest(f"unknown tier {tier!r}: use one of {', '.join(TIERS)}")
    cache = cache or NodeCache()
    try:
        fetcher = Fetcher(remote, cache)
        doc = remote.tier_doc(family, tier)
        located, tiers = remote.chunk_table(doc)
        ids = [i for i, t in tiers.items() if tier is None or t == tier]
        if pin and tier == "base":
            cache.pin(family)
        warm = list(ids)  # what the warm brings: kept over the limit if need be
        # leased while the warm runs, as a pull's chunks are: another process's eviction passes them
        # over (a delta's basis cached for it stays until it is decoded)
        try:
            with cache.leased(ids) as lease:
                stats = fetcher.ensure(family, ids, located, tiers)
                fetched = stats.fetched_bytes
                cache.set_tiers(tiers, family)  # tiers move as members join: refresh what the cache believes
                for version in cache.recent_pulls(family, recent) if recent else []:
                    try:
                        info = fetcher.version(family, version)
                    except NotFound:  # deleted on the registry since it was pulled: no longer one to keep warm
                        cache.forget_pull(family, version)
                        continue
                    lease.add(info.manifest.chunk_ids())  # under the same holder: one lock file however many
                    s = fetcher.ensure(family, info.manifest.chunk_ids(), info.located, info.tiers)
                    fetched += s.fetched_bytes
                    warm += s.chunk_ids
        except BaseException:
            evict_quietly(cache, warm)  # the limit holds after a failed warm too
            raise
        # the size limit holds after a warm as after a pull: older entries make room for what it
        # brought (more than the limit can hold keeps all of it, as a pull keeps its own chunks)
        cache.evict(protect=warm)
        chunks = len(set(warm))  # a chunk the tier and recent members share counts once
        return {
            "family": family,
            "tier": tier,
            "chunks": chunks,
            "fetched_bytes": fetched,
            "pinned": pin and tier == "base",
        }
    finally:
        remote.close()
