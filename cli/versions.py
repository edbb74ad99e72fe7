"""Commands on versions: push, pull, ls, show, delete."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from mfsreg.cli.backend import RegistryOption, open_backend
from mfsreg.cli.bars import progress_for
from mfsreg.cli.output import emit_json, human_bytes, table
from mfsreg.registry.errors import InvalidRequest
from mfsreg.registry.results import timestamp

JsonOption = typer.Option(False, "--json", help="Print one JSON object (for scripts and CI).")


def push(
    path: str = typer.Argument(..., help="A .safetensors file, a sharded checkpoint's index, or a model directory."),
    family: str = typer.Option(..., "--family", "-f", help="Family name, e.g. qwen7b."),
    version: str = typer.Option(..., "--version", "-v", help="Version name, e.g. medical-v3."),
    parent: str = typer.Option(None, "--parent", help="The version this one was fine-tuned from."),
    mend_damaged: bool = typer.Option(
        False,
        "--mend-damaged",
        help="Read, decode and hash every stored chunk the "
        "version needs (as check --read-data does, costing a pull's reads) and store "
        "again those whose bytes are damaged: a version already stored with this "
        "content is mended, a new one stores them before it commits. Chunks of lost "
        "packs are stored again without it.",
    ),
    description: str = typer.Option(None, "--description", "-d", help="What this version is (shown by show and ls)."),
    label: list[str] = typer.Option(
        None, "--label", "-l", help="KEY=VALUE to find the version by (ls --label); repeat for more."
    ),
    revision: str = typer.Option(
        None, "--revision", help="For a Hugging Face cache folder: the ref or commit id to push (default: main)."
    ),
    json_: bool = JsonOption,
    registry: str = RegistryOption,
) -> None:
    """Store one version of a family; only chunks the registry lacks are written.

    PATH may also be a Hugging Face cache folder (models--org--name): the snapshot refs/main names is pushed."""
    from mfsreg.registry.meta import check_meta, parse_labels

    meta = check_meta(description, parse_labels(label or []))  # refused before anything is read
    source = _given_path(path, "PATH")
    if revision is not None:
        from mfsreg.registry.format.hfcache import snapshot

        source = snapshot(source, revision)
    with open_backend(registry) as reg, progress_for(json_) as progress:
        result = reg.push(
            source, family, version, parent=parent, progress=progress, mend_damaged=mend_damaged, meta=meta
        )
    if json_:
        emit_json(result.to_dict())
        return
    verb = "already stored" if result.existed else "pushed"
    mended = ""
    if result.mended_chunks:
        # a remote push says what it sent; an embedded one stored them itself
        moved = (
            f"{human_bytes(result.sent_bytes)} sent" if result.sent_bytes else f"{human_bytes(result.new_bytes)} stored"
        )
        what = "had lost or damaged" if mend_damaged else "had lost"
        mended = f"; mended {result.mended_chunks} chunks that the blob store {what} ({moved})"
    typer.echo(
        f"{verb} {result.family}/{result.version} {result.digest[:19]}: {human_bytes(result.logical_bytes)} logical, "
        f"{human_bytes(result.new_bytes)} new, {result.reused_chunks}/{result.chunks} chunks reused "
        f"in {result.seconds:.2f}s{mended}"
    )


def pull(
    family: str = typer.Argument(...),
    version: str = typer.Argument(...),
    out: str = typer.Option(None, "--out", "-o", help="A file for a single-file version, a directory otherwise."),
    to_dir: str = typer.Option(
        None,
        "--to-dir",
        help="A directory an engine (vLLM, transformers) loads: every file "
        "of the version, hardlinked from the node cache where the filesystem allows it.",
    ),
    json_: bool = JsonOption,
    registry: str = RegistryOption,
) -> None:
    """Rebuild a version byte for byte, verified against its digests (through the node cache on a server)."""
    if (out is None) == (to_dir is None):
        raise InvalidRequest("give exactly one of --out/-o FILE_OR_DIR and --to-dir DIR")
    out_path = _output(out) if out is not None else None
    dir_path = _given_path(to_dir, "--to-dir") if to_dir is not None else None
    with open_backend(registry) as reg, progress_for(json_) as progress:
        if dir_path is not None:
            # remote: through the node cache, with hardlinks; embedded: written from the packs
            result = reg.pull(family, version, dir_path, progress=progress, to_dir=True)
        else:
            result = reg.pull(family, version, out_path, progress=progress)
    if json_:
        emit_json(result.to_dict())
        return
    extra = ""
    if result.fetched_bytes or result.cached_bytes:
        extra = (
            f" ({human_bytes(result.fetched_bytes)} fetched, {human_bytes(result.cached_bytes)} from the node cache)"
        )
    typer.echo(
        f"pulled {family}/{version} to {result.path}: {human_bytes(result.logical_bytes)} in {result.seconds:.2f}s, verified{extra}"
    )


def _output(value: str) -> Path:
    """-o: a path ending in '/' names a directory, as it does to cp; Path drops the slash, and the
    pull wrote a file of that name where no such directory was."""
    out = _given_path(value, "--out/-o")
    if value.endswith("/") and not out.is_dir():
        raise InvalidRequest(
            f"-o {value}: no such directory: make it first, or drop the trailing '/' to write a file of that name"
        )
    return out


def _given_path(value: str, what: str) -> Path:
    """An empty path (an unset shell variable, most likely) is refused: Path('') is the current
    directory, and a pull there would write over what it holds, a push store all of it."""
    if not value.strip():
        raise InvalidRequest(f"{what} is empty: give a path ('.' for the current directory)")
    return Path(value)


def ls(
    family: str = typer.Argument(None, help="List this family's versions; without it, list families."),
    label: list[str] = typer.Option(
        None, "--label", "-l", help="Only versions with this KEY=VALUE label; repeat to need several."
    ),
    json_: bool = JsonOption,
    registry: str = RegistryOption,
) -> None:
    """List families, or the versions of one family (with their tags, description and labels)."""
    wanted: dict[str, str] = {}
    if label:
        from mfsreg.registry.meta import parse_labels

        wanted = parse_labels(label)
        if family is None:
            raise InvalidRequest(
                "--label filters a family's versions: give the family, e.g. `mfsreg ls FAMILY --label k=v`"
            )
    with open_backend(registry, blobs=False) as reg:
        if family is None:
            _list_families(reg, json_)
            return
        vers = reg.versions(family)
        tagged: dict[str, list[str]] = {}
        for t in _tags(reg, family):
            tagged.setdefault(t.version, []).append(t.name)
    rows = [
        _version_row(v, tagged.get(v.name, [])) for v in vers if all(v.labels.get(k) == x for k, x in wanted.items())
    ]
    if json_:
        emit_json({"family": family, "versions": rows})
        return
    table(
        family,
        ["version", "tags", "parent", "size", "files", "digest", "labels", "description"],
        [
            [
                r["version"],
                ",".join(r["tags"]) or "-",
                r["parent"] or "-",
                human_bytes(r["logical_bytes"]),
                r["files"],
                r["digest"][:19],
                ",".join(f"{k}={v}" for k, v in r["labels"].items()) or "-",
                _short(r["description"]),
            ]
            for r in rows
        ],
        names=3,
    )


def _list_families(reg, json_: bool) -> None:
    rows = [
        dict(family=f.name, versions=f.member_count, base_quorum=f.base_quorum, chunk_size=f.chunk_size)
        for f in reg.families()
    ]
    if json_:
        emit_json({"families": rows})
        return
    table(
        None,
        ["family", "versions", "base quorum", "chunk size"],
        [[r["family"], r["versions"], r["base_quorum"], human_bytes(r["chunk_size"])] for r in rows],
    )


def _version_row(v, tags: list[str]) -> dict[str, Any]:
    """One version as `ls --json` gives it."""
    return {**v.to_dict(), "tags": tags}


def _tags(reg, family: str) -> list:
    """The family's tags; none from a server older than tags (it has no such route)."""
    from mfsreg.registry.errors import NoRoute

    try:
        return reg.tags(family)
    except NoRoute:
        return []


