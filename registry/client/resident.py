"""A model resident on a device that switches versions by copying only the chunks that differ."""

from __future__ import annotations

import contextlib
import threading

import torch

from mfsreg.registry.client.fetch import VersionInfo
from mfsreg.registry.client.node import evict_quietly, gone_meanwhile
from mfsreg.registry.client.remote import Closable
from mfsreg.registry.client.torch_loader import (
    Copier,
    Node,
    build,
    chunk_ids,
    collection_held,
    fill,
    layout,
    target_device,
)
from mfsreg.registry.errors import NotFound, RegistryError

IDLE_RELEASE_S = 30.0  # a model not switched for this long gives back its staging buffers (pinned memory on a GPU)


class ResidentModel(Closable):
    """One version of a family held on ``device`` in ``.tensors``; ``verify`` as for load_tensors.

    ``switch(version)`` moves to another version in place, copying only the chunks that differ into
    tensors that keep their dtype and shape, and returns the bytes copied. It caches every chunk
    before touching a tensor: a failure before that leaves the model at ``.version``; one during the
    copies leaves a mix, ``.version`` None, and the next switch refills every tensor.

    On a GPU the copies go through two pinned staging buffers (64 MiB each, or the largest chunk):
    they are given back when the model is closed or has not switched for IDLE_RELEASE_S seconds,
    and made again by the next switch.
    """

    closed_note = " (its tensors stay as they are)"

    def __init__(
        self,
        family: str,
        version: str,
        device: str | torch.device = "cpu",
        node: Node | None = None,
        verify: bool = True,
    ):
        self.device = target_device(device)  # before anything is asked of the node
        self._own = node is None
        self._lock = threading.Lock()  # a switch, and the release of the buffers when idle
        self._switches = 0
        self._idle: threading.Timer | None = None
        if node is not None:
            node.check_open()
        self.node = node or Node()
        try:
            self.family = family
            self.copier = Copier(self.node.cache, self.device, self.node.remote.pool, verify)  # see load_tensors
            self.version: str | None = version
            self.info: VersionInfo | None  # None while a switch copies (see switch)
            self.info, self.tensors = build(self.node, family, version, self.copier)
        except BaseException:  # no object to close later: its client, threads and buffers go now
            self.close()
            raise
        self.loaded_bytes = sum(t.nbytes for t in self.tensors.values())  # the pieces tile every tensor
        self._idle_later()

    def switch(self, version: str) -> int:
        self.check_open()
        self.node.check_open("this ResidentModel loads through ")
        with self._lock:
            self._switches += 1
            try:
                with collection_held():  # as a load's (torch_loader.build)
                    return self._switch(version)
            finally:
                self._idle_later()

    def _idle_later(self) -> None:
        """Give the staging buffers back if no switch comes within IDLE_RELEASE_S seconds."""
        if not self.copier.staged:
            return
        if self._idle is not None:
            self._idle.cancel()
        self._idle = threading.Timer(IDLE_RELEASE_S, self._release_if_idle, args=(self._switches,))
        self._idle.daemon = True
        self._idle.start()

    def _release_if_idle(self, seen: int) -> None:
        with self._lock:
            if self._switches == seen:
                self.copier.release()

    def _switch(self, version: str) -> int:
        family, before = self.family, self.version
        # what it fetches is leased from its fetch to its last copy (cache eviction.py)
        with contextlib.ExitStack() as held:
            target, new, renames, realloc, todo, needed = self._plan(version, held)
            # Tensors are touched only from here on: whatever stops the switch now leaves a mix.
            self.info, self.version = None, None  # set again only once every copy has landed
            try:
                for name, source in renames.items():
                    self.tensors[name] = self.tensors.pop(source)
                for name in list(self.tensors):
                    if name not in new:
                        del self.tensors[name]
                for name in realloc:  # one at a time, each old one freed as its new one comes: no higher peak
                    self.tensors.pop(name, None)
                    self.tensors[name] = self.copier.empty(new[name][0])
                copied = fill(
                    self.node,
                    target,
                    new,
                    self.copier,
                    self.tensors,
                    todo,
                    cached=True,
                    record=False,  # _plan's fetch recorded their use; the limit is kept below
                    outcome="the switch stopped partway",
                )
            except RegistryError as exc:
                evict_quietly(self.node.cache, needed)  # the limit holds after a failed switch too
                raise _reworded(
                    exc,
                    f"switch of {family} to {version} stopped partway: {exc}; the tensors are a mix of "
                    f"{before or 'versions'} and {version}, and .version is None: switch again (to any "
                    "version: it refills every tensor) or make a new ResidentModel",
                ) from None
            self.info, self.version = target, version
            if needed:
                self.node.cache.evict(protect=needed)
            self.node.cache.record_pull(family, version)
            return copied

    def _plan(self, version: str, held: contextlib.ExitStack):
        """What a switch to ``version`` copies, with every chunk of it brought into the node cache,
        before any tensor of the model is touched: (document, its layout, renames as {new name: the
        tensor it takes over}, names of the tensors to reallocate, pieces to copy by name, the chunks
        those pieces are cut from)."""
        family, before = self.family, self.version
        target, needed = None, []
        try:
            target = self.node.fetcher.version(family, version, fresh=True)
            # After a failed switch the tensors are in an unknown state: refill everything.
            old, new = (layout(self.info) if self.info is not None else {}), layout(target)
            renames = _renames(old, new, self.tensors)
            realloc, todo = [], {}
            for name, (span, pieces) in new.items():
                prior = old.get(renames.get(name, name))
                t = self.tensors.get(renames.get(name, name))
                same = (
                    prior is not None
                    and t is not None
                    and prior[0].dtype == span.dtype
                    and prior[0].shape == span.shape
                    and tuple(t.shape) == span.shape
                    and t.dtype == self.copier.empty_dtype(span)
                )
                if prior is None or not same:
                    realloc.append(name)
                    todo[name] = pieces
                    continue
                have = {(p.start, p.chunk.size, p.chunk.id) for p in prior[1]}
                todo[name] = [p for p in pieces if (p.start, p.chunk.size, p.chunk.id) not in have]
            needed = chunk_ids({name: (None, pieces) for name, pieces in todo.items()})
            if any(not self.node.cache.has(i) for i in needed):
                held.enter_context(self.node.cache.leased(needed))  # until the switch's last copy
                self.node.fetcher.ensure(family, needed, target.located, target.tiers)
            elif needed:
                # All cached: copied in milliseconds, with no lease (its lock file and rows cost
                # more than a small switch), as a load of cached chunks; a chunk another process
                # evicts meanwhile is fetched again by the copier, leased then.
                self.node.fetcher.note_used(family, needed, target.located, target.tiers)
        except RegistryError as exc:
            if needed:
                evict_quietly(self.node.cache, needed)  # the limit holds after a failed switch too
            kept = (
                f"nothing changed: the model still holds {before}"
                if before
                else "nothing changed: the model still holds the mix a failed switch left"
            )
            if isinstance(exc, NotFound) and target is not None:
                gone = gone_meanwhile(self.node.fetcher, target, exc, "switched to", kept)
                if gone is not exc:
                    raise gone from None
            raise _reworded(exc, f"switch of {family} to {version} failed: {exc}; {kept}") from None
        return target, new, renames, realloc, todo, needed

    def close(self) -> None:
        """Close the node this model opened (one passed in stays open); the tensors stay usable, but
        no switch can be made any more."""
        self.closed = True
        if self._idle is not None:
            self._idle.cancel()
        copier = getattr(self, "copier", None)  # None where the constructor failed before it
        if copier is not None:
            with self._lock:
                copier.release()
        if self._own:
            self.node.close()


