"""The `mfsreg` command: a thin Typer layer over the registry library.

Start-up is kept short (benchmarks/cli_startup.py): the command modules import only Typer at load
time, and each command imports the machinery it runs when it runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import typer

from mfsreg.cli import admin, cache, server, stats, tags, versions
from mfsreg.cli.exits import run_guarded

app = typer.Typer(
    name="mfsreg",
    help="Content-addressed registry for families of fine-tuned models.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _show_version(value: bool) -> None:
    if value:
        from mfsreg import __version__

        typer.echo(f"mfsreg {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_show_version, is_eager=True, help="Print mfsreg's version and exit."
    ),
) -> None:
    """Content-addressed registry for families of fine-tuned models."""


app.command()(versions.push)
app.command()(versions.pull)
app.command()(versions.ls)
app.command()(versions.show)
app.command()(versions.delete)
app.add_typer(tags.tag_app, name="tag")
# the list of commands shows a docstring's first paragraph with its line breaks: one line instead
app.command(short_help="Delete the chunks no version needs and give back their space.")(admin.prune)
app.command()(stats.stats)
app.command(short_help="Check that the blob store holds every byte the stored versions need.")(admin.check)
app.command(short_help="Who deleted, pruned, changed a quorum or a token, and when.")(admin.audit)
app.add_typer(admin.db_app, name="db")
app.add_typer(admin.family_app, name="family")
app.command()(server.serve)
app.add_typer(server.token_app, name="token")
app.add_typer(cache.cache_app, name="cache")


def main(args: Sequence[str] | None = None) -> None:
    """Run the command line ``args`` (default: sys.argv[1:]); exits with the command's code."""
    # standalone_mode=False: a usage error (a missing argument, a value of the wrong type, an unknown
    # command) reaches run_guarded, which prints it as one line like every other error
    run_guarded(lambda: app(args=None if args is None else list(args), prog_name="mfsreg", standalone_mode=False))


def entry() -> None:
    """The console script: ``main()``, then an exit that skips the interpreter's teardown of every
    loaded module (about 30 ms of a 0.3 s `mfsreg ls`; benchmarks/cli_startup.py). It runs the atexit
    handlers and flushes the standard streams first, and takes the usual way out while a thread
    other than the main one still runs, so nothing that a normal exit would finish is cut short."""
    try:
        main()
        code = 0
    except SystemExit as exc:
        if not isinstance(exc.code, int | None):
            raise  # a message to print: the interpreter's own exit does that
        code = exc.code or 0
    import threading

    if threading.active_count() > 1:
        raise SystemExit(code)
    import atexit
    import os
    import sys

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can be said on it
            pass
    os._exit(code)


if __name__ == "__main__":
    entry()
