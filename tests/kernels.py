"""The delta codec's three ways to run its kernels, for tests that compare the bytes each writes:
the C module's vector paths, its plain loops, and numpy (codec without the module)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from mfsreg.registry.format import codec

WAYS = ("vector", "plain", "numpy")


@contextmanager
def kernel_way(way: str, monkeypatch=None) -> Iterator[None]:
    """codec runs its kernels ``way`` in the block ("numpy" needs ``monkeypatch``); the vector paths
    are back on after. Where the module was not built, every way is numpy's."""
    module = codec._grouping
    if way == "numpy":
        monkeypatch.setattr(codec, "_grouping", None)
    elif module is not None:
        module.simd(way == "vector")
    try:
        yield
    finally:
        if way == "numpy":
            monkeypatch.setattr(codec, "_grouping", module)
        elif module is not None:
            module.simd(True)
