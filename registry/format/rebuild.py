"""Rebuild: manifest -> exact file bytes, every chunk verified, in memory and in the file.

Each file is written to a temp name beside its target, chunk by chunk at its offsets (a chunk used
twice in a file is fetched once). Chunk payloads are decoded on a thread pool, and each decoded
chunk's xxh3-128 must equal its id; once written, each is checked again where it lies in the file
(registry/format/filecheck.py), and only then is the file synced. The files of a version are renamed into
place together once all of them are written and checked (registry/format/durable.py's Placing).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TypeVar, cast

from mfsreg.registry.blobs.packs import ChunkForm
from mfsreg.registry.errors import IntegrityError, InvalidRequest
from mfsreg.registry.format import codec, filecheck
from mfsreg.registry.format.chunking import chunk_id
from mfsreg.registry.format.durable import Placing, writing
from mfsreg.registry.format.manifest import FileEntry, Manifest
from mfsreg.registry.parallel import sized_batches
from mfsreg.registry.progress import NullProgress, Progress

C = TypeVar("C", bound=ChunkForm)
_Raw = TypeVar("_Raw", bytes, bytes | memoryview)
# A source of encoded payloads: given chunks (a registry's StoredChunk, a node's Located), yield
# (chunk, payload) in any order.
PayloadSource = Callable[[list[C]], Iterator[tuple[ChunkForm, bytes]]]


@dataclass(frozen=True)
class PullResult:
    family: str
    version: str
    digest: str
    path: str
    logical_bytes: int
    files: int
    seconds: float
    fetched_bytes: int = 0  # payload bytes received over the network (node pulls through the cache)
    cached_bytes: int = 0  # raw bytes found in the node cache

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def decode_verified(chunk: ChunkForm, payload, basis: bytes | None = None) -> bytes:
    """Decode one stored chunk and check that its bytes hash to its id."""
    return _verified(chunk, payload, basis, codec.decode)


def _verified(chunk: ChunkForm, payload, basis, decode: Callable[..., _Raw]) -> _Raw:
    """decode_verified, through ``decode`` (codec.decode, or codec.decode_reusing)."""
    if not codec.is_known(chunk.encoding):  # a newer registry wrote it: the bytes are fine, this code is old
        raise IntegrityError(
            f"chunk {chunk.id} uses encoding {chunk.encoding!r}, which this mfsreg does not know: "
            "upgrade mfsreg on this machine"
        )
    try:
        raw = decode(chunk.encoding, payload, chunk.size, basis)
    except Exception as exc:  # zstd raises its own error types on corrupt frames
        raise IntegrityError(f"chunk {chunk.id} cannot be decoded ({exc}): the stored pack is damaged") from None
    if len(raw) != chunk.size or chunk_id(raw) != chunk.id:
        raise IntegrityError(f"chunk {chunk.id} does not match its digest: the stored pack is damaged")
    return raw


def safe_relpath(path: str) -> PurePosixPath:
    p = PurePosixPath(path)
    if (
        p.is_absolute()
        or not p.parts
        or any(part in ("..", "") or part.startswith(".") and part != "." for part in p.parts)
    ):
        raise IntegrityError(f"manifest names an unsafe path {path!r}: refusing to write it")
    return p


def _check_parent(out: Path) -> None:
    """The nearest existing folder above ``out`` must be a folder (say, not a file given by mistake)."""
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise InvalidRequest(f"cannot write {out}: {parent} is a file, not a directory")
            return


# What a pull must not write over or into, each with what it is: the registry's own files (its
# database, a local blob store), or a node cache.
Owned = Sequence[tuple[Path, str]]


def targets(manifest: Manifest, out: Path, owned: Owned = ()) -> list[tuple[FileEntry, Path]]:
    """Where each file of the version is written: ``out`` itself for a single-file version."""
    _check_parent(out)
    if manifest.single_file:
        f = manifest.files[0]
        dest = out / safe_relpath(f.path).name if out.is_dir() else out
        plan = [(f, dest)]
    else:
        if out.exists() and not out.is_dir():
            raise InvalidRequest(
                f"{out} is not a directory, but this version is a directory of {len(manifest.files)} files: "
                "give a directory"
            )
        plan = _under(manifest, out)
    _check_dests(plan, out, owned)
    return plan


def _under(manifest: Manifest, out: Path) -> list[tuple[FileEntry, Path]]:
    """Each file of the version at its path under the directory ``out``."""
    return [(f, out.joinpath(*safe_relpath(f.path).parts)) for f in manifest.files]


def check_dir(out: Path, manifest: Manifest, owned: Owned = ()) -> None:
    """``out`` can be the directory a pull --to-dir fills with ``manifest``'s files: an existing
    directory, or a new name under one."""
    _check_parent(out)
    if out.exists() and not out.is_dir():
        raise InvalidRequest(f"{out} is not a directory: --to-dir needs a directory (an existing one, or a new name)")
    _check_dests(_under(manifest, out), out, owned)
    if (stray := _stray_weights(out, manifest)) is not None:
        raise InvalidRequest(
            f"{out} holds {stray}, which this version does not: an engine loading the directory would "
            "read both versions' weights; pull into an empty directory, or remove it"
        )


WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def _stray_weights(out: Path, manifest: Manifest) -> PurePosixPath | None:
    """A weight file or shard index in ``out`` (or a folder the version writes into) that the
    version does not have: vLLM and transformers load every shard an index names, or every
    .safetensors file there, so a pull over another version's directory mixed the two."""
    mine = {safe_relpath(f.path) for f in manifest.files}
    for folder in sorted({PurePosixPath()} | {p.parent for p in mine}):
        try:
            with os.scandir(out.joinpath(*folder.parts)) as it:
                entries = list(it)
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in sorted(entries, key=lambda e: e.name):
            rel = folder / e.name
            if e.name.endswith(WEIGHT_SUFFIXES) and rel not in mine and not e.is_dir():
                return rel
    return None


