"""Prometheus metrics at /metrics (prometheus-client), for the operator's scraper.

Counted per request by the Metrics middleware (route template, method, status, latency, body bytes
each way) and by the routes (pushes, chunks, pulls), and per 503 by api/problems.py. With several
worker processes (`mfsreg serve --workers N`), each writes its samples under
PROMETHEUS_MULTIPROC_DIR, which `serve` sets, and /metrics adds up every worker's; one process
keeps them in memory. MFSREG_METRICS_TOKEN, where set, is the bearer token /metrics asks for.
"""

from __future__ import annotations

import hmac
import os
import time

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, Counter, Histogram, generate_latest

from mfsreg.api.logs import log_request

REQUESTS = Counter("mfsreg_http_requests", "HTTP requests answered", ["route", "method", "status"])
LATENCY = Histogram(
    "mfsreg_http_request_duration_seconds",
    "Time from a request's arrival to the end of its answer",
    ["route", "method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300),
)
RECEIVED = Counter("mfsreg_http_received_bytes", "Request body bytes received", ["route"])
SENT = Counter("mfsreg_http_sent_bytes", "Response body bytes sent", ["route"])
PUSHES = Counter(
    "mfsreg_pushes", "Commits of pushes: a version created, or one that existed with this content", ["outcome"]
)
CHUNKS = Counter(
    "mfsreg_chunks",
    "Chunks of pushes: stored from uploads (stored), or found stored when a new version was negotiated (reused)",
    ["outcome"],
)
PULLS = Counter("mfsreg_pulls", "Version documents served to nodes, and files served through the Hub API", ["kind"])
STORAGE_ERRORS = Counter("mfsreg_storage_errors", "Answers 503: the database or the blob store failed", ["backend"])


def storage_error(exc: BaseException) -> None:
    """Count a 503 by the backend whose code raised it (the deepest frame in registry.db or registry.blobs)."""
    backend, tb = "other", exc.__traceback__
    while tb is not None:
        module = tb.tb_frame.f_globals.get("__name__", "")
        if ".registry.db" in module:
            backend = "database"
        elif ".registry.blobs" in module:
            backend = "blob_store"
        tb = tb.tb_next
    STORAGE_ERRORS.labels(backend).inc()


def exposition(authorization: str | None, token: str | None) -> tuple[int, bytes, str]:
    """(status, body, content type) of GET /metrics: every worker's samples, where ``token`` allows."""
    if token and not hmac.compare_digest((authorization or "").encode(), f"Bearer {token}".encode()):
        return 401, b"/metrics needs Authorization: Bearer <MFSREG_METRICS_TOKEN>\n", "text/plain"
    registry = REGISTRY
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
    return 200, generate_latest(registry), CONTENT_TYPE_LATEST


class Metrics:
    """ASGI middleware: each HTTP request counted once its answer has gone, under its route's
    template (``unmatched`` where no route took it), so the label set stays small; and its access
    line logged (api/logs.py)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        got, out, status = [0], [0], [500]

        async def counting_receive():
            message = await receive()
            if message["type"] == "http.request":
                got[0] += len(message.get("body", b""))
            return message

        async def counting_send(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            elif message["type"] == "http.response.body":
                out[0] += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, counting_receive, counting_send)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = scope.get("method", "")
            REQUESTS.labels(route, method, str(status[0])).inc()
            LATENCY.labels(route, method).observe(time.perf_counter() - t0)
            RECEIVED.labels(route).inc(got[0])
            SENT.labels(route).inc(out[0])
            log_request(scope, status[0], time.perf_counter() - t0, got[0], out[0])
