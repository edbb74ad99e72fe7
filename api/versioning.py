"""ASGI middleware: every /v1/ request's protocol version (registry/protocol.py) is checked before
its token or body, and every /v1/ answer says the server's."""

from __future__ import annotations

from starlette._utils import get_route_path

from mfsreg.api.requestid import with_headers
from mfsreg.registry import protocol
from mfsreg.registry.errors import RegistryError

_HEADER = protocol.HEADER.lower().encode()
_ANSWER = (_HEADER, str(protocol.CURRENT).encode())


class ProtocolVersion:
    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not get_route_path(scope).startswith("/v1/"):
            await self.app(scope, receive, send)
            return

        send_with_version = with_headers(send, [_ANSWER])
        given = [v for k, v in scope.get("headers", ()) if k == _HEADER]
        try:
            if len(given) > 1:
                raise protocol.InvalidRequest(f"the request has {len(given)} {protocol.HEADER} headers: send one")
            protocol.check(given[0].decode("latin-1") if given else None)
        except RegistryError as exc:
            from mfsreg.api.problems import error_problem

            await error_problem(exc, scope)(scope, receive, send_with_version)
            return
        await self.app(scope, receive, send_with_version)
