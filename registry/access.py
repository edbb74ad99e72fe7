"""Which stored chunks a push may use without sending their bytes.

Chunks are stored once for the whole registry, so a chunk id names the same bytes in every family.
A token scoped to some families must not gain another family's bytes by naming their ids: a push
through it that committed an id only another family uses could then download those bytes through
its own family. So a push through such a token uses a stored chunk without uploading it only
where its own family already uses it, or a family the token may read does (the token could
download it there anyway). Any other chunk is asked for (negotiate lists it as missing) and,
once uploaded and re-hashed by the server, claimed for the family (db/claims.py): the commit
checks that every chunk passes one of the three. The registry still keeps one copy of the bytes.
A chunk stored as a delta against another family's chunk would still lend that basis (a version
lists the bases it needs to decode, and its readers may download them): before such a commit, the
chunk gets a plain copy of its own (detach_foreign_chains).

A token for every family (pattern ``*``), and an embedded push, may use every stored chunk.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from sqlalchemy import Connection

from mfsreg.registry import codec
from mfsreg.registry.auth import Principal
from mfsreg.registry.blobs.packs import StoredChunk
from mfsreg.registry.db import chunks as chunk_db
from mfsreg.registry.db import claims as claim_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.errors import IntegrityError, NotFound, StorageError
from mfsreg.registry.ingest import RecordedPacks
from mfsreg.registry.parallel import sized_batches
from mfsreg.registry.rebuild import decode_batch

log = logging.getLogger("mfsreg")


def reads_everything(who: Principal | None) -> bool:
    return who is None or (who.family_pattern == "*" and who.allows("read", None))


def unproven(conn: Connection, who: Principal | None, family: str, stored: Sequence[str]) -> set[str]:
    """Those of the ``stored`` chunk ids a push to ``family`` through ``who`` must upload before a
    commit may use them."""
    if who is None or reads_everything(who) or not stored:
        return set()
    # a push role includes read, so the family pushed to is among them
    readable = [f.id for f in version_db.list_families(conn) if who.allows("read", f.name)]
    todo = set(stored) - claim_db.used_by_families(conn, readable, list(stored))
    return todo - claim_db.claimed(conn, family, list(todo)) if todo else todo


PROOF_BATCH = 256 << 20  # raw bytes of stored chunks read back at a time to compare an upload with


def compare_stored(reg, uploaded: dict[str, bytes]) -> set[str]:
    """Compare each of ``uploaded`` (id -> raw bytes, already hashed to its id: stored chunks a
    scoped push must show it holds, see ``unproven``) with the bytes stored under that id; raise
    IntegrityError at the first that differs. The id is an xxh3-128, fast but not built to resist a
    forged collision: a claim must rest on the bytes themselves, or bytes crafted to hash like
    another family's chunk would lend that chunk. The error is the one a mismatched hash gets, so
    it says nothing of what is stored. Returns the ids deleted meanwhile (a prune), which the push
    may not claim and a commit then asks for again. Raises StorageError (a 503 that names nothing)
    where the stored bytes cannot be read back."""
    gone: set[str] = set()
    for batch in sized_batches(sorted(uploaded), lambda i: len(uploaded[i]), PROOF_BATCH):
        stored = stored_bytes(reg, batch)
        for i in batch:
            if i not in stored:
                gone.add(i)
            elif stored[i] != uploaded[i]:
                raise IntegrityError(f"chunk {i}: bytes do not match the id; the batch was refused")
    return gone


def stored_bytes(reg, ids: list[str], purpose: str = "compare a scoped upload with") -> dict[str, bytes]:
    """The raw bytes stored under those of ``ids`` still recorded, deltas decoded against their
    bases. A prune may move or delete a pack between the lookup and the read: looked up again
    once. A second failure is answered without its details (they would name another family's
    chunks and the storage), which go to the server's log; ``purpose`` says what the bytes were for."""
    for attempt in (1, 2):
        with read_tx(reg.engine) as conn:
            located = chunk_db.locate_closure(conn, ids)
        try:
            return decode_batch([i for i in ids if i in located], located, reg.read_payloads, reg.pool)
        except (NotFound, IntegrityError, StorageError) as exc:
            log.warning("could not read back stored chunks to %s (attempt %d of 2): %s", purpose, attempt, exc)
    raise StorageError(
        f"the registry could not read back stored chunks to {purpose}: send it "
        "again, and tell the registry's operator if this persists"
    )


def foreign_chains(conn: Connection, who: Principal | None, family: str, ids: Sequence[str]) -> list[str]:
    return _foreign_chains(conn, who, family, ids)[0]


def _foreign_chains(
    conn: Connection, who: Principal | None, family: str, ids: Sequence[str]
) -> tuple[list[str], dict[str, StoredChunk]]:
    """Those of ``ids`` stored as deltas whose chain of bases passes through a chunk ``who`` may
    not use: a version using them would list those bases among its chunks (a node needs them to
    decode), and its family's readers could download them. Such chunks get a plain copy of their
    own (detach_foreign_chains). Also where they and their bases are stored."""
    if reads_everything(who):
        return [], {}
    located = chunk_db.locate_closure(conn, ids)
    bases = {c.basis_id for c in located.values() if c.basis_id}
    foreign = unproven(conn, who, family, list(bases - set(ids)))
    if not foreign:
        return [], located

    own = set(ids)

    def reaches(i: str) -> bool:
        # up to the first chunk of ``ids`` on the way: that one gets a plain copy itself, or its chain is clean
        b = located[i].basis_id
        while b is not None and b in located and b not in own:
            if b in foreign:
                return True
            b = located[b].basis_id
        return False

    return [i for i in dict.fromkeys(ids) if i in located and reaches(i)], located


def detach_foreign_chains(
    reg, who: Principal | None, family: str, ids: Sequence[str], go_on: Callable[[Connection], bool] | None = None
) -> int:
    """Store a plain copy of each of ``ids`` whose delta chain passes through a chunk ``who`` may not
    use, and point its row there, so that a version of ``family`` needs only chunks it proved it
    holds. The registry decodes them itself (their bytes equal what the push uploaded, by id).
    Another family that used the delta now reads the plain copy: the same bytes, a little more
    storage, and no longer needs the delta's bases (db/chunks.rechain records that in the copy's
    transaction). ``go_on(conn)``, asked only when there is something to copy, in the same read
    transaction, may refuse (raise) or skip (False) the copies first: a commit's checks, which a
    commit needing no copy leaves to its own transaction. Returns how many were detached."""
    if reads_everything(who):
        return 0
    with read_tx(reg.engine) as conn:
        # only chunks the push has shown it holds: naming ids must not make the registry copy them
        shown = set(ids) - unproven(conn, who, family, list(ids))
        todo, located = _foreign_chains(conn, who, family, [i for i in ids if i in shown])
        if todo and go_on is not None and not go_on(conn):
            return 0
    if not todo:
        return 0
    raw = decode_batch(todo, located, reg.read_payloads, reg.pool)
    writer = _PlainCopies(reg)
    for i in todo:
        encoding, payload = codec.encode(raw[i])
        writer.add(i, len(raw[i]), encoding, payload, None, 0)
    writer.flush()
    return len(todo)


class _PlainCopies(RecordedPacks):
    """Packs of plain copies of stored chunks, recorded by pointing the chunks' rows at them."""

    def _write_rows(self, conn, pack_id: str, size: int, stored: list[StoredChunk]) -> None:
        chunk_db.repoint_plain(conn, pack_id, size, stored)
