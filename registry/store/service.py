"""The server side of the push and pull protocol, free of any web framework.

api/ routes call these; they take already-authorised requests and speak in registry values:
- ``negotiate``: which of a manifest's chunks the registry lacks (and whether the version exists)
- ``receive_batch``: store uploaded chunks after re-hashing each one (a mismatch stores nothing)
- ``commit``: make the version visible, after checking the manifest against its stored header chunks
- ``stream_chunks``: the stored payloads of a family's chunks, as a streamed batch
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

from mfsreg.registry.auth import Principal
from mfsreg.registry.blobs.packs import StoredChunk
from mfsreg.registry.config import check_chunk_size
from mfsreg.registry.context import Store
from mfsreg.registry.db import chunks as chunk_db
from mfsreg.registry.db import claims as claim_db
from mfsreg.registry.db import rebalance as tier_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import read_tx, write_tx
from mfsreg.registry.errors import (
    IntegrityError,
    InvalidModel,
    InvalidRequest,
    MissingChunks,
    NotFound,
    StorageError,
    TooLarge,
    shown,
)
from mfsreg.registry.format import codec
from mfsreg.registry.format.manifest import MAX_CHUNK_BYTES, SAFETENSORS, Manifest, parse_doc
from mfsreg.registry.format.rebuild import decode_verified
from mfsreg.registry.format.safetensors import parse_header
from mfsreg.registry.format.wire import (
    MAX_UPLOAD_CHUNKS,
    RAW_PER_BODY,
    Entry,
    Located,
    check_id,
    encode_index,
    parse_batch,
)
from mfsreg.registry.meta import VersionMeta
from mfsreg.registry.names import check_name
from mfsreg.registry.parallel import windowed_map
from mfsreg.registry.results import PushResult, timestamp
from mfsreg.registry.store import access
from mfsreg.registry.store.check import unreadable_or_damaged
from mfsreg.registry.store.deltas import BasisReader, cap_depth
from mfsreg.registry.store.ingest import (
    check_named_cut,
    check_parent,
    check_push_names,
    commit_step,
    negotiate_step,
    store_chunks,
)
from mfsreg.registry.store.lost import lost_packs, unreadable
from mfsreg.registry.store.tiers import TIERS


def _check_encoding(name: str) -> None:
    if not codec.is_known(name):
        raise InvalidRequest(f"unknown chunk encoding {shown(name, 40)}")


def negotiate(
    reg: Store,
    family: str,
    version: str,
    doc: object,
    parent: str | None = None,
    who: Principal | None = None,
    mend_damaged: bool = False,
) -> dict:
    """Which chunks to upload (those not stored, and those ``who`` may not use without sending
    them: registry/store/access.py), and for each a suggested basis, against which the server may store
    it as a delta. The manifest may be a draft (file sha256s null). ``mend`` lists the missing
    chunks that are stored, in a lost pack or, with ``mend_damaged``, damaged; where the version
    exists, see _negotiate_existing.
    See docs/design/protocol.md."""
    check_push_names(family, version, parent)
    manifest = parse_doc(doc, draft=True)
    check_parent(reg, family, parent, version)  # before anything is uploaded, as an embedded push does
    neg = negotiate_step(reg, family, version, parent, manifest, who, mend_damaged)  # the embedded push's own step
    ids, sizes, plan = manifest.chunk_ids(), manifest.chunk_sizes(), neg.plan
    # mended chunks are listed as missing, so the client sends them and the upload stores them
    # again (receive_batch reads them again first); where the version exists, only those
    return {
        "bases": plan.bases,
        "digest": manifest.digest,
        "exists": neg.existing is not None,
        "existing_digest": neg.existing.digest if neg.existing is not None else None,
        "existing_layout": neg.layout,
        "missing": [i for i in ids if i in plan.missing],
        "mend": [i for i in ids if i in plan.mend],
        "mend_damaged": mend_damaged,  # a server older than it leaves this out or says false: see the client
        "missing_bytes": sum(sizes[i] for i in plan.missing),
        "chunks": len(ids),
    }


def _parsed_batch(body: bytes, max_body: int) -> list:
    """An upload's entries, refused whole on an id sent twice, a delta encoding, a size out of
    range, or more decoded bytes than RAW_PER_BODY x MFSREG_MAX_BODY."""
    entries = list(parse_batch(body, MAX_UPLOAD_CHUNKS))
    seen: set[str] = set()
    for e, _ in entries:
        # Every copy would have to be verified, and only one stored: a client sends each chunk once
        # (hashing.encoded_chunks), so a repeated id is refused whatever its copies hold.
        if e.id in seen:
            raise InvalidRequest(f"chunk {e.id} appears more than once in the batch: send each chunk once")
        seen.add(e.id)
        _check_encoding(e.encoding)
        if codec.is_delta(e.encoding):
            raise InvalidRequest("delta-encoded uploads are not accepted: send raw or zstd chunks")
        if not 0 < e.size <= MAX_CHUNK_BYTES:
            raise InvalidRequest(f"chunk {e.id}: size {e.size} is out of range")
    limit = max(RAW_PER_BODY * max_body, MAX_CHUNK_BYTES)  # the largest chunk always fits
    decoded = sum(e.size for e, _ in entries)
    if decoded > limit:
        raise TooLarge(
            f"the batch's chunks add up to {decoded:,} bytes once decoded, over this "
            f"server's {limit:,} ({RAW_PER_BODY}x MFSREG_MAX_BODY): send fewer chunks per request"
        )
    return entries


def _verified(item):
    """(entry, payload, raw bytes) of an uploaded chunk, decoded and checked against its id."""
    e, payload = item
    try:
        raw = decode_verified(Located(e.id, e.size, e.encoding, e.length), payload)
    except IntegrityError:
        raise IntegrityError(f"chunk {e.id}: bytes do not match the id; the batch was refused") from None
    return e, payload, raw


def _encoded(basis_of: dict, reader: BasisReader, located: dict, item):
    """(entry, encoding, payload, basis id, depth) to store: a delta against the basis the client
    named where that is smaller than what was sent, else what was sent."""
    e, payload, raw = item
    basis_id = basis_of.get(e.id)
    basis = reader.usable(basis_id) if basis_id is not None else None
    if basis is not None:
        # The client's compressed upload is the plain candidate; a raw upload may still compress.
        plain = (e.encoding, payload) if e.encoding != codec.RAW else None
        encoding, out, is_delta = codec.best_encoding(raw, e.itemsize, basis, plain)
        if is_delta and len(out) < e.length:
            return e, encoding, out, basis_id, located[basis_id].depth + 1
    return e, e.encoding, bytes(payload), None, 0


def receive_batch(reg: Store, family: str, body: bytes, who: Principal | None = None) -> dict:
    """Verify and store one uploaded batch. Every chunk is decoded and re-hashed against its id; a
    mismatch, or an id sent twice, refuses the whole batch before a byte is written. A chunk naming
    a basis its family uses is stored as a delta where that is smaller. Through a scoped ``who``
    the chunks are claimed for ``family``, stored ones compared byte for byte, and ``new_bytes`` is
    the bytes sent. Raises TooLarge past RAW_PER_BODY x MFSREG_MAX_BODY decoded.
    See docs/design/protocol.md."""
    entries = _parsed_batch(body, reg.settings.max_body)
    scoped = not access.reads_everything(who)
    missing, allowed, located, proving, stored_here = _batch_rows(reg, family, who, entries)
    mend = _batch_mends(reg, entries, stored_here, proving)
    reader = BasisReader(located, reg.read_payloads, decode_verified, locate=reg.locate)
    # Every chunk is verified, the stored ones too: an upload is how a scoped token proves it
    # holds a chunk another family stored (registry/store/access.py); only the missing ones are stored.
    todo_ids = {e.id for e, _ in entries if e.id in missing} | mend
    basis_of = {
        e.id: cap_depth(e.basis_id, located)
        for e, _ in entries
        if e.id in todo_ids and e.id not in mend and e.basis_id in allowed
    }

    encode = functools.partial(_encoded, basis_of, reader, located)

    # All verified before anything is written; the bases' reads (network) overlap the verification.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsreg-bases") as io:
        fetching = io.submit(reader.prefetch, list(basis_of.values()))
        # raw bytes are kept for the chunks to store and those to compare, no others
        checked = [
            v if v[0].id in todo_ids or v[0].id in proving else (v[0], v[1], None)
            for v in windowed_map(reg.pool, _verified, entries)
        ]
        fetching.result()
    verified = [v for v in checked if v[0].id in todo_ids]
    proved = proving - access.compare_stored(
        reg, {e.id: raw for e, _, raw in checked if e.id in proving and raw is not None}
    )
    del checked
    ready = list(windowed_map(reg.pool, encode, verified))
    uploaded = {e.id: (e.encoding, payload) for e, payload, _ in verified}

    def items(wanted: set[str], gone: set[str] | None):
        for e, encoding, payload, basis_id, depth in ready:
            if e.id not in wanted:
                continue
            if gone and basis_id in gone:  # a prune deleted the basis meanwhile: store what the client sent
                (encoding, payload), basis_id, depth = uploaded[e.id], None, 0
            yield e.id, e.size, encoding, bytes(payload), basis_id, depth

    added = store_chunks(reg, todo_ids, basis_of.values(), items, mend)
    if scoped:
        with write_tx(reg.engine) as conn:
            claim_db.record(conn, family, sorted(todo_ids | proved))
        # What the registry held, and how it stores it, is not this token's to learn: new_bytes
        # counts every chunk sent, at the size sent, whether stored now, before, or as a delta.
        added = sum(e.length for e, _ in entries)
    return {"received": len(entries), "new_bytes": added}


def _batch_rows(reg: Store, family: str, who: Principal | None, entries: list) -> tuple:
    """What the database says of an upload's chunks: (ids not stored, the bases named that this
    family uses, where those are stored, stored ids a scoped ``who`` must prove it holds, where
    the stored ones are)."""
    hinted = list({e.basis_id for e, _ in entries if e.basis_id})
    with read_tx(reg.engine) as conn:
        missing = chunk_db.missing_ids(conn, [e.id for e, _ in entries])
        fam = version_db.find_family(conn, family)
        # only bases this family already uses: a push must not pull another family's bytes in
        allowed = tier_db.family_chunk_ids(conn, fam.id, hinted) if fam else set()
        located = chunk_db.locate_closure(conn, allowed)
        # stored chunks a scoped token has not shown it may use: compared with the stored bytes later
        proving = access.unproven(conn, who, family, [e.id for e, _ in entries if e.id not in missing])
        stored_here = chunk_db.locate_closure(conn, [e.id for e, _ in entries if e.id not in missing])
    return missing, allowed, located, proving, stored_here


def _batch_mends(reg: Store, entries: list, stored_here: dict, proving: set[str]) -> set[str]:
    """The stored chunks of an upload to store again: in a pack the blob store lost (negotiate
    listed them as missing), stored again plain; or whose bytes are damaged (negotiate listed them,
    asked to mend_damaged). Refused where a scoped token would mend a chunk it has not proved it
    holds: its bytes could not be compared with the stored ones (access.compare_stored), and an
    xxh3 id alone must not decide what another family's pulls get."""
    mend, lost = unreadable(reg, stored_here, [e.id for e, _ in entries if e.id in stored_here])
    # damaged ones: never one a scoped token must prove, which compare_stored reads back anyway
    mend |= _damaged_uploads(reg, [e.id for e, _ in entries if e.id in stored_here and e.id not in mend | proving])
    if mend & proving:
        pack_id, why = next(iter(lost.items()))
        advice = "a push through this token cannot mend it; tell the registry's operator"
        raise StorageError(
            f"the registry's storage lost data ({why}): {advice}",
            public=f"the registry's storage lost data (pack {pack_id}): {advice}",
        )
    return mend


