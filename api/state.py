"""What a request's scope carries from the token middleware (api/bearer.py) to the routes and the
access log (api/logs.py): who the request was found to be."""

from __future__ import annotations

from mfsreg.registry.principal import Principal

_KEY = "mfsreg.principal"


def principal_of(scope) -> Principal | None:
    """Who the request was found to be, if it got that far."""
    return scope.get("state", {}).get(_KEY)


def set_principal(scope, who: Principal) -> None:
    scope.setdefault("state", {})[_KEY] = who
