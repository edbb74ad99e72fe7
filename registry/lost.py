"""Packs the blob store lost: finding them, one size lookup per distinct pack, and which stored
chunks they take with them.

Only prune deletes the blob of a listed pack, and only once no chunk row points into it, so a
recorded chunk whose pack is missing or shorter than its bytes is damage: an object deleted by hand,
a restore that missed it, a store swapped under the registry. A push that would reuse such a chunk
sends it again instead (ingest.push, service.negotiate), and recording the new copy points the
chunk's row at it (db/chunks.record_pack): the push mends what it needs, and no version is committed
over bytes that cannot be read (service.commit checks again). A pull meets the same check before
it streams (service.check_packs).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

from registry.blobs.packs import StoredChunk, pack_key
from registry.errors import NotFound

log = logging.getLogger("mfsreg")

PACK_LOOKUPS = 8  # concurrent size lookups (HEADs on S3): they wait on the network, not the CPU


def lost_packs(reg, chunks: Iterable[StoredChunk]) -> dict[str, str]:
    """pack id -> what is wrong, for each pack of ``chunks`` that is missing from the blob store or
    ends before the last of their bytes. Several packs are looked up a few at a time on threads of
    their own (reg.pool is sized for the CPU work of uploads). A store that cannot be reached
    raises its StorageError."""
    ends: dict[str, int] = {}
    for c in chunks:
        ends[c.pack_id] = max(ends.get(c.pack_id, 0), c.offset + c.stored_size)

    def problem(item: tuple[str, int]) -> str | None:
        pack_id, end = item
        try:
            size = reg.blobs.size(pack_key(pack_id))
        except NotFound as exc:
            return str(exc)
        return None if size >= end else f"pack {pack_id} holds {size} bytes where its chunks need {end}"

    items = sorted(ends.items())
    if len(items) <= 1:
        found = [problem(i) for i in items]
    else:
        with ThreadPoolExecutor(max_workers=min(PACK_LOOKUPS, len(items)), thread_name_prefix="mfsreg-packs") as io:
            found = list(io.map(problem, items))
    return {p: why for (p, _), why in zip(items, found) if why is not None}


def unreadable(reg, located: dict[str, StoredChunk], ids: Iterable[str]) -> tuple[set[str], dict[str, str]]:
    """Those of the stored ``ids`` whose bytes, or the bytes of a basis down their delta chain,
    lie in a pack the store lost (``located`` holds them and their bases: db/chunks.locate_closure),
    and the lost packs (lost_packs). Such a chunk is mended by storing it again, plain."""
    lost = lost_packs(reg, located.values())
    if not lost:
        return set(), {}
    bad: set[str] = set()
    for i in ids:
        c = located.get(i)
        while c is not None:
            if c.pack_id in lost:
                bad.add(i)
                break
            c = located.get(c.basis_id) if c.basis_id else None
    return bad, lost


def warn_mending(lost: dict[str, str], chunks: int) -> None:
    """Said on the server's log (or an embedded push's stderr): the pack's other chunks, which
    this push does not send, stay lost for every version that uses them."""
    first, why = next(iter(lost.items()))
    more = f" and {len(lost) - 1} more" if len(lost) > 1 else ""
    log.warning("pack %s%s is lost from the blob store (%s): this push stores its %d chunks that lay there again; "
                "versions that use the pack's other chunks cannot be pulled until it is restored from a backup",
                first, more, why, chunks)
