"""Each request's id: the client's X-Request-ID where it is a short plain token, else a new one. It
is in every response's X-Request-ID header and every error body, and the server's log lines about a
request name it, so that a client's report leads the operator to the details it was not sent."""

from __future__ import annotations

import re
import uuid

HEADER = b"x-request-id"
_TOKEN = re.compile(rb"[A-Za-z0-9._-]{1,64}")


def request_id(scope) -> str | None:
    """The id RequestId gave this request (None outside one)."""
    return scope.get("state", {}).get("request_id")


class RequestId:
    """ASGI middleware, the outermost: sets ``scope["state"]["request_id"]`` and the response header."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = [v for k, v in scope.get("headers", ()) if k == HEADER]
        rid = given[0].decode() if len(given) == 1 and _TOKEN.fullmatch(given[0]) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        await self.app(scope, receive, with_headers(send, [(HEADER, rid.encode())]))


def with_headers(send, headers: list[tuple[bytes, bytes]]):
    """``send`` that sets ``headers`` on the response (replacing any of those names the app set):
    the one way the middlewares here add a header (request id, protocol version, page security)."""
    names = {k for k, _ in headers}

    async def sending(message):
        if message["type"] == "http.response.start":
            kept = [(k, v) for k, v in message.get("headers", ()) if k.lower() not in names]
            message = {**message, "headers": [*kept, *headers]}
        await send(message)

    return sending
