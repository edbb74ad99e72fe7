"""The web page: what each family shares, read-only, served by `mfsreg serve` at ``/``.

Server-rendered HTML (Jinja2 templates beside this file), charts as SVG and tables drawn on the
server, one stylesheet and one small script (copy buttons) from ``/ui/assets/``: nothing comes
from outside the server, and the Content-Security-Policy forbids it, inline scripts and styles
included, and framing.

Sign-in takes an mfsreg token and keeps it in an HttpOnly, SameSite=Strict cookie (Secure over
https); a page asks the same scope checks as /v1/ (registry/auth.py): a token for ``a*`` sees those
families alone, and every figure it sees is of one family, so none depends on the others. Without
a cookie the page is anonymous where MFSREG_ANONYMOUS_READ is on, else it asks to sign in.
"""

from __future__ import annotations

import functools
from pathlib import Path
from urllib.parse import parse_qs, quote, urlsplit

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.concurrency import run_in_threadpool

from mfsreg.api.posts import WEB_FORMS
from mfsreg.api.problems import public_line
from mfsreg.api.requestid import with_headers
from mfsreg.api.web import views
from mfsreg.registry.auth import Principal, authenticate
from mfsreg.registry.errors import InvalidRequest, RegistryError, Unauthorized

HERE = Path(__file__).parent
COOKIE = "mfsreg_session"
MAX_FORM = WEB_FORMS["/ui/login"]  # bytes of a sign-in form (api/limits.BodyLimit refuses more, unread)
SECURITY_HEADERS = [
    (
        b"content-security-policy",
        b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; connect-src 'self'; "
        b"form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"same-origin"),  # no-referrer would make a form's Origin "null"
]


def _templates():
    import jinja2  # loaded with the first page, not with the server's other routes

    env = jinja2.Environment(
        loader=jinja2.FileSystemLoader(HERE / "templates"),
        autoescape=True,
        trim_blocks=True,
        lstrip_blocks=True,
        undefined=jinja2.StrictUndefined,
    )
    env.filters.update(views.FILTERS)
    return env


class SecurityHeaders:
    """ASGI middleware: the page's headers on ``/`` and every ``/ui/`` answer, assets included."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "")
        if scope["type"] != "http" or not (path == "/" or path == "/ui" or path.startswith("/ui/")):
            await self.app(scope, receive, send)
            return

        await self.app(scope, receive, with_headers(send, SECURITY_HEADERS))


def _who(request: Request) -> Principal | None:
    """The cookie's token's principal, an anonymous reader where the server allows, else None."""
    reg = request.app.state.registry
    token = request.cookies.get(COOKIE)
    try:
        return authenticate(reg.engine, f"Bearer {token}" if token else None, reg.settings.anonymous_read)
    except Unauthorized:
        return None


def _local(path: str | None) -> str:
    """Where to go after signing in: a path of this server, never another site."""
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path


@functools.cache
def _env():
    return _templates()


def render(request: Request, template: str, code: int = 200, **context) -> HTMLResponse:
    who = context.pop("who", None)
    body = _env().get_template(template).render(who=who, signed_in=request.cookies.get(COOKIE) is not None, **context)
    return HTMLResponse(body, status_code=code, headers={"Cache-Control": "no-store"})


def page(request: Request, template: str, build) -> Response:
    """``build(registry, who)``'s context in ``template``; a refusal or error as a page of its own;
    without a valid token (and no anonymous reads), to the sign-in page."""
    who = _who(request)
    if who is None:
        gone = COOKIE in request.cookies
        target = f"/ui/login?next={quote(request.url.path)}" + ("&expired=1" if gone else "")
        response = RedirectResponse(target, status_code=303)
        if gone:
            response.delete_cookie(COOKIE, path="/")
        return response
    try:
        context = build(request.app.state.registry, who)
    except RegistryError as exc:
        status, line = public_line(exc, request.scope)
        return render(request, "error.html", status, who=who, status=status, message=line)
    return render(request, template, who=who, **context)


router = APIRouter(include_in_schema=False)  # HTML pages: not in the API's schema


@router.get("/")
def home(request: Request) -> Response:
    return page(request, "families.html", views.families)


@router.get("/ui")
def ui() -> Response:
    return RedirectResponse("/", status_code=308)


@router.get("/ui/families/{family}")
def family(family: str, request: Request) -> Response:
    return page(request, "family.html", lambda reg, who: views.family(reg, who, family))


@router.get("/ui/families/{family}/versions/{version}")
def version(family: str, version: str, request: Request) -> Response:
    base_url = str(request.base_url).rstrip("/")
    return page(request, "version.html", lambda reg, who: views.version(reg, who, family, version, base_url))


@router.get("/ui/login")
def login_form(request: Request, next: str = "/", expired: int = 0) -> Response:
    anonymous = request.app.state.registry.settings.anonymous_read
    message = "Your token is no longer valid: sign in again." if expired else None
    return render(request, "login.html", next=_local(next), anonymous=anonymous, message=message)


def _same_site(request: Request, what: str) -> None:
    """Refuse a form another site's page posted: its Origin names neither this server's Host nor,
    behind a proxy, the X-Forwarded-Host the proxy was asked for. (No Origin: not a browser's form.)"""
    origin = request.headers.get("origin")
    if origin is None:
        return
    ours = {request.headers.get("host"), *(h.strip() for h in request.headers.get("x-forwarded-host", "").split(","))}
    if urlsplit(origin).netloc not in ours - {None, ""}:
        raise InvalidRequest(f"a {what} from another site's page: use this server's own page")


def _secure(request: Request) -> bool:
    """Whether the browser reached the page over https: directly, or through a TLS proxy that said so."""
    forwarded = request.headers.get("x-forwarded-proto", "").split(",")[0].strip().lower()
    return request.url.scheme == "https" or forwarded == "https"


def _sign_in_form(request: Request, body: bytes) -> tuple[str, str]:
    """(token, where to go next) from a sign-in form posted by this server's own page."""
    _same_site(request, "sign-in")
    if len(body) > MAX_FORM:
        raise InvalidRequest(f"a sign-in form of {len(body):,} bytes: send a token, at most {MAX_FORM}")
    form = parse_qs(body.decode("utf-8", "replace"), max_num_fields=4)
    token = (form.get("token") or [""])[0].strip()
    if not token:
        raise InvalidRequest("no token given: paste an mfsreg token (mfs_...)")
    return token, _local((form.get("next") or ["/"])[0])


@router.post("/ui/login")
async def login(request: Request) -> Response:
    reg = request.app.state.registry
    try:
        token, target = _sign_in_form(request, await request.body())
        await run_in_threadpool(authenticate, reg.engine, f"Bearer {token}", False)
    except (RegistryError, ValueError) as exc:
        status = 401 if isinstance(exc, Unauthorized) else 400
        line = str(exc) if isinstance(exc, RegistryError) else "a malformed sign-in form: use the page's form"
        return render(request, "login.html", status, next="/", anonymous=reg.settings.anonymous_read, message=line)
    response = RedirectResponse(target, status_code=303)
    response.set_cookie(COOKIE, token, httponly=True, samesite="strict", secure=_secure(request), path="/")
    return response


@router.post("/ui/logout")
def logout(request: Request) -> Response:
    try:
        _same_site(request, "sign-out")
    except InvalidRequest as exc:
        return render(request, "error.html", 400, status=400, message=str(exc))
    response = RedirectResponse("/ui/login", status_code=303)
    response.delete_cookie(COOKIE, path="/")
    return response


ASSETS = {p.name: p for p in (HERE / "assets").iterdir() if p.is_file()}
_TYPES = {".css": "text/css", ".js": "text/javascript", ".svg": "image/svg+xml"}


@router.get("/ui/assets/{name}")
def asset(name: str) -> Response:
    """The page's packaged files. A route of one path segment, not a mount: a mount at /ui/assets
    would take the Hub's downloads of a family 'ui', version 'assets'."""
    path = ASSETS.get(name)
    if path is None:
        return Response("no such asset", status_code=404, media_type="text/plain")
    headers = {"Cache-Control": "public, max-age=3600"}
    return FileResponse(path, media_type=_TYPES.get(path.suffix, "application/octet-stream"), headers=headers)


def install(app: FastAPI) -> None:
    """The page's routes, its assets and its headers."""
    app.include_router(router)
    app.add_middleware(SecurityHeaders)
