"""Who is asking: a role and the families it may touch. registry/auth.py finds one from a token;
the audit log (registry/store/audit.py) names it. Imports nothing of the registry but its errors."""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

from mfsreg.registry.errors import Forbidden, Unauthorized

ROLES = ("read", "push", "admin")


@dataclass(frozen=True)
class Principal:
    """Who is asking: a role and the families it may touch (anonymous readers get role read, '*')."""

    role: str
    family_pattern: str
    anonymous: bool = False
    token_prefix: str | None = None  # the token's, as `token list` shows it (the audit log names it)
    token_description: str = ""  # the token's --description (a version's pushed_by, a tag move's actor)

    def allows(self, role: str, family: str | None) -> bool:
        if ROLES.index(self.role) < ROLES.index(role):
            return False
        return family is None or fnmatch.fnmatchcase(family, self.family_pattern)

    def require(self, role: str, family: str | None = None) -> None:
        if self.anonymous and role != "read":
            raise Unauthorized("this operation needs a token: set MFSREG_TOKEN (create one with `mfsreg token create`)")
        if ROLES.index(self.role) < ROLES.index(role):
            raise Forbidden(f"this token has role {self.role!r}; the operation needs {role!r}")
        if family is not None and not fnmatch.fnmatchcase(family, self.family_pattern):
            raise Forbidden(f"this token is limited to families matching {self.family_pattern!r}, not {family!r}")


ANONYMOUS_READER = Principal(role="read", family_pattern="*", anonymous=True)