def _short(text: str, limit: int = 40) -> str:
    """A description's first line, cut for a table cell."""
    line = text.splitlines()[0] if text else "-"
    return line if len(line) <= limit else line[: limit - 1] + "…"


def show(
    family: str = typer.Argument(...),
    version: str = typer.Argument(...),
    json_: bool = JsonOption,
    registry: str = RegistryOption,
) -> None:
    """Show one version (or the one a tag names): digest, parent, metadata, files, tensors and chunks."""
    with open_backend(registry, blobs=False) as reg:
        row, manifest = reg.manifest(family, version)
    files: list[dict[str, Any]] = [
        dict(path=f.path, kind=f.kind, size=f.size, sha256=f.sha256, tensors=len(f.tensors), chunks=len(f.chunks))
        for f in manifest.files
    ]
    doc = dict(
        family=row.family,
        version=row.name,
        parent=row.parent,
        digest=row.digest,
        logical_bytes=row.logical_bytes,
        created_at=timestamp(row.created_at),
        pushed_by=row.pushed_by,
        description=row.description,
        labels=row.labels,
        chunks=len(manifest.chunk_ids()),
        files=files,
    )
    if version != row.name:  # named by a tag
        doc["tag"] = version
    if json_:
        emit_json(doc)
        return
    named = f"  (tag {version})" if version != row.name else ""
    typer.echo(f"{row.family}/{row.name}  {row.digest}{named}")
    typer.echo(
        f"parent: {row.parent or '-'}   size: {human_bytes(row.logical_bytes)}   distinct chunks: {doc['chunks']}"
    )
    typer.echo(f"pushed: {doc['created_at']} by {row.pushed_by or '-'}")
    if row.labels:
        typer.echo("labels: " + ", ".join(f"{k}={v}" for k, v in row.labels.items()))
    if row.description:
        typer.echo(f"description: {row.description}")
    table(
        None,
        ["file", "kind", "size", "tensors", "chunks"],
        [[f["path"], f["kind"], human_bytes(f["size"]), f["tensors"], f["chunks"]] for f in files],
    )


def delete(
    family: str = typer.Argument(...),
    version: str = typer.Argument(...),
    json_: bool = JsonOption,
    registry: str = RegistryOption,
) -> None:
    """Delete a version; chunks other versions still need stay stored."""
    with open_backend(registry, blobs=False) as reg:
        result = reg.delete(family, version)
    if json_:
        emit_json(result.to_dict())
        return
    typer.echo(f"deleted {family}/{version}; {result.released_chunks} chunks no longer used by the family")
