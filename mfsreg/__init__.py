"""mfsreg: a content-addressed registry for families of fine-tuned models.

The Python API (docs/python.md). Names load on first use, so ``import mfsreg`` stays cheap:

>>> import mfsreg
>>> reg = mfsreg.Registry(mfsreg.Settings.from_env())      # the embedded registry under MFSREG_HOME
>>> remote = mfsreg.RemoteRegistry("http://127.0.0.1:8700")  # a server
>>> tensors = mfsreg.load_tensors("qwen7b", "medical-v3")    # needs the torch extra

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
    "RegistryError": "mfsreg.registry.errors",
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module 'mfsreg' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(_LAZY[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
