"""Request body limits: an oversized body is refused with 413 before it is buffered, and a JSON
body whose shape no request of this API has with 400 before it is parsed."""

from __future__ import annotations

from fastapi import Request
from starlette._utils import get_route_path

from mfsreg.api.posts import body_limit, json_shape_problem, takes_json, too_large_advice
from mfsreg.registry.errors import InvalidRequest, RegistryError, TooLarge


def _too_large(limit: int, method: str, path: str) -> TooLarge:
    return TooLarge(f"request body is over the {limit} byte limit: {too_large_advice(method, path)}")


class BodyLimit:
    """ASGI middleware: a declared Content-Length over the limit gets 413 at once. A body without
    one (chunked transfer), and any JSON body, is read here up to the limit (413 past it), a JSON
    one's shape checked (json_shape_problem), and replayed to the app: the frameworks inside would
    turn an error raised mid-read into a 400."""

    def __init__(self, app, max_body: int):
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope.get("method", ""), get_route_path(scope)
        length = dict(scope.get("headers", ())).get(b"content-length")
        limit = body_limit(method, path, self.max_body)
        if length is not None and length.isdigit() and int(length) > limit:
            await self._refuse(scope, receive, send, _too_large(limit, method, path))
            return
        json = takes_json(method, path)
        if (length is not None and not json) or method in ("GET", "HEAD", "DELETE", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                # the client went away before its last piece: what came is not the request it meant
                # to send (a commit cut short was carried out, replayed as if whole); no one to answer
                return
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > limit:
                await self._refuse(scope, receive, send, _too_large(limit, method, path))
                return
            if not message.get("more_body", False):
                break
        problem = json_shape_problem(bytes(body)) if json else None
        if problem is not None:
            await self._refuse(scope, receive, send, InvalidRequest(problem))
            return
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, exc: RegistryError):
        from mfsreg.api.problems import error_problem

        await error_problem(exc, scope)(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, counted as it streams in (chunked uploads have no Content-Length to check)."""
    buf = bytearray()
    async for piece in request.stream():  # a client gone midway raises ClientDisconnect (api/problems.py)
        buf += piece
        if len(buf) > limit:
            raise _too_large(limit, request.method, get_route_path(request.scope))
    return bytes(buf)
