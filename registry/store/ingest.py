"""Push: plan -> hash -> dedup -> encode -> write packs -> commit -> rebalance.

Chunk rows are recorded once their pack is durable; the version, its chunk uses and the tier
changes, in one transaction at the end. A push that dies leaves no version, and a re-run sends only
what is missing. A chunk two pushes send is recorded once; commits to a family take its row lock.
See docs/design/format.md.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from collections.abc import Set as AbstractSet
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from sqlalchemy import Connection

from mfsreg.registry import pushing, results
from mfsreg.registry.blobs.packs import StoredChunk
from mfsreg.registry.config import MAX_CHUNK_SIZE, MIN_CHUNK_SIZE
from mfsreg.registry.context import Store
from mfsreg.registry.db import chunks as chunk_db
from mfsreg.registry.db import claims as claim_db
from mfsreg.registry.db import rebalance as tier_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import read_tx, write_tx
from mfsreg.registry.db.locks import exclude_prune
from mfsreg.registry.errors import (
    Conflict,
    InvalidName,
    InvalidRequest,
    MissingChunks,
    NotFound,
    Pruned,
    StorageError,
)
from mfsreg.registry.format.hashing import HashJob, encoded_chunks, missing_bytes
from mfsreg.registry.format.manifest import Manifest
from mfsreg.registry.format.rebuild import decode_verified
from mfsreg.registry.meta import VersionMeta, check_meta
from mfsreg.registry.names import check_name, check_new_name
from mfsreg.registry.principal import Principal
from mfsreg.registry.progress import Progress
from mfsreg.registry.results import FamilyRow, PushResult, VersionRow
from mfsreg.registry.store import access, deltas
from mfsreg.registry.store.audit import named
from mfsreg.registry.store.check import to_mend
from mfsreg.registry.store.deltas import BasisReader
from mfsreg.registry.store.lost import LostWarning, PackSizes, lost_packs, warn_lost_bases
from mfsreg.registry.store.recorded import RecordedPacks
from mfsreg.registry.store.tags import check_free


def plan_deltas(
    reg: Store,
    family: str,
    parent: str | None,
    new_files: list,
    ids: list[str],
    missing: set[str],
    pack_sizes: PackSizes | None = None,
    warning: LostWarning | None = None,
    damaged: AbstractSet[str] = frozenset(),
) -> tuple[dict[str, str], BasisReader | None]:
    """Bases for the missing chunks (see registry/store/deltas.py) and a reader for their bytes.
    ``new_files``: (chunks, tensors) per file of the version pushed; ``pack_sizes``: the pack
    lookups this push made already (registry/store/lost.py); ``warning``: where the caller gathers what
    the push found lost into one warning (without it, warned of here); ``damaged``: stored chunks
    this push found damaged, on which no basis, nor a chain through them, is taken."""
    if not reg.settings.delta or not missing or not any(tensors for _, tensors in new_files):
        return {}, None
    present = [i for i in ids if i not in missing]
    with read_tx(reg.engine) as conn:
        fam = version_db.find_family(conn, family)
        if fam is None:
            return {}, None
        vid = None
        if parent is not None:
            row = version_db.find_version(conn, family, parent, tags=True)
            vid = row.id if row else None
        vid = (
            vid
            or version_db.most_shared_version(conn, fam.id, present, fam.member_count)
            or version_db.first_version(conn, fam.id)
        )
        if vid is None:
            return {}, None
        basis_manifest = Manifest.from_bytes(version_db.read_manifest(conn, vid))
        index = deltas.position_index((f.chunks, f.tensors) for f in basis_manifest.files)
        planned = deltas.plan_bases(new_files, index, missing)
        located = chunk_db.locate_closure(conn, set(planned.values()))
    # a basis in a pack the blob store lost cannot be read, nor one found damaged: one further down
    # its chain, or none (plain)
    lost = lost_packs(reg, located.values(), pack_sizes)
    bases, moved = {}, 0
    for cid, bid in planned.items():
        capped = deltas.cap_depth(bid, located, lost, damaged)
        # counted for the lost packs' warning only where the lost pack, not the damage, moved it
        if lost and capped != deltas.cap_depth(bid, located, damaged=damaged):
            moved += 1  # a readable basis further down, or none: the push stores more bytes
        if capped is not None:
            bases[cid] = capped
    if moved and warning is not None:
        warning.moving(lost, moved)
    elif moved:
        warn_lost_bases(lost, moved)
    reader = deltas.BasisReader(located, reg.read_payloads, decode_verified, locate=reg.locate)
    return bases, reader


ChunkItem = tuple  # (id, size, encoding, payload, basis id or None, depth): what RecordedPacks.add takes


@dataclass(frozen=True)
class PushPlan:
    """What a push sends and how the store keeps it: the chunks to store (new, and stored ones to
    store again), those of them mended, the bases suggested for the new ones, a reader of those."""

    missing: set[str]
    mend: set[str]
    bases: dict[str, str]
    reader: BasisReader | None


@dataclass(frozen=True)
class Survey:
    """What a push's "what is missing?" finds, read in one transaction."""

    existing: VersionRow | None  # the version already stored under this name
    family: FamilyRow | None  # None: the push makes the family
    missing: set[str]  # chunks not stored; with a scoped principal, also those it must send (unproven)
    located: dict[str, StoredChunk]  # where the stored ones lie, and the bases down their chains
    unproven: set[str]  # stored chunks the principal may not reuse without sending them (access.py)