def _damaged_uploads(reg: Store, ids: list[str]) -> set[str]:
    """Those of the stored chunks ``ids`` (uploaded again, in packs the store holds, and not ones a
    scoped token must prove it holds) whose stored bytes, or a basis's, do not read back: read,
    decoded and hashed, to be stored again. The server keeps no state between the negotiation and
    the upload, so it reads them again rather than take the client's word.
    See docs/design/check.md."""
    if not ids:
        return set()
    with read_tx(reg.engine) as conn:
        located = chunk_db.locate_closure(conn, ids)
    return unreadable_or_damaged(reg, located, ids)[0]


def _check_headers(reg: Store, manifest: Manifest, who: Principal | None = None, family: str = "") -> None:
    """Each safetensors file's first chunk must be a header that describes exactly its tensors.
    One decoded header is held at a time: a manifest may name many headers of up to 100 MB each."""
    files_of: dict[str, list] = {}
    for f in manifest.files:
        if f.kind == SAFETENSORS:
            files_of.setdefault(f.chunks[0].id, []).append(f)
    with read_tx(reg.engine) as conn:
        # a head ``who`` may not use is not read: its parse errors would describe another family's model
        usable = set(files_of) - access.unproven(conn, who, family, list(files_of))
    # a head not stored (or not usable) is left to commit_version, which reports missing chunks.
    # A head may be stored as a delta (an uploader may name any basis the family uses): decoded
    # against its bases, one head at a time.
    for head in [i for i in files_of if i in usable]:
        raw = access.stored_bytes(reg, [head], "check this manifest's headers against").get(head)
        if raw is None:
            continue
        for f in files_of[head]:
            try:
                parsed = parse_header(raw, f.size, f.path)
            except InvalidModel as exc:
                raise InvalidRequest(f"manifest does not match its header: {exc}") from None
            if parsed.header_size != f.chunks[0].size or tuple(parsed.tensors) != tuple(f.tensors):
                raise InvalidRequest(f"manifest does not match its header: {f.path}: tensors differ")


