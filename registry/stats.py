"""Sharing figures for one family or the whole registry.

- logical_bytes: the versions' file sizes summed; stored_bytes: the encoded bytes of the distinct
  chunks they use (the tiers add up to it); sharing_ratio: logical / stored.
- per version: logical bytes; the stored bytes it needs (delta bases included), as deltas and
  plain; the stored bytes it alone holds, in any family.
- per encoding: chunks, raw bytes and stored bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from mfsreg.registry.db import stats as q
from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.db.versions import family_exists, list_families
from mfsreg.registry.errors import NotFound


def compute_stats(engine, family: str | None = None, visible: Callable[[str], bool] | None = None) -> dict:
    """The figures of ``family`` (or of the registry). ``visible(name)``: the families the asker may
    read; a version's ``unique_bytes`` then counts what no other of those uses (what the registry
    stores for families they may not read is not theirs to learn)."""
    with read_tx(engine) as conn:
        if family is not None and not family_exists(conn, family):
            raise NotFound(f"family {family!r} does not exist: see `mfsreg ls`")
        logical, n_versions = q.logical_bytes(conn, family)
        tiers = q.tier_totals(conn, family)
        encodings = q.encodings(conn, family)
        seen = None if visible is None else [f.id for f in list_families(conn) if visible(f.name)]
        per_version = q.version_figures(conn, family, seen)
        pack_bytes, orphan_bytes, unlisted_bytes = q.storage_totals(conn) if family is None else (None, None, None)
    stored = sum(b for _, b in tiers.values())
    out = {
        "scope": family or "registry",
        "family": family,
        "versions_count": n_versions,
        "logical_bytes": logical,
        "stored_bytes": stored,
        "sharing_ratio": round(logical / stored, 4) if stored else 0.0,
        "tiers": {t: {"chunks": n, "bytes": b} for t, (n, b) in tiers.items()},
        "encodings": {e: {"chunks": n, "raw_bytes": r, "bytes": s} for e, (n, r, s) in sorted(encodings.items())},
        "versions": [
            {
                "family": f,
                "version": v,
                "logical_bytes": lb,
                "stored_bytes": need,
                "unique_bytes": alone,
                "delta_bytes": delta,
                "plain_bytes": plain,
            }
            for f, v, lb, need, alone, delta, plain in per_version
        ],
    }
    if family is None:
        out["pack_bytes"] = pack_bytes
        out["unreferenced_bytes"] = orphan_bytes
        out["unlisted_pack_bytes"] = unlisted_bytes
    return out
