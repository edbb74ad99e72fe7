"""What a POST needs, read off its path before its body is read: the role it needs (and for which
family), and the most bytes its body may hold.

The middlewares (api/auth.py, api/limits.py) check these before FastAPI reads and parses the body;
the routes check again, with the names checked too. See docs/design/protocol.md.
"""

from __future__ import annotations

import re

from mfsreg.api.schemas import MAX_DOWNLOAD_IDS

_DOWNLOAD = re.compile(r"/v1/families/([^/]+)/chunks/download")
_PUSH = re.compile(r"/v1/families/([^/]+)/(?:chunks|versions/[^/]+/(?:negotiate|commit))")
_PRUNE = re.compile(r"/v1/prune")

# A download names at most MAX_DOWNLOAD_IDS ids, 35 bytes each in compact JSON (32 hex digits,
# quotes, a comma): room for twice that and whitespace
MAX_DOWNLOAD_BODY = 80 * MAX_DOWNLOAD_IDS


def role_for(method: str, path: str) -> tuple[str, str | None] | None:
    """(role, family or None) a POST to ``path`` needs; None for other requests."""
    if method != "POST":
        return None
    if m := _DOWNLOAD.fullmatch(path):
        return "read", m[1]
    if m := _PUSH.fullmatch(path):
        return "push", m[1]
    if _PRUNE.fullmatch(path):
        return "admin", None
    return None


def body_limit(method: str, path: str, max_body: int) -> int:
    """The most bytes a request's body may hold: MFSREG_MAX_BODY, less for a download's list of ids."""
    if method == "POST" and _DOWNLOAD.fullmatch(path):
        return min(max_body, MAX_DOWNLOAD_BODY)
    return max_body
