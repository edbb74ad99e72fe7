"""`mfsreg stats`: how much is shared, per family, tier and version."""

from __future__ import annotations

import typer

from mfsreg.cli.backend import RegistryOption, open_backend
from mfsreg.cli.output import emit_json, human_bytes, table


def stats(
    family: str = typer.Option(None, "--family", "-f", help="One family; without it, the whole registry."),
    json_: bool = typer.Option(False, "--json", help="Print one JSON object."),
    registry: str = RegistryOption,
) -> None:
    """Logical vs stored bytes, the tiers, and what each version alone holds."""
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
    table(
        "tiers",
        ["tier", "chunks", "stored"],
        [[t, v["chunks"], human_bytes(v["bytes"])] for t, v in s["tiers"].items()],
    )
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
