"""A pack writer whose packs are recorded in the database as each becomes durable: the push's
(registry/store/ingest.py), and the base of prune's and access's writers of moved or copied chunks."""

from __future__ import annotations

from collections.abc import Set as AbstractSet

from mfsreg.registry.blobs.packs import PackWriter, StoredChunk, pack_key
from mfsreg.registry.context import Store
from mfsreg.registry.db import chunks as chunk_db
from mfsreg.registry.db import reclaim as prune_db
from mfsreg.registry.db.engine import read_tx, write_tx
from mfsreg.registry.errors import Pruned


class RecordedPacks(PackWriter):
    """A PackWriter whose packs are recorded in the database as each becomes durable;
    ``added`` counts the stored bytes of chunks this writer really added."""

    def __init__(self, reg: Store, mend: AbstractSet[str] = frozenset()):
        super().__init__(reg.blobs, reg.settings.pack_size, self._record, self._announce, self._withdraw)
        self._engine = reg.engine
        self.mend = mend  # chunks whose stored copy was lost or damaged: their rows move to the new one
        self.added = 0

    def _announce(self, pack_id: str, size: int) -> None:
        with write_tx(self._engine) as conn:
            prune_db.announce_pack(conn, pack_id, size)

    def _withdraw(self, pack_id: str) -> None:
        """A pack whose blob could not be written (a full disk, a store that went away): its
        announcement goes, so that stats do not count it as waiting for prune. The blob goes first,
        in case the write failed after it landed; if either step fails the row stays, and prune
        deletes both after the grace period, as for a writer that died."""
        try:
            self.store.delete(pack_key(pack_id))
            with write_tx(self._engine) as conn:
                prune_db.withdraw_pack(conn, pack_id)
        except Exception:  # the put's own error is the one to report
            pass

    def _record(self, pack_id: str, size: int, stored: list[StoredChunk]) -> None:
        try:
            with write_tx(self._engine) as conn:
                self._write_rows(conn, pack_id, size, stored)
        except Pruned:
            with read_tx(self._engine) as conn:
                claimed = not prune_db.is_announced(conn, pack_id)
            if claimed:  # prune took the pack for abandoned before its blob was written: nobody else deletes it
                self.store.delete(pack_key(pack_id))
            raise

    def _write_rows(self, conn, pack_id: str, size: int, stored: list[StoredChunk]) -> None:
        """The rows of a durable pack, in the transaction that lists it (db/reclaim.list_pack, which
        raises Pruned for a pack a prune took for abandoned). Writers of other rows override this."""
        self.added += chunk_db.record_pack(conn, pack_id, size, stored, self.mend)
