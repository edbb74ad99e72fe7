"""Printing results: one JSON object with --json, human tables otherwise."""

from __future__ import annotations

import json

from mfsreg.registry.wording import human_bytes  # noqa: F401  (the CLI's modules import it from here)


def emit_json(obj) -> None:
    print(json.dumps(obj, indent=None, sort_keys=False, default=str))


def table(title: str | None, columns: list[str], rows: list[list], names: int = 1) -> None:
    """The first ``names`` columns hold names, left-justified; the rest right-justified. Where the
    terminal is narrow every cell folds onto more lines instead of being cut: "lastlayers-…" or
    "1021…" no longer says which version or how many bytes."""
    from rich.console import Console  # rich loads when a table is printed, not with every command
    from rich.table import Table

    t = Table(title=title)
    for i, c in enumerate(columns):
        t.add_column(c, justify="left" if i < names else "right", overflow="fold")
    for r in rows:
        t.add_row(*[str(x) for x in r])
    Console().print(t)  # made per table: it reads COLUMNS and finds sys.stdout as they are now
