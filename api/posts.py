"""What a POST needs, read off its path before its body is read: the role it needs (and for which
family), and the most bytes its body may hold.

The middlewares (api/bearer.py, api/limits.py) check these before FastAPI reads and parses the body;
the routes check again, with the names checked too. See docs/design/protocol.md.
"""

from __future__ import annotations

import re

from mfsreg.registry.documents import MAX_DOWNLOAD_IDS

_DOWNLOAD = re.compile(r"/v1/families/([^/]+)/chunks/download")
_PUSH = re.compile(r"/v1/families/([^/]+)/(?:chunks|versions/[^/]+/(?:negotiate|commit))")
_MANIFEST = re.compile(r"/v1/families/[^/]+/versions/[^/]+/(?:negotiate|commit)")
_PRUNE = re.compile(r"/v1/prune")
_TAG = re.compile(r"/v1/families/([^/]+)/tags/[^/]+")
MAX_TAG_BODY = 4096  # {"version": NAME}: a name is at most 128 characters
# The web page's sign-in form (a token and a path) and sign-out (no body): anyone may post them,
# token or not, so their bodies are held to what they need before a byte is read
WEB_FORMS = {"/ui/login": 4096, "/ui/logout": 1024}

# A download names at most MAX_DOWNLOAD_IDS ids, 35 bytes each in compact JSON (32 hex digits,
# quotes, a comma): room for twice that and whitespace
MAX_DOWNLOAD_BODY = 80 * MAX_DOWNLOAD_IDS
# A manifest's chunk row is about 57 bytes of JSON: 32 MiB holds 590,000 chunks, 1.1 TB at 2 MiB each
MAX_MANIFEST_BODY = 32 << 20
# A JSON body of this API holds at most one array or object per this many bytes (a manifest's
# densest rows, a tensor's with an empty shape, take 20): checked before it is parsed, since
# parsing a flood of "[]," builds an object per 3 bytes, 20 bytes of memory per byte sent
BYTES_PER_CONTAINER = 16


def role_for(method: str, path: str) -> tuple[str, str | None] | None:
    """(role, family or None) a POST (or a tag's PUT) to ``path`` needs; None for other requests."""
    if method == "PUT" and (m := _TAG.fullmatch(path)):
        return "push", m[1]
    if method != "POST":
        return None
    if m := _DOWNLOAD.fullmatch(path):
        return "read", m[1]
    if m := _PUSH.fullmatch(path):
        return "push", m[1]
    if _PRUNE.fullmatch(path):
        return "admin", None
    return None


def _body_rule(method: str, path: str) -> tuple[int | None, str]:
    """A request's own cap on its body (None: MFSREG_MAX_BODY alone), and what to do past it: only
    an upload's batches can be made smaller by its sender (a 413 told a sign-in form to send smaller
    batches)."""
    if method == "POST" and path in WEB_FORMS:
        return WEB_FORMS[path], "paste the token alone"
    if method == "POST" and _DOWNLOAD.fullmatch(path):
        return MAX_DOWNLOAD_BODY, f"ask for at most {MAX_DOWNLOAD_IDS:,} chunk ids a request"
    if method == "POST" and _MANIFEST.fullmatch(path):
        said = f"(MFSREG_MAX_BODY, at most {MAX_MANIFEST_BODY >> 20} MiB)"
        return MAX_MANIFEST_BODY, f"the version's manifest is larger than this server takes {said}"
    if method == "PUT" and _TAG.fullmatch(path):
        return MAX_TAG_BODY, 'send {"version": NAME} alone'
    return None, "send smaller batches (MFSREG_MAX_BODY)"


def too_large_advice(method: str, path: str) -> str:
    """What to do about a body over its limit, said for the request it is (_body_rule)."""
    return _body_rule(method, path)[1]


def body_limit(method: str, path: str, max_body: int) -> int:
    """The most bytes a request's body may hold: MFSREG_MAX_BODY, less for a download's list of ids,
    a manifest, a tag's move and the web page's forms (_body_rule)."""
    cap = _body_rule(method, path)[0]
    return max_body if cap is None else min(max_body, cap)


def takes_json(method: str, path: str) -> bool:
    """Whether a request's body is a JSON document (checked for its shape before it is parsed)."""
    if method == "PUT":
        return bool(_TAG.fullmatch(path))
    return method == "POST" and bool(_DOWNLOAD.fullmatch(path) or _MANIFEST.fullmatch(path))


def json_shape_problem(body: bytes) -> str | None:
    """What is wrong with a JSON body's shape, seen without parsing it; None if nothing."""
    containers = body.count(b"[") + body.count(b"{")
    if containers > len(body) // BYTES_PER_CONTAINER + 64:
        return (
            f"the request's JSON holds {containers:,} arrays and objects in {len(body):,} bytes, more than "
            f"one per {BYTES_PER_CONTAINER} bytes, which no request of this API needs: send the document "
            "the route's schema describes (see /docs)"
        )
    return None
