"""A model resident on a device that switches versions by copying only the chunks that differ."""

from __future__ import annotations

import torch

from registry.client.node import evict_quietly, gone_meanwhile
from registry.client.torch_loader import Copier, Node, build, chunk_ids, fill, layout, target_device
from registry.errors import InvalidRequest, NotFound, RegistryError


class ResidentModel:
    """One version of a family held on ``device`` in ``.tensors`` (name -> tensor).

    ``switch(version)`` moves to another version in place: a tensor whose dtype and shape stay the
    same gets only its differing chunks copied over; a tensor whose shape changes is reallocated and
    filled; tensors the target lacks are dropped. Returns the bytes copied. ``verify``: as for
    load_tensors.

    A switch first brings every chunk it will copy into the node cache, and only then touches a
    tensor: a registry that fails or a chunk that fails its check on the way in leaves the model as
    it was, at its ``.version``. A failure once the copies have begun (a cached chunk found damaged
    and the registry unable to send it again) leaves a mix of both versions: ``.version`` is then
    None, and the next switch refills every tensor.
    """

    def __init__(self, family: str, version: str, device: str | torch.device = "cpu", node: Node | None = None,
                 verify: bool = True):
        self.device = target_device(device)  # before anything is asked of the node
        self._own = node is None
        self.closed = False
        if node is not None:
            node.check_open()
        self.node = node or Node()
        try:
            self.family = family
            self.copier = Copier(self.node.cache, self.device, self.node.remote.pool, verify)  # see load_tensors
            self.version: str | None = version
            self.info, self.tensors = build(self.node, family, version, self.copier)
        except BaseException:  # no object to close later: its client, threads and buffers go now
            self.close()
            raise
        self.loaded_bytes = sum(t.nbytes for t in self.tensors.values())  # the pieces tile every tensor

    def switch(self, version: str) -> int:
        if self.closed:  # its client is closed: httpx's RuntimeError, or the pool's, said so
            raise InvalidRequest("this ResidentModel is closed: make a new one (its tensors stay as they are)")
        self.node.check_open("this ResidentModel loads through ")
        family, before = self.family, self.version
        target, new, realloc, todo = self._plan(version)
        # Tensors are touched only from here on: whatever stops the switch now leaves a mix.
        self.info, self.version = None, None  # set again only once every copy has landed
        try:
            for name in list(self.tensors):
                if name not in new:
                    del self.tensors[name]
            for name in realloc:  # one at a time, each old one freed as its new one comes: no higher peak
                self.tensors.pop(name, None)
                self.tensors[name] = self.copier.empty(new[name][0])
            copied = fill(self.node, target, new, self.copier, self.tensors, todo, cached=True,
                          outcome="the switch stopped partway")
        except RegistryError as exc:
            raise _reworded(exc, f"switch of {family} to {version} stopped partway: {exc}; the tensors are a mix of "
                                 f"{before or 'versions'} and {version}, and .version is None: switch again (to any "
                                 "version: it refills every tensor) or make a new ResidentModel") from None
        self.info, self.version = target, version
        self.node.cache.record_pull(family, version)
        return copied

    def _plan(self, version: str):
        """What a switch to ``version`` copies, with every chunk of it brought into the node cache,
        before any tensor of the model is touched: (document, its layout, names of the tensors to
        reallocate, pieces to copy by name)."""
        family, before = self.family, self.version
        target, needed = None, []
        try:
            target = self.node.fetcher.version(family, version)
            # After a failed switch the tensors are in an unknown state: refill everything.
            old, new = (layout(self.info) if self.info is not None else {}), layout(target)
            realloc, todo = [], {}
            for name, (span, pieces) in new.items():
                prior = old.get(name)
                t = self.tensors.get(name)
                same = (prior is not None and t is not None and prior[0].dtype == span.dtype
                        and prior[0].shape == span.shape and tuple(t.shape) == span.shape
                        and t.dtype == self.copier.empty_dtype(span))
                if not same:
                    realloc.append(name)
                    todo[name] = pieces
                    continue
                have = {(p.start, p.chunk.size, p.chunk.id) for p in prior[1]}
                todo[name] = [p for p in pieces if (p.start, p.chunk.size, p.chunk.id) not in have]
            needed = chunk_ids({name: (None, pieces) for name, pieces in todo.items()})
            self.node.fetcher.ensure(family, needed, target.located, target.tiers)
        except RegistryError as exc:
            if needed:
                evict_quietly(self.node.cache, needed)  # the limit holds after a failed switch too
            kept = (f"nothing changed: the model still holds {before}" if before else
                    "nothing changed: the model still holds the mix a failed switch left")
            if isinstance(exc, NotFound) and target is not None:
                gone = gone_meanwhile(self.node.fetcher, target, exc, "switched to", kept)
                if gone is not exc:
                    raise gone from None
            raise _reworded(exc, f"switch of {family} to {version} failed: {exc}; {kept}") from None
        return target, new, realloc, todo

    def close(self) -> None:
        """Close the node this model opened (one passed in stays open); the tensors stay usable, but
        no switch can be made any more."""
        self.closed = True
        if self._own:
            self.node.close()


def _reworded(exc: RegistryError, message: str) -> RegistryError:
    """``exc``'s kind (which the CLI and callers act on) with ``message``."""
    try:
        return type(exc)(message)
    except TypeError:  # a kind built otherwise: the tree's root still says it
        return RegistryError(message)
