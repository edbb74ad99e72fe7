"""One table from the registry's error tree to HTTP problem details (RFC 9457)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match, Route

from mfsreg.api.requestid import request_id
from mfsreg.registry import errors as e
from mfsreg.registry.errors import shown

# uvicorn's own error logger: the lines land in the server's log, in its format, at its level
log = logging.getLogger("uvicorn.error")

STATUS: list[tuple[type[e.RegistryError], int]] = [
    (e.InvalidName, 400),
    (e.InvalidModel, 400),
    (e.InvalidRequest, 400),
    (e.Unauthorized, 401),
    (e.Forbidden, 403),
    (e.NotFound, 404),
    (e.Conflict, 409),
    (e.TooLarge, 413),
    (e.IntegrityError, 422),
    (e.StorageError, 503),
    (e.RegistryError, 500),
]


def status_for(exc: e.RegistryError) -> int:
    for kind, status in STATUS:
        if isinstance(exc, kind):
            return status
    return 500


# A detail is one line a person reads. The messages quote callers' values cut short
# (registry.errors.shown); this bounds any that does not, keeping the advice at the end.
MAX_DETAIL = 1000


# What a client is told of a server-side failure whose message names the server's internals (a
# StorageError without ``public``, or a bug); the operator finds the message in the log, by request id.
GENERAL = {
    503: "the registry's database or blob store failed",
    500: "the registry failed on an unexpected error",
}


def problem(
    status: int, code: str, detail: str, headers: Mapping[str, str] | None = None, request_id: str | None = None
) -> JSONResponse:
    if len(detail) > MAX_DETAIL:
        detail = f"{detail[: MAX_DETAIL - 300]} [...] {detail[-250:]}"
    headers = {**(headers or {}), **({"WWW-Authenticate": "Bearer"} if status == 401 else {})}
    body = {"type": f"urn:mfsreg:{code}", "title": code.replace("_", " "), "status": status, "detail": detail}
    if request_id:
        body["request_id"] = request_id
    return JSONResponse(body, status_code=status, media_type="application/problem+json", headers=headers)


def public_line(exc: e.RegistryError, scope) -> tuple[int, str]:
    """The status and the one line a client is told of ``exc``. A server-side failure (5xx) is
    logged whole with the request's id and told as its public line, which names no database,
    bucket, key or path, and the id."""
    status, rid = getattr(exc, "http_status", None) or status_for(exc), request_id(scope)
    if status < 500:
        return status, str(exc)
    log.warning("request %s: %s", rid, exc)
    if status == 503:
        from mfsreg.api.metrics import storage_error

        storage_error(exc)
    public = getattr(exc, "public", None) or GENERAL.get(status, GENERAL[500])
    return status, f"{public} (request id {rid}: quote it to the registry's operator)"


def error_problem(exc: e.RegistryError, scope) -> JSONResponse:
    """The answer to ``exc`` (public_line's), as problem details."""
    status, line = public_line(exc, scope)
    # http_headers: a Hub client's X-Error-Code, a 416's Content-Range (registry/store/hub.py)
    headers = getattr(exc, "http_headers", None) if status < 500 else None
    return problem(status, exc.code, line, headers, request_id=request_id(scope))


def install(app: FastAPI) -> None:
    @app.exception_handler(e.RegistryError)
    async def _registry_error(req: Request, exc: e.RegistryError):
        return error_problem(exc, req.scope)

    @app.exception_handler(Exception)
    async def _bug(req: Request, exc: Exception):
        # Starlette logs the traceback after this answer is sent; the client gets one line and the id
        rid = request_id(req.scope)
        return problem(
            500,
            "internal_error",
            f"{GENERAL[500]} (request id {rid}: quote it to the registry's operator)",
            request_id=rid,
        )

    @app.exception_handler(ClientDisconnect)
    async def _gone(req: Request, _exc: ClientDisconnect):
        # the client closed its connection before its body was whole: nothing of it is acted on, and
        # nothing is wrong with the server
        return problem(
            400,
            "invalid_request",
            "the client closed the connection before its request body was whole",
            request_id=request_id(req.scope),
        )

    @app.exception_handler(RequestValidationError)
    async def _validation(req: Request, exc: RequestValidationError):
        detail = _validation_detail(req, exc.errors()[0] if exc.errors() else {})
        return problem(422, "invalid_request", detail, request_id=request_id(req.scope))

    @app.exception_handler(StarletteHTTPException)
    async def _http(req: Request, exc: StarletteHTTPException):
        if exc.status_code == 400 and exc.detail == _UNPARSED:  # FastAPI's words for any failure to parse
            return problem(
                400,
                "invalid_request",
                "the request body could not be read as JSON (bad UTF-8, nested too "
                "deep, or a number too long): send a plain JSON object",
                request_id=request_id(req.scope),
            )
        # the exception's headers are part of the answer: a 405's Allow says which methods to use
        headers, detail = dict(exc.headers or {}), str(exc.detail)
        allow = (_allowed(req) or headers.get("Allow")) if exc.status_code == 405 else None
        if allow:
            headers["Allow"] = allow
            detail = f"method {shown(req.method, 20)} is not allowed on this path: use {allow}"
        return problem(exc.status_code, "http_error", detail, headers, request_id(req.scope))


def routes_of(routes) -> list:
    """The app's routes, those of included routers (api/routes/) in their place."""
    out = []
    for route in routes:
        inner = getattr(route, "original_router", None)  # FastAPI's _IncludedRouter
        out.extend(routes_of(inner.routes) if inner is not None else [route])
    return out


def _allowed(req: Request) -> str:
    """Every method some route takes on this path: Starlette's Allow names only the first route's,
    and a path served by two (GET and DELETE of a version) would be told one."""
    methods: set[str] = set()
    for route in routes_of(req.app.router.routes):
        if isinstance(route, Route) and route.matches(req.scope)[0] == Match.PARTIAL:
            methods |= route.methods or set()
    return ", ".join(sorted(methods))


_UNPARSED = "There was an error parsing the body"


def _is_json(ctype: str) -> bool:
    """FastAPI's own rule for a body it parses as JSON: application/json or application/*+json."""
    main, _, sub = ctype.split(";")[0].strip().lower().partition("/")
    return main == "application" and (sub == "json" or sub.endswith("+json"))


def _validation_detail(req: Request, first: dict) -> str:
    """FastAPI's first complaint about a request, in words that say what to send. A body that is not
    JSON, or was not labelled as JSON, reached the route's model as bytes, and read "Input should be
    a valid dictionary"."""
    loc, kind = tuple(first.get("loc", ())), first.get("type")
    if kind == "json_invalid":
        return (
            f"the request body is not valid JSON ({first.get('ctx', {}).get('error', 'decode error')} at character "
            f"{loc[1] if len(loc) > 1 else '?'}): send a JSON object"
        )
    if loc == ("body",) and kind == "missing":
        return "the request body is empty: send a JSON object (see /docs for this route's fields)"
    ctype = req.headers.get("content-type", "")
    if loc == ("body",) and not _is_json(ctype):
        sent = f"Content-Type {ctype[:60]!r}" if ctype else "no Content-Type"
        return f"the request body was sent with {sent}: send it as JSON, with Content-Type: application/json"
    if loc == ("body",) and kind in ("model_attributes_type", "dict_type"):
        return "the request body is JSON but not an object: send a JSON object (see /docs for this route's fields)"
    where = ".".join(str(x) for x in loc)
    return f"{where}: {first.get('msg', 'invalid request')}"
