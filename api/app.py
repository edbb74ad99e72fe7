"""The mfsreg HTTP API. Stateless: every request goes to the shared database and blob store, so
several processes can serve one registry behind a load balancer.

Push protocol: negotiate (which chunks are missing; the manifest may still lack its file sha256s)
-> upload batches of missing chunks (each one re-hashed by the server) -> commit with the complete
manifest (the version becomes visible). Pull: read the version's manifest
and chunk table, then download batches of chunks as a stream.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Query, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mfsreg.api import errors, hub, metrics, openapi, tags, web
from mfsreg.api.auth import Authenticate, principal
from mfsreg.api.limits import BodyLimit, read_body
from mfsreg.api.metrics import Metrics
from mfsreg.api.openapi import RESPONSES, FamilyName, FamilyQuery, VersionName
from mfsreg.api.query import strict_query
from mfsreg.api.requestid import RequestId
from mfsreg.api.schemas import (
    AuditEntryModel,
    CheckResultModel,
    CommitRequest,
    DeleteResultModel,
    DownloadRequest,
    FamilyModel,
    NegotiateRequest,
    NegotiateResponse,
    PruneResultModel,
    PushResultModel,
    UploadResponse,
    VersionModel,
)
from mfsreg.api.streams import broken_off
from mfsreg.registry import prune, service
from mfsreg.registry.auth import Principal
from mfsreg.registry.config import Settings
from mfsreg.registry.errors import Forbidden
from mfsreg.registry.meta import check_meta
from mfsreg.registry.names import check_name
from mfsreg.registry.registry import Registry
from mfsreg.registry.results import timestamp


def create_app(settings: Settings | None = None, registry: Registry | None = None) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        reg = registry or Registry(settings or Settings.from_env())
        app.state.registry = reg
        try:
            if registry is None:  # a store that cannot be opened fails the start, not the first push
                reg.open_blobs()
            yield
        finally:
            if registry is None:
                reg.close()

    from mfsreg import __version__

    app = FastAPI(
        title="mfsreg",
        version=__version__,
        summary="Content-addressed registry for families of fine-tuned models.",
        lifespan=lifespan,
        dependencies=[Depends(strict_query)],  # api/query.py: no unknown or repeated query parameters
        responses=RESPONSES,  # the error answers every route may give (api/openapi.py)
        docs_url=None,  # /docs is served from packaged assets (api/openapi.py); ReDoc needs a CDN: none
        redoc_url=None,
    )
    errors.install(app)
    openapi.install(app)
    tags.install(app)
    web.install(app)  # the page at / (api/web/)
    app.add_middleware(
        BodyLimit, max_body=(settings or (registry.settings if registry else Settings.from_env())).max_body
    )
    app.add_middleware(Authenticate)  # runs before BodyLimit: no body is read before the token is checked
    app.add_middleware(RequestId)  # every answer carries the request's id
    app.add_middleware(Metrics)  # added last, so it runs first: it times and counts the whole answer

    def reg_of(request: Request) -> Registry:
        return request.app.state.registry

    @app.head("/healthz", include_in_schema=False)  # load balancers' probes; one operation in the schema
    @app.get("/healthz", tags=["ops"])
    def healthz() -> dict:
        """Liveness: the process answers (it reaches neither the database nor the blob store)."""
        return {"status": "ok"}

    @app.head("/readyz", include_in_schema=False)
    @app.get("/readyz", tags=["ops"])
    def readyz(request: Request) -> dict:
        """Readiness: the database answers and the blob store can be reached (a 503 that says which
        is not, otherwise)."""
        reg_of(request).ping()
        return {"status": "ok"}

    @app.get("/metrics", include_in_schema=False)
    def prometheus(request: Request) -> Response:
        """Prometheus' text format (api/metrics.py); MFSREG_METRICS_TOKEN, where set, is asked for."""
        token = reg_of(request).settings.metrics_token
        status, body, ctype = metrics.exposition(request.headers.get("authorization"), token)
        headers = {"WWW-Authenticate": "Bearer"} if status == 401 else None
        return Response(body, status_code=status, media_type=ctype, headers=headers)

    @app.get("/v1/families", response_model=list[FamilyModel], tags=["read"])
    def families(request: Request, who: Principal = Depends(principal)):
        """Families the caller may read."""
        return [_family_model(f) for f in reg_of(request).families() if who.allows("read", f.name)]

    @app.get("/v1/families/{family}", response_model=FamilyModel, tags=["read"])
    def family(family: FamilyName, request: Request, who: Principal = Depends(principal)):
        """One family: its member count, tier policy and the chunk size every push to it cuts at."""
        check_name("family", family)
        who.require("read", family)
        return _family_model(reg_of(request).family(family))

    @app.get("/v1/families/{family}/versions", response_model=list[VersionModel], tags=["read"])
    def versions(family: FamilyName, request: Request, who: Principal = Depends(principal)):
        check_name("family", family)
        who.require("read", family)
        return [_version_model(v) for v in reg_of(request).versions(family)]

    # The two documents a node reads are plain JSON values with thousands of entries: returned as a
    # JSONResponse they skip FastAPI's per-value encoder, which took about 40% of a version request.
    @app.get(
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
        doc, tag = service.version_doc(reg_of(request), family, version, request.headers.get("if-none-match"))
        metrics.PULLS.labels("version_document").inc()
        if doc is None:  # the node's copy is current (service.version_doc)
            return Response(status_code=304, headers={"ETag": tag})
        return JSONResponse(doc, headers={"ETag": tag})

    @app.get("/v1/families/{family}/chunks", tags=["read"], response_class=JSONResponse)
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
        return JSONResponse(service.tier_doc(reg_of(request), family, tier))

    @app.delete("/v1/families/{family}/versions/{version}", response_model=DeleteResultModel, tags=["admin"])
    def delete(family: FamilyName, version: VersionName, request: Request, who: Principal = Depends(principal)):
        check_name("family", family)
        who.require("admin", family)
        return reg_of(request).delete(family, version, who).to_dict()

    @app.post("/v1/prune", response_model=PruneResultModel, tags=["admin"])
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
        return reg_of(request).prune(min_age, max_unused, dry_run, who=who).to_dict()

    @app.get("/v1/check", response_model=CheckResultModel, tags=["admin"])
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
        return reg_of(request).check(family, read_data).to_dict()

    @app.post("/v1/families/{family}/versions/{version}/negotiate", response_model=NegotiateResponse, tags=["push"])
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
        answer = service.negotiate(reg_of(request), family, version, body.manifest, body.parent, who, body.mend_damaged)
        if not answer["exists"]:
            metrics.CHUNKS.labels("reused").inc(answer["chunks"] - len(answer["missing"]))
        return answer

    @app.post(
        "/v1/families/{family}/chunks",
        response_model=UploadResponse,
        tags=["push"],
        openapi_extra={
            "requestBody": {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}
        },
    )
    async def upload(family: FamilyName, request: Request, who: Principal = Depends(principal)):
        """Step 2: a batch of encoded chunks (registry/wire.py). Each is decoded and re-hashed; a
        chunk whose bytes do not match its id refuses the whole batch."""
        check_name("family", family)
        who.require("push", family)
        body = await read_body(request, reg_of(request).settings.max_body)
        answer = await run_in_threadpool(service.receive_batch, reg_of(request), family, body, who)
        metrics.CHUNKS.labels("stored").inc(answer["received"])
        return answer

    @app.post(
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
            reg_of(request), family, version, body.parent, body.manifest, body.chunk_size, who, meta
        )
        metrics.PUSHES.labels("existed" if result.existed else "created").inc()
        if result.existed:
            response.status_code = 200
        return result.to_dict()

    @app.post(
        "/v1/families/{family}/chunks/download",
        tags=["read"],
        responses={200: {"content": {"application/octet-stream": {}}}},
    )
    def download(family: FamilyName, body: DownloadRequest, request: Request, who: Principal = Depends(principal)):
        """Stored payloads of chunks of this family, streamed as one batch (registry/wire.py)."""
        check_name("family", family)
        who.require("read", family)
        reg = reg_of(request)
        chunks = service.plan_download(reg, family, body.ids)
        stream = broken_off(service.stream_chunks(reg, chunks), f"download of {len(chunks)} chunks of family {family}")
        return StreamingResponse(stream, media_type="application/octet-stream")

    @app.get("/v1/audit", response_model=list[AuditEntryModel], tags=["admin"])
    def audit_log(
        request: Request,
        who: Principal = Depends(principal),
        limit: int = Query(100, ge=1, le=10_000, description="the newest entries, at most this many"),
    ):
        """Who deleted, pruned, changed a quorum or a token, and when, newest first: every entry for an
        admin token for every family, those about its families for one limited to some."""
        who.require("admin")
        return [_audit_model(row) for row in reg_of(request).audit(who, limit)]

    @app.get("/v1/stats", tags=["read"])
    def stats(request: Request, family: FamilyQuery = None, who: Principal = Depends(principal)) -> dict:
        if family is None and who.family_pattern != "*":
            raise Forbidden(f"this token is limited to families matching {who.family_pattern!r}: ask for one family")
        who.require("read", family)
        # a token for some families sees figures of those alone (registry/stats.py)
        visible = None if who.family_pattern == "*" else (lambda name: who.allows("read", name))
        return reg_of(request).stats(family, visible)

    hub.install(app)  # last: its /{family}/{name}/resolve/... path would take some of /v1/'s
    return app


def _audit_model(row) -> AuditEntryModel:
    return AuditEntryModel(
        at=timestamp(row.at), actor=row.actor, action=row.action, family=row.family, detail=row.detail
    )


def _family_model(f) -> FamilyModel:
    return FamilyModel(family=f.name, versions=f.member_count, base_quorum=f.base_quorum, chunk_size=f.chunk_size)


def _version_model(v) -> VersionModel:
    return VersionModel(
        family=v.family,
        version=v.name,
        parent=v.parent,
        digest=v.digest,
        logical_bytes=v.logical_bytes,
        files=v.file_count,
        single_file=v.single_file,
        created_at=timestamp(v.created_at),
        description=v.description,
        labels=v.labels,
        pushed_by=v.pushed_by,
    )
