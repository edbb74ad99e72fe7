"""Tensors straight from the node cache, without writing a file.

On the CPU chunk files are mapped into their tensors (registry/client/mapping.py) or copied, each
checked against its id unless ``verify=False``; on a GPU they go through pinned staging buffers on a
CUDA stream. Missing chunks are fetched ahead of the copies on a background thread.
See docs/design/node-cache.md.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import queue
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING

import torch

from mfsreg.registry.client.cache import NodeCache
from mfsreg.registry.client.fetch import MAX_AGE, Fetcher, VersionInfo
from mfsreg.registry.client.node import evict_quietly, gone_meanwhile, refetcher
from mfsreg.registry.client.remote import Closable, RemoteRegistry
from mfsreg.registry.format.chunking import ChunkRef, chunk_id

if TYPE_CHECKING:
    from mfsreg.registry.client.embedded import EmbeddedSource
from mfsreg.registry.config import age_from_env
from mfsreg.registry.errors import IntegrityError, InvalidRequest, NotFound
from mfsreg.registry.format.manifest import SAFETENSORS
from mfsreg.registry.format.safetensors import TensorSpan
from mfsreg.registry.parallel import sized_batches, windowed_map

mapping: ModuleType | None
try:
    from mfsreg.registry.client import mapping
except (ImportError, AttributeError, OSError):  # no POSIX mmap through libc (Windows): tensors are copied into
    mapping = None

DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "C64": torch.complex64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
if hasattr(torch, "float8_e8m0fnu"):
    DTYPES["F8_E8M0"] = torch.float8_e8m0fnu

FETCH_AHEAD_BYTES = 128 << 20  # raw bytes per fetch batch running ahead of the copies
STAGE_BYTES = 64 << 20  # each of the two pinned staging buffers on a GPU
# Chunks one pool task maps and checks on the CPU: a future per 1 MiB chunk cost about as much as
# mapping it; four per task (8 MiB at the default 2 MiB chunks) still spread a fetch group's chunks
# over the cores.
PIECES_PER_TASK = 4


@dataclass(frozen=True)
class Piece:
    """One chunk of one tensor: where its bytes go inside the tensor."""

    chunk: ChunkRef
    start: int  # byte offset inside the tensor


def layout(info: VersionInfo) -> dict[str, tuple[TensorSpan, list[Piece]]]:
    """tensor name -> (span, its chunks in order); worked out once per document (callers only read it)."""
    kept = info.__dict__.get("_layout")
    if kept is None:
        kept = _layout(info)
        object.__setattr__(info, "_layout", kept)  # a frozen dataclass: its fields stay as they are
    return kept


def _layout(info: VersionInfo) -> dict[str, tuple[TensorSpan, list[Piece]]]:
    out = {}
    for f in info.manifest.files:
        if f.kind != SAFETENSORS:
            continue
        chunks = sorted(f.chunks, key=lambda c: c.offset)
        i = 0
        for t in sorted(f.tensors, key=lambda t: t.start):
            while i < len(chunks) and chunks[i].offset < t.start:
                i += 1
            pieces = []
            while i < len(chunks) and chunks[i].offset < t.end:
                pieces.append(Piece(chunks[i], chunks[i].offset - t.start))
                i += 1
            out[t.name] = (t, pieces)
    return out


class Node(Closable):
    """What serving code needs on a node: the registry client, the node cache and a fetcher.
    Reads MFSREG_URL, MFSREG_TOKEN and MFSREG_CACHE_DIR for the arguments left out (None); an
    argument given empty is refused, as a cache_dir that is not an absolute path is (an empty
    MFSREG_* variable counts as unset, as everywhere). With no URL either way, it loads from the
    embedded registry under MFSREG_HOME (or ``registry``, an open Registry it does not close)."""

    def __init__(self, url: str | None = None, token: str | None = None, cache_dir: str | None = None, registry=None):
        for name, value, env in (("url", url, "MFSREG_URL"), ("token", token, "MFSREG_TOKEN")):
            if value is not None and not value:  # an empty one fell back on the variable, unseen
                raise InvalidRequest(f"{name}={value!r} is empty: give one, or leave {name}= out to use {env}")
        if registry is not None and url is not None:
            raise InvalidRequest("give url= or registry=, not both: one registry to load from")
        url = url or (None if registry is not None else os.environ.get("MFSREG_URL"))  # registry= wins
        max_age = age_from_env("MFSREG_VERSION_MAX_AGE", MAX_AGE)  # refused before anything is opened
        self.remote: RemoteRegistry | EmbeddedSource
        if url:
            self.remote = RemoteRegistry(url, token=token or os.environ.get("MFSREG_TOKEN") or None)
        else:  # the embedded registry under MFSREG_HOME, through the same steps a server runs
            from mfsreg.registry.client.embedded import EmbeddedSource
            from mfsreg.registry.config import Settings
            from mfsreg.registry.registry import Registry

            self.remote = EmbeddedSource(registry or Registry(Settings.from_env()), own=registry is None)
        try:
            self.cache = NodeCache(cache_dir)
        except BaseException:
            self.remote.close()
            raise
        self.fetcher = Fetcher(self.remote, self.cache, max_age=max_age)

    def close(self) -> None:
        self.closed = True
        self.remote.close()
        self.cache.close()


def target_device(device) -> torch.device:
    """``device`` as torch names it, where the loader can put tensors: the CPU or a CUDA device this
    process sees. Anything else is refused in one line: the loader knows those two ways only, and
    an "mps" or "meta" device got CPU tensors, quietly; a name torch does not know, or a CUDA device
    that is not there, raised torch's own error from deep inside the load."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise InvalidRequest(
            f"device {device!r} is not a device torch knows: use 'cpu' or 'cuda' (or 'cuda:N')"
        ) from None
    if dev.type == "cpu":
        if dev.index not in (None, 0):
            raise InvalidRequest(f"device {device!r}: the CPU has no device {dev.index}: use 'cpu'")
        return dev
    if dev.type != "cuda":
        raise InvalidRequest(f"device {device!r}: mfsreg loads tensors onto 'cpu' or 'cuda' only")
    if not torch.cuda.is_available():
        raise InvalidRequest(
            f"device {device!r}: this process sees no CUDA device (torch.cuda.is_available() is "
            "False: no GPU, or a torch built without CUDA): use 'cpu'"
        )
    if dev.index is not None and dev.index >= torch.cuda.device_count():
        raise InvalidRequest(
            f"device {device!r}: this process sees {torch.cuda.device_count()} CUDA device(s), numbered from 0"
        )
    if dev.index is None:
        # "cuda" is whichever device is current, and torch looks that up again at each use, per
        # thread: a ResidentModel made with GPU 1 current and switched from a thread (or a block)
        # where GPU 0 is would put reallocated tensors on GPU 0 and copy into them on GPU 0's
        # stream, which the staging buffers' events do not cover. So the number is fixed here.
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class Copier:
    """Puts cached chunks into tensor bytes on one device: mapped where they line up with pages (CPU), else copied."""

    def __init__(self, cache: NodeCache, device: torch.device, pool=None, verify: bool = True):
        self.cache = cache
        self.verify = verify  # False: trust the cache's files (checked when fetched), only their sizes
        self.refetch = None  # [chunk id] -> None: fetch chunks into the cache again (node.refetcher)
        self.device = device
        self.pool = pool  # CPU: pieces are read on several threads (file reads and xxh3 release the GIL)
        self.cuda = device.type == "cuda"
        # GPU: chunks are read and checked into a staging buffer, then copied on a stream of their
        # own. (A CPU copier may be made ``staged`` too: the same reads, checks and refetches into
        # plain buffers, copied in place of the device; tests use it where no GPU is lent.)
        self.staged = self.cuda
        if self.cuda:
            self.stream = torch.cuda.Stream(device=device)
        self.stages: list[torch.Tensor] | None = None  # two buffers, made at the first staged copy
        self.events: list = [None, None]  # per buffer: its copies' completion (a blocking event)
        self.cur = 0

    @property
    def maps_unchecked(self) -> bool:
        """Whether cached chunks are mapped without being read (the CPU, ``verify=False``): such a
        load looks for no chunk file before it maps them; one found missing as it maps costs that
        first build, and a second from the registry's answer, which fetches it (see build)."""
        return not self.verify and not self.cuda and mapping is not None

    @staticmethod
    def empty_dtype(span: TensorSpan) -> torch.dtype:
        dtype = DTYPES.get(span.dtype)
        if dtype is None:
            raise InvalidRequest(f"tensor {span.name!r}: dtype {span.dtype} has no torch equivalent here")
        return dtype

    def empty(self, span: TensorSpan) -> torch.Tensor:
        if not self.cuda and mapping is not None:
            return mapping.empty(span.shape, self.empty_dtype(span))
        return torch.empty(span.shape, dtype=self.empty_dtype(span), device=self.device)

    def copy(self, tensor: torch.Tensor, pieces: list[Piece]) -> int:
        """Put ``pieces`` into ``tensor``; see copy_many."""
        return self.copy_many([(tensor, pieces)])

    def copy_many(self, work: list[tuple[torch.Tensor, list[Piece]]]) -> int:
        """Put each tensor's pieces into it (mapped or copied), each checked against its id (with
        ``verify``; without, only against its size); returns their bytes. A chunk whose cache file
        is missing, cut short or damaged is dropped, fetched again and put in place again, once.
        On the CPU the pieces that line up with pages are mapped in one go on the calling thread;
        their checks, and the reads of the others, share the pool in runs of PIECES_PER_TASK.
        See docs/design/node-cache.md."""
        work = [(t, pieces) for t, pieces in work if pieces]
        total = sum(p.chunk.size for _, pieces in work for p in pieces)
        if self.staged:
            self._copy_staged(work)
            return total
        # (placer of one tensor, piece): read and checked; (placer, bytes, region, piece): mapped
        jobs, maps = [], []
        for tensor, pieces in work:
            region = mapping.region_of(tensor) if mapping is not None else None
            arr = _bytes_of(tensor).numpy()
            place = functools.partial(self._place, arr, region)
            for p in pieces:
                # A mapped piece is a few system calls: all of them are mapped in one go on the
                # calling thread (on the pool the threads would mostly hand the GIL back and forth);
                # the checks of mapped bytes, and reads, run on the pool. Mapped one by one on the
                # pool, a switch that replaced an 84 MB model took 8.4 to 9 ms, about a reload's.
                if region is not None and region.can_map(p.start, p.chunk.size):
                    maps.append((place, arr, region, p))
                else:
                    jobs.append((place, p))

        mapped = (
            mapping.map_many(
                [(region, p.start, p.chunk.size, self.cache.chunk_file(p.chunk.id)) for _, _, region, p in maps]
            )
            if maps and mapping is not None  # (maps: regions made by mapping)
            else []
        )
        # those not mapped (a file missing or of another size, past the budget) are read instead, or
        # else fetched again (and then mapped where they can be)
        failed = [
            (place, p) for (place, arr, _, p), ok in zip(maps, mapped) if not ok and not self._place(arr, None, p)
        ]
        if self.verify:
            jobs += [
                (functools.partial(self._check_mapped, place, region), p)
                for (place, _, region, p), ok in zip(maps, mapped)
                if ok
            ]
        self._put_all(jobs, failed)
        return total

    def _check_mapped(self, place: Callable[[Piece], bool], region, p: Piece) -> bool:
        """A piece mapped beforehand (copy_many): its bytes checked against its id. Where they do
        not match, the file is mapped again as it stands now and checked: the same damaged file
        at first (False: the caller drops it and fetches it again), then the new copy."""
        return self._intact(p.chunk, region.view(p.start, p.chunk.size)) or place(p)

    def _put_all(self, jobs: Sequence[tuple[Callable[[Piece], bool], Piece]], failed: list | None = None) -> None:
        """Run each ``put(piece)`` (on the pool, in runs of PIECES_PER_TASK, where there is one); the
        chunks of those that return False, and of ``failed``, are fetched again in one go, leased
        until they are put in place. Fetched on the calling thread, never on a pool thread: a fetch
        decodes on that same pool, and with every pool thread waiting for it, it would never run."""

        def run(part: Sequence) -> list:
            return [(put, p) for put, p in part if not put(p)]

        bad = list(failed or [])
        if self.pool is not None and len(jobs) > 1:
            runs = [jobs[i : i + PIECES_PER_TASK] for i in range(0, len(jobs), PIECES_PER_TASK)]
            bad += [job for part in windowed_map(self.pool, run, runs) for job in part]
        else:
            bad += run(jobs)
        if bad:  # leased until in place: another process's eviction passes them over
            with self.cache.leased([p.chunk.id for _, p in bad]):
                self._renew([p.chunk for _, p in bad])
                for put, p in bad:
                    if not put(p):
                        raise self.cache.failed_again(p.chunk.id)

    def _place(self, arr, region, p: Piece) -> bool:
        """CPU: map the chunk's cache file into its slot of the tensor, or read it there; checked against its id."""
        if region is not None and region.can_map(p.start, p.chunk.size):
            view = region.map_file(p.start, p.chunk.size, self.cache.chunk_file(p.chunk.id))
            if view is not None:
                return self._intact(p.chunk, view)
        return self._read(p.chunk, memoryview(arr[p.start : p.start + p.chunk.size]))

    def _copy_staged(self, work: list[tuple[torch.Tensor, list[Piece]]]) -> None:
        """GPU: the pieces read and checked into one staging buffer at a time (on the pool), the
        chunks that fail fetched again in one go per buffer, then the buffer's copies queued on the
        copier's stream while the next buffer fills."""
        items = [(_bytes_of(t), p) for t, pieces in work for p in pieces]
        biggest = max(p.chunk.size for _, p in items)
        if self.stages is None or biggest > self.stages[0].numel():
            self._make_stages(max(STAGE_BYTES, biggest))
        assert self.stages is not None
        room = self.stages[0].numel()
        batch: list[tuple[torch.Tensor, Piece, int]] = []
        used = 0
        for flat, p in items:
            if used + p.chunk.size > room:
                self._stage_batch(batch)
                batch, used = [], 0
            batch.append((flat, p, used))
            used += p.chunk.size
        if batch:
            self._stage_batch(batch)

    def _stage_batch(self, batch: list[tuple[torch.Tensor, Piece, int]]) -> None:
        assert self.stages is not None
        if self.events[self.cur] is not None:
            self.events[self.cur].synchronize()  # the buffer's last copies have landed: refill it
            self.events[self.cur] = None
        stage = self.stages[self.cur]

        def read_at(off: int, p: Piece) -> bool:
            return self._read(p.chunk, stage[off : off + p.chunk.size].numpy().data)

        self._put_all([(functools.partial(read_at, off), p) for _, p, off in batch])
        with torch.cuda.stream(self.stream) if self.cuda else contextlib.nullcontext():
            for flat, p, off in batch:
                n = p.chunk.size
                flat[p.start : p.start + n].copy_(stage[off : off + n], non_blocking=self.cuda)
        if self.cuda:
            ev = torch.cuda.Event(blocking=True)  # waited on by sleeping, not by spinning a core
            ev.record(self.stream)
            self.events[self.cur] = ev
        self.cur ^= 1

    def _read(self, chunk: ChunkRef, view: memoryview) -> bool:
        """Read a cached chunk into ``view``; False if its file is missing, short or does not match its id."""
        return self.cache.read_into(chunk.id, view) and self._intact(chunk, view)

    def _intact(self, chunk: ChunkRef, view) -> bool:
        """Whether bytes in place (of the right size) may be handed out: they hash to the chunk's
        id, or the caller trusts the cache (``verify=False``)."""
        return not self.verify or chunk_id(view) == chunk.id

    def _renew(self, chunks: list[ChunkRef]) -> None:
        """Drop these chunks' cache files (missing, cut short or damaged) and fetch them again, in one go."""
        ids = list(dict.fromkeys(c.id for c in chunks))
        if self.refetch is None:
            raise IntegrityError(
                f"chunk {ids[0]} in the node cache is missing or damaged, and this copy has no "
                "registry to fetch it from: load through mfsreg.load_tensors"
            )
        self.refetch(ids)

    def _make_stages(self, n: int) -> None:
        """Two staging buffers of ``n`` bytes each (pinned on a GPU): a family may be cut in chunks up
        to 256 MiB, over STAGE_BYTES. Made again only once every copy from the old ones has landed."""
        self.release()
        self.stages = [torch.empty(n, dtype=torch.uint8, pin_memory=self.cuda) for _ in range(2)]

    def begin(self) -> None:
        """Copies must not overtake work already queued on the current stream (say, kernels still
        reading the weights that a switch is about to overwrite)."""
        if self.cuda:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))

    def finish(self) -> None:
        """Wait until every queued copy has landed (sleeping on a blocking event)."""
        if self.cuda:
            ev = torch.cuda.Event(blocking=True)
            ev.record(self.stream)
            ev.synchronize()
        self.events, self.cur = [None, None], 0

    def release(self) -> None:
        """Free the staging buffers (pinned memory on a GPU) once their copies have landed; the next
        staged copy makes them again."""
        if self.stages is not None:
            self.finish()
            self.stages = None


