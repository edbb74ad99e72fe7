"""The Registry: one object that ties settings, metadata and blobs together.

The CLI and the API call only this (and the value types it returns). The blob store is opened on
first use: listing, stats, tokens and quorum read only the database, while push, pull, check and
prune open the store before they read a byte or write a row, so a bad store is refused first.
See docs/design/cli.md.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from mfsreg.registry.config import PRUNE_MAX_UNUSED, PRUNE_MIN_AGE, Settings
from mfsreg.registry.context import Kept
from mfsreg.registry.db import schema
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import create_db_engine, read_tx, write_tx
from mfsreg.registry.errors import InvalidRequest, NotFound, StorageError
from mfsreg.registry.names import check_name
from mfsreg.registry.results import CheckResult, DeleteResult, PruneResult

if TYPE_CHECKING:  # the push, pull and prune machinery loads when a method needs it (docs/design/cli.md)
    from mfsreg.registry.auth import Principal
    from mfsreg.registry.blobs.base import BlobStore
    from mfsreg.registry.blobs.packs import StoredChunk
    from mfsreg.registry.format.manifest import Manifest
    from mfsreg.registry.format.rebuild import PullResult
    from mfsreg.registry.meta import VersionMeta
    from mfsreg.registry.progress import Progress
    from mfsreg.registry.store.ingest import PushResult


KEPT_DOCUMENTS = 32  # version documents' parts kept by tag (a 7B model's lists about 7,000 chunks)


class Registry:
    def __init__(self, settings: Settings | None = None, migrate: bool | None = None):
        self.settings = settings or Settings.from_env()
        self.engine = create_db_engine(self.settings.database_url)
        auto = self.settings.embedded if migrate is None else migrate
        with read_tx(self.engine):
            pass  # surfaces an unreachable database as a StorageError before anything else
        schema.ensure_current(self.engine, auto_upgrade=auto)
        self._blobs: BlobStore | None = None
        self._blobs_lock = threading.Lock()  # a server's request threads may be the first to ask at once
        self.pool = ThreadPoolExecutor(max_workers=self.settings.workers, thread_name_prefix="mfsreg")
        self.documents = Kept(KEPT_DOCUMENTS)

    def open_blobs(self) -> BlobStore:
        """The blob store, opened the first time it is asked for (InvalidRequest for an
        MFSREG_BLOB_URL that names no usable store, or for a malformed MFSREG_S3_* setting of an
        s3 one, asked again each time until one opens).
        Opening it sends nothing to the store (on S3 botocore makes its client, looking up the
        credentials the usual AWS way): the first request to it is the first use's."""
        if self._blobs is None:
            with self._blobs_lock:
                if self._blobs is None:
                    from mfsreg.registry.blobs.stores import open_blob_store

                    s = self.settings
                    # a malformed S3 timeout is refused here, where it would be used (Settings.s3_error)
                    self._blobs = open_blob_store(s.blob_url, s.s3_endpoint_url, **s.blob_store_options())
        return self._blobs

    @property
    def blobs(self) -> BlobStore:
        return self.open_blobs()

    @blobs.setter
    def blobs(self, store: BlobStore) -> None:
        """Use ``store`` in place of the configured one (tests wrap the store to step in between
        its calls; the library itself only reads it)."""
        self._blobs = store

    def ping(self) -> None:
        """Raise StorageError unless the metadata database answers and the blob store can be
        reached (on S3 its bucket exists): what readiness means, since no push or pull works without
        both."""
        with read_tx(self.engine):
            pass
        self.blobs.check()

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        self.engine.dispose()

    def __enter__(self) -> Registry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- push / pull ---------------------------------------------------------------------------

    def push(
        self,
        path: Path,
        family: str,
        version: str,
        parent: str | None = None,
        progress: Progress | None = None,
        mend_damaged: bool = False,
        meta: VersionMeta | None = None,
    ) -> PushResult:
        """Store the version at ``path`` (a file, a sharded checkpoint, a model directory or a
        Hugging Face cache folder), with ``meta`` (a description and labels)."""
        from mfsreg.registry.store import ingest

        self.open_blobs()  # before the file is read or the family made: a bad store is refused first
        return ingest.push(self, Path(path), family, version, parent, progress, mend_damaged, meta)

    def manifest(self, family: str, version: str) -> tuple[version_db.VersionRow, Manifest]:
        with read_tx(self.engine) as conn:
            return _manifest_in(conn, family, version)

    def locate(self, ids: Iterable[str]) -> dict[str, StoredChunk]:
        """Where ``ids`` and the bases of their deltas are stored."""
        from mfsreg.registry.db import chunks as chunk_db

        with read_tx(self.engine) as conn:
            return chunk_db.locate_closure(conn, ids)

    def read_payloads(self, chunks: list[StoredChunk]):
        from mfsreg.registry.blobs.packs import read_payloads

        return read_payloads(self.blobs, chunks)

    def pull(
        self, family: str, version: str, out: Path, progress: Progress | None = None, to_dir: bool = False
    ) -> PullResult:
        """Rebuild the version at ``out`` (a file, or a directory for a single file to go in), or
        with ``to_dir`` as the files of the directory ``out``, made if missing."""
        from mfsreg.registry.db import chunks as chunk_db
        from mfsreg.registry.format import rebuild

        t0 = time.perf_counter()
        self.open_blobs()  # a bad store is refused first, as for a push, whether or not the version exists
        with read_tx(self.engine) as conn:  # one snapshot: the version and where its chunks were, together
            row, manifest = _manifest_in(conn, family, version)
            located = chunk_db.locate_closure(conn, manifest.chunk_ids())
        try:
            rebuild.rebuild(
                manifest,
                Path(out),
                located,
                self.read_payloads,
                self.pool,
                progress,
                to_dir=to_dir,
                owned=self._owned(),
            )
        except NotFound as exc:
            with read_tx(self.engine) as conn:
                now = version_db.find_version(conn, family, version, tags=True)
            if now is None or now.id != row.id:  # deleted meanwhile, and a prune took its packs: the user's race
                raise NotFound(
                    f"version {family}/{version} was deleted while it was being pulled: nothing was written"
                ) from None
            # a pack the registry records is gone: data loss, said as the server says it
            raise StorageError(
                f"the registry's storage lost data ({exc}): check that MFSREG_BLOB_URL names this "
                "registry's blob store, else restore that blob from a backup"
            ) from None
        return rebuild.PullResult(
            family=family,
            version=version,
            digest=row.digest,
            path=str(rebuild.written_path(manifest, Path(out))),
            logical_bytes=row.logical_bytes,
            files=row.file_count,
            seconds=time.perf_counter() - t0,
        )

    def _owned(self) -> list[tuple[Path, str]]:
        """What a pull must not write over or into: an SQLite database and the files SQLite and
        the migration lock keep beside it, and a blob store on local disk."""
        from mfsreg.registry.blobs.local import LocalBlobStore

        owned = []
        url = self.engine.url
        if url.get_backend_name() == "sqlite" and url.database not in (None, "", ":memory:"):
            db = Path(url.database)
            owned += [
                (db.with_name(db.name + end), "the registry's database")
                for end in ("", "-wal", "-shm", "-journal", ".migrate.lock")
            ]
        if isinstance(self.blobs, LocalBlobStore):
            owned.append((self.blobs.root, "the registry's blob store"))
        return owned

    # -- listing -------------------------------------------------------------------------------

    def family(self, family: str) -> version_db.FamilyRow:
        check_name("family", family)
        with read_tx(self.engine) as conn:
            return version_db.get_family(conn, family)

    def families(self) -> list[version_db.FamilyRow]:
        with read_tx(self.engine) as conn:
            return version_db.list_families(conn)

    def versions(self, family: str | None = None) -> list[version_db.VersionRow]:
        if family is not None:
            check_name("family", family)
        with read_tx(self.engine) as conn:
            if family is not None and not version_db.family_exists(conn, family):
                raise NotFound(f"family {family!r} does not exist: see `mfsreg ls`")
            return version_db.list_versions(conn, family)

    def chunk_tiers(self, family: str, tier: str | None = None) -> dict[str, tuple[str, int]]:
        """chunk id -> (tier, number of members using it) for one family."""
        from mfsreg.registry.db import rebalance as tier_db

        check_name("family", family)
        with read_tx(self.engine) as conn:
            fam = version_db.get_family(conn, family)
            return tier_db.chunk_tiers(conn, fam.id, tier)

    def stats(self, family: str | None = None, visible: Callable[[str], bool] | None = None) -> dict:
        """Sharing figures of ``family`` or the registry; ``visible``: see registry/store/stats.py."""
        from mfsreg.registry.store.stats import compute_stats

        if family is not None:
            check_name("family", family)
        out = compute_stats(self.engine, family, visible)
        if family is None:
            out["leftover_bytes"] = self._leftover_bytes()
        return out

    def family_summaries(self) -> list[dict]:
        """Every family's versions, logical and stored bytes and sharing ratio (registry/store/stats.py)."""
        from mfsreg.registry.store.stats import family_summaries

        return family_summaries(self.engine)

    def sharing_matrix(self, family: str) -> dict:
        """The bytes each pair of the family's newest versions share (registry/store/stats.py)."""
        from mfsreg.registry.store.stats import sharing_matrix

        check_name("family", family)
        return sharing_matrix(self.engine, family)

    def _leftover_bytes(self) -> int | None:
        """Bytes of the parts of packs killed writers left in a local blob store (prune removes
        them). None for an S3 store, which stats never contacts (it reads only the database, and
        runs while the endpoint is down: `prune --dry-run` counts S3's), or a store not readable."""
        from mfsreg.registry.blobs.urls import parse_blob_url

        try:
            if parse_blob_url(self.settings.blob_url)[0] != "file":
                return None
            return sum(left.size for left in self.blobs.leftovers())
        except (StorageError, InvalidRequest, OSError):
            return None

    # -- changes -------------------------------------------------------------------------------

    def delete(self, family: str, version: str, who: Principal | None = None) -> DeleteResult:
        """Remove a version and re-tier its family; its children now descend from its parent. Chunks
        that no version needs any more become unreferenced (see stats' ``unreferenced_bytes``): a
        later push of the same bytes reuses them, and ``prune`` gives back their space. The audit
        log records it, as done by ``who`` (None: the embedded CLI's user)."""
        from mfsreg.registry.db import rebalance as tier_db
        from mfsreg.registry.store import audit
        from mfsreg.registry.store.tags import drop_for_version

        check_name("family", family)
        check_name("version", version)
        with write_tx(self.engine) as conn:
            fam = version_db.lock_family(conn, family)
            row = version_db.find_version(conn, family, version, tags=True)
            if row is not None and row.name != version:  # a tag: deleting the version it names is not meant
                untag = "" if version == "latest" else f", or remove the tag (`mfsreg tag rm {family} {version}`)"
                raise InvalidRequest(
                    f"{family}/{version} is a tag of version {row.name}: delete a version by its own name "
                    f"(`mfsreg delete {family} {row.name}`){untag}"
                )
            row = version_db.get_version(conn, family, version, tags=False)
            ids = version_db.version_chunk_ids(conn, row.id)
            drop_for_version(conn, fam.id, row.id, row.name, who)
            version_db.delete_version(conn, row.id)
            changed, dropped = tier_db.remove_member(conn, fam.id, ids, fam.member_count, fam.base_quorum)
            version_db.set_member_count(conn, fam.id, fam.member_count - 1)
            audit.record(conn, who, "delete", family, version=version, digest=row.digest)
        return DeleteResult(family, version, changed, len(dropped))

    def check(
        self, family: str | None = None, read_data: bool = False, progress: Progress | None = None
    ) -> CheckResult:
        """Which packs and chunks the stored versions need are lost or damaged, and which versions
        cannot be pulled because of them (registry/store/check.py); changes nothing."""
        from mfsreg.registry.store.check import check as check_registry

        self.open_blobs()
        return check_registry(self, family, read_data, progress)

    def prune(
        self,
        min_age: float = PRUNE_MIN_AGE,
        max_unused: float = PRUNE_MAX_UNUSED,
        dry_run: bool = False,
        progress: Progress | None = None,
        who: Principal | None = None,
    ) -> PruneResult:
        """Delete the chunks no version needs and give back their space (registry/store/prune.py). The
        audit log records a run that was not a dry one."""
        from mfsreg.registry.store import audit, prune

        self.open_blobs()  # before it deletes a row: a prune that cannot reach the blobs must change nothing
        result = prune.prune(self, min_age, max_unused, dry_run, progress)
        if not dry_run:
            with write_tx(self.engine) as conn:
                audit.record(
                    conn,
                    who,
                    "prune",
                    None,
                    min_age=min_age,
                    deleted_chunks=result.deleted_chunks,
                    deleted_packs=result.deleted_packs,
                    freed_bytes=result.freed_bytes,
                )
        return result

    def set_base_quorum(self, family: str, quorum: float, who: Principal | None = None) -> int:
        """Change a family's base quorum and re-tier its chunks; returns rows that changed tier. The
        audit log records it."""
        from mfsreg.registry.db import rebalance as tier_db
        from mfsreg.registry.store import audit
        from mfsreg.registry.store.tiers import check_quorum

        check_name("family", family)
        check_quorum(quorum)
        with write_tx(self.engine) as conn:
            fam = version_db.lock_family(conn, family)
            version_db.set_quorum(conn, fam.id, quorum)
            changed = tier_db.recompute(conn, fam.id, fam.member_count, quorum)
            audit.record(conn, who, "quorum", family, before=fam.base_quorum, after=quorum)
            return changed

    # -- tags ----------------------------------------------------------------------------------

    def tag_set(self, family: str, tag: str, version: str, who: Principal | None = None):
        """Point ``tag`` at ``version`` (registry/store/tags.py); returns the TagMove."""
        from mfsreg.registry.store import tags

        return tags.set_tag(self.engine, family, tag, version, who)

    def tag_rm(self, family: str, tag: str, who: Principal | None = None):
        from mfsreg.registry.store import tags

        return tags.remove_tag(self.engine, family, tag, who)

    def tags(self, family: str) -> list:
        from mfsreg.registry.store import tags

        return tags.list_tags(self.engine, family)

    def tag_history(self, family: str, tag: str | None = None, limit: int = 1000) -> list:
        from mfsreg.registry.store import tags

        return tags.history(self.engine, family, tag, limit)

    def audit(self, who: Principal | None = None, limit: int = 100) -> list:
        """The newest ``limit`` audit entries ``who`` may read (registry/store/audit.py)."""
        from mfsreg.registry.store import audit

        return audit.entries(self.engine, who, limit)


def upgrade_database(settings: Settings | None = None) -> str:
    """Apply pending migrations (``mfsreg db upgrade``); returns the revision now in force."""
    settings = settings or Settings.from_env(blobs=False)  # migrations touch no blob
    engine = create_db_engine(settings.database_url)
    try:
        with read_tx(engine):
            pass
        return schema.upgrade(engine)
    finally:
        engine.dispose()


def _manifest_in(conn, family: str, version: str) -> tuple[version_db.VersionRow, Manifest]:
    from mfsreg.registry.format.manifest import Manifest

    check_name("family", family)
    check_name("version", version)
    row = version_db.get_version(conn, family, version)
    return row, Manifest.from_bytes(version_db.read_manifest(conn, row.id))
