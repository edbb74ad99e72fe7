"""The push protocol's three steps: negotiate (which chunks are missing), upload batches of chunks,
commit (the version becomes visible). See docs/design/protocol.md."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import Response

from mfsreg.api import metrics
from mfsreg.api.bearer import principal
from mfsreg.api.limits import read_body
from mfsreg.api.openapi import FamilyName, VersionName
from mfsreg.api.routes import registry_of
from mfsreg.registry.auth import Principal
from mfsreg.registry.documents import (
    CommitRequest,
    NegotiateRequest,
    NegotiateResponse,
    PushResultModel,
    UploadResponse,
)
from mfsreg.registry.meta import check_meta
from mfsreg.registry.names import check_name
from mfsreg.registry.store import service

router = APIRouter()


@router.post("/v1/families/{family}/versions/{version}/negotiate", response_model=NegotiateResponse, tags=["push"])
def negotiate(
    family: FamilyName,
    version: VersionName,
    body: NegotiateRequest,
    request: Request,
    who: Principal = Depends(principal),
):
    """Step 1 of a push: which of the manifest's chunks must be uploaded."""
    check_name("family", family)
    who.require("push", family)
    answer = service.negotiate(
        registry_of(request), family, version, body.manifest, body.parent, who, body.mend_damaged
    )
    if not answer["exists"]:
        metrics.CHUNKS.labels("reused").inc(answer["chunks"] - len(answer["missing"]))
    return answer


@router.post(
    "/v1/families/{family}/chunks",
    response_model=UploadResponse,
    tags=["push"],
    openapi_extra={
        "requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
    },
)
async def upload(family: FamilyName, request: Request, who: Principal = Depends(principal)):
    """Step 2: a batch of encoded chunks (registry/format/wire.py). Each is decoded and re-hashed; a
    chunk whose bytes do not match its id refuses the whole batch."""
    check_name("family", family)
    who.require("push", family)
    body = await read_body(request, registry_of(request).settings.max_body)
    answer = await run_in_threadpool(service.receive_batch, registry_of(request), family, body, who)
    metrics.CHUNKS.labels("stored").inc(answer["received"])
    return answer


@router.post(
    "/v1/families/{family}/versions/{version}/commit",
    response_model=PushResultModel,
    status_code=201,
    tags=["push"],
    responses={200: {"model": PushResultModel, "description": "The version was already stored with this content"}},
)
def commit(
    family: FamilyName,
    version: VersionName,
    body: CommitRequest,
    request: Request,
    response: Response,
    who: Principal = Depends(principal),
):
    """Step 3: the version becomes visible, atomically, if every chunk is stored. 201 when this
    commit created it; 200 (``existed``) when it was already stored with the same content."""
    check_name("family", family)
    who.require("push", family)
    meta = check_meta(body.description, body.labels)
    result = service.commit(
        registry_of(request), family, version, body.parent, body.manifest, body.chunk_size, who, meta
    )
    metrics.PUSHES.labels("existed" if result.existed else "created").inc()
    if result.existed:
        response.status_code = 200
    return result.to_dict()
