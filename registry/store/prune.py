"""Prune: give back the space of chunks that no version needs (restic's prune, for our packs).

Keeps every chunk a version needs (version_chunks), those recorded within ``min_age``, and their
bases; deletes the other chunk rows and old claims; retires packs left with no kept chunk and
repacks those over ``max_unused``; deletes a blob once its pack has been unlisted for ``min_age``,
and the parts of packs killed writers left (temp files, S3 multipart uploads) once that old.
Decides on a snapshot, then checks that choice again under exclude_writers (db/locks.py).
See docs/design/prune.md.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta

from mfsreg.registry.blobs.base import Leftover
from mfsreg.registry.blobs.packs import StoredChunk, pack_key
from mfsreg.registry.config import PRUNE_MAX_UNUSED, PRUNE_MIN_AGE
from mfsreg.registry.context import Store
from mfsreg.registry.db import claims as claim_db
from mfsreg.registry.db import reclaim as q
from mfsreg.registry.db.engine import read_tx, write_tx
from mfsreg.registry.db.locks import exclude_writers
from mfsreg.registry.errors import InvalidRequest, NotFound, StorageError
from mfsreg.registry.progress import NullProgress, Progress
from mfsreg.registry.results import PruneResult
from mfsreg.registry.store.recorded import RecordedPacks

DEFAULT_MIN_AGE = PRUNE_MIN_AGE  # seconds: longer than any push between its first upload and its commit
DEFAULT_MAX_UNUSED = PRUNE_MAX_UNUSED  # a pack with more than this share of unused bytes is repacked
MAX_MIN_AGE = 10 * 365 * 86400.0  # seconds: beyond this, date arithmetic overflows (and no grace needs it)


def check_prune_args(min_age: float, max_unused: float) -> None:
    if not 0 <= min_age <= MAX_MIN_AGE:
        raise InvalidRequest(f"min age {min_age} s: give zero or more seconds, at most {MAX_MIN_AGE:.0f} (ten years)")
    if not 0 <= max_unused < 1:
        raise InvalidRequest(f"max unused {max_unused}: give a share of a pack in [0, 1), e.g. 0.1")


@dataclass(frozen=True)
class _Plan:
    garbage: list[q.ChunkState]
    retire: list[str]  # packs without a kept chunk
    repack: list[str]  # packs with too much unused space
    to_move: int  # stored bytes of the kept chunks in ``repack``


def _plan(states: list[q.ChunkState], sizes: dict[str, int], max_unused: float) -> _Plan:
    kept = {c.id for c in states if c.used or not c.settled}
    basis = {c.id: c.basis_id for c in states}
    todo = [b for i in kept if (b := basis.get(i))]
    while todo:  # bases of kept chunks down their chains (a used chunk's bases are used already)
        b = todo.pop()
        if b in basis and b not in kept:
            kept.add(b)
            if below := basis[b]:
                todo.append(below)
    live: dict[str, int] = defaultdict(int)
    for c in states:
        if c.id in kept:
            live[c.pack_id] += c.stored_size
    retire = [p for p in sizes if live[p] == 0]
    repack = [p for p, size in sizes.items() if 0 < live[p] and size - live[p] > max_unused * size]
    return _Plan([c for c in states if c.id not in kept], retire, repack, sum(live[p] for p in repack))


def decide(conn, cutoff, sizes: dict[str, int], max_unused: float) -> _Plan:
    """What a prune whose grace period began at ``cutoff`` deletes, retires and repacks (``sizes``:
    every listed pack's size), as of ``conn``'s snapshot. It reads every chunk row into this
    process (6.6 s at 530,000 rows on Postgres, benchmarks/metadata_scale.py), which is why writers
    do not wait for it: ``still_unneeded`` checks its choice again once they do. Tried: a recursive
    CTE that keeps the rows in the database read them in 3.3 s, but the delete must then evaluate
    it a second time, or hold it in a temporary table."""
    return _plan(q.chunk_states(conn, cutoff), sizes, max_unused)


def still_unneeded(conn, garbage: list[q.ChunkState]) -> list[q.ChunkState]:
    """Of the chunks a decision on an earlier snapshot found unneeded, those still unneeded now
    (``conn`` excludes writers): a version committed since may need one (version_chunks holds the
    bases of its deltas too), and a chunk recorded since may be a delta against one. Each kept
    takes its bases along, down their chains, as in ``_plan``. Two lookups per thousand chosen
    chunks, by index, instead of the decision's read of every row."""
    chosen = {c.id: c for c in garbage}
    todo = list(q.used_among(conn, list(chosen)))
    todo += [b for i, b in q.deltas_against(conn, list(chosen)) if i not in chosen]  # a chosen delta: below
    kept: set[str] = set()
    while todo:
        i = todo.pop()
        if i in chosen and i not in kept:
            kept.add(i)
            if below := chosen[i].basis_id:
                todo.append(below)
    return [c for c in garbage if c.id not in kept]


def prune(
    reg: Store,
    min_age: float = DEFAULT_MIN_AGE,
    max_unused: float = DEFAULT_MAX_UNUSED,
    dry_run: bool = False,
    progress: Progress | None = None,
) -> PruneResult:
    """Delete what no version needs and free its space (see the module docstring); with ``dry_run``,
    only say what that would do."""
    # (over 60 lines: the steps under one prune lock, in the order they must run; helpers
    # would spread that order, which the module docstring explains, over several functions)
    check_prune_args(min_age, max_unused)
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    grace = timedelta(seconds=min_age)
    with q.one_prune_at_a_time(reg.engine):
        with read_tx(reg.engine) as conn:  # writers go on meanwhile (see the module docstring)
            sizes = q.pack_sizes(conn)
            cutoff = q.db_now(conn) - grace  # for chunks and claims alike: a claim kept with its chunk
            plan = decide(conn, cutoff, sizes, max_unused)
        garbage, retired, moved = plan.garbage, plan.retire, plan.to_move
        damaged: dict[str, str] = {}  # packs a repack could not read (pack id -> why)
        if not dry_run:
            with write_tx(reg.engine) as conn:
                exclude_writers(conn)
                q.forget_relisted(conn)  # so that retiring such a pack again starts its grace period afresh
                garbage = still_unneeded(conn, plan.garbage)
                q.delete_chunks(conn, [c.id for c in garbage])
                claim_db.forget_before(conn, cutoff)  # those of pushes that never committed
                retired = q.retire_packs(conn, plan.retire)  # a pack whose chunk stayed stays listed
        if dry_run:
            due, waiting = _would_delete(reg, plan.retire + plan.repack, sizes, grace, min_age)
        else:
            # with the chunks still_unneeded kept there; a pack that cannot be read stays as it is
            moved, damaged = _repack(reg, plan.repack, progress)
            due = _delete_blobs(reg, grace)  # whatever the repack found: one bad pack must not block this
            with read_tx(reg.engine) as conn:
                waiting = q.unlisted(conn)
        # parts of packs that writers killed mid-put left (never recorded): gone once past the grace
        # period, counted with the blobs deleted; younger ones may be a put still running
        stale, young = _leftovers(reg, min_age)
        if not dry_run:
            for left in stale:
                reg.blobs.remove_leftover(left)
        due = [*due, *((left.name, left.size) for left in stale)]
        waiting = [*waiting, *((left.name, left.size) for left in young)]
    repacked = [p for p in plan.repack if p not in damaged]
    result = PruneResult(
        dry_run=dry_run,
        deleted_chunks=len(garbage),
        deleted_chunk_bytes=sum(c.stored_size for c in garbage),
        repacked_packs=len(repacked),
        moved_bytes=moved,
        retired_packs=len(retired) + len(repacked),
        deleted_packs=len(due),
        freed_bytes=sum(s for _, s in due),
        waiting_packs=len(waiting),
        waiting_bytes=sum(s for _, s in waiting),
        seconds=time.perf_counter() - t0,
    )
    if damaged:
        raise _unrepacked(damaged, result)
    return result


def _would_delete(
    reg: Store, retiring_ids: list[str], sizes: dict[str, int], grace: timedelta, min_age: float
) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """A dry run's (blobs a run would delete now, blobs that would wait out the grace period)."""
    retiring = [(p, sizes[p]) for p in retiring_ids]
    with read_tx(reg.engine) as conn:
        due = q.unlisted(conn, q.db_now(conn) - grace)
        waiting = [r for r in q.unlisted(conn) + retiring if r not in due]
    # as the real run counts: blobs that exist (a writer that died before its put left none)
    due = [r for r in due if reg.blobs.exists(pack_key(r[0]))] + (retiring if min_age == 0 else [])
    return due, [r for r in waiting if r not in due]


def _unrepacked(damaged: dict[str, str], result: PruneResult) -> StorageError:
    """The error of a prune that could not read some packs it meant to repack; the rest ran."""
    first, why = next(iter(damaged.items()))
    more = f" and {len(damaged) - 1} more" if len(damaged) > 1 else ""
    said = (
        "the chunks versions still need there are lost, and that pack was left as it was; restore its blob from "
        f"a backup (MFSREG_BLOB_URL names the store). The rest of the prune ran: {result.deleted_chunks} chunks "
        f"deleted, {result.repacked_packs} packs repacked, {result.deleted_packs} blobs deleted "
        f"({result.freed_bytes:,} bytes)"
    )
    return StorageError(
        f"prune could not repack pack {first}{more}, which storage lost or cut short ({why}): {said}",
        public=f"prune could not repack pack {first}{more}, which storage lost or cut short: {said}",
    )


def _leftovers(reg: Store, min_age: float) -> tuple[list[Leftover], list[Leftover]]:
    """The blob store's leftovers (BlobStore.leftovers): those older than ``min_age``, and the rest."""
    stale: list[Leftover] = []
    young: list[Leftover] = []
    for left in reg.blobs.leftovers():
        (stale if left.age >= min_age else young).append(left)
    return stale, young


class _MovedPacks(RecordedPacks):
    """New packs for repacked chunks: announced like a push's, recorded by pointing the chunks'
    rows at them (``old_pack``: chunk id -> the pack it comes from) instead of adding rows."""

    def __init__(self, reg: Store, old_pack: dict[str, str]):
        super().__init__(reg)
        self.old_pack = old_pack

    def _write_rows(self, conn, pack_id: str, size: int, stored: list[StoredChunk]) -> None:
        q.record_moved(conn, pack_id, size, [(c.id, self.old_pack[c.id], c.offset) for c in stored])


def _repack(reg: Store, pack_ids: list[str], progress: Progress) -> tuple[int, dict[str, str]]:
    """Copy the chunks still in ``pack_ids`` into new packs, point their rows there, and retire the
    old packs; returns the stored bytes copied, and the packs whose blob could not be read (missing
    or cut short: damage, since only prune deletes a listed pack's blob), each with why. Those stay
    listed, as they are, and the others are repacked all the same. Payloads are copied as stored,
    so nothing is decoded or encoded again."""
    with read_tx(reg.engine) as conn:
        rows = {p: q.chunks_in(conn, p) for p in pack_ids}
    progress.start("repack", sum(r[3] for rs in rows.values() for r in rs))
    old_pack: dict[str, str] = {}

    writer = _MovedPacks(reg, old_pack)
    damaged: dict[str, str] = {}
    for pack_id, chunk_rows in rows.items():
        located = [
            StoredChunk(cid, size, enc, stored, pack_id, off, basis, depth)
            for cid, size, enc, stored, off, basis, depth in chunk_rows
        ]
        try:
            for c, payload in reg.read_payloads(located):
                old_pack[c.id] = pack_id
                writer.add(c.id, c.size, c.encoding, payload, c.basis_id, c.depth)
                progress.advance("repack", c.stored_size)
        except NotFound as exc:
            # chunks added before the failure were read whole and move with the rest: those rows
            # then point at a new pack, and the damaged one keeps only what could not be read
            damaged[pack_id] = str(exc)
    writer.flush()
    with write_tx(reg.engine) as conn:
        q.retire_packs(conn, pack_ids)  # each once no chunk row points into it (not a damaged one)
    return writer.bytes_written, damaged


def _delete_blobs(reg: Store, grace: timedelta) -> list[tuple[str, int]]:
    """Delete the blobs of packs unlisted for ``grace`` or longer; returns those that existed. They
    are claimed first, in a transaction that excludes writers (db/locks.py): a writer that recorded
    its pack meanwhile keeps it, and one that records it afterwards is refused (db/reclaim.list_pack),
    so no chunk row ever points into a deleted blob. Rows go only after their blobs: a prune that
    dies in between leaves claims that the next one finishes."""
    with write_tx(reg.engine) as conn:
        exclude_writers(conn)
        due = q.claim_due(conn, q.db_now(conn) - grace)
    deleted = []
    for pack_id, size in due:
        key = pack_key(pack_id)
        if reg.blobs.exists(key):  # a writer that died before its put left no blob: nothing freed
            reg.blobs.delete(key)
            deleted.append((pack_id, size))
    with write_tx(reg.engine) as conn:
        q.forget_unlisted(conn, [p for p, _ in due])
    return deleted
