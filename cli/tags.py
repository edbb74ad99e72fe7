"""Commands on tags: set, rm, ls (with --history)."""

from __future__ import annotations

import typer

from mfsreg.cli.backend import RegistryOption, open_backend
from mfsreg.cli.output import emit_json, table

tag_app = typer.Typer(
    help="Movable names for versions (prod, staging; latest follows the last push).", no_args_is_help=True
)
JsonOption = typer.Option(False, "--json", help="Print one JSON object (for scripts and CI).")


@tag_app.command("set")
def set_(
    family: str = typer.Argument(...),
    tag: str = typer.Argument(..., help="The tag's name; it may not be one of the family's version names."),
    version: str = typer.Argument(..., help="The version it is to name (or another tag)."),
    json_: bool = JsonOption,
    registry: str = RegistryOption,
) -> None:
    """Point a tag at a version, making or moving it (a server needs a push token for the family)."""
    with open_backend(registry, blobs=False) as reg:
        move = reg.tag_set(family, tag, version)
    if json_:
        emit_json(move.to_dict())
    elif move.before == move.after:
        typer.echo(f"{family}/{tag} already names {move.after}")
    else:
        typer.echo(f"{family}/{tag} -> {move.after}" + (f" (was {move.before})" if move.before else ""))


@tag_app.command("rm")
def rm(
    family: str = typer.Argument(...),
    tag: str = typer.Argument(...),
    json_: bool = JsonOption,
    registry: str = RegistryOption,
) -> None:
    """Remove a tag (the version stays); `latest` then follows the last push again."""
    with open_backend(registry, blobs=False) as reg:
        move = reg.tag_rm(family, tag)
    if json_:
        emit_json(move.to_dict())
    else:
        typer.echo(f"removed {family}/{tag} (it named {move.before})")


@tag_app.command("ls")
def ls(
    family: str = typer.Argument(...),
    history: bool = typer.Option(False, "--history", help="Every move of the tags: who, when, from, to."),
    tag: str = typer.Option(None, "--tag", help="With --history: one tag's moves."),
    json_: bool = JsonOption,
    registry: str = RegistryOption,
) -> None:
    """List a family's tags, or with --history every move of them, newest first."""
    with open_backend(registry, blobs=False) as reg:
        if history:
            events = reg.tag_history(family, tag)
        else:
            tags = reg.tags(family)
    if history:
        rows = [e.to_dict() for e in events]
        if json_:
            emit_json({"family": family, "history": rows})
            return
        table(
            f"{family}: tag moves",
            ["tag", "from", "to", "by", "at"],
            [[r["tag"], r["from_version"] or "-", r["to_version"] or "-", r["actor"], r["at"][:19]] for r in rows],
            names=5,
        )
        return
    rows = [t.to_dict() for t in tags]
    if json_:
        emit_json({"family": family, "tags": rows})
        return
    table(
        family,
        ["tag", "version", "set by", "set at"],
        [
            [r["tag"], r["version"], "(last push)" if r["automatic"] else r["set_by"], (r["set_at"] or "-")[:19]]
            for r in rows
        ],
        names=4,
    )