def _bytes_of(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 view (a 0-d tensor too)."""
    return tensor.view(-1).view(torch.uint8) if tensor.dim() else tensor.reshape(1).view(torch.uint8)


class FetchAhead:
    """Fetches ``groups`` of chunks into the cache on a background thread, started at once: the
    caller copies what is cached meanwhile (a generator would start it only at the first ``next``,
    after those copies: 60 ms of a 1.16 GB member's load spent before the first request went out).
    Iterating yields group indexes as their chunks land. ``close`` (also when iteration stopped
    early: a copy failed) tells the thread to stop and waits for it: batches not yet started are
    dropped, the one in flight ends, and nothing is handed over any more. ``wait_sent()`` returns
    once the first request is about to go out, or the first group has ended or failed without one,
    or there is no group."""

    def __init__(self, fetcher: Fetcher, info: VersionInfo, groups: list[list[str]]):
        self.count = len(groups)
        self.done: queue.Queue = queue.Queue(maxsize=2)
        self.stop = threading.Event()
        self.sent = threading.Event()

        def work():
            try:
                for k, ids in enumerate(groups):
                    fetcher.ensure(info.family, ids, info.located, info.tiers, cancel=self.stop, sending=self.sent.set)
                    self.sent.set()  # (nothing was missing after all)
                    if not self._hand(k):
                        return
            except BaseException as exc:  # hand the error to the consumer (if it still listens)
                self._hand(exc)  # (the first group's error goes into an empty queue: never blocks)
            finally:
                self.sent.set()  # a failure, or no group at all: nothing more to wait for

        self.thread = threading.Thread(target=work, name="mfsreg-fetch-ahead", daemon=True)
        self.thread.start()

    def _hand(self, item) -> bool:
        while not self.stop.is_set():
            try:
                self.done.put(item, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def wait_sent(self) -> None:
        while not self.sent.wait(0.5):  # in steps: a wait without a timeout ignores Ctrl-C on Windows
            pass

    def __iter__(self) -> Iterator[int]:
        for _ in range(self.count):
            while True:
                try:
                    item = self.done.get(timeout=0.5)  # (see wait_sent)
                    break
                except queue.Empty:
                    pass
            if isinstance(item, BaseException):
                raise item
            yield item

    def close(self) -> None:
        # Also when closed early: the batch in flight ends (the fetch stops at the next one) before
        # the caller's lease on these chunks goes, so nothing lands in the cache unleased after it.
        self.stop.set()
        self.thread.join()

    def __enter__(self) -> FetchAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def chunk_ids(lay: dict) -> list[str]:
    """The distinct chunks a layout's tensors are made of."""
    return list(dict.fromkeys(p.chunk.id for _, pieces in lay.values() for p in pieces))


def fill(
    node: Node,
    info: VersionInfo,
    lay: dict,
    copier: Copier,
    targets: dict[str, torch.Tensor],
    todo: dict[str, list[Piece]],
    cached: bool | None = None,
    record: bool = True,
    refetch=None,
    outcome: str = "no tensors were handed out",
) -> int:
    """Fetch what ``todo`` needs (ahead of the copies) and copy it into ``targets``; returns bytes
    copied. ``lay``: layout(info). ``cached``: whether every chunk of ``todo`` was just seen cached
    (None: look). ``record=False`` leaves telling the cache's index (the chunks' use, then eviction
    to the size limit) to the caller. ``refetch``: what the copier calls for chunks to fetch again
    (default: fetch them on ``info``'s word). ``outcome``: what a failure leaves, said where the
    version was deleted meanwhile."""
    # (over 60 lines: the lease, the fetch-ahead and the copies' finish are one try block, so
    # that a failure anywhere releases them in order; split, that order would be spread out)
    names = [n for n in todo if todo[n]]
    needed = list(dict.fromkeys(p.chunk.id for n in names for p in todo[n]))
    have: set[str] = set()  # where ``cached`` is False: taken as none
    if cached is None:
        have = {i for i in needed if node.cache.has(i)}
        cached = len(have) == len(needed)
    copied = 0
    copier.refetch = refetch or refetcher(node.fetcher, info)
    copier.begin()
    done = False
    try:
        if cached:
            # All cached (a warm node): nothing to fetch ahead, and a fetch thread would only take
            # turns with the copies for the interpreter (a warm, unchecked load of 1.16 GB about
            # 1.2x as slow). (A chunk evicted meanwhile by another process is refetched by the copier.)
            if record:
                node.fetcher.note_used(info.family, needed, info.located, info.tiers)
            copied = copier.copy_many([(targets[name], todo[name]) for name in names])
        else:
            ready, groups = _fetch_groups(names, todo, have)
            chunk_groups = [list(dict.fromkeys(p.chunk.id for n in g for p in todo[n])) for g in groups]
            # leased while they are fetched and copied: another process's eviction passes them over
            # (cache eviction.py). Not above: a warm load's copies take milliseconds, and a chunk
            # evicted under them is fetched again by the copier.
            with (
                node.cache.leased(needed),
                FetchAhead(node.fetcher, info, chunk_groups) as landed,
            ):
                # the tensors already cached are copied while the thread fetches the rest, once its
                # first request is on its way: copied at once, they took the interpreter from the
                # fetch thread and delayed that request (docs/design/node-cache.md)
                landed.wait_sent()
                if ready:
                    ids = list(dict.fromkeys(p.chunk.id for n in ready for p in todo[n]))
                    node.fetcher.note_used(info.family, ids, info.located, info.tiers)
                    copied += copier.copy_many([(targets[name], todo[name]) for name in ready])
                for k in landed:
                    copied += copier.copy_many([(targets[name], todo[name]) for name in groups[k]])
        done = True
    except NotFound as exc:  # the server's "not part of family", where the version went meanwhile
        raise gone_meanwhile(node.fetcher, info, exc, "loaded", outcome) from None
    finally:
        # also after a failure: no copy may still be queued into tensors being freed; an error of its
        # own then must not hide the failure that stopped the load (it is noted on it instead)
        _finish(copier, failing=not done)
        if record and not done:
            evict_quietly(node.cache, needed)  # the limit holds after a failed load too
    if record:
        node.cache.evict(protect=needed)
    return copied


def _fetch_groups(names: list[str], todo: dict[str, list[Piece]], have: set[str]) -> tuple[list[str], list[list[str]]]:
    """(the tensors whose chunks are all cached, copied while the first fetch runs; the others in
    the order the fetch-ahead brings them, in runs of FETCH_AHEAD_BYTES of chunks to fetch). Cut by
    the bytes to fetch, not the tensors' sizes: a member with the base cached fetches its few
    changed chunks in one go, every request of it at once, instead of a few per run of 128 MB of
    tensors, one run after another (0.8 s against 0.5 for lora-chat's 105 MB of 1.16 GB)."""
    ready = [n for n in names if all(p.chunk.id in have for p in todo[n])]
    taken = set(ready)
    counted: set[str] = set(have)

    def to_fetch(name: str) -> int:
        new = {p.chunk.id: p.chunk.size for p in todo[name] if p.chunk.id not in counted}
        counted.update(new)
        return sum(new.values())

    return ready, list(sized_batches([n for n in names if n not in taken], to_fetch, FETCH_AHEAD_BYTES))


def _finish(copier: Copier, failing: bool) -> None:
    """``copier.finish()``; where a failure is already on its way out, an error of the finish is
    added to it as a note rather than raised in its place."""
    if not failing:
        copier.finish()
        return
    exc = sys.exc_info()[1]
    try:
        copier.finish()
    except Exception as late:
        if exc is not None:
            exc.add_note(f"then waiting for the copies already queued failed too: {late}")


def _in_background(fn, *args) -> Future:
    """``fn(*args)`` on a thread of its own; its result or error in the future."""
    fut: Future = Future()

    def run():
        fut.set_running_or_notify_cancel()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # handed to whoever asks for the result
            fut.set_exception(exc)

    threading.Thread(target=run, name="mfsreg-revalidate", daemon=True).start()
    return fut


_held_lock = threading.Lock()
_held_depth = 0  # loads and switches under way in this process
_held_was_on = False  # whether automatic collection was on when the first of them began


@contextlib.contextmanager
def collection_held() -> Iterator[None]:
    """Automatic garbage collection held off while the block runs, then set back as it was.

    A load makes few objects that outlive it (about 3,200 for a 1.16 GB member), but the thousands
    it makes and drops count towards the interpreter's thresholds, and a full collection that falls
    inside a load walks every object of the process (torch's included: 40 ms in a bare node
    process, 110-150 ms in bench_ready's) while the load's threads wait for it: 2 of 10 traced
    loads of a 1.16 GB member took 0.37 s instead of 0.27 (docs/benchmarks.md). Held off, that
    collection runs at the next allocation after the load instead. Nested and concurrent loads
    share one hold: collection comes back when the last of them ends, and only if it was on when
    the first began (a process that turned it off keeps it off). Its limits: while loads on several
    threads keep overlapping, collection stays off until none runs; a ``gc.disable()`` made while a
    hold is on is undone when it ends (where collection was on when it began)."""
    global _held_depth, _held_was_on
    try:
        with _held_lock:
            if _held_depth == 0:
                _held_was_on = gc.isenabled()
                gc.disable()
            _held_depth += 1
        yield
    finally:
        with _held_lock:
            _held_depth -= 1
            if _held_depth == 0 and _held_was_on:
                gc.enable()


def build(node: Node, family: str, version: str, copier: Copier) -> tuple[VersionInfo, dict[str, torch.Tensor]]:
    """A version's tensors, and the document they were laid out from (automatic garbage collection
    held off meanwhile: collection_held).

    Where the node keeps the document and caches every chunk it names, the tensors are built from
    it while another thread asks whether it is current, and handed out only once the answer has
    come. They are built again from the answer where it names other bytes, or where the build
    failed and the answer is new or chunks must be fetched again; an error in the answer is raised.
    See docs/design/node-cache.md."""
    with collection_held():
        return _build(node, family, version, copier)


def _build(node: Node, family: str, version: str, copier: Copier) -> tuple[VersionInfo, dict[str, torch.Tensor]]:
    fresh = node.fetcher.fresh(family, version)
    if fresh is not None:  # confirmed by the registry within MFSREG_VERSION_MAX_AGE: no question to ask
        return fresh, _from(node, fresh, layout(fresh), copier, cached=True if copier.maps_unchecked else None)
    kept = node.fetcher.kept(family, version)
    lay = layout(kept) if kept is not None else {}
    ids = chunk_ids(lay)
    # A load that maps without the check looks for no chunk file beforehand: the mapping's own open
    # finds one missing (evicted by another process), and the build from the answer below fetches
    # it. The stat of each of a 1.16 GB model's 577 files took 1.4 to 2 ms of a 13 ms unchecked load
    # (benchmarks/HISTORY.md). A load that reads its chunks looks first: a chunk found missing only
    # there would cost reading (and checking) all the others once more.
    if kept is None or (not copier.maps_unchecked and not all(node.cache.has(i) for i in ids)):
        info = node.fetcher.version(family, version)
        return info, _from(node, info, layout(info), copier)
    answer = _in_background(node.fetcher.version, family, version)
    tensors, failure = None, None

    def deferred(chunk_ids: list[str]) -> None:
        """A chunk to fetch again (damaged, or evicted meanwhile) is dropped now if its file is
        damaged (a good copy another process wrote meanwhile stays: get_verified checks which file
        it drops), but fetched only on the answer's word, by the build from the current document below."""
        for i in chunk_ids:
            node.cache.get_verified(i)
        raise _Deferred(chunk_ids)

    try:
        # what it tells the cache's index waits for the answer: a version since deleted records nothing
        tensors = _from(node, kept, lay, copier, cached=True, record=False, refetch=deferred)
    except Exception as exc:  # decided once the answer is in, outside this block: no chained tracebacks
        failure = exc
    try:
        current = answer.result()
    except BaseException:  # the first build's regions go now, not with the traceback that holds this frame
        tensors = failure = None
        raise
    if failure is not None:
        if current is kept and not isinstance(failure, _Deferred):  # the same document: this load's own failure
            raise failure
    elif tensors is not None and current.digest == kept.digest:
        # the same bytes; their tiers as the registry tells them now
        node.fetcher.note_used(family, [i for i in ids if i in current.located], current.located, current.tiers)
        node.cache.evict(protect=ids)
        return current, tensors
    # the first build's regions go before the second's are made (its error's frames held them)
    tensors = failure = None
    return current, _from(node, current, layout(current), copier)


class _Deferred(Exception):
    """Raised by a build from a kept document that met chunks to fetch again: it is built again
    from the registry's answer, which fetches them."""


def _from(
    node: Node,
    info: VersionInfo,
    lay: dict,
    copier: Copier,
    cached: bool | None = None,
    record: bool = True,
    refetch=None,
) -> dict[str, torch.Tensor]:
    # Each tensor is made when fill first copies into it, so the fetch-ahead's first request goes out
    # before, not after, the 93 tensors of an 84 MB member are made (2.4 ms of its 52 ms load).
    made = _Made(lambda name: copier.empty(lay[name][0]))
    fill(node, info, lay, copier, made, {name: pieces for name, (_, pieces) in lay.items()}, cached, record, refetch)
    return {name: made[name] for name in lay}  # in the layout's order; those without bytes made here


class _Made(dict):
    """name -> tensor, each made by ``make(name)`` when first looked up."""

    def __init__(self, make: Callable[[str], torch.Tensor]):
        super().__init__()
        self.make = make

    def __missing__(self, name: str) -> torch.Tensor:
        self[name] = t = self.make(name)
        return t


def load_tensors(
    family: str, version: str, device: str | torch.device = "cpu", node: Node | None = None, verify: bool = True
) -> dict[str, torch.Tensor]:
    """A version's tensors on ``device``, built from the node cache (fetching what it lacks).

    Every chunk is checked against its id as it is fetched. ``verify`` (the default) checks each
    cached chunk again as it is loaded, which reads every byte: a cache file that rotted on disk
    since is dropped and fetched again. ``verify=False`` trusts the cache's files as fetched (they
    are written once, read-only, and renamed into place whole; files missing or of the wrong size
    are still fetched again), so a CPU load maps (or reads) them without hashing them; ``mfsreg
    cache verify`` finds damage instead."""
    device = target_device(device)  # before anything is asked of the node
    own = node is None
    node = node or Node()
    try:
        node.check_open()
        copier = Copier(node.cache, device, node.remote.pool, verify)
        try:
            _, tensors = build(node, family, version, copier)
        finally:
            copier.release()  # its staging buffers (pinned memory on a GPU) go with the load
        node.cache.record_pull(family, version)
        return tensors
    finally:
        if own:
            node.close()
