"""Request body limits: refuse oversized bodies with 413 before they are buffered."""

from __future__ import annotations

from fastapi import Request
from starlette._utils import get_route_path

from mfsreg.api.posts import body_limit
from mfsreg.api.requestid import request_id
from mfsreg.registry.errors import TooLarge


def _too_large(limit: int) -> TooLarge:
    return TooLarge(f"request body is over the {limit} byte limit: send smaller batches (MFSREG_MAX_BODY)")


class BodyLimit:
    """ASGI middleware: a declared Content-Length over the limit gets 413 at once. A body without
    one (chunked transfer) is read here up to the limit, 413 past it, and replayed to the app:
    the frameworks inside would turn an error raised mid-read into a 400."""

    def __init__(self, app, max_body: int):
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", ()))
        length = headers.get(b"content-length")
        limit = body_limit(scope.get("method", ""), get_route_path(scope), self.max_body)
        if length is not None:
            if length.isdigit() and int(length) > limit:
                await self._refuse(scope, receive, send, limit)
                return
            await self.app(scope, receive, send)
            return
        if scope.get("method") in ("GET", "HEAD", "DELETE", "OPTIONS"):
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
                await self._refuse(scope, receive, send, limit)
                return
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope, receive, send, limit: int):
        from mfsreg.api.errors import problem

        await problem(413, TooLarge.code, str(_too_large(limit)), request_id=request_id(scope))(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, counted as it streams in (chunked uploads have no Content-Length to check)."""
    buf = bytearray()
    async for piece in request.stream():  # a client gone midway raises ClientDisconnect (api/errors.py)
        buf += piece
        if len(buf) > limit:
            raise _too_large(limit)
    return bytes(buf)
