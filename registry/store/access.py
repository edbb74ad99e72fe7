"""Which stored chunks a push may use without sending their bytes, and which bytes a version may
lend its family's readers.

Through a token scoped to some families: those its family, or a family it may read, uses, and those
a push to its family uploaded and the server verified (claims, db/claims.py); any other it uploads.
A token for every family (``*``), and an embedded push, may use every stored chunk.

Whoever pushes, a version lends its family's readers only bytes of that family: a reused chunk
stored as a delta whose chain of bases leaves the family (a basis no version of the family uses,
nor claimed for it) gets a plain copy of its own before the commit.
See docs/design/protocol.md.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from sqlalchemy import Connection

from mfsreg.registry.auth import Principal
from mfsreg.registry.blobs.packs import StoredChunk
from mfsreg.registry.context import Store
from mfsreg.registry.db import chunks as chunk_db
from mfsreg.registry.db import claims as claim_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.errors import IntegrityError, NotFound, StorageError
from mfsreg.registry.format import codec
from mfsreg.registry.format.rebuild import decode_batch
from mfsreg.registry.parallel import sized_batches
from mfsreg.registry.store.recorded import RecordedPacks

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


def compare_stored(reg: Store, uploaded: dict[str, bytes]) -> set[str]:
    """Compare each of ``uploaded`` (id -> raw bytes, already hashed to its id; see ``unproven``)
    with the bytes stored under that id. Raises IntegrityError at the first that differs, worded as
    for a mismatched hash so it says nothing of what is stored, and StorageError (naming nothing)
    where the stored bytes cannot be read back. Returns the ids deleted meanwhile (a prune), which
    the push may not claim.
    See docs/design/protocol.md."""
    gone: set[str] = set()
    for batch in sized_batches(sorted(uploaded), lambda i: len(uploaded[i]), PROOF_BATCH):
        stored = stored_bytes(reg, batch)
        for i in batch:
            if i not in stored:
                gone.add(i)
            elif stored[i] != uploaded[i]:
                raise IntegrityError(f"chunk {i}: bytes do not match the id; the batch was refused")
    return gone


def stored_bytes(reg: Store, ids: list[str], purpose: str = "compare a scoped upload with") -> dict[str, bytes]:
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
    said = (
        f"the registry could not read back stored chunks to {purpose}: send it again, and tell the registry's "
        "operator if this persists"
    )
    raise StorageError(said, public=said)


def foreign_chains(conn: Connection, who: Principal | None, family: str, ids: Sequence[str]) -> list[str]:
    return _foreign_chains(conn, who, family, ids)[0]


def outside_family(conn: Connection, family: str, ids: Sequence[str]) -> set[str]:
    """Those of the stored ``ids`` that no version of ``family`` uses and that are not claimed for it."""
    if not ids:
        return set()
    fam = version_db.find_family(conn, family)
    todo = set(ids) - (claim_db.used_by_families(conn, [fam.id], list(ids)) if fam is not None else set())
    return todo - claim_db.claimed(conn, family, list(todo)) if todo else todo


def _foreign_chains(
    conn: Connection, who: Principal | None, family: str, ids: Sequence[str]
) -> tuple[list[str], dict[str, StoredChunk]]:
    """Those of ``ids`` stored as deltas whose chain of bases passes through a chunk of another
    family (outside_family): a version using them would list those bases among its chunks (a node
    needs them to decode), and its family's readers could download another family's bytes. Such
    chunks get a plain copy of their own (detach_foreign_chains). Also where they and their bases
    are stored. ``who`` does not change the answer: what a version lends, it lends to its readers."""
    located = chunk_db.locate_closure(conn, ids)
    bases = {c.basis_id for c in located.values() if c.basis_id}
    foreign = outside_family(conn, family, list(bases - set(ids)))
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
    reg: Store,
    who: Principal | None,
    family: str,
    ids: Sequence[str],
    go_on: Callable[[Connection], bool] | None = None,
) -> int:
    """Store a plain copy of each of ``ids`` the push has shown it holds whose delta chain passes
    through a chunk of another family, and point its row there; the versions that used the delta
    then no longer need its bases (db/chunks.rechain, same transaction). ``go_on(conn)``, called in
    the read transaction only when there is something to copy, may raise, or return False to skip
    the copies. Returns how many were detached.
    See docs/design/protocol.md."""
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