def survey(reg: Store, family: str, version: str, ids: list[str], who: Principal | None = None) -> Survey:
    """The push's second step, asked once by the embedded push and by the server's negotiate: is
    the version there, is the family, which of its chunks are stored and where, and which of those
    ``who`` must send all the same (none for the embedded registry's own push)."""
    with read_tx(reg.engine) as conn:
        existing = version_db.find_version(conn, family, version)
        fam = version_db.find_family(conn, family)
        missing = chunk_db.missing_ids(conn, ids)
        stored = [i for i in ids if i not in missing]
        located = chunk_db.locate_closure(conn, stored)
        unproven = access.unproven(conn, who, family, stored)
    return Survey(existing, fam, missing | unproven, located, unproven)


def plan_push(
    reg: Store,
    family: str,
    parent: str | None,
    new_files: list,
    ids: list[str],
    located: dict[str, StoredChunk],
    missing: set[str],
    unproven: AbstractSet[str] = frozenset(),
    progress: Progress | None = None,
    mend_damaged: bool = False,
) -> PushPlan:
    """The step of a push between hashing and uploading, for the embedded push and the server's
    negotiation alike: of the stored chunks it reuses (``located``, less those a scoped token must
    send anyway: ``unproven``, another family's, which it must not learn the state of), those in
    a pack the blob store lost and, with ``mend_damaged``, those whose bytes do not read back are
    stored again, plain; the new ones get bases (plan_deltas), none in a lost or damaged pack."""
    pack_sizes: PackSizes = {}
    reused = [i for i in ids if i in located and i not in unproven]
    mend, damaged, warning = to_mend(reg, located, reused, progress, pack_sizes, mend_damaged)
    bases, reader = plan_deltas(reg, family, parent, new_files, ids, missing, pack_sizes, warning, damaged.keys())
    warning.say()
    return PushPlan(missing | mend, mend, {c: b for c, b in bases.items() if c not in mend}, reader)


@dataclass(frozen=True)
class Negotiation:
    """The store's answer to a push's "what is missing?": for a version stored already, its row
    and layout, and as the plan the chunks to store again (``plan.missing`` = ``plan.mend``); else
    the plan of what to send."""

    existing: VersionRow | None
    layout: str | None  # the stored version's Manifest.layout, where it exists
    plan: PushPlan