def _commit_manifest(
    reg: Store, family: str, version: str, parent: str | None, doc: object, chunk_size: int | None, who
) -> Manifest:
    """A commit's manifest, checked: names, document, readable stored chunks, safetensors headers,
    the cut and the parent; what commit_version would refuse, refused before anything is written."""
    check_push_names(family, version, parent)
    manifest = parse_doc(doc)
    _check_readable(reg, family, version, manifest)  # first: the header check below reads stored heads
    _check_headers(reg, manifest, who, family)
    if chunk_size is not None:
        check_chunk_size(chunk_size, "chunk_size")
    check_named_cut(manifest, chunk_size)
    check_parent(reg, family, parent, version)
    return manifest


def commit(
    reg: Store,
    family: str,
    version: str,
    parent: str | None,
    doc: object,
    chunk_size: int | None = None,
    who: Principal | None = None,
    meta: VersionMeta | None = None,
) -> PushResult:
    """Step 3 of a push (docs/design/protocol.md): the version appears, with ``meta``, recorded as
    pushed by ``who``."""
    manifest = _commit_manifest(reg, family, version, parent, doc, chunk_size, who)
    return commit_step(reg, family, version, parent, manifest, chunk_size, who, meta)  # the embedded push's own step


def _check_readable(reg: Store, family: str, version: str, manifest: Manifest) -> None:
    """Before a commit: every pack the version's chunks (and their bases) lie in is in storage and
    long enough, one size lookup per pack. A chunk in a lost pack is refused as missing, which the
    client answers by negotiating again (listed missing there), uploading it (mended) and
    committing again: a version appears only over bytes that can be read."""
    ids = manifest.chunk_ids()
    with read_tx(reg.engine) as conn:
        if version_db.find_version(conn, family, version) is not None:
            return  # compared by digest (a client retrying after a lost answer): nothing is committed
        located = chunk_db.locate_closure(conn, ids)
    bad, lost = unreadable(reg, located, [i for i in ids if i in located])
    if bad:
        raise MissingChunks(
            f"{len(bad)} chunks of {family}/{version} lie in a pack the registry's storage lost "
            f"({next(iter(lost.values()))}): upload them, then commit again"
        )


