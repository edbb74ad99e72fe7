"""Result values shared by the embedded registry and the remote client (no database imports)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from datetime import datetime

from mfsreg.registry.errors import Conflict


@dataclass(frozen=True)
class FamilyRow:
    id: int
    name: str
    base_quorum: float
    member_count: int
    chunk_size: int  # bytes: every member is cut at this size, so that they dedup against each other


@dataclass(frozen=True)
class VersionRow:
    id: int
    family: str
    name: str
    parent: str | None
    digest: str
    logical_bytes: int
    file_count: int
    single_file: bool
    created_at: datetime | str
    description: str = ""
    labels: dict[str, str] = field(default_factory=dict)
    pushed_by: str = ""  # a token's prefix and description, or local:<user> (registry/audit.actor_of)

    def to_dict(self) -> dict:
        """As GET /v1/families/F/versions and `ls F --json` write it."""
        return dict(
            family=self.family,
            version=self.name,
            parent=self.parent,
            digest=self.digest,
            logical_bytes=self.logical_bytes,
            files=self.file_count,
            single_file=self.single_file,
            created_at=timestamp(self.created_at),
            description=self.description,
            labels=self.labels,
            pushed_by=self.pushed_by,
        )


@dataclass(frozen=True)
class TagRow:
    name: str
    version: str
    set_by: str
    set_at: datetime | str | None
    automatic: bool = False  # ``latest`` while no one has set it by hand: it follows the last push

    def to_dict(self) -> dict:
        """As `tag ls --json` and GET /v1/families/F/tags write it."""
        at = None if self.set_at is None else timestamp(self.set_at)
        return dict(tag=self.name, version=self.version, set_by=self.set_by, set_at=at, automatic=self.automatic)


@dataclass(frozen=True)
class TagEvent:
    tag: str
    from_version: str | None
    to_version: str | None
    actor: str
    at: datetime | str

    def to_dict(self) -> dict:
        return {**self.__dict__, "at": timestamp(self.at)}


@dataclass(frozen=True)
class TagMove:
    family: str
    tag: str
    before: str | None  # the version it named, None if it was not set
    after: str | None  # the version it names now, None once removed

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class PushResult:
    family: str
    version: str
    digest: str
    logical_bytes: int
    new_bytes: int  # stored (encoded) bytes this push added; through a scoped token, the bytes it sent (registry/store/service.py)
    new_chunks: int
    reused_chunks: int
    chunks: int
    files: int
    tier_changes: int
    existed: bool  # the same version with the same digest was already there: nothing was committed
    seconds: float
    sent_bytes: int = 0  # chunk payload bytes sent to a server (remote pushes; batch framing excluded)
    # chunks stored again because the pack their stored copy lay in was lost (registry/store/lost.py):
    # counted in new_chunks too; a re-push of an existing version (existed) mends only these
    mended_chunks: int = 0

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class DeleteResult:
    family: str
    version: str
    tier_changes: int
    released_chunks: int

    def to_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class PruneResult:
    dry_run: bool
    deleted_chunks: int  # chunk rows no version needs, deleted (or that would be, in a dry run)
    deleted_chunk_bytes: int  # their stored bytes
    repacked_packs: int
    moved_bytes: int  # stored bytes of kept chunks copied into new packs
    retired_packs: int  # packs taken out of use by this run
    deleted_packs: int  # pack blobs deleted by this run (retired now or earlier, or never recorded)
    freed_bytes: int  # bytes of those blobs
    waiting_packs: int  # unlisted packs (retired, or never recorded) whose blobs wait out the grace period
    waiting_bytes: int
    seconds: float

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def existing_result(
    digest: str,
    logical_bytes: int,
    files: int,
    new_digest: str,
    n_chunks: int,
    family: str,
    version: str,
    t0: float,
    layout: str | None = None,
    new_layout: str | None = None,
) -> PushResult:
    """The result of pushing a version that is already there: fine if it is the same content.
    ``layout``/``new_layout`` (Manifest.layout), where known, must match as well as the digests."""
    if digest != new_digest:
        raise Conflict(
            f"version {family}/{version} already exists with other content ({digest[:19]}...): versions are immutable, push under a new name"
        )
    if layout is not None and new_layout is not None and layout != new_layout:
        raise Conflict(
            f"version {family}/{version} already exists with other content: the same file digests, other "
            "chunks (whatever committed it sent sha256s its bytes do not have); push under a new name, and "
            "check what committed it"
        )
    return PushResult(
        family=family,
        version=version,
        digest=digest,
        logical_bytes=logical_bytes,
        new_bytes=0,
        new_chunks=0,
        reused_chunks=n_chunks,
        chunks=n_chunks,
        files=files,
        tier_changes=0,
        existed=True,
        seconds=time.perf_counter() - t0,
    )


def timestamp(value) -> str:
    """A row's time as every --json output and API answer writes it: ISO 8601 (the database hands
    back a datetime, or a string where it already was one)."""
    return value.isoformat() if hasattr(value, "isoformat") else str(value)


@dataclass
class CheckResult:
    """What `mfsreg check` found (registry/store/check.py), embedded or as the server answers it."""

    scope: str  # a family's name, or "registry"
    versions: int
    chunks: int  # distinct chunks the versions need, bases included
    packs: int  # distinct packs they lie in
    stored_bytes: int  # their encoded bytes
    read_bytes: int = 0  # encoded bytes read and checked (read_data), bases read again included
    lost_packs: dict[str, str] = field(default_factory=dict)  # pack id -> what is wrong with it
    damaged_chunks: dict[str, str] = field(default_factory=dict)  # chunk id -> why it fails (read_data)
    # pack id -> {"chunks": its damaged chunks, "first": "chunk <id>: why"} (read_data)
    damaged_packs: dict[str, dict] = field(default_factory=dict)
    unreadable_chunks: int = 0  # chunks that cannot be rebuilt: in a lost pack, damaged, or down a chain through one
    unrecorded_chunks: int = 0  # chunks a version needs that have no row in the database (records lost)
    broken_versions: list[str] = field(default_factory=list)  # "family/version" that cannot be pulled
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.lost_packs or self.damaged_chunks or self.unrecorded_chunks)

    def to_dict(self) -> dict:
        return dict(self.__dict__, ok=self.ok)
