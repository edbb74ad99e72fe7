"""The HTTP API's routes, one module per resource; api/app.py includes their routers in order.
The models' builders below turn the registry's rows into the wire documents (registry/documents.py)."""

from __future__ import annotations

from fastapi import Request

from mfsreg.registry.documents import AuditEntryModel, FamilyModel, VersionModel
from mfsreg.registry.registry import Registry
from mfsreg.registry.results import timestamp


def registry_of(request: Request) -> Registry:
    """The app's Registry (set by create_app's lifespan)."""
    return request.app.state.registry


def audit_model(row) -> AuditEntryModel:
    return AuditEntryModel(
        at=timestamp(row.at), actor=row.actor, action=row.action, family=row.family, detail=row.detail
    )


def family_model(f) -> FamilyModel:
    return FamilyModel(family=f.name, versions=f.member_count, base_quorum=f.base_quorum, chunk_size=f.chunk_size)


def version_model(v) -> VersionModel:
    return VersionModel(**v.to_dict())
