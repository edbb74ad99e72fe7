"""Query strings held to what each route declares.

Starlette hands a route the last value of a repeated parameter and FastAPI passes over the names a
route does not declare, so `POST /v1/prune?dry-run=true` (a typo) ran a real prune, and
`?dry_run=true&dry_run=false` one too. Every route gets this check as an app-wide dependency: a
name the route does not take, or one given twice, is a 400 before the route runs.
"""

from __future__ import annotations

from fastapi import Request

from mfsreg.registry.errors import InvalidRequest

_SHOWN = 64  # characters of a name quoted back: the error line stays short whatever was sent


def _declared(route) -> set[str]:
    """The query names a route takes, its dependencies' included (walked here: FastAPI's own
    flattening helpers are internal, and renamed between releases)."""
    names: set[str] = set()
    todo = [getattr(route, "dependant", None)]
    while todo:
        dependant = todo.pop()
        if dependant is not None:
            names.update(p.alias for p in dependant.query_params)
            todo.extend(dependant.dependencies)
    return names


def strict_query(request: Request) -> None:
    query = request.query_params
    route = request.scope.get("route")
    if not query or "hub" in getattr(route, "tags", ()):  # Hub clients send what the Hub takes (api/routes/hub.py)
        return
    known = _declared(route)
    for name in query.keys():
        shown = name if len(name) <= _SHOWN else name[:_SHOWN] + "..."
        if name not in known:
            takes = ", ".join(sorted(known)) or "none"
            raise InvalidRequest(f"unknown query parameter {shown!r}: this route takes {takes}")
        if len(query.getlist(name)) > 1:
            raise InvalidRequest(f"query parameter {shown!r} is given more than once: give it once")
