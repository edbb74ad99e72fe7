"""Versions: a family's list, one version's document (what a node reads to pull it), and delete."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from mfsreg.api import metrics
from mfsreg.api.bearer import principal
from mfsreg.api.openapi import FamilyName, VersionName
from mfsreg.api.routes import registry_of, version_model
from mfsreg.registry.auth import Principal
from mfsreg.registry.documents import (
    DeleteResultModel,
    VersionModel,
)
from mfsreg.registry.names import check_name
from mfsreg.registry.store import service

router = APIRouter()


@router.get("/v1/families/{family}/versions", response_model=list[VersionModel], tags=["read"])
def versions(family: FamilyName, request: Request, who: Principal = Depends(principal)):
    check_name("family", family)
    who.require("read", family)
    return [version_model(v) for v in registry_of(request).versions(family)]


# The two documents a node reads are plain JSON values with thousands of entries: returned as a
# JSONResponse they skip FastAPI's per-value encoder, which took about 40% of a version request.
@router.get(
    "/v1/families/{family}/versions/{version}",
    tags=["read"],
    response_class=JSONResponse,
    responses={304: {"description": "The copy the If-None-Match tag names is current: no body"}},
)
def version(family: FamilyName, version: VersionName, request: Request, who: Principal = Depends(principal)):
    """A version with its manifest and, per chunk id it needs, [encoding, stored bytes, basis id, raw bytes, tier].
    Tagged (ETag); with a current If-None-Match the answer is a 304 with no body."""
    check_name("family", family)
    who.require("read", family)
    doc, tag = service.version_doc(registry_of(request), family, version, request.headers.get("if-none-match"))
    metrics.PULLS.labels("version_document").inc()
    if doc is None:  # the node's copy is current (service.version_doc)
        return Response(status_code=304, headers={"ETag": tag})
    return JSONResponse(doc, headers={"ETag": tag})


@router.delete("/v1/families/{family}/versions/{version}", response_model=DeleteResultModel, tags=["admin"])
def delete(family: FamilyName, version: VersionName, request: Request, who: Principal = Depends(principal)):
    check_name("family", family)
    who.require("admin", family)
    return registry_of(request).delete(family, version, who).to_dict()
