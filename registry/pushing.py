"""A push's steps in order, written once for both registries: check the names, cut and hash the
source, ask what is missing, upload it, commit, and after a commit refused for chunks a prune
deleted meanwhile, ask again, upload and commit once more.

``drive`` runs the sequence; a ``PushSteps`` carries each step to a store. The embedded registry's
(registry/store/ingest.py, ``LocalPush``) calls the store's steps in this process; the remote
client's (registry/client/remote.py, ``HttpPush``) sends them to a server, which answers them with
those same store steps (registry/store/service.py): ``ingest.negotiate_step`` (what is missing),
``ingest.store_chunks`` (through upload_missing here, receive_batch there) and
``ingest.commit_step``. A new push feature is one change here, and one per transport where it
crosses the wire. See docs/design/protocol.md.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Protocol

from mfsreg.registry.errors import MissingChunks
from mfsreg.registry.format.hashing import HashJob, missing_bytes
from mfsreg.registry.format.manifest import Manifest
from mfsreg.registry.format.source import open_source
from mfsreg.registry.meta import VersionMeta
from mfsreg.registry.progress import NullProgress, Progress
from mfsreg.registry.results import PushResult


@dataclass(frozen=True)
class Offer:
    """A store's answer to "what is missing?": the chunks to send (``mend`` among them: stored
    already, in a lost or damaged copy), the bases it suggests for them, and, where the version is
    stored already with this content, the result of the push so far (``existing``: then only
    ``missing``, the chunks to mend, is sent and nothing is committed)."""

    missing: set[str]
    mend: set[str] = field(default_factory=set)
    bases: dict[str, str] = field(default_factory=dict)
    existing: PushResult | None = None


class PushSteps(Protocol):
    """The steps of one push to one store; each raises a RegistryError subclass for what it refuses."""

    def check_names(self, meta: VersionMeta | None) -> VersionMeta | None:
        """The family, version and parent names (and ``meta``) are valid: refused before any file is read."""

    def prepare(self) -> int:
        """The first step that asks the store: the chunk size the version is cut at (the family's)."""

    def negotiate(self, job: HashJob, mend_damaged: bool, progress: Progress) -> Offer:
        """What of the hashed version the store lacks (``progress``: where the store reads what
        it holds, asked to with ``mend_damaged``)."""

    def upload(self, job: HashJob, offer: Offer, progress: Progress) -> tuple[int, int]:
        """Store ``offer.missing``; returns (payload bytes sent over a wire, stored bytes added)."""

    def commit(self, manifest: Manifest, chunk_size: int, meta: VersionMeta | None) -> PushResult:
        """Make the version visible; MissingChunks where chunks it reuses went meanwhile. The result
        counts the version's chunks and tier changes; ``existed`` where the name was committed first."""

    def renegotiate(self, manifest: Manifest) -> Offer:
        """After MissingChunks from commit: what to send before committing once more."""


def drive(
    steps: PushSteps,
    path: Path,
    progress: Progress | None = None,
    mend_damaged: bool = False,
    meta: VersionMeta | None = None,
) -> PushResult:
    """Push the model file or folder at ``path`` through ``steps``."""
    progress = progress or NullProgress()
    t0 = time.perf_counter()
    meta = steps.check_names(meta)
    source = open_source(Path(path))  # every input check happens before the store is asked anything
    chunk_size = steps.prepare()
    with HashJob(source, chunk_size, progress) as job:
        offer = steps.negotiate(job, mend_damaged, progress)
        if offer.existing is not None:  # stored with this content: mend what the store lists, commit nothing
            if not offer.missing:
                return replace(offer.existing, seconds=time.perf_counter() - t0)
            sent, added = steps.upload(job, offer, progress)
            return _counted(offer.existing, sent, added, offer.missing, offer.missing, t0)
        missing, mend = set(offer.missing), set(offer.mend)
        skipped = job.logical_bytes - missing_bytes(job, missing)
        progress.start("skip", skipped)
        progress.advance("skip", skipped)
        sent, added = steps.upload(job, offer, progress)
        manifest = job.manifest()  # waits for the file digests, which ran beside the encoding
        try:
            committed = steps.commit(manifest, chunk_size, meta)
        except MissingChunks:
            # a prune deleted chunks this push found stored before the commit could use them
            again = steps.renegotiate(manifest)
            more = steps.upload(job, again, NullProgress())
            sent, added = sent + more[0], added + more[1]
            missing, mend = missing | again.missing, mend | again.mend
            committed = steps.commit(manifest, chunk_size, meta)
    if committed.existed:  # a concurrent push of the same name committed first: nothing added
        return replace(committed, sent_bytes=sent, seconds=time.perf_counter() - t0)
    return _counted(committed, sent, added, missing, mend, t0)


def _counted(result: PushResult, sent: int, added: int, missing: set[str], mend: set[str], t0: float) -> PushResult:
    """``result`` with what this push sent and stored."""
    return replace(
        result,
        new_bytes=added,
        new_chunks=len(missing),
        reused_chunks=result.chunks - len(missing),
        sent_bytes=sent,
        mended_chunks=len(mend),
        seconds=time.perf_counter() - t0,
    )
