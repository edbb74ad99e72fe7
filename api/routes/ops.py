"""Operators' routes: liveness (/healthz), readiness (/readyz) and Prometheus metrics (/metrics)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from mfsreg.api import metrics
from mfsreg.api.routes import registry_of

router = APIRouter()


@router.head("/healthz", include_in_schema=False)  # load balancers' probes; one operation in the schema
@router.get("/healthz", tags=["ops"])
def healthz() -> dict:
    """Liveness: the process answers (it reaches neither the database nor the blob store)."""
    return {"status": "ok"}


@router.head("/readyz", include_in_schema=False)
@router.get("/readyz", tags=["ops"])
def readyz(request: Request) -> dict:
    """Readiness: the database answers and the blob store can be reached (a 503 that says which
    is not, otherwise)."""
    registry_of(request).ping()
    return {"status": "ok"}


@router.get("/metrics", include_in_schema=False)
def prometheus(request: Request) -> Response:
    """Prometheus' text format (api/metrics.py); MFSREG_METRICS_TOKEN, where set, is asked for."""
    token = registry_of(request).settings.metrics_token
    status, body, ctype = metrics.exposition(request.headers.get("authorization"), token)
    headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
    return Response(body, status_code=status, media_type=ctype, headers=headers)
