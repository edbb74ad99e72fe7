"""Which registry a command talks to: the embedded default, or a server when MFSREG_URL is set."""

from __future__ import annotations

import os
from contextlib import contextmanager

import typer

RegistryOption = typer.Option(
    None, "--registry", envvar="MFSREG_URL", show_envvar=True,
    help="URL of an mfsreg server; without it the embedded registry under MFSREG_HOME is used.",
)


@contextmanager
def open_backend(url: str | None = None):
    """Yield an object with push/pull/manifest/families/versions/stats/delete."""
    if url:
        from registry.client.remote import RemoteRegistry

        backend = RemoteRegistry(url, token=os.environ.get("MFSREG_TOKEN"))
    else:
        from registry.registry import Registry

        backend = Registry()
    try:
        yield backend
    finally:
        backend.close()
