"""Packs the blob store lost: finding them (one size lookup per distinct pack) and the stored chunks
they take with them.

Only prune deletes a listed pack's blob, so a recorded chunk whose pack is missing or short is
damage: a push sends it again, mending it, and takes no basis there; commits and pulls check the
packs first.
See docs/design/check.md.
"""

from __future__ import annotations

import logging
from collections.abc import Container, Iterable
from concurrent.futures import ThreadPoolExecutor

from mfsreg.registry.blobs.packs import StoredChunk, pack_key
from mfsreg.registry.context import Store
from mfsreg.registry.errors import NotFound

log = logging.getLogger("mfsreg")

PACK_LOOKUPS = 8  # concurrent size lookups (HEADs on S3): they wait on the network, not the CPU


PackSizes = dict[str, int | str]  # pack id -> its size in the blob store, or why it has none: lookups one push shares


def lost_packs(reg: Store, chunks: Iterable[StoredChunk], sizes: PackSizes | None = None) -> dict[str, str]:
    """pack id -> what is wrong, for each pack of ``chunks`` that is missing from the blob store or
    ends before the last of their bytes. Several packs are looked up a few at a time on threads of
    their own (reg.pool is sized for the CPU work of uploads). ``sizes`` keeps the lookups, so that
    a push that checks its reused chunks and then its bases (mostly in the same packs) looks each
    pack up once. A store that cannot be reached raises its StorageError."""
    ends: dict[str, int] = {}
    for c in chunks:
        ends[c.pack_id] = max(ends.get(c.pack_id, 0), c.offset + c.stored_size)
    sizes = {} if sizes is None else sizes

    def size_of(pack_id: str) -> int | str:
        try:
            return reg.blobs.size(pack_key(pack_id))
        except NotFound as exc:
            return str(exc)

    todo = sorted(p for p in ends if p not in sizes)
    if len(todo) <= 1:
        found = [size_of(p) for p in todo]
    else:
        with ThreadPoolExecutor(max_workers=min(PACK_LOOKUPS, len(todo)), thread_name_prefix="mfsreg-packs") as io:
            found = list(io.map(size_of, todo))
    sizes.update(zip(todo, found))
    out: dict[str, str] = {}
    for pack_id, end in sorted(ends.items()):
        size = sizes[pack_id]
        if isinstance(size, str):
            out[pack_id] = size
        elif size < end:
            out[pack_id] = f"pack {pack_id} holds {size} bytes where its chunks need {end}"
    return out


def unreadable(
    reg: Store, located: dict[str, StoredChunk], ids: Iterable[str], sizes: PackSizes | None = None
) -> tuple[set[str], dict[str, str]]:
    """Those of the stored ``ids`` whose bytes, or the bytes of a basis down their delta chain,
    lie in a pack the store lost (``located`` holds them and their bases: db/chunks.locate_closure),
    and the lost packs (lost_packs). Such a chunk is mended by storing it again, plain."""
    lost = lost_packs(reg, located.values(), sizes)
    if not lost:
        return set(), {}
    return {i for i in ids if through_lost(i, located, lost)}, lost


def through_lost(
    chunk_id: str, located: dict[str, StoredChunk], lost: Container[str], bad: Container[str] = frozenset()
) -> bool:
    """Whether ``chunk_id``'s bytes, or those of a basis down its delta chain, lie in a ``lost``
    pack, or are one of the ``bad`` chunks (mfsreg check's damaged and unrecorded ones)."""
    i: str | None = chunk_id
    while i is not None:
        c = located.get(i)
        if i in bad or (c is not None and c.pack_id in lost):
            return True
        i = c.basis_id if c is not None else None
    return False


def warn_lost_bases(lost: dict[str, str], chunks: int | None = None) -> None:
    """Said where a push's new chunks could not lean on the basis chosen for them: stored against a
    readable basis further down its chain, or plain, so the push costs more bytes, and the pack
    stays lost for the versions that use it."""
    LostWarning().moving(lost, chunks).say()


def warn_damaged_basis(chunk_id: str, why: str) -> None:
    """Said once a push where a new chunk could not lean on the basis chosen for it because a chunk
    of that basis's chain is damaged in its pack: the new chunk is stored plain, and the damage
    stays for the versions that use it."""
    log.warning(
        "basis chunk %s cannot be read back (%s): this push stores the new chunks planned against it (and "
        "against any other damaged basis) without deltas; `mfsreg check --read-data` names the versions the "
        "damage breaks, and a push of each again with --mend-damaged mends them",
        chunk_id,
        why,
    )


class LostWarning:
    """What one push found lost, said in one warning: the chunks it stores again (warn_mending) and
    the new chunks it stores without the deltas planned against them (warn_lost_bases). A push that
    does both over one pack named it twice."""

    def __init__(self) -> None:
        self.lost: dict[str, str] = {}
        self.mended = 0
        self.moved: int | None = 0  # None: some, not counted

    def mending(self, lost: dict[str, str], chunks: int) -> LostWarning:
        if chunks:
            self.lost.update(lost)
            self.mended += chunks
        return self

    def moving(self, lost: dict[str, str], chunks: int | None) -> LostWarning:
        if chunks is None or chunks:
            self.lost.update(lost)
            self.moved = None if chunks is None or self.moved is None else self.moved + chunks
        return self

    def say(self) -> None:
        if not self.lost:
            return
        first, why = next(iter(self.lost.items()))
        more = f" and {len(self.lost) - 1} more" if len(self.lost) > 1 else ""
        did = []
        if self.mended:
            did.append(f"this push stores its {self.mended} chunks that lay there again")
        if self.moved != 0:
            count = f"{self.moved} " if self.moved is not None else ""
            did.append(f"{count}new chunks of this push are stored without deltas against the chunks that lay there")
        them = "the pack's other chunks" if self.mended else "them"
        log.warning(
            "pack %s%s is lost from the blob store (%s): %s; versions that use %s cannot be pulled until it "
            "is restored from a backup",
            first,
            more,
            why,
            ", and ".join(did),
            them,
        )