def _check_dests(plan: list[tuple[FileEntry, Path]], out: Path, owned: Owned = ()) -> None:
    """Before anything is written: no file of the version may land where a directory is, or under a
    file (the rename, or the folder it needs, would fail after the files before it were written),
    nor in what ``owned`` names (`-o $MFSREG_HOME/registry.db` replaced the database, and said
    "verified")."""
    roots = [(root.resolve(), what) for root, what in owned]
    for f, dest in plan:
        real = dest.resolve()
        for root, what in roots:
            if real == root or root in real.parents:
                where = "that is" if real == root else "that lies in"
                raise InvalidRequest(
                    f"cannot write {dest}: {where} {what} ({root}), which the pull would damage; pull elsewhere"
                )
        if dest.is_dir():
            raise InvalidRequest(
                f"cannot write {dest}: a directory is there, where the version's file {f.path} goes; "
                "move it away or pull elsewhere"
            )
        try:
            mode = dest.lstat().st_mode
        except (FileNotFoundError, NotADirectoryError):  # nothing there, or a file above it (refused below)
            mode = None
        if mode is not None and not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            # the file is built under a temp name and renamed over its place: that would put a file
            # where the device or pipe was (with root's rights, over /dev/full), not write into it
            raise InvalidRequest(
                f"cannot write {dest}: it is a pipe, socket or device, which a pull would replace with "
                "a file; give the path of a file or a directory"
            )
        for parent in dest.parents:
            if parent == out or out not in parent.parents:  # at or above ``out``: checked already
                break
            if parent.exists() and not parent.is_dir():
                raise InvalidRequest(
                    f"cannot write {dest}: {parent} is a file, where the version needs a directory; "
                    "move it away or pull elsewhere"
                )


def written_path(manifest: Manifest, out: Path) -> Path:
    """Where a pull to ``out`` put the version, once written: the file itself for a single-file
    version pulled into a directory, else ``out``."""
    if manifest.single_file and out.is_dir():
        return out / safe_relpath(manifest.files[0].path).name
    return out


