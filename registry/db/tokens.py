"""Queries on API tokens (hashes only; the secrets are never stored)."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection, select, update

from mfsreg.registry.db.models import tokens


@dataclass(frozen=True)
class TokenRow:
    id: int
    prefix: str
    role: str
    family_pattern: str
    description: str
    created_at: datetime


_COLS = (
    tokens.c.id,
    tokens.c.prefix,
    tokens.c.role,
    tokens.c.family_pattern,
    tokens.c.description,
    tokens.c.created_at,
)


def insert_token(
    conn: Connection, token_hash: str, prefix: str, role: str, family_pattern: str, description: str
) -> None:
    conn.execute(
        tokens.insert().values(
            token_hash=token_hash, prefix=prefix, role=role, family_pattern=family_pattern, description=description
        )
    )


def find_token(conn: Connection, token_hash: str) -> TokenRow | None:
    row = conn.execute(select(*_COLS).where(tokens.c.token_hash == token_hash, tokens.c.revoked_at.is_(None))).first()
    return TokenRow(*row) if row else None


def list_tokens(conn: Connection) -> list[TokenRow]:
    return [
        TokenRow(*r) for r in conn.execute(select(*_COLS).where(tokens.c.revoked_at.is_(None)).order_by(tokens.c.id))
    ]


def revoke(conn: Connection, prefix: str) -> int:
    return conn.execute(
        update(tokens)
        .where(tokens.c.prefix == prefix, tokens.c.revoked_at.is_(None))
        .values(revoked_at=datetime.now(UTC))
    ).rowcount
