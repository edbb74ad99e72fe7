"""Family and version names: the one place that says which names are valid.

Names end up in URLs, database rows and (on pull) file names, so they are restricted to a small
alphabet with no path separators and no leading dot.
"""

from __future__ import annotations

import re

from mfsreg.registry.errors import InvalidName, shown

NAME_CHARS = "A-Za-z0-9._-"  # a regex character class's body: what a name may hold
NAME_PATTERN = rf"^[A-Za-z0-9_-][{NAME_CHARS}]{{0,127}}$"  # also in the API's OpenAPI document
_NAME = re.compile(NAME_PATTERN)


def check_name(kind: str, name: str) -> str:
    """Return ``name`` if valid for a family or version, else raise InvalidName."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise InvalidName(
            f"invalid {kind} name {shown(name)}: use 1-128 letters, digits, '.', '_' or '-', not starting with '.'"
        )
    return name


def check_new_name(kind: str, name: str) -> str:
    """``name`` for a family or version a push creates: valid, and not starting with '-', which a
    command line reads as an option (`pull -v base` for family '-v' needs `pull -- -v base`). A name
    an earlier release stored can still be pulled, listed and deleted (check_name)."""
    check_name(kind, name)
    if name.startswith("-"):
        raise InvalidName(
            f"invalid {kind} name {shown(name)}: a new name may not start with '-', which a command line "
            "reads as an option; start it with a letter or digit"
        )
    return name
