"""Hugging Face cache folders (``models--org--name/`` with blobs/, refs/ and snapshots/): a push of
one stores the snapshot its ``refs/main`` names (or the revision asked for), never the cache's own
files. A folder that has the cache's layout but cannot give a snapshot is refused in one line."""

from __future__ import annotations

import re
from pathlib import Path

from mfsreg.registry.errors import InvalidModel, InvalidRequest, shown

_REVISION = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,127}")


def is_cache_repo(path: Path) -> bool:
    """Whether ``path`` has a cache repo's layout: a snapshots/ folder beside refs/ or blobs/."""
    return (path / "snapshots").is_dir() and ((path / "refs").is_dir() or (path / "blobs").is_dir())


def snapshot(path: Path, revision: str | None = None) -> Path:
    """The snapshot folder of the cache repo ``path`` that ``revision`` names: a ref (refs/REV, by
    default main) or a commit id (snapshots/REV)."""
    if not is_cache_repo(path):
        raise InvalidRequest(
            f"--revision is for a Hugging Face cache folder (models--org--name), and {path} is not one"
        )
    names = sorted(p.name for p in (path / "snapshots").iterdir() if p.is_dir())
    have = (
        f"its snapshots: {', '.join(names[:5])}{' ...' if len(names) > 5 else ''}" if names else "it holds no snapshot"
    )
    ref = revision or "main"
    if not _REVISION.fullmatch(ref):
        raise InvalidRequest(f"--revision {shown(ref)}: give a ref name (main) or a commit id")
    commit = None
    ref_file = path / "refs" / ref
    if ref_file.is_file():
        commit = ref_file.read_text(errors="replace").strip()
        if not _REVISION.fullmatch(commit):
            raise InvalidModel(f"{ref_file}: does not hold a commit id: download the model again, or give --revision")
    elif (path / "snapshots" / ref).is_dir():
        commit = ref
    if commit is None:
        raise InvalidModel(
            f"{path} is a Hugging Face cache folder without refs/{ref}: give --revision with a ref or commit id ({have})"
        )
    folder = path / "snapshots" / commit
    if not folder.is_dir():
        raise InvalidModel(
            f"{path}: refs/{ref} names commit {commit}, which snapshots/ lacks: download it again, or give --revision ({have})"
        )
    return folder
