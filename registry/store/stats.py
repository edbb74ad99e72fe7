"""Sharing figures for one family or the whole registry.

- logical_bytes: the versions' file sizes summed; stored_bytes: the encoded bytes of the distinct
  chunks they use (the tiers add up to it); sharing_ratio: logical / stored.
- per version: logical bytes; the stored bytes it needs (delta bases included), as deltas and
  plain; the stored bytes it alone holds, in any family.
- per version, ``shares``: of the bytes of the distinct chunks it uses, how many are in its family's
  base tier ("shares 91% with base"), in the group tier (shared with some other members) and in the
  unique tier (only in this version), each as raw bytes, a fraction, stored bytes, and how much of
  that is stored as deltas. The tiers are its own family's: no other family's pushes change them.
  The web page (api/web/) draws these same figures.
- per encoding: chunks, raw bytes and stored bytes.
"""

from __future__ import annotations

from collections.abc import Callable

from mfsreg.registry.db import sharing as q
from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.db.versions import family_exists, get_family, list_families, list_versions
from mfsreg.registry.errors import NotFound
from mfsreg.registry.store.tiers import BASE, GROUP, UNIQUE


def shares(split: dict[str, tuple[int, int, int, int]]) -> dict[str, dict[str, float | int]]:
    """tier -> {bytes, fraction, stored_bytes, delta_bytes, delta_stored_bytes} of one version, from
    content_split's sums for it."""
    total = sum(raw for raw, *_ in split.values())
    out: dict[str, dict[str, float | int]] = {}
    for tier in (BASE, GROUP, UNIQUE):
        raw, stored, draw, dstored = split.get(tier, (0, 0, 0, 0))
        out[tier] = {
            "bytes": raw,
            "fraction": round(raw / total, 4) if total else 0.0,
            "stored_bytes": stored,
            "delta_bytes": draw,
            "delta_stored_bytes": dstored,
        }
    return out


def _content_ids(manifest: bytes) -> set[str]:
    """The distinct chunk ids of a stored manifest's files (as Manifest.doc_of reads it, without
    importing the manifest module and its file-format machinery: `mfsreg stats` starts faster)."""
    import json

    import zstandard

    doc = json.loads(zstandard.ZstdDecompressor().decompress(manifest))
    return {ref[0] for f in doc["files"] for ref in f["chunks"]}


def content_split(conn, family: str | None) -> dict[int, dict[str, tuple[int, int, int, int]]]:
    """version id -> tier -> (raw bytes, stored bytes, raw bytes stored as deltas, stored bytes of
    those), over the distinct chunks of each version's own files (not the bases its deltas decode
    against: a dense fine-tune stored as deltas shares none of its bytes) and their tier in its own
    family, so that no other family's pushes change a figure."""
    facts = q.chunk_facts(conn, family)
    out: dict[int, dict[str, tuple[int, int, int, int]]] = {}
    for vid, fid, blob in q.manifests(conn, family):
        sums = {t: [0, 0, 0, 0] for t in (BASE, GROUP, UNIQUE)}
        for cid in _content_ids(blob):
            fact = facts.get((fid, cid))
            if fact is None:  # no row for a chunk the manifest names: `mfsreg check` reports it
                continue
            tier, raw, stored, delta = fact
            row = sums[tier]
            row[0] += raw
            row[1] += stored
            if delta:
                row[2] += raw
                row[3] += stored
        out[vid] = {t: (a, b, c, d) for t, (a, b, c, d) in sums.items()}
    return out


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
        split = content_split(conn, family)
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
                "shares": shares(split.get(vid, {})),
            }
            for vid, f, v, lb, need, alone, delta, plain in per_version
        ],
    }
    if family is None:
        out["pack_bytes"] = pack_bytes
        out["unreferenced_bytes"] = orphan_bytes
        out["unlisted_pack_bytes"] = unlisted_bytes
    return out


MATRIX_MAX = 40  # members in a sharing matrix: the newest this many (a page of 40 x 40 cells)


def sharing_matrix(engine, family: str, limit: int = MATRIX_MAX) -> dict:
    """Bytes each pair of ``family``'s newest ``limit`` versions share: ``shared[i][j]`` is the raw
    size of the distinct chunks of both one's and the other's files (``shared[i][i]``: all of
    version i's). ``omitted``: the older versions left out."""
    with read_tx(engine) as conn:
        fam_id = get_family(conn, family).id  # NotFound where there is none
        every = list_versions(conn, family)
        rows = every[-limit:]
        facts = q.chunk_facts(conn, family)
        blobs = {vid: blob for vid, _, blob in q.manifests(conn, family, [r.id for r in rows])}
    # Chunks held by the same set of versions are added up once per set: a family's chunks fall
    # into few such sets (the base's, each member's own, a few shared), so no versions x chunks
    # matrix is built however large the models.
    holders: dict[str, list[int]] = {}
    size: dict[str, int] = {}
    for i, r in enumerate(rows):
        for cid in _content_ids(blobs[r.id]):
            fact = facts.get((fam_id, cid))
            if fact is not None:
                holders.setdefault(cid, []).append(i)
                size[cid] = fact[1]
    by_set: dict[tuple[int, ...], int] = {}
    for cid, held_by in holders.items():
        key = tuple(held_by)
        by_set[key] = by_set.get(key, 0) + size[cid]
    shared = [[0] * len(rows) for _ in rows]
    for members, n in by_set.items():
        for i in members:
            for j in members:
                shared[i][j] += n
    return {
        "versions": [r.name for r in rows],
        "shared": shared,
        "omitted": len(every) - len(rows),
    }


def family_summaries(engine) -> list[dict]:
    """Each family's versions, logical and stored bytes and sharing ratio: the figures compute_stats
    gives for one family, for all of them in two queries."""
    with read_tx(engine) as conn:
        fams = list_families(conn)
        totals = q.family_totals(conn)
    out = []
    for f in fams:
        n, logical, stored = totals.get(f.id, (0, 0, 0))
        out.append(
            {
                "family": f.name,
                "versions_count": n,
                "logical_bytes": logical,
                "stored_bytes": stored,
                "sharing_ratio": round(logical / stored, 4) if stored else 0.0,
            }
        )
    return out
