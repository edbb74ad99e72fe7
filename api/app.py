"""The mfsreg HTTP API. Stateless: every request goes to the shared database and blob store, so
several processes can serve one registry behind a load balancer.

Push protocol: negotiate (which chunks are missing; the manifest may still lack its file sha256s)
-> upload batches of missing chunks (each one re-hashed by the server) -> commit with the complete
manifest (the version becomes visible). Pull: read the version's manifest
and chunk table, then download batches of chunks as a stream.
"""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from mfsreg.api import openapi, problems, web
from mfsreg.api.bearer import Authenticate
from mfsreg.api.limits import BodyLimit
from mfsreg.api.metrics import Metrics
from mfsreg.api.openapi import RESPONSES
from mfsreg.api.query import strict_query
from mfsreg.api.requestid import RequestId
from mfsreg.api.routes import admin, families, hub, ops, pull, push, tags, versions
from mfsreg.api.versioning import ProtocolVersion
from mfsreg.registry.config import Settings
from mfsreg.registry.registry import Registry


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
    problems.install(app)
    openapi.install(app)
    tags.install(app)
    web.install(app)  # the page at / (api/web/)
    app.add_middleware(
        BodyLimit, max_body=(settings or (registry.settings if registry else Settings.from_env())).max_body
    )
    app.add_middleware(Authenticate)  # runs before BodyLimit: no body is read before the token is checked
    app.add_middleware(ProtocolVersion)  # before the token: a client of another protocol is told so first
    app.add_middleware(RequestId)  # every answer carries the request's id
    app.add_middleware(Metrics)  # added last, so it runs first: it times and counts the whole answer

    for router in (ops.router, families.router, versions.router, push.router, pull.router, admin.router):
        app.include_router(router)
    hub.install(app)  # last: its /{family}/{name}/resolve/... path would take some of /v1/'s
    return app