def negotiate_step(
    reg: Store,
    family: str,
    version: str,
    parent: str | None,
    manifest: Manifest,
    who: Principal | None = None,
    mend_damaged: bool = False,
    progress: Progress | None = None,
) -> Negotiation:
    """A push's negotiation, for the embedded push (LocalPush) and the server's negotiate alike:
    the survey, the cut checks, and the plan: for a version stored with this layout (a draft's
    unknown digest aside), the chunks to mend (to_mend); for a new one, plan_push. ``manifest``
    may be a draft (file sha256s None); the caller has checked the names and the parent."""
    ids = manifest.chunk_ids()
    found = survey(reg, family, version, ids, who)
    # before anything is uploaded
    if found.family is None:
        check_new_cut(family, manifest.cut_size())
    elif found.existing is None:
        check_cut(manifest, family, found.family.chunk_size)
    if found.existing is not None:
        layout = stored_layout(reg, found.existing)
        mend: set[str] = set()
        if layout == manifest.layout and manifest.digest in (None, found.existing.digest):
            mend, _, warning = to_mend(reg, found.located, ids, progress, read_data=mend_damaged)
            warning.say()
        return Negotiation(found.existing, layout, PushPlan(mend, mend, {}, None))
    # stored, but in a pack the blob store lost (or down a delta chain through one), and, asked,
    # those whose stored bytes (or a basis's) do not read back: sent again, plain
    files = [(f.chunks, f.tensors) for f in manifest.files]
    plan = plan_push(
        reg, family, parent, files, ids, found.located, found.missing, found.unproven, progress, mend_damaged
    )
    return Negotiation(None, None, plan)


def commit_step(
    reg: Store,
    family: str,
    version: str,
    parent: str | None,
    manifest: Manifest,
    chunk_size: int | None = None,
    who: Principal | None = None,
    meta: VersionMeta | None = None,
    uploaded: bool = True,
) -> PushResult:
    """A push's commit, for the embedded push (LocalPush) and the server's commit alike: what the
    commit's transaction would refuse is refused before a reused delta whose chain leaves the
    family gets a plain copy (so that the version lends its family's readers no other family's
    bytes: registry/store/access.py), then commit_version, recorded as pushed by ``who``. The
    result counts every chunk as reused; ``existed`` where the name was committed first.
    ``uploaded``: the chunks came through the server (False: the embedded push's own)."""
    t0 = time.perf_counter()

    def refused_first(conn) -> bool:
        """What the commit's transaction would refuse, refused before any copy is made; a version of
        that name that exists needs none (it is compared by digest below)."""
        fam = version_db.find_family(conn, family)
        if fam is not None and version_db.find_version(conn, family, version) is not None:
            return False
        if fam is not None:
            check_cut(manifest, family, fam.chunk_size)
        elif chunk_size is None:
            check_new_cut(family, manifest.cut_size())
        stored_for(conn, family, version, manifest, lambda c, ids: access.unproven(c, who, family, ids))
        return True

    access.detach_foreign_chains(reg, who, family, manifest.chunk_ids(), refused_first)

    def unproven(conn, ids):  # checked again in the commit's transaction: what the version would lend
        return access.unproven(conn, who, family, ids) | set(access.foreign_chains(conn, who, family, ids))

    # an embedded push (``uploaded=False``) claimed nothing and has nothing to prove: its commit's
    # transaction neither checks nor forgets claims, as before the two pushes shared this step
    changed, existing = commit_version(
        reg,
        family,
        version,
        parent,
        manifest,
        chunk_size,
        unproven if uploaded else None,
        meta=meta,
        pushed_by=named(who),
    )
    if existing is not None:
        return existing_result(reg, existing, manifest, family, version, t0)
    return committed_result(family, version, manifest, changed, t0)


def store_chunks(
    reg: Store,
    ids: set[str],
    bases: Iterable[str | None],
    items: Callable[[set[str], set[str] | None], Iterable[ChunkItem]],
    mend: AbstractSet[str] = frozenset(),
) -> int:
    """Store the chunks ``ids`` as ``items(wanted, gone)`` yields them (``gone`` None on the first
    pass), deltas against ``bases``; returns the stored bytes added. ``mend``: those of ``ids``
    stored already, whose lost or damaged copy this one replaces. Where a prune refuses a pack
    (Pruned), the chunks still missing are stored once more, ``gone`` naming the bases it deleted;
    a second refusal is raised.
    See docs/design/prune.md."""
    first, pending = RecordedPacks(reg, mend), iter(items(ids, None))
    try:
        for item in pending:
            first.add(*item)
        first.flush()
        return first.added
    except Pruned:
        pass
    finally:
        getattr(pending, "close", lambda: None)()  # a generator stopped early: its encoding jobs end here
    with read_tx(reg.engine) as conn:
        still = chunk_db.missing_ids(conn, list(ids)) | (set(mend) & set(ids))
        gone = chunk_db.missing_ids(conn, [b for b in set(bases) if b is not None])
    again = RecordedPacks(reg, mend)
    for item in items(still, gone):
        again.add(*item)
    again.flush()
    return first.added + again.added


