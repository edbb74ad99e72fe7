"""What each page shows, as plain data for its template: the figures are registry/store/stats.py's (the
same `mfsreg stats` prints), the words registry/wording.py's."""

from __future__ import annotations

from mfsreg.registry.auth import Principal
from mfsreg.registry.errors import NotFound
from mfsreg.registry.names import check_name
from mfsreg.registry.registry import Registry
from mfsreg.registry.wording import human_bytes, in_words, percent

FILTERS = {"bytes": human_bytes, "percent": percent}
BAR_WIDTH = 1000  # the bars' SVG viewBox width
MAX_TENSORS = 500  # rows of a version's tensor table
# a bar's parts, left to right: (key, CSS class, legend)
PARTS = [
    ("base", "base", "shared with base"),
    ("group", "group", "shared with other versions"),
    ("only", "only", "only in this version"),
    ("deltas", "deltas", "only in this version, stored as deltas"),
]


def _visible(who: Principal):
    return None if who.family_pattern == "*" else (lambda name: who.allows("read", name))


def _check(who: Principal, family: str) -> None:
    """The caller's scope, checked before anything is read: a refusal says nothing of what exists."""
    check_name("family", family)
    who.require("read", family)


def _open(reg: Registry, who: Principal, family: str) -> dict:
    """The family's figures, after the caller's scope is checked."""
    _check(who, family)
    return reg.stats(family, _visible(who))


def families(reg: Registry, who: Principal) -> dict:
    """The families the caller may read, with the figures `mfsreg stats -f F` gives for each."""
    items = []
    for s in reg.family_summaries():
        if not who.allows("read", s["family"]):
            continue
        items.append(
            {
                "name": s["family"],
                "versions": s["versions_count"],
                "logical": s["logical_bytes"],
                "stored": s["stored_bytes"],
                "ratio": s["sharing_ratio"],
                "tags": [(t.name, t.version) for t in reg.tags(s["family"])],
            }
        )
    return {"title": "Families", "families": items}


def _parts(shares_of: dict) -> dict[str, int]:
    unique = shares_of["unique"]
    return {
        "base": shares_of["base"]["bytes"],
        "group": shares_of["group"]["bytes"],
        "only": unique["bytes"] - unique["delta_bytes"],
        "deltas": unique["delta_bytes"],
    }


def bar(shares_of: dict, scale: int) -> list[dict]:
    """The SVG rectangles of one version's bar, ``scale`` raw bytes to the whole width."""
    out, x = [], 0.0
    for key, cls, legend in PARTS:
        n = _parts(shares_of)[key]
        width = BAR_WIDTH * n / scale if scale else 0.0
        if n:
            out.append({"cls": cls, "x": round(x, 2), "width": round(width, 2), "title": f"{legend}: {human_bytes(n)}"})
        x += width
    return out


def _tree(rows) -> list[dict]:
    """The lineage as nested nodes: roots are versions without a parent in the family."""
    names = {r.name for r in rows}
    nodes = {r.name: {"name": r.name, "children": []} for r in rows}
    roots = []
    for r in rows:
        if r.parent in names and r.parent != r.name:
            nodes[r.parent]["children"].append(nodes[r.name])
        else:
            roots.append(nodes[r.name])
    return roots


def _heat(matrix: dict) -> list[dict]:
    """Rows of the sharing matrix: each cell the share of the row's bytes the column's version also
    holds, a class of ten shades, and the bytes in its title."""
    out = []
    for i, name in enumerate(matrix["versions"]):
        own = matrix["shared"][i][i]
        cells = []
        for j, other in enumerate(matrix["versions"]):
            n = matrix["shared"][i][j]
            fraction = n / own if own else 0.0
            cells.append(
                {
                    "text": percent(fraction),
                    "cls": f"h{min(9, int(fraction * 10))}",
                    "title": f"{name} shares {human_bytes(n)} ({percent(fraction)} of its bytes) with {other}",
                }
            )
        out.append({"name": name, "cells": cells})
    return out


def family(reg: Registry, who: Principal, name: str) -> dict:
    s = _open(reg, who, name)
    rows = reg.versions(name)
    tags: dict[str, list[str]] = {}
    for t in reg.tags(name):
        tags.setdefault(t.version, []).append(t.name)
    figures = {v["version"]: v for v in s["versions"]}
    rows = [r for r in rows if r.name in figures]  # (one pushed or deleted between the two reads: next time)
    scale = max((sum(_parts(v["shares"]).values()) for v in s["versions"]), default=0)
    versions = [
        {
            "name": r.name,
            "parent": r.parent,
            "size": r.logical_bytes,
            "created": str(r.created_at)[:19],
            "tags": tags.get(r.name, []),
            "words": in_words(figures[r.name]["shares"]),
            "bar": bar(figures[r.name]["shares"], scale),
        }
        for r in rows
    ]
    matrix = reg.sharing_matrix(name)
    return {
        "title": name,
        "family": reg.family(name),
        "stats": s,
        "versions": versions,
        "parts": PARTS,
        "tree": _tree(rows),
        "heat": _heat(matrix),
        "heat_names": matrix["versions"],
        "heat_omitted": matrix["omitted"],
    }


def _commands(base_url: str, family: str, row, single_file: bool) -> list[dict]:
    target = f"-o ./{row.name}.safetensors" if single_file else f"--to-dir ./{row.name}"
    env = f"export MFSREG_URL={base_url}\nexport MFSREG_TOKEN=mfs_...   # a read token for {family}\n"
    return [
        {"id": "pull-cli", "label": "CLI", "text": f"{env}mfsreg pull {family} {row.name} {target}"},
        {
            "id": "pull-python",
            "label": "Python",
            "text": f'{env}python -c \'import mfsreg; tensors = mfsreg.load_tensors("{family}", "{row.name}")\'',
        },
        {
            "id": "pull-hub",
            "label": "Hugging Face (HF_ENDPOINT)",
            "text": (
                f"export HF_ENDPOINT={base_url}\nexport HF_TOKEN=mfs_...   # a read token for {family}\n"
                f"huggingface-cli download {family}/{row.name} --local-dir ./{row.name}"
            ),
        },
    ]


def version(reg: Registry, who: Principal, family: str, name: str, base_url: str = "") -> dict:
    check_name("version", name)
    _check(who, family)
    row, manifest = reg.manifest(family, name)
    s = reg.stats(family, _visible(who))  # after the version is read: a push between still has its figures
    figures = next((v for v in s["versions"] if v["version"] == row.name), None)
    if figures is None:  # deleted between the two reads
        raise NotFound(f"version {family}/{row.name} was deleted just now: see the family's page")
    scale = sum(_parts(figures["shares"]).values())
    tensors = [(f.path, t) for f in manifest.files for t in f.tensors]
    return {
        "title": f"{family}/{row.name}",
        "family_name": family,
        "row": row,
        "asked": name,
        "tags": [t.name for t in reg.tags(family) if t.version == row.name],
        "words": in_words(figures["shares"]),
        "shares": figures["shares"],
        "bar": bar(figures["shares"], scale),
        "parts": PARTS,
        "files": manifest.files,
        "chunk_count": len(manifest.chunk_ids()),
        "tensors": tensors[:MAX_TENSORS],
        "tensor_count": len(tensors),
        "commands": _commands(base_url, family, row, manifest.single_file),
    }
