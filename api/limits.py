"""Request body limits: refuse oversized bodies with 413 before they are buffered."""

from __future__ import annotations

from fastapi import Request

from registry.errors import TooLarge


def _too_large(limit: int) -> TooLarge:
    return TooLarge(f"request body is over the {limit} byte limit: send smaller batches (MFSREG_MAX_BODY)")


class BodyLimit:
    """ASGI middleware: a declared Content-Length over the limit gets 413 at once."""

    def __init__(self, app, max_body: int):
        self.app = app
        self.max_body = max_body

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            for name, value in scope.get("headers", ()):
                if name == b"content-length" and value.isdigit() and int(value) > self.max_body:
                    from api.errors import problem

                    resp = problem(413, TooLarge.code, str(_too_large(self.max_body)))
                    await resp(scope, receive, send)
                    return
        await self.app(scope, receive, send)


async def read_body(request: Request, limit: int) -> bytes:
    """The body, counted as it streams in (chunked uploads have no Content-Length to check)."""
    buf = bytearray()
    async for piece in request.stream():
        buf += piece
        if len(buf) > limit:
            raise _too_large(limit)
    return bytes(buf)
