"""`mfsreg stats`: how much is shared, per family, tier and version, in plain words.

The figures are registry/store/stats.py's, the same the web page draws; encoding names and the
registry-wide "alone holds" column only under --verbose (and always in --json)."""

from __future__ import annotations

import typer

from mfsreg.cli.backend import RegistryOption, open_backend
from mfsreg.cli.output import emit_json, human_bytes, table
from mfsreg.registry.wording import in_words

TIER_WORDS = {"base": "most versions", "group": "some versions", "unique": "one version"}


def stats(
    family: str = typer.Option(None, "--family", "-f", help="One family; without it, the whole registry."),
    verbose: bool = typer.Option(
        False, "--verbose", "-v", help="Also the encodings and what each version alone holds."
    ),
    json_: bool = typer.Option(False, "--json", help="Print one JSON object (every figure, encodings included)."),
    registry: str = RegistryOption,
) -> None:
    """How much each version shares with base and with other versions, and what only it holds."""
    with open_backend(registry, blobs=False) as reg:
        s = reg.stats(family)
    if json_:
        emit_json(s)
        return
    typer.echo(
        f"{s['scope']}: {s['versions_count']} versions, {human_bytes(s['logical_bytes'])} logical, "
        f"{human_bytes(s['stored_bytes'])} stored, sharing ratio {s['sharing_ratio']:.2f}x"
    )
    if s.get("leftover_bytes"):
        typer.echo(
            f"{human_bytes(s['leftover_bytes'])} in parts of packs that killed writers left: "
            "`mfsreg prune` removes them once older than --min-age"
        )
    for v in s["versions"]:
        if "shares" not in v:  # a server older than these figures: its tables below say the rest
            continue
        name = v["version"] if family else f"{v['family']}/{v['version']}"
        typer.echo(f"  {name} ({human_bytes(v['logical_bytes'])}): {in_words(v['shares'])}")
    table(
        "tiers",
        ["tier", "chunks used by", "chunks", "stored"],
        [[t, TIER_WORDS[t], v["chunks"], human_bytes(v["bytes"])] for t, v in s["tiers"].items()],
        names=2,
    )
    if not verbose:
        return
    if s.get("encodings"):
        table(
            "encodings",
            ["encoding", "chunks", "raw", "stored"],
            [[e, v["chunks"], human_bytes(v["raw_bytes"]), human_bytes(v["bytes"])] for e, v in s["encodings"].items()],
        )
    # with --family every row is that family's: its column would only narrow the others
    named = (lambda v: [v["version"]]) if family else (lambda v: [v["family"], v["version"]])
    table(
        "versions",
        ([] if family else ["family"]) + ["version", "logical", "needs stored", "as deltas", "alone holds"],
        [
            named(v)
            + [
                human_bytes(v["logical_bytes"]),
                human_bytes(v["stored_bytes"]),
                human_bytes(v["delta_bytes"]),
                human_bytes(v["unique_bytes"]),
            ]
            for v in s["versions"]
        ],
        names=1 if family else 2,
    )
