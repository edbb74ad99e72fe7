"""A model resident on a device that switches versions by copying only the chunks that differ."""

from __future__ import annotations

import torch

from registry.client.torch_loader import Copier, Node, build, fill, layout, target_device


class ResidentModel:
    """One version of a family held on ``device`` in ``.tensors`` (name -> tensor).

    ``switch(version)`` moves to another version in place: a tensor whose dtype and shape stay the
    same gets only its differing chunks copied over; a tensor whose shape changes is reallocated and
    filled; tensors the target lacks are dropped. Returns the bytes copied. ``verify``: as for
    load_tensors.
    """

    def __init__(self, family: str, version: str, device: str | torch.device = "cpu", node: Node | None = None,
                 verify: bool = True):
        self.device = target_device(device)  # before anything is asked of the node
        self._own = node is None
        self.node = node or Node()
        try:
            self.family = family
            self.copier = Copier(self.node.cache, self.device, self.node.remote.pool, verify)  # see load_tensors
            self.version = version
            self.info, self.tensors = build(self.node, family, version, self.copier)
        except BaseException:  # no object to close later: its client, threads and buffers go now
            self.close()
            raise
        self.loaded_bytes = sum(t.nbytes for t in self.tensors.values())  # the pieces tile every tensor

    def switch(self, version: str) -> int:
        target = self.node.fetcher.version(self.family, version)
        # After a failed switch the tensors are in an unknown state: refill everything.
        old, new = (layout(self.info) if self.info is not None else {}), layout(target)
        todo = {}
        for name, (span, pieces) in new.items():
            before = old.get(name)
            t = self.tensors.get(name)
            same = (before is not None and t is not None and before[0].dtype == span.dtype and before[0].shape == span.shape
                    and tuple(t.shape) == span.shape and t.dtype == self.copier.empty_dtype(span))
            if not same:
                self.tensors[name] = self.copier.empty(span)
                todo[name] = pieces
                continue
            have = {(p.start, p.chunk.size, p.chunk.id) for p in before[1]}
            todo[name] = [p for p in pieces if (p.start, p.chunk.size, p.chunk.id) not in have]
        for name in list(self.tensors):
            if name not in new:
                del self.tensors[name]
        self.info = None  # set again only once every copy has landed
        copied = fill(self.node, target, new, self.copier, self.tensors, todo,
                      outcome=f"the tensors are part {self.version}, part {version}; the next switch refills them")
        self.info, self.version = target, version
        self.node.cache.record_pull(self.family, version)
        return copied

    def close(self) -> None:
        if self._own:
            self.node.close()