def upload_missing(
    reg: Store,
    job: HashJob,
    missing: set[str],
    pool: ThreadPoolExecutor,
    progress: Progress,
    bases: dict[str, str] | None = None,
    reader: BasisReader | None = None,
    mend: AbstractSet[str] = frozenset(),
) -> int:
    """Encode and store the chunks in ``missing`` (``mend``: those among them stored already, whose
    copy was lost or damaged); returns the stored bytes this push added."""
    bases = bases or {}
    progress.start("send", missing_bytes(job, missing))
    counted: set[str] = set()  # a second pass re-sends chunks the bar has counted

    def items(wanted: set[str], gone: set[str] | None) -> Iterator[ChunkItem]:
        usable = {c: b for c, b in bases.items() if b not in (gone or ())}
        basis_raw = reader.usable if reader is not None else None
        for c, encoding, payload, basis_id in encoded_chunks(job, wanted, pool, usable, basis_raw):
            depth = reader.located[basis_id].depth + 1 if basis_id and reader is not None else 0
            yield c.id, c.size, encoding, payload, basis_id, depth
            if c.id not in counted:
                counted.add(c.id)
                progress.advance("send", c.size)

    return store_chunks(reg, missing, bases.values(), items, mend)


def check_push_names(family: str, version: str, parent: str | None) -> None:
    check_new_name("family", family)
    check_new_name("version", version)
    if version == version_db.LATEST:
        raise InvalidName(
            "version name 'latest' is kept for the tag that follows the last push: choose another version name"
        )
    if parent is not None:
        check_name("version", parent)


def check_parent(reg: Store, family: str, parent: str | None, version: str | None = None) -> None:
    """The parent (a version's name, or a tag) exists; with ``version``, that name is no tag's."""
    with read_tx(reg.engine) as conn:
        if version is not None:
            check_free(conn, family, version)
        if parent is not None and version_db.find_version(conn, family, parent, tags=True) is None:
            raise NotFound(f"parent version {family}/{parent} does not exist: push it first or drop --parent")


def family_chunk_size(reg: Store, family: str) -> int:
    """The size a push to ``family`` cuts at: the family's own, or for a new family this registry's."""
    with read_tx(reg.engine) as conn:
        fam = version_db.find_family(conn, family)
    return fam.chunk_size if fam is not None else reg.settings.chunk_size


def check_cut(manifest: Manifest, family: str, chunk_size: int) -> None:
    """Refuse a version cut otherwise than its family (members dedup only if cut alike): another push
    created the family at another size after this one looked it up, or a client older than family
    chunk sizes cut at its own."""
    if not manifest.follows_chunk_size(chunk_size):
        raise Conflict(
            f"family {family!r} is cut in chunks of {chunk_size:,} bytes and this push is not: push it "
            f"again with a client that reads the family's size, or with MFSREG_CHUNK_SIZE={chunk_size}"
        )


def check_new_cut(family: str, cut: int | None) -> None:
    """A new family takes the size its first version's manifest was cut at (Manifest.cut_size, for a
    client that names none): one no family may have is refused, naming it, rather than creating the
    family at this registry's size and refusing the push as cut otherwise than that (a 409 about a
    family that does not exist yet). Such cuts match no family's, so nothing that could commit is lost."""
    if cut is not None and not MIN_CHUNK_SIZE <= cut <= MAX_CHUNK_SIZE:
        raise InvalidRequest(
            f"the manifest is cut in chunks of {cut:,} bytes, which new family {family!r} would take: "
            f"a chunk size is {MIN_CHUNK_SIZE:,} to {MAX_CHUNK_SIZE:,} bytes; cut it at one of them "
            "(MFSREG_CHUNK_SIZE)"
        )


def check_named_cut(manifest: Manifest, chunk_size: int | None) -> None:
    """A manifest that names the chunk size it was cut at must be cut at it."""
    if chunk_size is not None and not manifest.follows_chunk_size(chunk_size):
        raise InvalidRequest(f"the manifest is not cut at the chunk size it names ({chunk_size:,} bytes)")


