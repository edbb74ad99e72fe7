"""Hashing a push's input into a manifest, and encoding the chunks to send.

Shared by the embedded push (registry/ingest.py) and the node-side client (registry/client/), so it
touches no database: it reads files, cuts them, hashes and encodes.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from collections.abc import Iterator

from registry import codec
from registry.chunking import ChunkRef, MappedFile, chunk_sha256, hash_file, plan_cuts
from registry.manifest import BLOB, SAFETENSORS, FileEntry, Manifest
from registry.parallel import windowed_map
from registry.progress import Progress
from registry.source import Source

ENCODE_WINDOW = 64  # chunks in flight to the encoder pool: bounds memory to a few packs


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


def missing_bytes(manifest: Manifest, missing: set[str]) -> int:
    sizes = manifest.chunk_sizes()
    return sum(sizes[i] for i in missing if i in sizes)


def encoded_chunks(source: Source, manifest: Manifest, wanted: set[str], pool: ThreadPoolExecutor,
                   ) -> Iterator[tuple[ChunkRef, str, str, bytes]]:
    """(chunk, sha256, encoding, payload) for each chunk in ``wanted``, once each, in file order.

    Encoding runs on the pool (zstd and hashlib release the GIL). A file's mmap stays open until
    all of its chunks have been yielded, so callers must consume each item before the next file.
    """
    todo = set(wanted)
    for src, entry in zip(source.files, manifest.files):
        chosen: list[ChunkRef] = []
        for c in entry.chunks:
            if c.id in todo:
                chosen.append(c)
                todo.discard(c.id)
        if not chosen:
            continue
        with MappedFile(src.path) as mf:
            def job(c: ChunkRef, view=mf.view):
                return c, *_encode(view[c.offset : c.offset + c.size], c.itemsize)

            yield from windowed_map(pool, job, chosen, ENCODE_WINDOW)
