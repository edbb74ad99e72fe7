"""mkdocs hooks: the pages that are generated from the code at build time, so they cannot drift.

- cli.md: the marker line ``<!-- mfsreg:cli-reference -->`` becomes the reference of the Typer app
  (``mfsreg.cli.main.app``), as typer's own ``typer ... utils docs`` would write it.
- configuration.md: the marker line ``<!-- mfsreg:variables -->`` becomes a table of every MFSREG_*
  variable, from ``mfsreg.registry.variables.VARIABLES``.

Registered in mkdocs.yml under ``hooks:``. The two generators are plain functions, so a test can
call them without mkdocs.
"""

from __future__ import annotations

import re

CLI_MARKER = "<!-- mfsreg:cli-reference -->"
VARIABLES_MARKER = "<!-- mfsreg:variables -->"

# who reads a variable, in the words of the table (registry/variables.py: Variable.used_by)
USED_BY = {
    "registry": "registry (embedded and server)",
    "server": "server",
    "client": "client (CLI or Python, against a server)",
    "node": "node",
    "CLI": "CLI",
}


def cli_reference(heading_level: int = 2) -> str:
    """Markdown reference of the ``mfsreg`` command and every subcommand. The top heading is at
    ``heading_level`` (2: under the page's own title), each command group one level deeper."""
    import typer
    import typer.main
    from typer.cli import get_docs_for_click

    from mfsreg.cli.main import app

    command = typer.main.get_command(app)
    docs = get_docs_for_click(
        obj=command,
        ctx=typer.Context(command),
        indent=heading_level - 1,
        name="mfsreg",
        title="`mfsreg`",
    )
    return _escape_help(docs).strip() + "\n"


def variables_table() -> str:
    """Markdown table of every MFSREG_* variable: name, default, who reads it, what it does."""
    from mfsreg.registry.variables import VARIABLES

    rows = ["| variable | default | read by | what it does |", "|---|---|---|---|"]
    for v in VARIABLES:
        default = f"`{v.default}`" if " " not in v.default else v.default
        rows.append(f"| `{v.name}` | {_cell(default)} | {_cell(USED_BY.get(v.used_by, v.used_by))} | {_cell(v.help)} |")
    return "\n".join(rows) + "\n"


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    """mkdocs hook: put the generated parts in place of their marker lines."""
    if CLI_MARKER in markdown:
        markdown = _replace_marker(markdown, CLI_MARKER, cli_reference())
    if VARIABLES_MARKER in markdown:
        markdown = _replace_marker(markdown, VARIABLES_MARKER, variables_table())
    return markdown


def _replace_marker(markdown: str, marker: str, text: str) -> str:
    lines = markdown.splitlines()
    if marker not in (line.strip() for line in lines):
        raise ValueError(f"{marker} must stand on a line of its own")
    return "\n".join(text if line.strip() == marker else line for line in lines) + "\n"


def _cell(text: str) -> str:
    """One table cell: no line breaks, pipes escaped."""
    return " ".join(text.split()).replace("|", "\\|")


_CODE_SPAN = re.compile(r"(`[^`]*`)")


def _escape_text(text: str) -> str:
    """Markdown's special characters in help text (outside code spans) shown as themselves: a
    '*' of a family pattern ('qwen*', [default: *]) would otherwise start emphasis, and a '<'
    an HTML tag."""
    parts = _CODE_SPAN.split(text)
    for i in range(0, len(parts), 2):  # even parts lie outside code spans
        parts[i] = parts[i].replace("\\", "\\\\").replace("*", "\\*").replace("<", "&lt;").replace(">", "&gt;")
    return "".join(parts)


_ITEM = re.compile(r"^(\* `[^`]*`)(.*)$")  # "* `--family <str>`: help"


def _escape_help(docs: str) -> str:
    out, fenced = [], False
    for line in docs.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif fenced or line.startswith("#") or line.startswith("**"):
            pass  # code, headings and the bold section labels typer writes are left as they are
        elif item := _ITEM.match(line):
            line = item.group(1) + _escape_text(item.group(2))
        else:
            line = _escape_text(line)
        out.append(line)
    return "\n".join(out)