def stored_for(
    conn: Connection,
    family: str,
    version: str,
    manifest: Manifest,
    unproven: Callable[[Connection, list[str]], set[str]] | None = None,
) -> dict[str, StoredChunk]:
    """Where the chunks a version uses are stored: its own and, to rebuild them, the bases of its
    deltas (tiers count both). Refuses a manifest that names chunks not stored, or (``unproven``)
    that the pusher has not shown it holds, or gives a chunk another size than the stored one."""
    ids = manifest.chunk_ids()
    located = chunk_db.locate_closure(conn, ids)
    # Chunks not stored and chunks the pusher has not shown it holds get one answer, counted
    # together: told apart, they would say which ids some family this token may not read stores.
    absent = {i for i in ids if i not in located}
    absent |= unproven(conn, [i for i in ids if i in located]) if unproven is not None else set()
    if absent:
        raise MissingChunks(
            f"{len(absent)} chunks of {family}/{version} are not stored for this family (first: "
            f"{min(absent)}): upload them, then commit again"
        )
    if any(c.basis_id and c.basis_id not in located for c in located.values()):
        # A delta whose basis has no row: prune never leaves one (it keeps every basis in use),
        # so the records are damaged, and no upload of the version's own chunks can mend that.
        said = (
            f"the registry's records lost the basis of a stored chunk of {family}/{version}: "
            "tell the registry's operator (`mfsreg prune` does not do this; a restore might have)"
        )
        raise StorageError(said, public=said)
    wrong = [c.id for f in manifest.files for c in f.chunks if located[c.id].size != c.size]
    if wrong:
        raise InvalidRequest(f"manifest gives chunk {wrong[0]} a size other than the stored one: it cannot rebuild")
    return located


def commit_version(
    reg: Store,
    family: str,
    version: str,
    parent: str | None,
    manifest: Manifest,
    chunk_size: int | None = None,
    unproven: Callable[[Connection, list[str]], set[str]] | None = None,
    meta: VersionMeta | None = None,
    pushed_by: str = "",
) -> tuple[int, VersionRow | None]:
    """Make a version visible in one transaction: check that every chunk is stored, write the
    version and its chunk uses, rebalance the family's tiers. ``chunk_size``: the manifest's cut
    (None: read off it); a new family takes it. ``unproven``: stored chunks the pusher has not shown
    it may use; any raises MissingChunks. Returns (rows that changed tier, None), or (0, existing
    row) where the name was committed first."""
    check_named_cut(manifest, chunk_size)
    read = chunk_size if chunk_size is not None else manifest.cut_size()  # a size the manifest follows, or None
    cut = read if read is not None and MIN_CHUNK_SIZE <= read <= MAX_CHUNK_SIZE else None  # no family's otherwise
    with write_tx(reg.engine) as conn:
        exclude_prune(conn)  # the chunks checked below stay until this commit is in
        if cut != read and version_db.find_family(conn, family) is None:
            check_new_cut(family, read)
        fam = version_db.lock_family(conn, family, cut or reg.settings.chunk_size)
        existing = version_db.find_version(conn, family, version)
        if existing is not None:
            return 0, existing
        check_free(conn, family, version)
        if cut != fam.chunk_size:
            check_cut(manifest, family, fam.chunk_size)
        parent_id = None
        if parent is not None:
            prow = version_db.find_version(conn, family, parent, tags=True)
            if prow is None:
                raise NotFound(f"parent version {family}/{parent} does not exist: push it first or drop --parent")
            parent_id = prow.id
        ids = manifest.chunk_ids()
        located = stored_for(conn, family, version, manifest, unproven)
        if unproven is not None:  # only pushes through the server claim chunks
            claim_db.forget(conn, family, ids)  # the family uses them from now on
        version_db.insert_version(
            conn,
            fam.id,
            version,
            parent_id,
            manifest.final_digest(),
            manifest.logical_bytes,
            len(manifest.files),
            manifest.single_file,
            manifest.to_bytes(),
            list(located),
            meta,
            pushed_by,
        )
        changed = tier_db.add_member(conn, fam.id, list(located), fam.member_count, fam.base_quorum)
        version_db.set_member_count(conn, fam.id, fam.member_count + 1)
    return changed, None


