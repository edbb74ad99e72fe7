"""Scoped bearer tokens: roles, family patterns, and the check every API request goes through.

A token is shown once at creation and stored only as its sha256. Roles are ordered: read < push <
admin; each includes the ones before it. A token's family pattern (shell-style, e.g. ``qwen*``)
limits which families it may touch; ``*`` means all. Anonymous reads can be opened by a setting;
anonymous writes never.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import UTC, datetime, timedelta

from mfsreg.registry.db import tokens as token_db
from mfsreg.registry.db.engine import read_tx, write_tx
from mfsreg.registry.errors import InvalidRequest, Unauthorized, shown
from mfsreg.registry.names import NAME_CHARS
from mfsreg.registry.principal import ANONYMOUS_READER, ROLES, Principal  # noqa: F401  (re-exported)

TOKEN_PREFIX = "mfs_"


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


# What a family name may hold (registry/names.py), with shell wildcards: '*', '?' and [classes]. A
# pattern of other characters (a space, an unclosed '[') matches no family a push can create.
_PATTERN = re.compile(rf"(?:[*?{NAME_CHARS}]|\[!?[{NAME_CHARS}]+\])+")  # NAME_CHARS ends in '-': keep it last


MAX_DESCRIPTION = 256
MAX_EXPIRY = 10 * 365 * 86400.0  # seconds


def check_pattern(pattern: str) -> str:
    if not pattern or len(pattern) > 128 or not _PATTERN.fullmatch(pattern):
        raise InvalidRequest(
            f"invalid family pattern {shown(pattern)}: use a family name's characters (letters, digits, "
            "'.', '_', '-') with the wildcards '*', '?' or [abc], e.g. 'qwen*'"
        )
    return pattern


def create_token(
    engine,
    role: str,
    family_pattern: str = "*",
    description: str = "",
    expires_in: float | None = None,
    who: Principal | None = None,
) -> str:
    """Create a token, valid for ``expires_in`` seconds (None: until revoked); returns the secret,
    which is not stored and cannot be shown again. The audit log records it, as done by ``who``."""
    if role not in ROLES:
        raise InvalidRequest(f"unknown role {shown(role, 40)}: use one of {', '.join(ROLES)}")
    check_pattern(family_pattern)
    # kept whole (it was cut at 256 quietly), and on one line of `token list`
    if len(description) > MAX_DESCRIPTION or any(ch < " " or ch == "\x7f" for ch in description):
        raise InvalidRequest(
            f"token description of {len(description):,} characters: give at most {MAX_DESCRIPTION}, "
            "on one line, without control characters"
        )
    if expires_in is not None and not 0 < expires_in <= MAX_EXPIRY:
        raise InvalidRequest(f"token expiry of {expires_in:g} s: give more than zero, at most ten years")
    from mfsreg.registry.store import audit

    secret = TOKEN_PREFIX + secrets.token_urlsafe(32)
    expires_at = datetime.now(UTC) + timedelta(seconds=expires_in) if expires_in is not None else None
    with write_tx(engine) as conn:
        token_db.insert_token(conn, hash_token(secret), secret[:10], role, family_pattern, description, expires_at)
        audit.record(
            conn, who, "token-create", None, token=secret[:10], scope=role, families=family_pattern, expires=expires_at
        )
    return secret


def authenticate(engine, authorization: str | None, anonymous_read: bool) -> Principal:
    """The principal for an Authorization header value (``Bearer <token>``), or raise Unauthorized."""
    if not authorization:
        if anonymous_read:
            return ANONYMOUS_READER
        raise Unauthorized("missing token: set MFSREG_TOKEN (create one with `mfsreg token create`)")
    scheme, _, value = authorization.partition(" ")
    if scheme.lower() != "bearer" or not value.strip():
        raise Unauthorized("malformed Authorization header: send 'Bearer <token>'")
    with read_tx(engine) as conn:
        row = token_db.find_token(conn, hash_token(value.strip()))
    if row is None:
        raise Unauthorized("unknown or revoked token: check MFSREG_TOKEN")
    now = datetime.now(UTC)
    if row.expires_at is not None and _aware(row.expires_at) <= now:
        raise Unauthorized(
            f"token {row.prefix} expired at {_aware(row.expires_at):%Y-%m-%d %H:%M} UTC: create a new one "
            "(`mfsreg token create --expires ...`)"
        )
    if row.last_used_at is None or _aware(row.last_used_at) < now - token_db.USE_GRAIN:
        with write_tx(engine) as conn:  # at most once a minute per token
            token_db.note_use(conn, row.id, now)
    return Principal(
        role=row.role, family_pattern=row.family_pattern, token_prefix=row.prefix, token_description=row.description
    )


def _aware(at: datetime) -> datetime:
    """A stored time as an aware UTC one (SQLite hands back naive UTC)."""
    return at if at.tzinfo is not None else at.replace(tzinfo=UTC)


def list_tokens(engine) -> list[token_db.TokenRow]:
    with read_tx(engine) as conn:
        return token_db.list_tokens(conn)


def revoke_token(engine, prefix: str, who: Principal | None = None) -> int:
    """Revoke the token of ``prefix``; returns how many were (0 or 1). The audit log records it."""
    from mfsreg.registry.store import audit

    with write_tx(engine) as conn:
        n = token_db.revoke(conn, prefix)
        if n:
            audit.record(conn, who, "token-revoke", None, token=prefix)
        return n
