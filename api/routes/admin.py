"""Admin routes: prune, check and the audit log."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Query, Request

from mfsreg.api.bearer import principal
from mfsreg.api.openapi import FamilyQuery
from mfsreg.api.routes import audit_model, registry_of
from mfsreg.registry.auth import Principal
from mfsreg.registry.documents import (
    AuditEntryModel,
    CheckResultModel,
    PruneResultModel,
)
from mfsreg.registry.errors import Forbidden
from mfsreg.registry.names import check_name
from mfsreg.registry.store import prune

router = APIRouter()


@router.post("/v1/prune", response_model=PruneResultModel, tags=["admin"])
def prune_registry(
    request: Request,
    who: Principal = Depends(principal),
    min_age: float = Query(
        prune.DEFAULT_MIN_AGE, description="grace period, seconds", json_schema_extra={"minimum": 0}
    ),
    max_unused: float = Query(
        prune.DEFAULT_MAX_UNUSED,
        description="repack a pack with more than this share of unused bytes",
        json_schema_extra={"minimum": 0, "maximum": 1},
    ),
    dry_run: bool = Query(False),
):
    """Delete the chunks no version needs and give back their space (`mfsreg prune`): the whole
    registry, so it needs an admin token for every family."""
    who.require("admin")
    if who.family_pattern != "*":
        raise Forbidden(
            f"prune acts on every family; this token is limited to {who.family_pattern!r}: "
            "use an admin token created with --family '*'"
        )
    return registry_of(request).prune(min_age, max_unused, dry_run, who=who).to_dict()


@router.get("/v1/check", response_model=CheckResultModel, tags=["admin"])
def check_store(
    request: Request,
    who: Principal = Depends(principal),
    family: FamilyQuery = None,
    read_data: bool = Query(False, description="also read, decode and hash every chunk"),
):
    """Whether the blob store holds every byte the stored versions need (`mfsreg check`): one
    family with an admin token for it, the whole registry with one for every family. A check
    finds problems, it is not one: the answer is a 200 either way (``ok``)."""
    if family is not None:
        check_name("family", family)
        who.require("admin", family)
    else:
        who.require("admin")
        if who.family_pattern != "*":
            raise Forbidden(
                f"a check without a family reads every family; this token is limited to "
                f"{who.family_pattern!r}: give --family, or use an admin token created with --family '*'"
            )
    return registry_of(request).check(family, read_data).to_dict()


@router.get("/v1/audit", response_model=list[AuditEntryModel], tags=["admin"])
def audit_log(
    request: Request,
    who: Principal = Depends(principal),
    limit: int = Query(100, ge=1, le=10_000, description="the newest entries, at most this many"),
):
    """Who deleted, pruned, changed a quorum or a token, and when, newest first: every entry for an
    admin token for every family, those about its families for one limited to some."""
    who.require("admin")
    return [audit_model(row) for row in registry_of(request).audit(who, limit)]