def push(
    reg: Store,
    path: Path,
    family: str,
    version: str,
    parent: str | None = None,
    progress: Progress | None = None,
    mend_damaged: bool = False,
    meta: VersionMeta | None = None,
) -> PushResult:
    """Store a version (see the module's docstring), with ``meta`` (description, labels): the
    push's steps (registry/pushing.py) run against this store in this process. ``mend_damaged``:
    read, decode and hash every stored chunk the version needs (its bases down the chains too) and
    store again, plain, those whose bytes are damaged as well as those lost: where the version is
    stored already with this content, that is all the push does; a new version's reused chunks are
    mended so before it commits over them."""
    return pushing.drive(LocalPush(reg, family, version, parent), path, progress, mend_damaged, meta)


class LocalPush:
    """A push's steps (pushing.PushSteps) against the embedded store: the survey, the planning,
    the store and the commit that the server's negotiate, upload and commit call as well
    (registry/store/service.py), without a wire between."""

    def __init__(self, reg: Store, family: str, version: str, parent: str | None) -> None:
        self.reg, self.family, self.version, self.parent = reg, family, version, parent
        self.reader: BasisReader | None = None  # the bases' bytes, for the offer negotiated last

    def check_names(self, meta: VersionMeta | None) -> VersionMeta | None:
        check_push_names(self.family, self.version, self.parent)
        # a library caller's values, checked as the CLI's and the API's are
        return check_meta(meta.description, meta.labels) if meta is not None else None

    def prepare(self) -> int:
        check_parent(self.reg, self.family, self.parent, self.version)
        return family_chunk_size(self.reg, self.family)

    def negotiate(self, job: HashJob, mend_damaged: bool, progress: Progress) -> pushing.Offer:
        reg, family, version = self.reg, self.family, self.version
        draft = job.draft()  # the file digests run on beside the upload
        neg = negotiate_step(reg, family, version, self.parent, draft, None, mend_damaged, progress)
        plan = neg.plan
        if neg.existing is not None:  # other content: refused; this content: the chunks to mend
            done = existing_result(reg, neg.existing, job.manifest(), family, version, time.perf_counter(), neg.layout)
            return pushing.Offer(plan.missing, plan.mend, existing=done)
        self.reader = plan.reader
        return pushing.Offer(plan.missing, plan.mend, plan.bases)

    def upload(self, job: HashJob, offer: pushing.Offer, progress: Progress) -> tuple[int, int]:
        return 0, upload_missing(
            self.reg, job, offer.missing, self.reg.pool, progress, offer.bases, self.reader, offer.mend
        )

    def commit(self, manifest: Manifest, chunk_size: int, meta: VersionMeta | None) -> PushResult:
        return commit_step(
            self.reg, self.family, self.version, self.parent, manifest, chunk_size, None, meta, uploaded=False
        )

    def renegotiate(self, manifest: Manifest) -> pushing.Offer:
        plan = negotiate_step(self.reg, self.family, self.version, self.parent, manifest).plan
        self.reader = plan.reader
        return pushing.Offer(plan.missing, plan.mend, plan.bases)


def committed_result(family: str, version: str, manifest: Manifest, changed: int, t0: float) -> PushResult:
    """A commit's result: the version's chunks, all counted as reused until the push counts its own."""
    n = len(manifest.chunk_ids())
    return PushResult(
        family=family,
        version=version,
        digest=manifest.final_digest(),
        logical_bytes=manifest.logical_bytes,
        new_bytes=0,
        new_chunks=0,
        reused_chunks=n,
        chunks=n,
        files=len(manifest.files),
        tier_changes=changed,
        existed=False,
        seconds=time.perf_counter() - t0,
    )


def existing_result(
    reg: Store, row, manifest: Manifest, family: str, version: str, t0: float, layout: str | None = None
) -> PushResult:
    """The result of a push of ``row``'s name (results.existing_result); ``layout``: the stored
    version's, where the caller read it already (negotiate_step), else read here when the digests match."""
    if row.digest != manifest.digest:
        layout = None
    elif layout is None:
        layout = stored_layout(reg, row)
    return results.existing_result(
        row.digest,
        row.logical_bytes,
        row.file_count,
        manifest.final_digest(),
        len(manifest.chunk_ids()),
        family,
        version,
        t0,
        layout,
        manifest.layout,
    )


def stored_layout(reg: Store, row) -> str:
    """Manifest.layout of the stored version ``row``."""
    with read_tx(reg.engine) as conn:
        return Manifest.from_bytes(version_db.read_manifest(conn, row.id)).layout
