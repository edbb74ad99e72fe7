"""Hashing a push's input into a manifest, and encoding the chunks to send.

Shared by the embedded push (registry/store/ingest.py) and the node-side client (registry/client/), so it
touches no database: it reads files, cuts them, hashes and encodes.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from mfsreg.registry.errors import InvalidModel
from mfsreg.registry.format import codec
from mfsreg.registry.format.chunking import ChunkRef, MappedFile, chunk_id, file_sha256, plan_cuts
from mfsreg.registry.format.manifest import BLOB, SAFETENSORS, FileEntry, Manifest
from mfsreg.registry.format.source import Source
from mfsreg.registry.parallel import windowed_map
from mfsreg.registry.progress import Progress

ENCODE_WINDOW = 64  # chunks in flight to the encoder pool: bounds memory to a few packs


class HashJob:
    """Hashing of a push's input, with the file digests still running.

    Chunk ids come first (xxh3-128 runs at about 20 GB/s on this thread); the whole-file sha256s
    (about 1.8 GB/s, the slowest step of a mostly-duplicate push) run on their own thread and are
    only awaited by ``manifest()``. Meanwhile the caller can look up and encode the missing chunks
    on the pool, so encoding overlaps the digest instead of following it.
    """

    def __init__(self, source: Source, chunk_size: int, progress: Progress):
        self.source = source
        self._digests = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsreg-digest")
        self._cancel = (
            threading.Event()
        )  # set by close(): a push that fails or is interrupted does not wait for the digest
        self._maps: list[MappedFile] = []
        self._futures = []
        self.file_chunks: list[tuple[ChunkRef, ...]] = []
        try:
            progress.start("hash", sum(f.size for f in source.files))
            for f in source.files:
                mf = MappedFile(f.path)
                self._maps.append(mf)
                self._futures.append(self._digests.submit(file_sha256, mf.view, self._cancel))
                cuts = plan_cuts(mf.size, f.header, chunk_size)
                refs = []
                for c in cuts:
                    refs.append(ChunkRef(chunk_id(mf.view[c.offset : c.offset + c.size]), c.offset, c.size, c.itemsize))
                    progress.advance("hash", c.size)
                self.file_chunks.append(tuple(refs))
        except BaseException:
            self.close(failing=True)
            raise

    @property
    def views(self) -> list[memoryview]:
        """Each file's bytes (mmapped), valid until ``close()``."""
        return [mf.view for mf in self._maps]

    def chunk_ids(self) -> list[str]:
        return list(dict.fromkeys(c.id for refs in self.file_chunks for c in refs))

    def chunk_sizes(self) -> dict[str, int]:
        return {c.id: c.size for refs in self.file_chunks for c in refs}

    @property
    def logical_bytes(self) -> int:
        return sum(f.size for f in self.source.files)

    def manifest(self) -> Manifest:
        """The manifest; waits for the file digests, then checks that no file changed while it was
        read (what a commit needs: the ids, digests and encoded chunks all read the same bytes)."""
        digests = [fut.result() for fut in self._futures]
        for mf in self._maps:
            why = mf.changed()
            if why is not None:
                raise changed_while_pushed(mf.path, why)
        return self._manifest(digests)

    def draft(self) -> Manifest:
        """The manifest without waiting: file digests not yet computed are None (enough to ask which
        chunks are missing and to send them; a commit needs ``manifest()``)."""
        return self._manifest([fut.result() if fut.done() else None for fut in self._futures])

    def _manifest(self, digests: list[str | None]) -> Manifest:
        entries = []
        for f, refs, sha in zip(self.source.files, self.file_chunks, digests):
            entries.append(
                FileEntry(
                    path=f.rel,
                    kind=SAFETENSORS if f.header else BLOB,
                    size=f.size,
                    sha256=sha,
                    chunks=refs,
                    tensors=f.header.tensors if f.header else (),
                )
            )
        return Manifest(files=tuple(entries), single_file=self.source.single_file)

    def close(self, failing: bool = False) -> None:
        """Stop the digests and unmap the files (``failing``: see MappedFile.close)."""
        self._cancel.set()
        for fut in self._futures:
            fut.cancel()
        self._digests.shutdown(wait=True)  # a running digest still reads its mmap
        for mf in self._maps:
            mf.close(failing)

    def __enter__(self) -> HashJob:
        return self

    def __exit__(self, exc_type, *exc) -> None:
        self.close(failing=exc_type is not None)


def changed_while_pushed(path, why: str) -> InvalidModel:
    return InvalidModel(
        f"{path} changed while it was being pushed ({why}): nothing was committed; push it "
        "again once whatever writes it has finished"
    )


def hash_source(source: Source, chunk_size: int, progress: Progress) -> Manifest:
    """Chunk ids and digests of every file of ``source``; reads each file once, through mmap."""
    with HashJob(source, chunk_size, progress) as job:
        return job.manifest()


def missing_bytes(manifest: Manifest | HashJob, missing: set[str]) -> int:
    sizes = manifest.chunk_sizes()
    return sum(sizes[i] for i in missing if i in sizes)


def encoded_chunks(
    job: HashJob,
    wanted: set[str],
    pool: ThreadPoolExecutor,
    bases: dict[str, str] | None = None,
    basis_raw: Callable[[str], bytes | None] | None = None,
) -> Iterator[tuple[ChunkRef, str, bytes, str | None]]:
    """(chunk, encoding, payload, basis id or None) for each chunk in ``wanted``, once each, in
    file order, encoded on ``pool``: a delta against ``bases[id]`` (its bytes from ``basis_raw``,
    None where gone) where that is smaller. Each chunk, read through the job's mmaps, is hashed
    again once encoded: raises InvalidModel where its bytes changed.
    See docs/design/format.md.
    """
    bases = bases or {}
    todo = set(wanted)
    for f, view, refs in zip(job.source.files, job.views, job.file_chunks):
        chosen: list[ChunkRef] = []
        for c in refs:
            if c.id in todo:
                chosen.append(c)
                todo.discard(c.id)
        if not chosen:
            continue

        def encode_one(c: ChunkRef, view=view, path=f.path):
            basis_id = bases.get(c.id)
            basis = basis_raw(basis_id) if basis_id is not None and basis_raw is not None else None
            data = view[c.offset : c.offset + c.size]
            encoding, payload, is_delta = codec.best_encoding(data, c.itemsize, basis)
            if chunk_id(data) != c.id:
                raise changed_while_pushed(path, f"the bytes at offset {c.offset} are not those hashed first")
            return c, encoding, payload, basis_id if is_delta else None

        yield from windowed_map(pool, encode_one, chosen, ENCODE_WINDOW)