def _renames(old: dict, new: dict, tensors: dict) -> dict[str, str]:
    """{new name: old name} for tensors the target names anew (a member saved with a prefix, such as
    PEFT's "base_model.model.", or converted between naming schemes) that hold chunks of a tensor it
    no longer names, or whose name is its own with a prefix added or dropped, of the same dtype and
    shape: that tensor is taken over and only its differing chunks copied, where matching by name
    alone reallocated and refilled the whole model. Each old tensor goes to the new name that shares
    the most bytes of chunks with it."""
    dropped = {n for n in old if n not in new and n in tensors}
    holders: dict[str, set[str]] = {}  # chunk id -> the dropped tensors holding it
    for n in dropped:
        for p in old[n][1]:
            holders.setdefault(p.chunk.id, set()).add(n)
    ends: dict[str, set[str]] = {}  # each dotted tail of a dropped name ("layers.0.q_proj.weight") -> the names
    for n in dropped:
        parts = n.split(".")
        for i in range(len(parts)):
            ends.setdefault(".".join(parts[i:]), set()).add(n)
    votes = []
    for name, (span, pieces) in new.items():
        if name in old or name in tensors or not dropped:
            continue
        # its namesakes (one name a dotted tail of the other) count even with no chunk in common: a
        # tensor whose every chunk changed still takes over the old one, with no second allocation
        parts = name.split(".")
        tails = {".".join(parts[i:]) for i in range(len(parts))}
        shared = dict.fromkeys(ends.get(name, set()) | (tails & dropped), 0)
        for p in pieces:
            for n in holders.get(p.chunk.id, ()):
                shared[n] = shared.get(n, 0) + p.chunk.size
        for n, size in shared.items():
            if old[n][0].dtype == span.dtype and old[n][0].shape == span.shape:
                votes.append((size, name, n))
    renames, taken = {}, set()
    # most shared bytes first; between equals (every layer norm is all ones, so one chunk) the old
    # name the new one ends with, or that ends with it, as a prefix added or dropped leaves it
    for *_, name, n in sorted((-size, not (name.endswith(n) or n.endswith(name)), name, n) for size, name, n in votes):
        if name not in renames and n not in taken:
            renames[name] = n
            taken.add(n)
    return renames


def _reworded(exc: RegistryError, message: str) -> RegistryError:
    """``exc``'s kind (which the CLI and callers act on) with ``message``."""
    try:
        return type(exc)(message)
    except TypeError:  # a kind built otherwise: the tree's root still says it
        return RegistryError(message)
