"""The Hugging Face Hub's read routes (registry/store/hub.py): with ``HF_ENDPOINT`` set to this server and
``HF_TOKEN`` to an mfsreg read token, `huggingface_hub` and `transformers` download a version by
repo id ``FAMILY/VERSION`` or ``FAMILY/TAG``. Scopes hold as on /v1/: a token for other families
gets a 403, no token a 401 unless anonymous reads are open. See docs/hub.md."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from mfsreg.api import metrics
from mfsreg.api.bearer import principal
from mfsreg.api.streams import broken_off
from mfsreg.registry.auth import Principal
from mfsreg.registry.errors import Unauthorized
from mfsreg.registry.store import hub


def hub_principal(request: Request) -> Principal:
    """The caller, as for /v1/; a refusal names HF_TOKEN, the variable a Hub client reads."""
    try:
        return principal(request)
    except Unauthorized as exc:
        raise Unauthorized(str(exc).replace("MFSREG_TOKEN", "HF_TOKEN")) from None


def _repo(request: Request, who: Principal, family: str, name: str, revision: str = hub.MAIN) -> hub.Repo:
    who.require("read", family)  # before anything is looked up: a 401/403 says nothing of what exists
    return hub.open_repo(request.app.state.registry, family, name, revision)


def model_info_main(family: str, name: str, request: Request, who: Principal = Depends(hub_principal)):
    return model_info(family, name, hub.MAIN, request, who)


def model_info(family: str, name: str, revision: str, request: Request, who: Principal = Depends(hub_principal)):
    """A version as the Hub describes a model: its commit id (``sha``), files (``siblings``), and
    its description, labels and lineage under ``cardData``."""
    repo = _repo(request, who, family, name, revision)
    row = repo.row
    return JSONResponse(
        {
            "_id": row.digest,
            "id": f"{family}/{name}",
            "modelId": f"{family}/{name}",
            "author": family,
            "sha": repo.commit,
            "lastModified": hub.hub_time(row.created_at),
            "createdAt": hub.hub_time(row.created_at),
            "private": False,
            "disabled": False,
            "gated": False,
            "tags": [f"{k}:{v}" for k, v in row.labels.items()],
            "siblings": [
                {"rfilename": path, "size": f.size, "lfs": {"sha256": f.sha256, "size": f.size, "pointerSize": 0}}
                for path, f in repo.files.items()
            ],
            "cardData": {
                "family": row.family,
                "version": row.name,
                "parent": row.parent,
                "digest": row.digest,
                "description": row.description,
                "labels": row.labels,
                "pushed_by": row.pushed_by,
            },
        }
    )


def tree(
    family: str, name: str, revision: str, request: Request, folder: str = "", who: Principal = Depends(hub_principal)
):
    """The version's files (all of them, recursively: one page), as `list_repo_tree` reads them."""
    repo = _repo(request, who, family, name, revision)
    prefix = folder.strip("/") + "/" if folder.strip("/") else ""
    return JSONResponse(
        [
            {
                "type": "file",
                "path": path,
                "size": f.size,
                "oid": (f.sha256 or "")[: hub.COMMIT_HEX],
                "lfs": {"oid": f.sha256, "size": f.size, "pointerSize": 0},
            }
            for path, f in repo.files.items()
            if path.startswith(prefix)
        ]
    )


def resolve(
    family: str, name: str, revision: str, path: str, request: Request, who: Principal = Depends(hub_principal)
):
    """One file of the version: HEAD for its commit id, ETag (its sha256) and size; GET for its
    bytes, rebuilt from chunks as they are sent, whole or one byte range (206)."""
    repo = _repo(request, who, family, name, revision)
    entry = hub.entry_of(repo, path)
    headers = {
        "X-Repo-Commit": repo.commit,
        "ETag": f'"{entry.sha256}"',
        "Accept-Ranges": "bytes",
        "Content-Type": "application/octet-stream",
    }
    span = hub.parse_range(request.headers.get("range"), entry.size)
    start, stop = span or (0, entry.size)
    headers["Content-Length"] = str(stop - start)
    status = 200
    if span is not None:
        status = 206
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{entry.size}"
    if request.method == "HEAD":
        return Response(status_code=status, headers=headers)
    reg = request.app.state.registry
    metrics.PULLS.labels("hub_file").inc()
    stream = broken_off(hub.read_file(reg, repo, entry, start, stop), f"Hub download of {family}/{name}/{path}")
    return StreamingResponse(stream, status_code=status, headers=headers)


def install(app: FastAPI) -> None:
    """Add the Hub's routes to ``app``, after every /v1/ route (the resolve path would take some of
    theirs). Not in /docs' schema: they follow the Hub's protocol, documented in docs/hub.md."""
    models = "/api/models/{family}/{name}"
    for path, fn, methods in (
        (models, model_info_main, ["GET"]),
        (f"{models}/revision/{{revision}}", model_info, ["GET"]),
        (f"{models}/tree/{{revision}}", tree, ["GET"]),
        (f"{models}/tree/{{revision}}/{{folder:path}}", tree, ["GET"]),
        ("/{family}/{name}/resolve/{revision}/{path:path}", resolve, ["GET", "HEAD"]),
    ):
        app.add_api_route(path, fn, methods=methods, tags=["hub"], include_in_schema=False)
