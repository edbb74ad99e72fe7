"""What the index on chunks.pack_id (migration 0009) saves prune on a large registry's Postgres.

    python -m benchmarks.prune_index [--chunks 400000] [--packs 2000] [--runs 3]

Method. Each run creates a scratch Postgres database (127.0.0.1:5432, trust auth, as the tests
use), migrates it to 0008 (before the index) or to head, and fills it with --chunks chunk rows
spread over --packs packs (rows only: no blobs; a 7B model at 2 MiB chunks is about 7,000 rows, so
400,000 is a registry of some 800 GB of distinct chunks). A tenth of the packs is emptied, as
prune's deletes leave them. Timed: db/reclaim.chunks_in for another tenth of the packs (what a
repack asks per pack) and db/reclaim.retire_packs of the emptied ones (each DELETE FROM packs makes
Postgres check the foreign key from chunks). Both revisions take turns in each run; the anchor is
0008's time in the same run. Figures are medians over --runs. Writes results/prune_index.json.
"""

from __future__ import annotations

import argparse
import time
import uuid

from alembic import command
from sqlalchemy import text

from benchmarks.common import finish, machine_info, median, scratch_postgres, table
from mfsreg.registry.db import reclaim as q
from mfsreg.registry.db.schema import _config


def one(revision: str, n_chunks: int, n_packs: int) -> dict:
    with scratch_postgres("mfsreg_prune_index") as engine:
        command.upgrade(_config(engine), revision)
        packs = [uuid.uuid4().hex for _ in range(n_packs)]
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO packs (id, size) VALUES (:id, 1)"), [{"id": p} for p in packs])
            insert = text(
                'INSERT INTO chunks (id, size, encoding, stored_size, pack_id, "offset", depth) '
                "VALUES (:id, 1, 'raw', 1, :p, :o, 0)"
            )
            for k in range(0, n_chunks, 50_000):
                conn.execute(
                    insert,
                    [
                        {"id": uuid.uuid4().hex, "p": packs[i % n_packs], "o": i}
                        for i in range(k, min(n_chunks, k + 50_000))
                    ],
                )
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
            conn.execute(text("ANALYZE"))
        tenth = n_packs // 10
        emptied, asked = packs[:tenth], packs[tenth : 2 * tenth]
        with engine.begin() as conn:
            conn.execute(text("DELETE FROM chunks WHERE pack_id = ANY(:v)"), {"v": emptied})
        t0 = time.perf_counter()
        with engine.begin() as conn:
            for p in asked:
                q.chunks_in(conn, p)
        t1 = time.perf_counter()
        with engine.begin() as conn:
            q.retire_packs(conn, emptied)
        t2 = time.perf_counter()
        return {"chunks_in_s": t1 - t0, "retire_s": t2 - t1, "packs_asked": len(asked), "packs_retired": len(emptied)}


def report(doc: dict) -> str:
    rows = []
    n = doc["runs_detail"][0]["head"]
    for what, key in (
        (f"chunks_in of {n['packs_asked']} packs", "chunks_in_s"),
        (f"retire_packs of {n['packs_retired']} emptied packs", "retire_s"),
    ):
        before, after = doc["median"]["0008"][key], doc["median"]["head"][key]
        rows.append([what, before, after, f"{after / before:.3f}x"])
    return f"{doc['chunks']:,} chunk rows in {doc['packs']:,} packs, median of {doc['runs']} runs\n" + table(
        ["query", "0008 (no index) s", "head s", "head / 0008"], rows
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", type=int, default=400_000)
    ap.add_argument("--packs", type=int, default=2000)
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    t_start = time.perf_counter()
    doc = {"chunks": args.chunks, "packs": args.packs, "runs": args.runs, "machine": machine_info(), "runs_detail": []}
    for i in range(args.runs):
        order = ("0008", "head") if i % 2 == 0 else ("head", "0008")
        doc["runs_detail"].append({rev: one(rev, args.chunks, args.packs) for rev in order})
    doc["median"] = {
        rev: {k: median([r[rev][k] for r in doc["runs_detail"]]) for k in ("chunks_in_s", "retire_s")}
        for rev in ("0008", "head")
    }
    finish("prune_index.json", doc, report, t_start)


if __name__ == "__main__":
    main()
