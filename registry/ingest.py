"""Push: plan -> hash -> dedup -> encode -> write packs -> commit -> rebalance.

Atomicity: chunk rows are recorded only after their pack is durable, and the version row, its chunk
uses and the tier changes are written in one transaction at the end. A push that dies midway leaves
no version; the chunks it did store are recorded, so a re-run sends only what is still missing.

Concurrency: uploads of two pushes run side by side; a chunk both of them send is recorded once
(the first pack wins). Commits to one family are serialised by its row lock (db/versions.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from registry import codec
from registry.blobs.packs import PackWriter, StoredChunk
from registry.chunking import ChunkRef, MappedFile, chunk_sha256, hash_file, plan_cuts
from registry.db import chunks as chunk_db
from registry.db import tiers as tier_db
from registry.db import versions as version_db
from registry.db.engine import read_tx, write_tx
from registry.errors import Conflict, NotFound
from registry.manifest import BLOB, SAFETENSORS, FileEntry, Manifest
from registry.names import check_name
from registry.progress import NullProgress, Progress
from registry.source import Source, open_source

ENCODE_WINDOW = 64  # chunks in flight to the encoder pool: bounds memory to a few packs


@dataclass(frozen=True)
class PushResult:
    family: str
    version: str
    digest: str
    logical_bytes: int
    new_bytes: int  # stored (encoded) bytes this push added
    new_chunks: int
    reused_chunks: int
    chunks: int
    files: int
    tier_changes: int
    existed: bool  # the same version with the same digest was already there: nothing was done
    seconds: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def hash_source(source: Source, chunk_size: int, pool: ThreadPoolExecutor, progress: Progress) -> Manifest:
    """Chunk ids and digests of every file of ``source``; reads each file once, through mmap."""
    progress.start("hash", sum(f.size for f in source.files))
    entries = []
    for f in source.files:
        with MappedFile(f.path) as mf:
            cuts = plan_cuts(mf.size, f.header, chunk_size)
            refs, sha = hash_file(mf, cuts, pool, lambda n: progress.advance("hash", n))
        entries.append(
            FileEntry(
                path=f.rel, kind=SAFETENSORS if f.header else BLOB, size=f.size, sha256=sha,
                chunks=tuple(refs), tensors=f.header.tensors if f.header else (),
            )
        )
    return Manifest(files=tuple(entries), single_file=source.single_file)


def _encode(view: memoryview, itemsize: int) -> tuple[str, str, bytes]:
    sha = chunk_sha256(view)
    encoding, payload = codec.encode(view, itemsize)
    return sha, encoding, payload


def _windowed(pool: ThreadPoolExecutor, jobs: Iterator, window: int):
    """pool.map with at most ``window`` jobs in flight, results in order."""
    pending = []
    for fn, args, meta in jobs:
        pending.append((pool.submit(fn, *args), meta))
        if len(pending) >= window:
            fut, m = pending.pop(0)
            yield fut.result(), m
    for fut, m in pending:
        yield fut.result(), m


def upload_missing(reg, source: Source, manifest: Manifest, missing: set[str], pool: ThreadPoolExecutor, progress: Progress) -> int:
    """Encode and store the chunks in ``missing``; returns the stored bytes this push added."""
    added = 0

    def on_flush(pack_id: str, size: int, stored: list[StoredChunk]) -> None:
        nonlocal added
        with write_tx(reg.engine) as conn:
            added += chunk_db.record_pack(conn, pack_id, size, stored)

    writer = PackWriter(reg.blobs, reg.settings.pack_size, on_flush)
    todo = set(missing)
    send_total = 0
    for f in manifest.files:
        for c in f.chunks:
            if c.id in todo:
                send_total += c.size
                todo.discard(c.id)
    progress.start("send", send_total)
    todo = set(missing)
    for src, entry in zip(source.files, manifest.files):
        wanted: list[ChunkRef] = []
        for c in entry.chunks:
            if c.id in todo:
                wanted.append(c)
                todo.discard(c.id)
        if not wanted:
            continue
        with MappedFile(src.path) as mf:
            jobs = ((_encode, (mf.view[c.offset : c.offset + c.size], c.itemsize), c) for c in wanted)
            for (sha, encoding, payload), c in _windowed(pool, jobs, ENCODE_WINDOW):
                writer.add(c.id, c.size, sha, encoding, payload)
                progress.advance("send", c.size)
            writer.flush()  # the mmap closes next: nothing may still point into it
    writer.flush()
    return added


def push(reg, path: Path, family: str, version: str, parent: str | None = None, progress: Progress | None = None) -> PushResult:
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    check_name("family", family)
    check_name("version", version)
    if parent is not None:
        check_name("version", parent)
    source = open_source(Path(path))  # every input check happens before the registry is touched
    with read_tx(reg.engine) as conn:
        if parent is not None and version_db.find_version(conn, family, parent) is None:
            raise NotFound(f"parent version {family}/{parent} does not exist: push it first or drop --parent")
    pool = reg.pool
    manifest = hash_source(source, reg.settings.chunk_size, pool, progress)
    ids = manifest.chunk_ids()
    sizes = manifest.chunk_sizes()
    n_chunks = len(ids)

    with read_tx(reg.engine) as conn:
        existing = version_db.find_version(conn, family, version)
        missing = chunk_db.missing_ids(conn, ids)
    if existing is not None:
        return _existing(existing, manifest, family, version, n_chunks, t0)
    progress.start("skip", sum(sizes[i] for i in ids if i not in missing))
    progress.advance("skip", sum(sizes[i] for i in ids if i not in missing))
    added = upload_missing(reg, source, manifest, missing, pool, progress)

    with write_tx(reg.engine) as conn:
        fam = version_db.lock_family(conn, family, create=True)
        again = version_db.find_version(conn, family, version)
        if again is not None:  # a concurrent push of the same name committed first
            return _existing(again, manifest, family, version, n_chunks, t0)
        parent_id = None
        if parent is not None:
            prow = version_db.find_version(conn, family, parent)
            if prow is None:
                raise NotFound(f"parent version {family}/{parent} was deleted during the push")
            parent_id = prow.id
        still_missing = chunk_db.missing_ids(conn, ids)
        if still_missing:
            raise NotFound(f"{len(still_missing)} chunks vanished during the push: run it again")
        version_db.insert_version(
            conn, fam.id, version, parent_id, manifest.digest, manifest.logical_bytes, len(manifest.files),
            manifest.single_file, manifest.to_bytes(), ids,
        )
        changed = tier_db.add_member(conn, fam.id, ids, fam.member_count, fam.base_quorum)
        version_db.set_member_count(conn, fam.id, fam.member_count + 1)
    return PushResult(
        family=family, version=version, digest=manifest.digest, logical_bytes=manifest.logical_bytes,
        new_bytes=added, new_chunks=len(missing), reused_chunks=n_chunks - len(missing), chunks=n_chunks,
        files=len(manifest.files), tier_changes=changed, existed=False, seconds=time.perf_counter() - t0,
    )


def _existing(row, manifest: Manifest, family: str, version: str, n_chunks: int, t0: float) -> PushResult:
    if row.digest != manifest.digest:
        raise Conflict(
            f"version {family}/{version} already exists with other content ({row.digest}): versions are immutable, push under a new name"
        )
    return PushResult(
        family=family, version=version, digest=row.digest, logical_bytes=row.logical_bytes, new_bytes=0,
        new_chunks=0, reused_chunks=n_chunks, chunks=n_chunks, files=row.file_count, tier_changes=0,
        existed=True, seconds=time.perf_counter() - t0,
    )
