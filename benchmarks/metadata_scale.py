"""How the registry's metadata reads grow with the registry, on Postgres.

    python -m benchmarks.metadata_scale [--families 5] [--sizes 10,50] [--runs 3] [--out F]

Method. For each size (versions per family) a scratch Postgres database (127.0.0.1:5432, trust
auth, as the tests use) is migrated to head and filled by SQL with the rows of a synthetic registry
(no blobs): --families families, each version using the family's 5,000 base chunks and 2,000 of its
own (a third of them deltas against a base chunk), and 1% chunks no version uses; at 50 versions a
family, 530,000 chunk rows and 1.75M version_chunks rows (a 7B member at 2 MiB chunks is about
7,000 rows). Timed, through the registry's own query functions, median of --runs: the version
document's chunk table (what a node reads before each pull or load), the member sharing the most
of a version's chunks (a push without --parent looks it up for its deltas' bases), a family's tier
table (cache warm), one family's stats and the whole registry's storage totals (stats), prune's
unlisted packs, the read at the heart of prune's decision (which chunks it keeps, which packs it
retires or repacks; on a snapshot, while commits go on), and the check of its choice that commits
wait for (what a version committed meanwhile needs; the deletes after it are not timed). Anchor, in the same database and run: one full scan of version_chunks (count(*)), the cost
of reading the registry's biggest table once. A read that grows with its own work stays flat
between sizes; one that grows with the registry follows the anchor (prune's decision must: it
reads every chunk row; the check grows with the chunks chosen, 1% of them here). Writes results/metadata_scale.json (or --out).
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from datetime import timedelta

from sqlalchemy import text

from benchmarks.common import finish, machine_info, scratch_postgres, table
from mfsreg.registry.db import chunks as chunk_db
from mfsreg.registry.db import reclaim as prune_db
from mfsreg.registry.db import sharing as stats_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.db.schema import upgrade
from mfsreg.registry.store import prune

BASE, OWN = 5000, 2000  # chunks every member of a family uses, chunks each member alone uses
FILL = [
    "INSERT INTO families (id, name, base_quorum, member_count, chunk_size) "
    "SELECT f, 'fam'||f, 1.0, :V, 2097152 FROM generate_series(1,:F) f",
    "INSERT INTO versions (id, family_id, name, parent_id, digest, logical_bytes, file_count, single_file, manifest) "
    "SELECT (f-1)*:V+v, f, 'v'||v, CASE WHEN v>1 THEN (f-1)*:V+v-1 END, 'sha256:'||md5(f||':'||v)||md5('x'), "
    "15000000000, 1, 1, '\\x00'::bytea FROM generate_series(1,:F) f, generate_series(1,:V) v",
    "SELECT setval('families_id_seq', :F)",
    "SELECT setval('versions_id_seq', :F*:V)",
    "CREATE TEMP TABLE ch AS SELECT id, f, v, k, row_number() over () - 1 AS rn FROM ("
    " SELECT md5('b'||f||':'||i) id, f, 0 v, i k FROM generate_series(1,:F) f, generate_series(1,:B) i"
    " UNION ALL SELECT md5('u'||f||':'||v||':'||j), f, v, j FROM generate_series(1,:F) f, generate_series(1,:V) v,"
    " generate_series(1,:U) j"
    " UNION ALL SELECT md5('o'||i), 0, -1, i FROM generate_series(1, (:F*(:B+:V*:U))/100) i) s",
    "INSERT INTO packs (id, size, created_at) SELECT md5('p'||g), 60000000, now() - interval '2 days' "
    "FROM generate_series(0, (SELECT count(*) FROM ch)/40) g",
    'INSERT INTO chunks (id, size, encoding, stored_size, pack_id, "offset", basis_id, depth, created_at) '
    "SELECT id, 2097152, CASE WHEN v>0 AND k%3=0 THEN 'sub' ELSE 'zstd' END, "
    "CASE WHEN v>0 AND k%3=0 THEN 400000 ELSE 1500000 END, md5('p'||(rn/40)), (rn%40)*1500000, "
    "CASE WHEN v>0 AND k%3=0 THEN md5('b'||f||':'||(k % :B + 1)) END, CASE WHEN v>0 AND k%3=0 THEN 1 ELSE 0 END, "
    "now() - interval '2 days' FROM ch",
    "INSERT INTO version_chunks (version_id, chunk_id) SELECT (f-1)*:V+v, md5('b'||f||':'||i) "
    "FROM generate_series(1,:F) f, generate_series(1,:V) v, generate_series(1,:B) i",
    "INSERT INTO version_chunks (version_id, chunk_id) SELECT (f-1)*:V+v, id FROM ch WHERE v>0",
    "INSERT INTO family_chunks (family_id, chunk_id, users, tier) "
    "SELECT f, md5('b'||f||':'||i), :V, 'base' FROM generate_series(1,:F) f, generate_series(1,:B) i",
    "INSERT INTO family_chunks (family_id, chunk_id, users, tier) SELECT f, id, 1, 'unique' FROM ch WHERE v>0",
]


def _sql(statement: str, **values: int):
    # integers written into the text: bound, psycopg sends small ones as int2, and generate_series
    # over them overflows
    return text(re.sub(r":([A-Z])\b", lambda m: str(int(values[m.group(1)])), statement))


def measure(families: int, versions: int, runs: int) -> dict:
    with scratch_postgres("mfsreg_metadata_scale") as engine:
        upgrade(engine)
        with engine.begin() as c:
            for statement in FILL:
                c.execute(_sql(statement, F=families, V=versions, B=BASE, U=OWN))
        with engine.connect().execution_options(isolation_level="AUTOCOMMIT") as c:
            c.execute(text("VACUUM ANALYZE"))
            rows = {
                t: c.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()
                for t in ("chunks", "version_chunks", "family_chunks", "versions")
            }
        with read_tx(engine) as c:
            fam = version_db.get_family(c, "fam1")
            one = [r.id for r in version_db.list_versions(c, "fam1")][versions // 2]
            one_ids = version_db.version_chunk_ids(c, one)
            cutoff = prune_db.db_now(c) - timedelta(hours=1)
            chosen = prune.decide(c, cutoff, prune_db.pack_sizes(c), prune.DEFAULT_MAX_UNUSED).garbage
        reads = {
            "anchor: count(*) of version_chunks": lambda c: c.execute(
                text("SELECT count(*) FROM version_chunks")
            ).scalar(),
            "version document's chunk table": lambda c: chunk_db.version_chunk_table(c, one),
            "push: the member sharing most of a version's chunks": lambda c: version_db.most_shared_version(
                c, fam.id, one_ids, fam.member_count
            ),
            "a family's tier table (all tiers)": lambda c: chunk_db.family_chunk_table(c, fam.id),
            "stats of one family: per-version figures": lambda c: stats_db.version_figures(c, "fam1"),
            "stats of the registry: storage totals": lambda c: stats_db.storage_totals(c),
            "prune: unlisted packs": lambda c: prune_db.unlisted(c),
            "prune: the decision (chunks kept, packs to retire and repack)": lambda c: prune.decide(
                c, cutoff, prune_db.pack_sizes(c), prune.DEFAULT_MAX_UNUSED
            ),
            "prune: its choice checked again, writers waiting": lambda c: prune.still_unneeded(c, chosen),
        }
        seconds = {}
        for label, read in reads.items():
            times = []
            for _ in range(runs):
                with engine.connect() as c:
                    tx = c.begin()
                    c.exec_driver_sql("SET LOCAL statement_timeout = 300000")
                    t0 = time.perf_counter()
                    read(c)
                    times.append(time.perf_counter() - t0)
                    tx.rollback()
            seconds[label] = statistics.median(times)
        return {"versions_per_family": versions, "rows": rows, "prune_chosen_chunks": len(chosen), "seconds": seconds}


def report(doc: dict) -> str:
    small, large = doc["sizes"][0], doc["sizes"][-1]
    rows = []
    for label in small["seconds"]:
        a, b = small["seconds"][label], large["seconds"][label]
        anchor = large["seconds"]["anchor: count(*) of version_chunks"]
        rows.append([label, a, b, f"{b / a:.2f}x", f"{b / anchor:.2f}x"])
    head = (
        f"{doc['families']} families; {small['versions_per_family']} versions each "
        f"({small['rows']['chunks']:,} chunk rows, {small['rows']['version_chunks']:,} version_chunks) and "
        f"{large['versions_per_family']} ({large['rows']['chunks']:,}, {large['rows']['version_chunks']:,}); "
        f"median of {doc['runs']} runs"
    )
    return (
        head
        + "\n"
        + table(
            [
                "read",
                f"s at {small['versions_per_family']}",
                f"s at {large['versions_per_family']}",
                "growth",
                "/ anchor (large)",
            ],
            rows,
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", type=int, default=5)
    ap.add_argument("--sizes", default="10,50", help="versions per family, smallest first")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="metadata_scale.json", help="file name under benchmarks/results/")
    args = ap.parse_args()
    t_start = time.perf_counter()
    sizes = [int(s) for s in args.sizes.split(",")]
    doc = {
        "families": args.families,
        "runs": args.runs,
        "machine": machine_info(),
        "sizes": [measure(args.families, v, args.runs) for v in sizes],
    }
    finish(args.out, doc, report, t_start)


if __name__ == "__main__":
    main()
