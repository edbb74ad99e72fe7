"""The node side: talks to an mfsreg server over HTTP only (a node needs no database driver).

``load_tensors`` and ``ResidentModel`` need torch (the ``torch`` extra); they are imported lazily
so that the rest of the client works without it.
"""

__all__ = ["RemoteRegistry", "load_tensors", "ResidentModel", "Node"]


def __getattr__(name: str):
    # every name loads on first use: a module of the package imports this one first, and must not
    # bring the HTTP client (and what it imports) with it
    if name == "RemoteRegistry":
        from mfsreg.registry.client.remote import RemoteRegistry

        return RemoteRegistry
    if name in ("load_tensors", "Node"):
        from mfsreg.registry.client import torch_loader

        return getattr(torch_loader, name)
    if name == "ResidentModel":
        from mfsreg.registry.client.resident import ResidentModel

        return ResidentModel
    raise AttributeError(name)
