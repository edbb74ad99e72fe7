"""The `mfsreg` command: a thin Typer layer over the registry library."""

from __future__ import annotations

import typer

from cli import admin, cache, server, stats, versions
from cli.errors import run_guarded

app = typer.Typer(
    name="mfsreg",
    help="Content-addressed registry for families of fine-tuned models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)
app.command()(versions.push)
app.command()(versions.pull)
app.command()(versions.ls)
app.command()(versions.show)
app.command()(versions.delete)
# the list of commands shows a docstring's first paragraph with its line breaks: one line instead
app.command(short_help="Delete the chunks no version needs and give back their space.")(admin.prune)
app.command()(stats.stats)
app.command(short_help="Check that the blob store holds every byte the stored versions need.")(admin.check)
app.add_typer(admin.db_app, name="db")
app.add_typer(admin.family_app, name="family")
app.command()(server.serve)
app.add_typer(server.token_app, name="token")
app.add_typer(cache.cache_app, name="cache")


def main() -> None:
    # standalone_mode=False: a usage error (a missing argument, a value of the wrong type, an unknown
    # command) reaches run_guarded, which prints it as one line like every other error
    run_guarded(lambda: app(standalone_mode=False))


if __name__ == "__main__":
    main()
