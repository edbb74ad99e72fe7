"""mfsreg: a content-addressed registry for families of fine-tuned models.

The Python API (docs/python.md). Names load on first use, so ``import mfsreg`` stays cheap:

>>> import mfsreg
>>> reg = mfsreg.open()        # the embedded registry under MFSREG_HOME, or a server if MFSREG_URL is set
>>> tensors = mfsreg.load_tensors("qwen7b", "prod")          # needs the torch extra; embedded or a server
>>> mfsreg.load_into(model, "qwen7b", "medical-v3")          # into an existing torch module

The folders registry/, api/, cli/ and migrations/ install as ``mfsreg.registry``, ``mfsreg.api``,
``mfsreg.cli`` and ``mfsreg.migrations`` (setup.py maps them).
"""

from __future__ import annotations

__version__ = "0.2.0"

# name -> module that defines it; imported by __getattr__ the first time the name is used
_LAZY = {
    "Registry": "mfsreg.registry.registry",
    "Settings": "mfsreg.registry.config",
    "RemoteRegistry": "mfsreg.registry.client.remote",
    "load_tensors": "mfsreg.registry.client.torch_loader",
    "Node": "mfsreg.registry.client.torch_loader",
    "ResidentModel": "mfsreg.registry.client.resident",
    "load_into": "mfsreg.registry.client.into",
    "RegistryError": "mfsreg.registry.errors",
}

# open is left out: `from mfsreg import *` must not hide the builtin open
__all__ = ["__version__", *_LAZY]


def open(url: str | None = None, token: str | None = None):
    """A registry handle: a RemoteRegistry for ``url`` (or MFSREG_URL, with ``token`` or
    MFSREG_TOKEN), else the embedded Registry under MFSREG_HOME. Both push, pull, list, tag and
    delete alike; close it (or use it in a with block) when done."""
    import os

    url = url or os.environ.get("MFSREG_URL") or None
    if url:
        from mfsreg.registry.client.remote import RemoteRegistry

        return RemoteRegistry(url, token=token or os.environ.get("MFSREG_TOKEN") or None)
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    return Registry(Settings.from_env())


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mfsreg' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*__all__, "open"])
