"""Which registry a command talks to: the embedded default, or a server when MFSREG_URL is set."""

from __future__ import annotations

import os
from contextlib import contextmanager

import typer

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
def open_backend(url: str | None = None, *, blobs: bool = True):
    """Yield an object with push/pull/manifest/families/versions/stats/delete. ``blobs=False`` for a
    command that reads or changes only the database (ls, show, stats, delete): the embedded registry
    then runs whatever MFSREG_BLOB_URL and the MFSREG_S3_* settings hold, since it never opens the store."""
    if url:
        from mfsreg.registry.client.remote import RemoteRegistry

        backend = RemoteRegistry(url, token=os.environ.get("MFSREG_TOKEN") or None)  # empty: unset
    else:
        backend = embedded(blobs=blobs)
    try:
        yield backend
    finally:
        backend.close()


def embedded(*, blobs: bool = True):
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
