"""`mfsreg check`: does the blob store still hold every byte that the stored versions need?

Looks up each pack that a version's chunks, or the bases of their deltas, lie in (registry/store/lost.py)
and, with ``read_data``, reads, decodes and hashes every such chunk; names what is wrong with the
versions it breaks. Changes nothing, so it runs beside pushes and pulls. ``unreadable_or_damaged``
is the same read for ``push --mend-damaged``.
See docs/design/check.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable

from mfsreg.registry.blobs.packs import StoredChunk, read_payloads
from mfsreg.registry.context import Store
from mfsreg.registry.db import chunks as chunk_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.errors import IntegrityError, NotFound
from mfsreg.registry.format.rebuild import closure, decode_verified, levels
from mfsreg.registry.parallel import sized_batches, windowed_map
from mfsreg.registry.progress import NullProgress, Progress
from mfsreg.registry.results import CheckResult
from mfsreg.registry.store.lost import LostWarning, PackSizes, lost_packs, through_lost, unreadable

# chunk bytes, decoded, checked at a time with read_data (plus the bases their deltas need): what
# memory holds at once. Counted raw, not stored: a batch of deltas can decode to ten times its size
READ_BATCH = 64 << 20

log = logging.getLogger("mfsreg")


def check(
    reg: Store, family: str | None = None, read_data: bool = False, progress: Progress | None = None
) -> CheckResult:
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    with read_tx(reg.engine) as conn:  # one snapshot: the versions and where their chunks were
        if family is not None:
            version_db.get_family(conn, family)  # NotFound, in one line, for a family that does not exist
        rows = version_db.list_versions(conn, family)
        lists = version_db.chunk_ids_by_version(conn, family)  # one query, not one per version
        needs = {f"{r.family}/{r.name}": lists.get(r.id, []) for r in rows}
        located = chunk_db.locate_closure(conn, {i for ids in needs.values() for i in ids})
    result = CheckResult(
        scope=family or "registry",
        versions=len(rows),
        chunks=len(located),
        packs=len({c.pack_id for c in located.values()}),
        stored_bytes=sum(c.stored_size for c in located.values()),
    )
    result.lost_packs = lost_packs(reg, located.values())
    if read_data:
        result.damaged_chunks, result.read_bytes = find_damaged(reg, located, result.lost_packs, progress)
        for i, why in result.damaged_chunks.items():
            pack = result.damaged_packs.setdefault(located[i].pack_id, {"chunks": 0, "first": f"chunk {i}: {why}"})
            pack["chunks"] += 1
    # a version names a chunk with no row of its own (no foreign key holds it): the records lost it
    unrecorded = {i for ids in needs.values() for i in ids if i not in located}
    result.unrecorded_chunks = len(unrecorded)
    broken = set(result.damaged_chunks) | unrecorded
    bad = {i for i in located if through_lost(i, located, result.lost_packs, broken)} | unrecorded
    result.unreadable_chunks = len(bad)
    result.broken_versions = [v for v, ids in needs.items() if not bad.isdisjoint(ids)]
    result.seconds = time.perf_counter() - t0
    return result


def unreadable_or_damaged(
    reg: Store,
    located: dict[str, StoredChunk],
    ids: Iterable[str],
    progress: Progress | None = None,
    sizes: PackSizes | None = None,
    read_data: bool = True,
) -> tuple[set[str], dict[str, str], dict[str, str]]:
    """lost.unreadable, and also reading every chunk of ``located`` (the stored ``ids`` and their
    bases: db/chunks.locate_closure) outside the lost packs, decoding and hashing it: those of
    ``ids`` whose bytes, or a basis's down their delta chain, lie in a lost pack or are damaged;
    with the lost packs and the damaged chunks (id -> why). Such a chunk is mended by storing it
    again, plain. Reads every stored byte ``located`` names: only on request. ``sizes``: the pack
    lookups the push made already (lost.lost_packs), so that its bases' packs are looked up once.
    ``read_data=False`` (a push without --mend-damaged): lost.unreadable alone, nothing damaged."""
    if not read_data:
        return *unreadable(reg, located, ids, sizes), {}
    lost = lost_packs(reg, located.values(), sizes)
    damaged, _ = find_damaged(reg, located, lost, progress or NullProgress())
    return {i for i in ids if through_lost(i, located, lost, damaged)}, lost, damaged


def to_mend(
    reg: Store,
    located: dict[str, StoredChunk],
    ids: Iterable[str],
    progress: Progress | None = None,
    sizes: PackSizes | None = None,
    read_data: bool = True,
) -> tuple[set[str], dict[str, str], LostWarning]:
    """What a push stores again of the stored ``ids`` (unreadable_or_damaged, the same arguments),
    and what it says of it: the damaged chunks are warned of now (warn_damaged), the lost packs go
    into the LostWarning returned, for the caller to say once (with the bases its delta planning
    finds in them too). Returns (chunks to mend, damaged chunks, that warning)."""
    mend, lost, damaged = unreadable_or_damaged(reg, located, ids, progress, sizes, read_data)
    warn_damaged(damaged, located, mend)
    return mend, damaged, LostWarning().mending(lost, len({i for i in mend if through_lost(i, located, lost)}))


def warn_damaged(damaged: dict[str, str], located: dict[str, StoredChunk], mended: set[str]) -> None:
    """Said where a push stores again chunks whose stored bytes are damaged. A damaged basis that
    the version itself does not use is not sent (its deltas are, plain): it stays damaged for the
    other versions that use it, and this says so."""
    if not damaged or not mended:
        return
    first, why = min(damaged.items())
    left = sorted(set(damaged) - mended)
    rest = (
        (
            f"; {len(left)} damaged chunks this version does not use (first: {left[0]}, a basis of its deltas) stay "
            "damaged for the versions that use them (mfsreg check --read-data names them)"
        )
        if left
        else ""
    )
    log.warning(
        "%d stored chunks are damaged (first: chunk %s in pack %s: %s): this push stores again the %d chunks "
        "of the version that need them%s",
        len(damaged),
        first,
        located[first].pack_id,
        why,
        len(mended),
        rest,
    )


def find_damaged(
    reg: Store, located: dict[str, StoredChunk], lost: dict[str, str], progress: Progress
) -> tuple[dict[str, str], int]:
    """Read, decode and hash every chunk outside the lost packs, a batch at a time, each plain
    chunk with the deltas on it; a basis is read again only where a batch ends between them. A
    pack found lost on the way is added to ``lost``. Returns (damaged chunk -> why, encoded bytes
    read)."""
    # each plain chunk with the deltas that lean on it, down their chains: a batch then holds most
    # bases its deltas need, and reads them once (in pack order, a batch of a full fine-tune's
    # deltas read every base chunk again: twice the stored bytes in all)
    roots: dict[str, StoredChunk] = {}

    def root(c: StoredChunk) -> StoredChunk:
        if c.id not in roots:
            b = located.get(c.basis_id) if c.basis_id else None
            roots[c.id] = c if b is None else root(b)
        return roots[c.id]

    todo = sorted(
        (c for c in located.values() if c.pack_id not in lost),
        key=lambda c: (root(c).pack_id, root(c).offset, c.depth, c.pack_id, c.offset),
    )
    progress.start("verify", sum(c.stored_size for c in todo))
    damaged: dict[str, str] = {}
    read = 0
    for batch in sized_batches(todo, lambda c: c.size, READ_BATCH):
        try:
            order = closure([c.id for c in batch], located)
        except IntegrityError as exc:  # a chain too long or circular: every chunk of the batch is suspect
            damaged.update((c.id, str(exc)) for c in batch)
            continue
        wanted = [located[i] for i in order if located[i].pack_id not in lost]
        try:
            payloads = {c.id: p for c, p in read_payloads(reg.blobs, wanted)}
        except NotFound:  # a pack went (or was cut short) since it was looked up: lost, as the lookup says
            lost.update(lost_packs(reg, wanted))
            continue
        read += sum(c.stored_size for c in wanted)
        damaged.update(_decode_levels(reg, order, located, payloads))
        progress.advance("verify", sum(c.stored_size for c in batch))
    return damaged, read


def _decode_levels(reg: Store, order: list[str], located: dict[str, StoredChunk], payloads: dict) -> dict[str, str]:
    """Decode ``order`` (bases first) level by level on the registry's pool; a chunk whose basis
    did not decode is not counted as damaged itself: check() finds it through its basis."""
    raw: dict[str, bytes] = {}
    damaged: dict[str, str] = {}

    def job(i: str) -> tuple[str, bytes | None, str | None]:
        c = located[i]
        if i not in payloads:  # its pack is lost: said once, for the pack
            return i, None, None
        if c.basis_id and c.basis_id not in raw:
            return i, None, None
        try:
            return i, decode_verified(c, payloads[i], raw[c.basis_id] if c.basis_id else None), None
        except IntegrityError as exc:
            return i, None, str(exc).removeprefix(f"chunk {i} ")  # listed under its id already

    for level in levels(order, located):
        for i, data, why in windowed_map(reg.pool, job, level):
            if data is not None:
                raw[i] = data
            elif why is not None:
                damaged[i] = why
    return damaged
