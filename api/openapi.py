"""What the OpenAPI document says beyond the routes' own models: the error answers every route may
give, as problem details, and the form of family and version names (checked by the routes, which
answer a bad one with a 400 naming it)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import FastAPI, Path, Query
from fastapi.openapi.utils import get_openapi

from mfsreg.registry.documents import Problem
from mfsreg.registry.names import NAME_PATTERN

PROBLEM = "application/problem+json"

# status -> when a route answers it; every route may answer these
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"description": "The request is malformed: a name, a parameter or the body"},
    401: {"description": "No token, or one that is not valid (where anonymous reads are closed)"},
    403: {"description": "The token may not do this to this family"},
    404: {"description": "No such family, version or chunk"},
    409: {"description": "A conflict with what is stored: a version of that name with other content"},
    413: {"description": "The request body is larger than the server takes"},
    422: {"description": "The body does not have the fields this route takes, or bytes do not match their id"},
    503: {"description": "The database or the blob store cannot be reached, or lost data"},
}
RESPONSES: dict[int | str, dict[str, Any]] = {code: {**doc, "model": Problem} for code, doc in ERRORS.items()}

_NAME = {"pattern": NAME_PATTERN, "maxLength": 128, "minLength": 1}
FamilyName = Annotated[str, Path(description="A family's name", json_schema_extra=_NAME)]
VersionName = Annotated[str, Path(description="A version's name", json_schema_extra=_NAME)]
FamilyQuery = Annotated[str | None, Query(description="One family's name", json_schema_extra=_NAME)]


BEARER = {
    "type": "http",
    "scheme": "bearer",
    "description": "An mfsreg token (`mfsreg token create`), sent as `Authorization: Bearer mfs_...`; "
    "read routes take none where the server opens anonymous reads (MFSREG_ANONYMOUS_READ)",
}


def install(app: FastAPI) -> None:
    """Build the document once, with error answers as application/problem+json (FastAPI writes
    every model as application/json)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
            # the bearer token every /v1/ route reads (api/bearer.py): /docs shows an Authorize button
            doc.setdefault("components", {})["securitySchemes"] = {"bearer": BEARER}
            for path, ops in doc["paths"].items():
                if path.startswith("/v1/"):
                    for operation in ops.values():
                        operation["security"] = [{"bearer": []}]
            for operation in (op for path in doc["paths"].values() for op in path.values()):
                for code, answer in operation.get("responses", {}).items():
                    content = answer.get("content", {})
                    if code[0] in "45" and "application/json" in content:
                        content[PROBLEM] = content.pop("application/json")
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to shape the document
    _offline_docs(app)


ASSETS = "/docs-assets"


def _offline_docs(app: FastAPI) -> None:
    """/docs from Swagger UI's files packaged with the server (swagger-ui-bundle), not a CDN: it works
    in an air-gapped cluster. FastAPI's own /docs and /redoc (both from a CDN) are turned off in
    create_app."""
    from fastapi.openapi.docs import get_swagger_ui_html, get_swagger_ui_oauth2_redirect_html
    from fastapi.staticfiles import StaticFiles
    from swagger_ui_bundle import swagger_ui_path

    app.mount(ASSETS, StaticFiles(directory=swagger_ui_path), name="docs-assets")

    @app.get("/docs", include_in_schema=False)
    def docs():
        return get_swagger_ui_html(
            openapi_url="/openapi.json",
            title=f"{app.title} API",
            swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
            swagger_css_url=f"{ASSETS}/swagger-ui.css",
            swagger_favicon_url=f"{ASSETS}/favicon-32x32.png",
            oauth2_redirect_url="/docs/oauth2-redirect",
            swagger_ui_parameters={"persistAuthorization": True},
        )

    @app.get("/docs/oauth2-redirect", include_in_schema=False)
    def oauth2_redirect():
        return get_swagger_ui_oauth2_redirect_html()
