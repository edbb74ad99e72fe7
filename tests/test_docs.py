"""The documentation cannot drift from the code: the settings page is made from the table of
variables, which must name exactly the MFSREG_* variables the code reads; the CLI reference is made
from the Typer app when the site is built; README stays a short front door."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from mfsreg.registry.variables import NAMES, VARIABLES

REPO = Path(__file__).resolve().parent.parent
PACKAGE = ["mfsreg", "registry", "api", "cli", "migrations"]
VARIABLE = re.compile(r"\bMFSREG_[A-Z0-9_]*[A-Z0-9]\b")


def _strings(path: Path) -> list[str]:
    """The string constants of a module (f-strings' literal parts included), docstrings and
    comments aside: the names the code reads, sets and tells users to set."""
    tree = ast.parse(path.read_text(), str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_the_table_of_variables_names_exactly_what_the_code_reads():
    read: dict[str, list[str]] = {}
    for folder in PACKAGE:
        for path in (REPO / folder).rglob("*.py"):
            for text in _strings(path):
                for name in VARIABLE.findall(text):
                    read.setdefault(name, []).append(str(path.relative_to(REPO)))
    assert set(read) - NAMES == set(), {n: read[n] for n in set(read) - NAMES}  # read, not documented
    assert NAMES - set(read) == set()  # documented, never read
    assert len(VARIABLES) == len(NAMES)  # no name twice
    assert all(v.help.strip() and v.default.strip() for v in VARIABLES)


def test_the_settings_page_and_the_cli_reference_are_generated():
    hooks = (REPO / "mkdocs.yml").read_text()
    assert "docs/hooks.py" in hooks
    assert "<!-- mfsreg:variables -->" in (REPO / "docs" / "configuration.md").read_text()
    assert "<!-- mfsreg:cli-reference -->" in (REPO / "docs" / "cli.md").read_text()


def test_the_generated_pages_hold_every_variable_and_every_command():
    """What docs/hooks.py puts in place of the markers (the strict `make docs` build renders it)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("docs_hooks", REPO / "docs" / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    variables = hooks.variables_table()
    assert all(f"`{v.name}`" in variables for v in VARIABLES)
    reference = hooks.cli_reference()
    for command in ("push", "pull", "ls", "show", "delete", "prune", "stats", "check", "serve"):
        assert f"`mfsreg {command}`" in reference, command
    for group, sub in (("db", "upgrade"), ("family", "quorum"), ("token", "create"), ("cache", "warm")):
        assert f"`mfsreg {group} {sub}`" in reference, (group, sub)


def test_readme_is_a_short_front_door():
    readme = (REPO / "README.md").read_text()
    assert len(readme.encode()) <= 10_000
    assert "make demo" in readme and "make test" in readme
    for target in re.findall(r"\]\(([^)#]+)", readme):  # relative links lead to files in the repository
        if "://" not in target:
            assert (REPO / target).resolve().is_relative_to(REPO) and (REPO / target).exists(), target