def closure(
    ids: list[str], located: Mapping[str, ChunkForm], have: Callable[[str], bool] = lambda i: False
) -> list[str]:
    """``ids`` plus the bases their deltas need, each listed after its basis (decode order).
    Bases for which ``have`` is true (already decoded elsewhere, e.g. in a node cache) stop the walk."""
    order: list[str] = []
    seen: set[str] = set()

    def visit(i: str, depth: int = 0) -> None:
        if i in seen:
            return
        if depth and have(i):
            return
        if depth > 64:
            raise IntegrityError(f"chunk {i}: delta chain too long or circular")
        b = located[i].basis_id
        if b:
            if b not in located:
                raise IntegrityError(f"chunk {i}: its basis {b} is missing from the registry")
            visit(b, depth + 1)
        seen.add(i)
        order.append(i)

    for i in ids:
        visit(i)
    return order


def levels(order: list[str], located: Mapping[str, ChunkForm]) -> list[list[str]]:
    """``order`` (bases first, as closure gives it) cut into decode levels: plain chunks and deltas
    whose basis is not in ``order`` first, then each delta one level after its basis, so that a
    level decodes in parallel once the one before it is done."""
    level: dict[str, int] = {}
    out: list[list[str]] = []
    for i in order:
        b = located[i].basis_id
        level[i] = level[b] + 1 if b and b in level else 0
        if level[i] == len(out):
            out.append([])
        out[level[i]].append(i)
    return out


class _BasisUnreadable(Exception):
    """A basis ``cached`` said was held could not be read after all (decode_batch fetches it)."""


# told of each chunk decoded and checked, on the thread that decoded it; from decode_landed the
# bytes may be a view of that thread's buffer, valid only during the call
Landed = Callable[[str, bytes | memoryview], None]


def _decode_on(chunk: ChunkForm, payload, basis: Future | None, landed: Landed | None, keep: bool) -> bytes | None:
    held = None
    if basis is not None:
        held = basis.result()  # submitted before this job: running or done by now (the pool takes jobs in order)
        if held is None:
            raise _BasisUnreadable(chunk.basis_id)
    if not keep:  # handed to landed only: decoded into this thread's buffer where the encoding allows
        assert landed is not None
        landed(chunk.id, _verified(chunk, payload, held, codec.decode_reusing))
        return None
    raw = decode_verified(chunk, payload, held)
    if landed is not None:
        landed(chunk.id, raw)
    return raw


class _Decoding:
    """One batch's decode jobs on the pool, each started once its payload and its basis are in."""

    def __init__(
        self,
        located: Mapping[str, ChunkForm],
        pool: ThreadPoolExecutor,
        reads: dict[str, Future],
        landed: Landed | None,
        keeping: set[str] | None,
    ):
        self.located, self.pool, self.reads = located, pool, reads  # reads: bases held elsewhere, by id
        self.landed = landed
        self.keeping = keeping  # the chunks whose bytes are kept (None: all), returned or a basis of another
        self.jobs: dict[str, Future] = {}
        self.received: dict[str, tuple[ChunkForm, bytes]] = {}  # (kept for a second round)
        self.waiting: dict[str, list[tuple[ChunkForm, bytes]]] = {}  # basis id -> deltas that came first

    def take(self, c: ChunkForm, p) -> None:
        if c.id not in self.received:
            self.received[c.id] = (c, p)
            self._start(c, p)

    def _start(self, c: ChunkForm, p) -> None:
        b = self.located[c.id].basis_id
        if not b:
            self.jobs[c.id] = self.pool.submit(_decode_on, c, p, None, self.landed, self._kept(c.id))
        elif (basis := self.jobs.get(b) or self.reads.get(b)) is not None:
            self.jobs[c.id] = self.pool.submit(_decode_on, c, p, basis, self.landed, self._kept(c.id))
        else:  # its basis comes later in this stream: decoded once that is under way
            self.waiting.setdefault(b, []).append((c, p))
            return
        for after in self.waiting.pop(c.id, ()):
            self._start(*after)

    def _kept(self, i: str) -> bool:
        return self.keeping is None or i in self.keeping

    def results(self, order: list[str]) -> tuple[dict[str, bytes | None], list[str]]:
        """(raw bytes by id, None where not kept; the ids whose basis could not be read after all)."""
        missing = [i for i in order if i not in self.received]
        if missing:
            raise IntegrityError(f"chunk {missing[0]} was not delivered by the store")
        raw: dict[str, bytes | None] = {}
        again = []
        for i in order:
            try:
                raw[i] = self.jobs[i].result()
            except _BasisUnreadable:
                again.append(i)
        return raw, again

    def close(self) -> None:
        """Also after a failure: no job still decodes a payload the caller's store may close."""
        for f in self.jobs.values():
            f.cancel()
        wait([*self.jobs.values(), *self.reads.values()])

    def held(self) -> dict[str, bytes | memoryview]:
        """The bases held elsewhere that could be read."""
        return {b: f.result() for b, f in self.reads.items() if f.exception() is None and f.result() is not None}


