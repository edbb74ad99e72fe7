"""Queries on API tokens (hashes only; the secrets are never stored)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from sqlalchemy import Connection, or_, select, update

from mfsreg.registry.db.models import tokens

# last_used_at is written at most once a minute per token: a request does not cost a write
USE_GRAIN = timedelta(minutes=1)


@dataclass(frozen=True)
class TokenRow:
    id: int
    prefix: str
    role: str
    family_pattern: str
    description: str
    created_at: datetime
    expires_at: datetime | None
    last_used_at: datetime | None


_COLS = (
    tokens.c.id,
    tokens.c.prefix,
    tokens.c.role,
    tokens.c.family_pattern,
    tokens.c.description,
    tokens.c.created_at,
    tokens.c.expires_at,
    tokens.c.last_used_at,
)


def insert_token(
    conn: Connection,
    token_hash: str,
    prefix: str,
    role: str,
    family_pattern: str,
    description: str,
    expires_at: datetime | None = None,
) -> None:
    conn.execute(
        tokens.insert().values(
            token_hash=token_hash,
            prefix=prefix,
            role=role,
            family_pattern=family_pattern,
            description=description,
            expires_at=expires_at,
        )
    )


def find_token(conn: Connection, token_hash: str) -> TokenRow | None:
    """The token of that hash, unless revoked (an expired one is returned: the caller says so)."""
    row = conn.execute(select(*_COLS).where(tokens.c.token_hash == token_hash, tokens.c.revoked_at.is_(None))).first()
    return TokenRow(*row) if row else None


def list_tokens(conn: Connection) -> list[TokenRow]:
    return [
        TokenRow(*r) for r in conn.execute(select(*_COLS).where(tokens.c.revoked_at.is_(None)).order_by(tokens.c.id))
    ]


def note_use(conn: Connection, token_id: int, now: datetime) -> None:
    """Record that the token was used at ``now``, unless that was recorded within USE_GRAIN."""
    conn.execute(
        update(tokens)
        .where(
            tokens.c.id == token_id,
            or_(tokens.c.last_used_at.is_(None), tokens.c.last_used_at < now - USE_GRAIN),
        )
        .values(last_used_at=now)
    )


def revoke(conn: Connection, prefix: str) -> int:
    return conn.execute(
        update(tokens)
        .where(tokens.c.prefix == prefix, tokens.c.revoked_at.is_(None))
        .values(revoked_at=datetime.now(UTC))
    ).rowcount