def plan_download(reg: Store, family: str, ids: list[str]) -> list[StoredChunk]:
    """The stored chunks to stream, after checking they belong to ``family`` (a token scoped to one
    family must not read another family's bytes by naming their ids)."""
    ids = [check_id(i) for i in dict.fromkeys(ids)]  # a 400 for what cannot be an id, not "not part of"
    with read_tx(reg.engine) as conn:
        located = chunk_db.locate_in_family(conn, family, ids)
        outside = [i for i in ids if i not in located]
        if outside or not ids:
            version_db.get_family(conn, family)  # a family that does not exist is named as such
        if outside:
            raise NotFound(f"{len(outside)} requested chunks are not part of family {family!r} (first: {outside[0]})")
    # pack order lets the blob reads coalesce
    return sorted((located[i] for i in ids), key=lambda c: (c.pack_id, c.offset))


def check_packs(reg: Store, chunks: list[StoredChunk]) -> None:
    """Every pack the batch reads is in storage and reaches its last chunk, checked before the
    stream starts: a store that lost (or cut short) a pack is answered with an error the client
    can show, instead of a response that breaks off halfway. One size lookup per pack (a HEAD on
    S3; registry/store/lost.py)."""
    for pack_id, why in lost_packs(reg, chunks).items():
        raise StorageError(
            f"the registry's storage lost data ({why}): tell the registry's operator",
            public=f"the registry's storage lost data (pack {pack_id}): tell the registry's operator",
        )


# A batch of at most this many stored bytes is read whole before it is sent, with no HEAD per pack
# first: a node's load asks for fetch.BATCH_BYTES raw bytes at most (plus any bases it lacks). A
# streamed batch holds a pack's ranges at a time, which may be as large. (At 8 MiB a 1.16 GB
# member's load took 0.414 s instead of 0.384: docs/benchmarks.md.)
EAGER_BYTES = 32 << 20
STREAM_PIECE = 1 << 20  # bytes a download's answer sends at a time (at least: whole payloads)


