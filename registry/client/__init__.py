"""The node side: talks to an mfsreg server over HTTP only (a node needs no database driver)."""

from registry.client.remote import RemoteRegistry

__all__ = ["RemoteRegistry"]