def decode_batch(
    ids: list[str],
    located: Mapping[str, C],
    payloads: PayloadSource[C],
    pool: ThreadPoolExecutor,
    known: Callable[[str], bytes | memoryview | None] | None = None,
    cached: Callable[[str], bool] | None = None,
    landed: Landed | None = None,
) -> dict[str, bytes]:
    """Raw bytes of ``ids`` (and of the bases they need), fetched in one go, each decoded on the pool
    as soon as its payload and its basis are in: decoding overlaps the transfer. ``known`` supplies
    raw bytes of bases held elsewhere (a node cache), which are then neither fetched nor decoded.
    With ``cached`` (whether ``known`` holds a chunk, asked cheaply) those bases are read on the pool
    while the request runs, not before it is sent (50 bases of 2 MiB read and checked: 40 ms of a
    1.16 GB member's load); one that cannot be read after all is fetched in a second request.
    ``landed(id, raw)`` is called on the pool as each chunk is decoded and checked (a node writes it
    to its cache there: at the end of the batch, the writes of 105 MB took 10-80 ms after the last
    decode); every call has returned when decode_batch returns or raises."""
    return cast(dict[str, bytes], _decode_batch(ids, located, payloads, pool, known, cached, landed, keep=True))


def decode_landed(
    ids: list[str],
    located: Mapping[str, C],
    payloads: PayloadSource[C],
    pool: ThreadPoolExecutor,
    landed: Landed,
    known: Callable[[str], bytes | memoryview | None] | None = None,
    cached: Callable[[str], bool] | None = None,
) -> list[str]:
    """decode_batch for a caller that only writes each chunk on (a node's cache file): ``landed``
    gets the bytes, often a view of the decoding thread's buffer (codec.decode_reusing), and only
    the bases of other chunks in the batch are held until it ends. Returns the ids decoded. A new
    bytes object per chunk, all held to the end of the batch, was 105 MB of fresh memory, faulted
    in page by page, in a 1.16 GB member's load with the base cached."""
    return list(_decode_batch(ids, located, payloads, pool, known, cached, landed, keep=False))


