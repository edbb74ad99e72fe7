"""Which registry a command talks to: the embedded default, or a server when MFSREG_URL is set."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:
    from mfsreg.registry.client.remote import RemoteRegistry
    from mfsreg.registry.interface import RegistryClient
    from mfsreg.registry.registry import Registry

RegistryOption = typer.Option(
    None,
    "--registry",
    envvar="MFSREG_URL",
    show_envvar=True,
    help="URL of an mfsreg server; without it the embedded registry under MFSREG_HOME is used.",
)


# The same option for the node cache's commands, which have no embedded registry to fall back on.
ServerOption = typer.Option(
    None,
    "--registry",
    envvar="MFSREG_URL",
    show_envvar=True,
    help="URL of the mfsreg server whose chunks the node cache holds (required: the cache serves a server).",
)


@contextmanager
def open_backend(url: str | None = None, *, blobs: bool = True) -> Iterator[RegistryClient]:
    """Yield the registry the command talks to, as the one interface both kinds implement
    (registry/interface.py): a server's client with MFSREG_URL, else the embedded one. ``blobs=False`` for a
    command that reads or changes only the database (ls, show, stats, delete): the embedded registry
    then runs whatever MFSREG_BLOB_URL and the MFSREG_S3_* settings hold, since it never opens the store."""
    if url:
        backend: RegistryClient = server_client(url)
    else:
        backend = embedded(blobs=blobs)  # mypy checks that both fit the interface
    try:
        yield backend
    finally:
        backend.close()


def server_client(url: str) -> RemoteRegistry:
    """A client of the server at ``url``, with MFSREG_TOKEN (an empty one counts as unset)."""
    from mfsreg.registry.client.remote import RemoteRegistry

    return RemoteRegistry(url, token=os.environ.get("MFSREG_TOKEN") or None)


def embedded(*, blobs: bool = True) -> Registry:
    """The embedded Registry. With ``blobs`` (a command that opens the blob store) a malformed
    MFSREG_BLOB_URL, or for an s3 one a malformed MFSREG_S3_* timeout or attempts, is refused here,
    before the database is opened (or, on a new MFSREG_HOME, made); without, they are never looked
    at: the store opens only on first use, and such a command has none."""
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    return Registry(Settings.from_env(blobs=blobs))


def local_only(command: str) -> None:
    """Refuse a command that acts on the metadata database directly while MFSREG_URL names a
    server: it would change (or create) a local registry the user did not mean."""
    url = os.environ.get("MFSREG_URL")
    if url:
        from mfsreg.registry.errors import InvalidRequest

        raise InvalidRequest(
            f"`mfsreg {command}` acts on the registry's database directly, not through a server, and "
            f"MFSREG_URL is set ({url}): run it where the database is (MFSREG_DATABASE_URL), without MFSREG_URL"
        )
