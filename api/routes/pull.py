"""Chunk downloads: stored payloads of a family's chunks, streamed as one batch (registry/format/wire.py)."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from mfsreg.api.bearer import principal
from mfsreg.api.openapi import FamilyName
from mfsreg.api.routes import registry_of
from mfsreg.api.streams import broken_off
from mfsreg.registry.auth import Principal
from mfsreg.registry.documents import (
    DownloadRequest,
)
from mfsreg.registry.names import check_name
from mfsreg.registry.store import service

router = APIRouter()


@router.post(
    "/v1/families/{family}/chunks/download",
    tags=["read"],
    responses={200: {"content": {"application/octet-stream": {}}}},
)
def download(family: FamilyName, body: DownloadRequest, request: Request, who: Principal = Depends(principal)):
    """Stored payloads of chunks of this family, streamed as one batch (registry/format/wire.py)."""
    check_name("family", family)
    who.require("read", family)
    reg = registry_of(request)
    chunks = service.plan_download(reg, family, body.ids)
    stream = broken_off(service.stream_chunks(reg, chunks), f"download of {len(chunks)} chunks of family {family}")
    return StreamingResponse(stream, media_type="application/octet-stream")
