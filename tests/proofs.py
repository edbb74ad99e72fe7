"""A scoped upload's proof as receive_batch makes it (registry/store/service.py), for tests that call it
on an embedded registry: the stored chunks the token may not use yet (access.unproven) compared with
what it sent (access.compare_stored)."""

from __future__ import annotations

from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.store import access


def check_proofs(reg, who, family: str, uploaded: dict[str, bytes]) -> set[str]:
    """The ids of ``uploaded`` the push may claim: all but those deleted meanwhile; raises
    IntegrityError at the first stored chunk whose bytes differ."""
    with read_tx(reg.engine) as conn:
        proving = access.unproven(conn, who, family, list(uploaded))
    return set(uploaded) - access.compare_stored(reg, {i: uploaded[i] for i in proving})
