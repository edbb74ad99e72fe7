"""Who is asking: every /v1/ request's principal, from its bearer token (see registry/auth.py).

The token is checked by an ASGI middleware before the request's body is read: FastAPI reads and
parses a route's body before it runs the route's dependencies, so a check made there would let a
caller without a valid token have the server read and parse a body up to MFSREG_MAX_BODY. The
``principal`` dependency hands the routes what the middleware found.
"""

from __future__ import annotations

from fastapi import Request
from starlette._utils import get_route_path
from starlette.concurrency import run_in_threadpool
from starlette.routing import Match

from mfsreg.api.posts import role_for
from mfsreg.api.state import principal_of, set_principal
from mfsreg.registry.auth import Principal, authenticate
from mfsreg.registry.errors import InvalidRequest, RegistryError


class Authenticate:
    """ASGI middleware: a /v1/ request without a valid token is answered 401 (or, where anonymous
    reads are open, goes on as an anonymous reader), and a POST whose token lacks the role it
    needs 401 or 403, before its body is read."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not get_route_path(scope).startswith("/v1/") or _no_route_takes(scope):
            await self.app(scope, receive, send)  # the routes answer it (a method no route takes: 405)
            return
        from mfsreg.api.problems import error_problem

        reg = scope["app"].state.registry
        headers = [v for k, v in scope.get("headers", ()) if k == b"authorization"]
        header = headers[0] if headers else None
        try:
            if len(headers) > 1:  # which one would be meant? (a dict kept the last, so a proxy's won)
                raise InvalidRequest(
                    f"the request has {len(headers)} Authorization headers: send one, 'Authorization: Bearer mfs_...'"
                )
            found = await run_in_threadpool(
                authenticate, reg.engine, header.decode("latin-1") if header else None, reg.settings.anonymous_read
            )
            need = role_for(scope.get("method", ""), get_route_path(scope))
            if need is not None:  # before the body is read and parsed (api/posts.py says why)
                found.require(*need)
        except RegistryError as exc:
            await error_problem(exc, scope)(scope, receive, send)
            return
        set_principal(scope, found)
        await self.app(scope, receive, send)


def _no_route_takes(scope) -> bool:
    """Whether no route takes this request's method on its path (a TRACE, a PUT): answered 405 with
    the methods that are taken, token or not, as an undeclared method is everywhere."""
    from mfsreg.api.problems import routes_of

    matches = [route.matches(scope)[0] for route in routes_of(scope["app"].router.routes)]
    return Match.FULL not in matches and Match.PARTIAL in matches


def principal(request: Request) -> Principal:
    found = principal_of(request.scope)
    if found is None:  # a route the middleware did not see: check the token here
        reg = request.app.state.registry
        found = authenticate(reg.engine, request.headers.get("authorization"), reg.settings.anonymous_read)
        set_principal(request.scope, found)  # the access log names it (api/logs.py)
    return found
