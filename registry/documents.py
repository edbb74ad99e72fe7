"""The API's wire documents: request and response bodies, as pydantic models. The server reads
requests and writes answers with them (api/); the remote client checks the server's answers with
them (client/remote.py), importing this module at its first check. pydantic lives here only.

The two documents a node reads on every load (a version's and a tier's, thousands of chunk rows)
are not models: they are written as plain JSON and checked by hand where they are read
(client/remote.py's chunk_table and manifest_of), which costs a fraction of a model's validation."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class NegotiateRequest(BaseModel):
    parent: str | None = None
    manifest: dict[str, Any] = Field(
        description="The manifest the client computed (files, chunks, tensors). "
        "File sha256s may be null here (a draft): they are required at commit."
    )
    mend_damaged: bool = Field(
        False,
        description="Read, decode and hash every stored chunk the version needs "
        "(where it exists with this content) or reuses (a new version), a pull's reads, and "
        "list under ``mend`` those whose stored bytes are damaged, as well as those lost "
        "(`mfsreg push --mend-damaged`).",
    )


class NegotiateResponse(BaseModel):
    digest: str | None = Field(
        description="The version's digest; null when the manifest was a draft (file sha256s null)."
    )
    exists: bool
    existing_digest: str | None
    existing_layout: str | None = Field(
        None,
        description="The stored version's layout (registry.format.manifest.Manifest."
        "layout: its files' chunks); a push of the same digest and another layout "
        "is refused.",
    )
    missing: list[str] = Field(
        description="Chunk ids the registry lacks, in first-use order; where the version "
        "exists, only those to mend (``mend``)."
    )
    mend: list[str] = Field(
        [],
        description="Those of ``missing`` that are stored, in a pack the blob store lost "
        "(with mend_damaged, or whose stored bytes are damaged): "
        "uploaded, they are stored again and the version that uses them pulls again. Where the "
        "version exists with this content, a client uploads these and commits nothing.",
    )
    mend_damaged: bool = Field(
        False,
        description="Whether ``mend`` also names damaged chunks: the request's "
        "mend_damaged, for a new version and one that exists alike.",
    )
    missing_bytes: int
    chunks: int
    bases: dict[str, str] = Field(description="Suggested delta basis per missing chunk id; send it with the chunk.")


class CommitRequest(BaseModel):
    parent: str | None = Field(None, description="The version (or a tag of it) this one was fine-tuned from")
    manifest: dict[str, Any]
    description: str | None = Field(None, description="What this version is; at most 1024 characters")
    labels: dict[str, str] | None = Field(None, description="KEY: VALUE pairs to find it by (`ls --label`); at most 32")
    chunk_size: int | None = Field(
        None,
        description="The size the manifest was cut at (the family's: GET "
        "/v1/families/{family}); a new family is created with it. A push cut at "
        "another size than an existing family's is refused (409).",
    )


class UploadResponse(BaseModel):
    received: int
    new_bytes: int


MAX_DOWNLOAD_IDS = 100_000


class DownloadRequest(BaseModel):
    ids: list[str] = Field(
        max_length=MAX_DOWNLOAD_IDS,
        description="Chunk ids (xxh3-128, 32 lowercase hex digits) of chunks this family's versions use",
        json_schema_extra={"items": {"type": "string", "pattern": "^[0-9a-f]{32}$"}},
    )


class PushResultModel(BaseModel):
    family: str
    version: str
    digest: str
    logical_bytes: int
    new_bytes: int
    new_chunks: int
    reused_chunks: int
    chunks: int
    files: int
    tier_changes: int
    existed: bool
    seconds: float


class FamilyModel(BaseModel):
    family: str
    versions: int
    base_quorum: float
    chunk_size: int = Field(description="Bytes: every push to the family cuts its tensors at this size.")


class VersionModel(BaseModel):
    family: str
    version: str
    parent: str | None
    digest: str
    logical_bytes: int
    files: int
    single_file: bool
    created_at: str
    description: str = ""
    labels: dict[str, str] = {}
    pushed_by: str = Field("", description="The token that pushed it (its prefix and description), or local:<user>")


class PruneResultModel(BaseModel):
    dry_run: bool
    deleted_chunks: int
    deleted_chunk_bytes: int
    repacked_packs: int
    moved_bytes: int
    retired_packs: int
    deleted_packs: int
    freed_bytes: int
    waiting_packs: int
    waiting_bytes: int
    seconds: float


class DamagedPackModel(BaseModel):
    chunks: int
    first: str


class CheckResultModel(BaseModel):
    scope: str
    versions: int
    chunks: int
    packs: int
    stored_bytes: int
    read_bytes: int
    lost_packs: dict[str, str]
    damaged_chunks: dict[str, str]
    damaged_packs: dict[str, DamagedPackModel]
    unreadable_chunks: int
    unrecorded_chunks: int
    broken_versions: list[str]
    seconds: float
    ok: bool


class DeleteResultModel(BaseModel):
    family: str
    version: str
    tier_changes: int
    released_chunks: int


class Problem(BaseModel):
    """Problem details (RFC 9457): the body of every error answer, as application/problem+json."""

    type: str = Field(description="urn:mfsreg:CODE, e.g. urn:mfsreg:not_found")
    title: str = Field(description="CODE in words")
    status: int = Field(description="The HTTP status, repeated")
    detail: str = Field(description="One line: what is wrong and what to do")
    request_id: str | None = Field(None, description="The request's id, also in its X-Request-ID header")


class AuditEntryModel(BaseModel):
    at: str = Field(description="When, ISO 8601 UTC")
    actor: str = Field(description="A token's prefix, or local:<user> for the embedded CLI")
    action: str = Field(description="delete, prune, quorum, token-create or token-revoke")
    family: str | None
    detail: str = Field(description="What was done, as a JSON object")


class TagModel(BaseModel):
    tag: str
    version: str
    set_by: str
    set_at: str | None
    automatic: bool = Field(False, description="``latest`` while not set by hand: it follows the last push")


class TagRequest(BaseModel):
    version: str = Field(description="The version (or another tag) the tag is to name")


class TagMoveModel(BaseModel):
    family: str
    tag: str
    before: str | None = Field(description="The version it named; null if it was not set")
    after: str | None = Field(description="The version it names now; null once removed")


class TagEventModel(BaseModel):
    tag: str
    from_version: str | None
    to_version: str | None
    actor: str
    at: str
