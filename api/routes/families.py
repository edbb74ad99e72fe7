"""Families: the list a token may read, one family, its chunks by tier (what `mfsreg cache warm`
fetches) and its sharing figures (/v1/stats)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import JSONResponse

from mfsreg.api.bearer import principal
from mfsreg.api.openapi import FamilyName, FamilyQuery
from mfsreg.api.routes import family_model, registry_of
from mfsreg.registry.auth import Principal
from mfsreg.registry.documents import (
    FamilyModel,
)
from mfsreg.registry.errors import Forbidden
from mfsreg.registry.names import check_name
from mfsreg.registry.store import service

router = APIRouter()


@router.get("/v1/families", response_model=list[FamilyModel], tags=["read"])
def families(request: Request, who: Principal = Depends(principal)):
    """Families the caller may read."""
    return [family_model(f) for f in registry_of(request).families() if who.allows("read", f.name)]


@router.get("/v1/families/{family}", response_model=FamilyModel, tags=["read"])
def family(family: FamilyName, request: Request, who: Principal = Depends(principal)):
    """One family: its member count, tier policy and the chunk size every push to it cuts at."""
    check_name("family", family)
    who.require("read", family)
    return family_model(registry_of(request).family(family))


@router.get("/v1/families/{family}/chunks", tags=["read"], response_class=JSONResponse)
def family_chunks(
    family: FamilyName,
    request: Request,
    tier: str | None = Query(
        None,
        description="One tier; without it, every chunk",
        json_schema_extra={"enum": ["base", "group", "unique"]},
    ),
    who: Principal = Depends(principal),
):
    """The family's chunks of one tier (base, group, unique) or all: what `mfsreg cache warm` fetches."""
    check_name("family", family)
    who.require("read", family)
    return JSONResponse(service.tier_doc(registry_of(request), family, tier))


@router.get("/v1/stats", tags=["read"])
def stats(request: Request, family: FamilyQuery = None, who: Principal = Depends(principal)) -> dict:
    if family is None and who.family_pattern != "*":
        raise Forbidden(f"this token is limited to families matching {who.family_pattern!r}: ask for one family")
    who.require("read", family)
    # a token for some families sees figures of those alone (registry/store/stats.py)
    visible = None if who.family_pattern == "*" else (lambda name: who.allows("read", name))
    return registry_of(request).stats(family, visible)