def _decode_batch(
    ids: list[str],
    located: Mapping[str, C],
    payloads: PayloadSource[C],
    pool: ThreadPoolExecutor,
    known: Callable[[str], bytes | memoryview | None] | None,
    cached: Callable[[str], bool] | None,
    landed: Landed | None,
    keep: bool,
) -> dict[str, bytes | None]:
    reads: dict[str, Future] = {}
    if known is not None and cached is None:

        def have(i: str) -> bool:
            data = known(i)
            if data is not None:
                reads[i] = Future()
                reads[i].set_result(data)
            return data is not None

        order = closure(ids, located, have)
    else:
        order = closure(ids, located, cached or (lambda i: False))
    wanted = set(order)
    if known is not None and cached is not None:
        for b in dict.fromkeys(located[i].basis_id for i in order):
            if b and b not in wanted:
                reads[b] = pool.submit(known, b)
    # without keep, only the bases of other chunks of the batch are held, for the chunks decoded from them
    keeping = None if keep else {b for i in order if (b := located[i].basis_id) in wanted}
    decoding = _Decoding(located, pool, reads, landed, keeping)
    try:
        for c, p in payloads([located[i] for i in order]):
            if c.id in wanted:
                decoding.take(c, p)
        raw, again = decoding.results(order)
    finally:
        decoding.close()
    if again:  # fetch the bases that could not be read; the payloads received are not asked for again
        held, received = decoding.held(), decoding.received

        def more(chunks: list[C]) -> Iterator[tuple[ChunkForm, bytes]]:
            yield from (received[c.id] for c in chunks if c.id in received)
            if rest := [c for c in chunks if c.id not in received]:
                yield from payloads(rest)

        def once(i: str, data: bytes | memoryview) -> None:
            # A chunk this round decoded but did not keep (keep=False) is decoded again there (from
            # the payload received) where an unreadable basis leans on it: it has landed already.
            if landed is not None and i not in raw:
                landed(i, data)

        raw.update(_decode_batch(again, located, more, pool, lambda i: raw.get(i) or held.get(i), None, once, keep))
    return raw


def write_file(
    entry: FileEntry,
    dest: Path,
    located: Mapping[str, C],
    payloads: PayloadSource[C],
    pool: ThreadPoolExecutor,
    progress: Progress,
    placing: Placing,
) -> None:
    """Write one file atomically from its chunks, each decoded and checked against its id, then
    checked again where it lies in the written file (registry/format/filecheck.py); renamed into place by
    ``placing``, with the version's other files.

    The file is written in batches at the chunks' offsets; while one batch is written, the next is
    fetched and decoded on a second thread, and the one before is checked on the pool (file
    writes, xxh3 and the decoders release the GIL)."""
    chunks = filecheck.check_tiling(entry)
    batches = list(sized_batches(chunks, lambda c: c.size, filecheck.BATCH_BYTES))

    def decode(batch):
        return decode_batch(list(dict.fromkeys(c.id for c in batch)), located, payloads, pool)

    placing.make_dirs(dest.parent)
    with writing(dest), filecheck.CheckedFile(dest, entry.size, pool) as out:
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsreg-rebuild") as side:
            if batches:
                nxt = side.submit(decode, batches[0])
            for k, batch in enumerate(batches):
                raw = nxt.result()
                if k + 1 < len(batches):
                    nxt = side.submit(decode, batches[k + 1])
                for c in batch:
                    filecheck.write_at(out.fd, raw[c.id], c.offset)
                out.finished(batch)
                progress.advance("write", sum(c.size for c in batch))
        bad = out.bad()
        if bad:  # each was checked when decoded: what reads back differs from what was written
            raise IntegrityError(
                f"{entry.path}: chunk {bad[0].id} does not read back from {out.tmp} as it was written: "
                "check this machine's disk and memory, then pull again"
            )
        out.commit(placing)


def rebuild(
    manifest: Manifest,
    out: Path,
    located: Mapping[str, C],
    payloads: PayloadSource[C],
    pool: ThreadPoolExecutor,
    progress: Progress | None = None,
    to_dir: bool = False,
    owned: Owned = (),
) -> list[Path]:
    """Write the version's files at ``out`` (see ``targets``), or with ``to_dir`` each at its path
    under the directory ``out``, made with them if missing (and removed again if the pull fails)."""
    progress = progress or NullProgress()
    missing = [c.id for f in manifest.files for c in f.chunks if c.id not in located]
    missing += [c.basis_id for c in located.values() if c.basis_id and c.basis_id not in located]
    if missing:
        raise IntegrityError(
            f"{len(missing)} chunks of this version are missing from the registry (first: {missing[0]})"
        )
    if to_dir:
        check_dir(out, manifest, owned)
        plan = _under(manifest, out)
    else:
        plan = targets(manifest, out, owned)
    progress.start("write", manifest.logical_bytes)
    with Placing() as placing:
        for entry, dest in plan:
            write_file(entry, dest, located, payloads, pool, progress, placing)
    return [d for _, d in plan]
