"""The auth dependency: the request's principal, from its bearer token (see registry/auth.py)."""

from __future__ import annotations

from fastapi import Request

from registry.auth import Principal, authenticate


def principal(request: Request) -> Principal:
    reg = request.app.state.registry
    return authenticate(reg.engine, request.headers.get("authorization"), reg.settings.anonymous_read)
