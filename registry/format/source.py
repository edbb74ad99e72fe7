"""What a push reads: a single .safetensors file, a sharded checkpoint, a model directory, or a
Hugging Face cache folder (its snapshot: registry/format/hfcache.py).

Everything is validated here, before the registry is touched, so that bad input leaves every stored
byte as it was. A directory may hold .safetensors files, a ``*.safetensors.index.json`` that maps
tensors to shards, and small side files (config.json, tokenizer files), which are stored as blobs
and come back on pull. Hidden files and folders (``.git``, ``.cache``) are skipped.
"""

from __future__ import annotations

import errno
import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from mfsreg.registry.errors import InvalidModel, InvalidRequest
from mfsreg.registry.format.manifest import MAX_PATH_BYTES, unsafe_path
from mfsreg.registry.format.safetensors import SafetensorsHeader, read_header

INDEX_SUFFIX = ".safetensors.index.json"
MAX_INDEX_BYTES = 64 << 20


@dataclass(frozen=True)
class SourceFile:
    rel: str  # path inside the version, '/'-separated
    path: Path
    size: int
    header: SafetensorsHeader | None  # None for side files


@dataclass(frozen=True)
class Source:
    files: tuple[SourceFile, ...]
    single_file: bool


def open_source(path: Path) -> Source:
    path = Path(path)
    if path.is_symlink() and not path.exists():
        raise InvalidModel(_dangling(path))
    if not path.exists():
        raise InvalidRequest(f"{path}: no such file or directory")
    if path.is_dir():
        from mfsreg.registry.format import hfcache

        return _directory(hfcache.snapshot(path) if hfcache.is_cache_repo(path) else path)
    _regular(path)
    if path.name.endswith(INDEX_SUFFIX):
        return _index_only(path)
    if path.suffix == ".safetensors":
        return Source((_safetensors(path, path.name),), single_file=True)
    raise InvalidModel(f"{path}: not a .safetensors file, a {INDEX_SUFFIX} index or a model directory")


def _regular(path: Path) -> None:
    """A pipe, socket or device would be read until it ends (a pipe nobody writes to: never)."""
    if not path.is_file():
        raise InvalidModel(
            f"{path}: not a regular file (a pipe, socket or device): push regular files only (a file, or "
            "a model directory of them)"
        )


def _safetensors(path: Path, rel: str) -> SourceFile:
    _regular(path)
    return SourceFile(_storable(rel), path, path.stat().st_size, read_header(path, where=rel))


def _side(path: Path, rel: str) -> SourceFile:
    _regular(path)
    return SourceFile(_storable(rel), path, path.stat().st_size, None)


def _storable(rel: str) -> str:
    """A file's path as a version holds it; refused here where the server would refuse it, so that
    no registry (embedded ones included) stores a version a node would refuse to pull."""
    if unsafe_path(rel):
        raise InvalidModel(
            f"{rel!r}: a version cannot hold this file name (control characters, bytes that are not "
            f"UTF-8, or over {MAX_PATH_BYTES} bytes): rename the file, or move it out of the model"
        )
    return rel


def _walk(root: Path) -> list[Path]:
    """Every file a push of the directory ``root`` stores, in path order; hidden files and folders
    are skipped. Anything else that is not a file to store (a broken link, a link to a folder, a
    pipe, a folder it may not list) is refused, naming it: rglob passed over them without a word,
    and the version was stored without them."""
    out = []

    def unlistable(err: OSError) -> None:
        raise InvalidModel(
            f"{err.filename}: cannot list this folder ({err.strerror}): give read access to it, or move it "
            "out of the model directory"
        ) from None

    for folder, subfolders, names in os.walk(root, onerror=unlistable):
        here = Path(folder)
        subfolders[:] = [d for d in subfolders if not d.startswith(".")]
        for d in subfolders:
            if (here / d).is_symlink():  # os.walk lists it and does not go in
                raise InvalidModel(
                    f"{here / d}: a link to a folder, which a push does not follow: put the folder's "
                    "files there instead, or move the link out of the model directory"
                )
        for name in names:
            p = here / name
            if name.startswith("."):
                continue
            if p.is_symlink() and not p.exists():
                raise InvalidModel(_dangling(p))
            out.append(p)  # a file, a link to one (a Hugging Face snapshot's), or what _regular refuses
    return sorted(out)


def _dangling(link: Path) -> str:
    """What is wrong with a link that leads to no file: Path.exists answers False for a loop too,
    which was reported as "no such file" of a path that ls shows."""
    try:
        link.stat()
    except OSError as err:
        if err.errno == errno.ELOOP:
            return (
                f"{link}: a link that leads back to itself (a loop of links): point it at the model file, or remove it"
            )
    return (
        f"{link}: a link to {os.readlink(link)!r}, which does not exist: restore what it points to, or remove the link"
    )


def _directory(root: Path) -> Source:
    files: list[SourceFile] = []
    for p in _walk(root):
        rel = p.relative_to(root).as_posix()
        files.append(_safetensors(p, rel) if p.suffix == ".safetensors" else _side(p, rel))
    if not any(f.header is not None for f in files):
        raise InvalidModel(f"{root}: no .safetensors file in this directory")
    for f in files:
        if f.rel.endswith(INDEX_SUFFIX):
            _check_index(f.path, f.rel, {x.rel: x for x in files}, PurePosixPath(f.rel).parent)
    return Source(tuple(files), single_file=False)


def _index_only(index: Path) -> Source:
    """An index file named directly: push it and the shards it names (plus nothing else)."""
    root = index.parent
    weight_map = _read_index(index, index.name)
    shards = {}
    for shard in sorted(set(weight_map.values())):
        p = root / shard
        if not p.is_file():
            raise InvalidModel(f"{index.name}: names shard {shard!r}, which is missing beside it")
        shards[shard] = _safetensors(p, shard)
    files = {index.name: _side(index, index.name), **shards}
    _check_index(index, index.name, files, PurePosixPath("."))
    return Source(tuple(files.values()), single_file=False)


def _read_index(path: Path, rel: str) -> dict[str, str]:
    if path.stat().st_size > MAX_INDEX_BYTES:
        raise InvalidModel(f"{rel}: index is over {MAX_INDEX_BYTES} bytes: not a safetensors index")
    try:
        doc = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise InvalidModel(f"{rel}: not valid JSON: a sharded checkpoint needs a valid index") from None
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise InvalidModel(f"{rel}: no weight_map of tensor names to shard files")
    for shard in set(weight_map.values()):
        p = PurePosixPath(shard)
        if p.is_absolute() or ".." in p.parts or not shard.endswith(".safetensors"):
            raise InvalidModel(
                f"{rel}: shard name {shard!r} must be a .safetensors file inside the model directory "
                "(no absolute path, no '..')"
            )
    return weight_map


def _check_index(path: Path, rel: str, files: dict[str, SourceFile], base: PurePosixPath) -> None:
    weight_map = _read_index(path, rel)
    names: dict[str, set[str]] = {}
    for tensor, shard in weight_map.items():
        key = (base / shard).as_posix()
        f = files.get(key)
        if f is None or f.header is None:
            raise InvalidModel(f"{rel}: names shard {shard!r}, which is missing")
        if key not in names:
            names[key] = {t.name for t in f.header.tensors}
        if tensor not in names[key]:
            raise InvalidModel(f"{rel}: tensor {tensor!r} is not in shard {shard!r}")