def stream_chunks(reg: Store, chunks: list[StoredChunk]) -> Iterator[bytes]:
    """The batch as the wire sends it (registry/format/wire.py), its packs found whole first: a lost or cut
    pack is answered with an error the client can show, not a stream that breaks off halfway. A
    small batch (EAGER_BYTES) is read whole before the answer starts, which finds that too, and
    saves the size lookups (a HEAD per pack on S3: 7-10 ms of a 30 ms batch of a node's few changed
    chunks, measured on moto); a bigger one (from a client that asks for more at once) is checked
    by check_packs and then streamed. A pack that disappears while a stream runs can still only
    break it off."""
    if sum(c.stored_size for c in chunks) <= EAGER_BYTES:
        payloads: Iterator | list = _read_whole(reg, chunks)
    else:
        check_packs(reg, chunks)
        payloads = reg.read_payloads(chunks)

    def stream() -> Iterator[bytes]:
        # payloads joined into pieces of STREAM_PIECE bytes or more: each piece the server sends is
        # a hop to a worker thread and a pass through every middleware's send, which for a batch of
        # 20 payloads of 100 KB cost about as much as reading them from S3
        parts: list = [encode_index(Entry(c.id, c.size, c.encoding, c.stored_size, c.basis_id) for c in chunks)]
        held = len(parts[0])
        for _c, payload in payloads:
            parts.append(payload)
            held += len(payload)
            if held >= STREAM_PIECE:
                yield b"".join(parts)
                parts, held = [], 0
        if parts:
            yield b"".join(parts)

    return stream()


def _read_whole(reg: Store, chunks: list[StoredChunk]) -> list:
    """Every payload of ``chunks``, read now; a pack missing or cut short raises check_packs' error."""
    try:
        got = list(reg.read_payloads(chunks))
        if all(len(p) == c.stored_size for c, p in got):
            return got
    except NotFound:
        pass
    check_packs(reg, chunks)  # says which pack is lost, in the public words
    raise StorageError(
        "the registry's storage answered with fewer bytes than a pack holds: tell the registry's operator"
    )


def version_doc(reg: Store, family: str, version: str, if_none_match: str | None = None) -> tuple[dict | None, str]:
    """(document, tag) of a version for a node: its manifest, and per chunk it needs (its own and
    the bases of its deltas) [encoding, stored bytes, basis id, raw bytes, tier], read in one
    transaction (four queries). The tag, an HTTP entity tag, holds the version's row id, its
    family's epoch and its digest. Where ``if_none_match`` names the current tag, the document is
    None, after one query. The manifest and the chunk table, which the tag fixes, are kept in memory
    by tag (``reg.documents``): a fleet of nodes asking for the same member costs one query each
    after the first (the two reads were half of the server's time on a version request).
    See docs/design/node-cache.md."""
    check_name("family", family)
    check_name("version", version)
    with read_tx(reg.engine) as conn:
        found = version_db.find_version_and_epoch(conn, family, version)
        if found is None:
            version_db.get_version(conn, family, version)  # says which of the two is missing
            raise NotFound(f"version {family}/{version} was being changed: ask again")  # committed just now
        row, epoch = found
        tag = f'"{row.id}.{epoch}.{row.digest.removeprefix("sha256:")[:16]}"'
        if if_none_match is not None and _tag_matches(if_none_match, tag):
            return None, tag
        parts = reg.documents.get(tag)
        if parts is None:
            parts = (
                Manifest.doc_of(version_db.read_manifest(conn, row.id)),
                chunk_db.version_chunk_table(conn, row.id),
            )
            reg.documents.put(tag, parts)
        manifest, table = parts
    doc = {
        "family": row.family,
        "version": row.name,
        "parent": row.parent,
        "digest": row.digest,
        "logical_bytes": row.logical_bytes,
        "files": row.file_count,
        "single_file": row.single_file,
        "created_at": timestamp(row.created_at),
        "description": row.description,
        "labels": row.labels,
        "pushed_by": row.pushed_by,
        "manifest": manifest,
        "chunks": table,
    }
    return doc, tag


def _tag_matches(if_none_match: str, tag: str) -> bool:
    """RFC 9110's weak comparison of If-None-Match (a list of tags, or *) with ``tag``."""
    tags = {t.strip().removeprefix("W/") for t in if_none_match.split(",")}
    return "*" in tags or tag in tags


def tier_doc(reg: Store, family: str, tier: str | None) -> dict:
    """A family's chunks of one tier (or all), with what a node needs to fetch them."""
    if tier is not None and tier not in TIERS:
        raise InvalidRequest(f"unknown tier {shown(tier, 40)}: use one of {', '.join(TIERS)}")
    check_name("family", family)
    with read_tx(reg.engine) as conn:
        fam = version_db.get_family(conn, family)
        return {"family": family, "tier": tier, "chunks": chunk_db.family_chunk_table(conn, fam.id, tier)}
