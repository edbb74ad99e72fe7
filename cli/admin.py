"""Admin commands on the metadata database: `db upgrade`, `family quorum`."""

from __future__ import annotations

import typer

from cli.output import emit_json

db_app = typer.Typer(help="The metadata database.", no_args_is_help=True)
family_app = typer.Typer(help="Family settings.", no_args_is_help=True)


@db_app.command("upgrade")
def upgrade(json_: bool = typer.Option(False, "--json")) -> None:
    """Apply pending schema migrations to MFSREG_DATABASE_URL (or the embedded database)."""
    from registry.registry import upgrade_database

    rev = upgrade_database()
    if json_:
        emit_json({"revision": rev})
    else:
        typer.echo(f"database schema at revision {rev}")


@family_app.command("quorum")
def quorum(
    family: str = typer.Argument(...),
    value: float = typer.Argument(..., help="Fraction of members that must use a chunk for it to be base, in (0, 1]."),
    json_: bool = typer.Option(False, "--json"),
) -> None:
    """Set a family's base quorum and re-tier its chunks."""
    from registry.registry import Registry

    with Registry() as reg:
        changed = reg.set_base_quorum(family, value)
    if json_:
        emit_json({"family": family, "base_quorum": value, "tier_changes": changed})
    else:
        typer.echo(f"{family}: base quorum {value}; {changed} chunks changed tier")
