"""Routes for tags: list, history, set (PUT) and remove (DELETE). Setting or removing needs a push
token for the family; every move is recorded (registry/store/tags.py)."""

from __future__ import annotations

from fastapi import Depends, FastAPI, Query, Request

from mfsreg.api.bearer import principal
from mfsreg.api.openapi import FamilyName, VersionName
from mfsreg.registry.auth import Principal
from mfsreg.registry.documents import TagEventModel, TagModel, TagMoveModel, TagRequest
from mfsreg.registry.names import check_name

PREFIX = "/v1/families/{family}/tags"
TagName = VersionName  # one namespace per family: a tag's name follows a version's rules


def tags(family: FamilyName, request: Request, who: Principal = Depends(principal)):
    """The family's tags, ``latest`` among them (``automatic`` while it follows the last push)."""
    check_name("family", family)
    who.require("read", family)
    return [t.to_dict() for t in request.app.state.registry.tags(family)]


def history(
    family: FamilyName,
    request: Request,
    who: Principal = Depends(principal),
    tag: str | None = Query(None, description="One tag's moves; without it, every tag's"),
    limit: int = Query(1000, ge=1, le=10_000, description="the newest moves, at most this many"),
):
    """Every move of the family's tags, newest first: who, when, from which version to which."""
    check_name("family", family)
    who.require("read", family)
    return [e.to_dict() for e in request.app.state.registry.tag_history(family, tag, limit)]


def set_tag(family: FamilyName, tag: TagName, body: TagRequest, request: Request, who: Principal = Depends(principal)):
    """Point the tag at a version (made if missing, moved if set). A tag may not take a version's name (409)."""
    check_name("family", family)
    who.require("push", family)
    return request.app.state.registry.tag_set(family, tag, body.version, who).to_dict()


def remove_tag(family: FamilyName, tag: TagName, request: Request, who: Principal = Depends(principal)):
    """Remove the tag; ``latest`` then follows the last push again."""
    check_name("family", family)
    who.require("push", family)
    return request.app.state.registry.tag_rm(family, tag, who).to_dict()


def install(app: FastAPI) -> None:
    """Add the tag routes to ``app`` (added to the app itself, not included as a router, so that
    every route sits in app.router.routes, where the middlewares and the 405 answer look)."""
    route = app.add_api_route
    route(PREFIX, tags, methods=["GET"], response_model=list[TagModel], tags=["tags"])
    route(
        "/v1/families/{family}/tag-history", history, methods=["GET"], response_model=list[TagEventModel], tags=["tags"]
    )
    route(f"{PREFIX}/{{tag}}", set_tag, methods=["PUT"], response_model=TagMoveModel, tags=["tags"])
    route(f"{PREFIX}/{{tag}}", remove_tag, methods=["DELETE"], response_model=TagMoveModel, tags=["tags"])
