"""Prune: the space of chunks no version needs comes back; everything a version needs stays whole."""

from __future__ import annotations

import dataclasses
import filecmp
import threading
import time
from datetime import UTC, datetime

import pytest
from sqlalchemy import func, insert, select, text, update

from mfsreg.registry.blobs.packs import pack_key
from mfsreg.registry.config import Settings
from mfsreg.registry.db import reclaim as prune_db
from mfsreg.registry.db.engine import create_db_engine, read_tx, write_tx
from mfsreg.registry.db.locks import exclude_writers
from mfsreg.registry.db.models import chunks, packs, unlisted_packs
from mfsreg.registry.errors import Conflict, InvalidRequest, NotFound, Pruned
from mfsreg.registry.format.hashing import HashJob, hash_source
from mfsreg.registry.format.source import open_source
from mfsreg.registry.format.wire import Entry, build_batch
from mfsreg.registry.progress import NullProgress
from mfsreg.registry.registry import Registry
from mfsreg.registry.store import service
from mfsreg.registry.store.ingest import commit_version, plan_deltas, upload_missing
from mfsreg.registry.store.recorded import RecordedPacks
from tests.cli_run import mfsreg, mfsreg_json
from tests.hooks import OnFirst, OnSend, Tally

LONG_AGO = datetime(2020, 1, 1, tzinfo=UTC)
HOUR = 3600.0


def pack_blobs(reg) -> set[str]:
    return set(reg.blobs.list("packs/"))


def table_packs(reg) -> set[str]:
    with read_tx(reg.engine) as conn:
        return {pack_key(i) for i in conn.execute(select(packs.c.id)).scalars()}


def chunk_bytes(reg) -> int:
    with read_tx(reg.engine) as conn:
        return int(conn.execute(select(func.coalesce(func.sum(chunks.c.stored_size), 0))).scalar_one())


def age(reg, table, column) -> None:
    """Move every row's timestamp back to long ago, as if the grace period had passed."""
    with write_tx(reg.engine) as conn:
        conn.execute(update(table).values({column: LONG_AGO}))


class InFlightPush:
    """A push stopped before its commit, as ingest.push runs it: ``plan`` hashes the file and
    chooses bases for its deltas (against ``parent``), ``upload`` stores and records the missing
    chunks, ``commit`` makes the version. Tests run other things between the steps."""

    def __init__(self, reg, path, version: str, parent: str | None = None):
        self.reg, self.family, self.version, self.parent = reg, "fam", version, parent
        self.source = open_source(path)
        self.job = HashJob(self.source, reg.settings.chunk_size, NullProgress())

    def plan(self) -> InFlightPush:
        ids = self.job.chunk_ids()
        self.missing = set(ids) - set(self.reg.locate(ids))
        new_files = [
            (refs, f.header.tensors if f.header else ()) for refs, f in zip(self.job.file_chunks, self.source.files)
        ]
        self.bases, self.reader = plan_deltas(self.reg, self.family, self.parent, new_files, ids, self.missing)
        return self

    def upload(self) -> set[str]:
        upload_missing(self.reg, self.job, self.missing, self.reg.pool, NullProgress(), self.bases, self.reader)
        return self.missing

    def commit(self) -> None:
        manifest = self.job.manifest()
        self.job.close()
        commit_version(self.reg, self.family, self.version, self.parent, manifest, self.reg.settings.chunk_size)


def upload_without_commit(reg, path) -> set[str]:
    """What a push killed just before its commit leaves: its new chunks stored and recorded, no version."""
    push = InFlightPush(reg, path, "never").plan()
    try:
        return push.upload()
    finally:
        push.job.close()


def chat_retired(reg, fam):
    """base and lora-chat pushed, lora-chat deleted, and a prune (grace period not yet over for its
    packs) that retires them and keeps their blobs for now; returns that prune's result."""
    reg.push(fam["base"], "fam", "base")
    reg.push(fam["lora-chat"], "fam", "lora-chat")
    reg.delete("fam", "lora-chat")
    age(reg, chunks, "created_at")
    return reg.prune(min_age=HOUR, max_unused=0)


def pulls_whole(reg, fam, tmp_path, *names) -> None:
    for name in names:
        out = tmp_path / f"pulled-{name}"
        reg.pull("fam", name, out)
        assert filecmp.cmp(out, fam[name], shallow=False), name


def push_family_and_delete_two(reg, fam) -> None:
    reg.push(fam["base"], "fam", "base")
    for name in ("lora-chat", "full-med", "vocab-ext"):
        reg.push(fam[name], "fam", name, parent="base")
    reg.delete("fam", "lora-chat")
    reg.delete("fam", "vocab-ext")


def test_prune_gives_back_the_space_of_deleted_versions(reg, fam, tmp_path):
    push_family_and_delete_two(reg, fam)
    before = reg.stats()
    assert before["unreferenced_bytes"] > 0

    res = reg.prune(min_age=0, max_unused=0)

    after = reg.stats()
    assert res.deleted_chunks > 0 and res.deleted_chunk_bytes == before["unreferenced_bytes"]
    assert after["unreferenced_bytes"] == 0
    assert res.freed_bytes > 0 and res.waiting_packs == 0
    # with max_unused 0 every pack left holds only chunks versions need, and every blob has its row
    assert after["pack_bytes"] == chunk_bytes(reg) == after["stored_bytes"]
    assert pack_blobs(reg) == table_packs(reg)
    assert before["pack_bytes"] - after["pack_bytes"] == res.freed_bytes - res.moved_bytes
    pulls_whole(reg, fam, tmp_path, "base", "full-med")

    again = reg.prune(min_age=0, max_unused=0)  # nothing left to do
    assert (again.deleted_chunks, again.repacked_packs, again.retired_packs, again.freed_bytes) == (0, 0, 0, 0)


def test_prune_keeps_the_bases_that_deltas_need(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    reg.push(fam["full-med"], "fam", "full-med", parent="base")
    _, m = reg.manifest("fam", "full-med")
    bases = {c.basis_id for c in reg.locate(m.chunk_ids()).values() if c.basis_id}
    assert bases and not bases & set(m.chunk_ids())  # base's chunks, needed by full-med's deltas only
    reg.delete("fam", "base")

    reg.prune(min_age=0, max_unused=0)

    assert set(reg.locate(bases)) == bases
    pulls_whole(reg, fam, tmp_path, "full-med")


def test_prune_spares_what_a_push_in_flight_stored(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    in_flight = upload_without_commit(reg, fam["lora-chat"])
    assert in_flight and reg.stats()["unreferenced_bytes"] > 0

    res = reg.prune(min_age=HOUR, max_unused=0)  # recorded moments ago: inside the grace period
    assert res.deleted_chunks == 0 and set(reg.locate(in_flight)) >= in_flight

    age(reg, chunks, "created_at")  # the push died an hour ago
    res = reg.prune(min_age=HOUR, max_unused=0)
    assert res.deleted_chunks == len(in_flight) and not reg.locate(in_flight)
    pulls_whole(reg, fam, tmp_path, "base")


def test_a_commit_whose_chunks_were_pruned_is_refused_whole(reg, fam):
    reg.push(fam["base"], "fam", "base")
    _, m = reg.manifest("fam", "base")
    reg.delete("fam", "base")
    reg.prune(min_age=0)
    # a push that found these chunks stored before the prune, committing after it
    with pytest.raises(NotFound, match="not stored"):
        commit_version(reg, "fam", "base-again", None, m, reg.settings.chunk_size)
    assert [v.name for v in reg.versions("fam")] == []


def test_retired_packs_wait_out_the_grace_period(reg, fam, tmp_path):
    push_family_and_delete_two(reg, fam)
    age(reg, chunks, "created_at")

    first = reg.prune(min_age=HOUR, max_unused=0)
    assert first.retired_packs > 0 and first.deleted_packs == 0
    assert first.waiting_packs == first.retired_packs
    assert reg.stats()["unlisted_pack_bytes"] == first.waiting_bytes > 0
    assert pack_blobs(reg) > table_packs(reg)  # the retired blobs are still there for readers
    pulls_whole(reg, fam, tmp_path, "base", "full-med")

    age(reg, unlisted_packs, "since")
    second = reg.prune(min_age=HOUR, max_unused=0)
    assert (second.deleted_packs, second.freed_bytes) == (first.waiting_packs, first.waiting_bytes)
    assert second.waiting_packs == 0 and pack_blobs(reg) == table_packs(reg)
    assert reg.stats()["unlisted_pack_bytes"] == 0
    pulls_whole(reg, fam, tmp_path, "base", "full-med")


def test_dry_run_changes_nothing_and_foretells_the_real_run(reg, fam):
    push_family_and_delete_two(reg, fam)
    before = (reg.stats(), pack_blobs(reg), chunk_bytes(reg))

    dry = reg.prune(min_age=0, max_unused=0, dry_run=True)
    assert (reg.stats(), pack_blobs(reg), chunk_bytes(reg)) == before

    real = reg.prune(min_age=0, max_unused=0)
    fields = (
        "deleted_chunks",
        "deleted_chunk_bytes",
        "repacked_packs",
        "moved_bytes",
        "retired_packs",
        "deleted_packs",
        "freed_bytes",
        "waiting_packs",
    )
    assert dry.dry_run and not real.dry_run
    assert {f: getattr(dry, f) for f in fields} == {f: getattr(real, f) for f in fields}


def test_packs_under_the_unused_share_are_left_alone(reg, fam):
    push_family_and_delete_two(reg, fam)
    res = reg.prune(min_age=0, max_unused=0.99)  # only packs with nothing needed go
    assert res.repacked_packs == 0 and res.moved_bytes == 0
    assert reg.stats()["pack_bytes"] >= chunk_bytes(reg)


def test_one_prune_at_a_time(reg):
    with prune_db.one_prune_at_a_time(reg.engine):
        with pytest.raises(Conflict, match="another prune is running"):
            reg.prune(min_age=0)
    reg.prune(min_age=0)  # the lock is released


@pytest.mark.parametrize("min_age, max_unused", [(-1, 0.1), (float("nan"), 0.1), (0, 1.0), (0, -0.1)])
def test_prune_refuses_bad_arguments(reg, min_age, max_unused):
    with pytest.raises(InvalidRequest):
        reg.prune(min_age=min_age, max_unused=max_unused)


def test_prune_on_s3(tmp_path, fam, s3_blob_url):
    blob_url, endpoint = s3_blob_url
    settings = Settings.from_env(
        {"MFSREG_HOME": str(tmp_path / "home")},
        blob_url=blob_url,
        s3_endpoint_url=endpoint,
        chunk_size=64 << 10,
        pack_size=1 << 20,
    )
    with Registry(settings, migrate=True) as reg:
        push_family_and_delete_two(reg, fam)
        res = reg.prune(min_age=0, max_unused=0)
        assert res.freed_bytes > 0 and reg.stats()["unreferenced_bytes"] == 0
        assert pack_blobs(reg) == table_packs(reg)
        pulls_whole(reg, fam, tmp_path, "base", "full-med")


def test_cli_prune(home_env, fam):
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=home_env)
    mfsreg("push", fam["lora-chat"], "--family", "fam", "--version", "chat", env=home_env)
    mfsreg("delete", "fam", "chat", env=home_env)
    dry = mfsreg_json("prune", "--min-age", "0", "--dry-run", env=home_env)
    out = mfsreg_json("prune", "--min-age", "0s", "--max-unused", "0", env=home_env)
    assert dry["dry_run"] and not out["dry_run"]
    assert out["deleted_chunks"] == dry["deleted_chunks"] > 0 and out["freed_bytes"] > 0
    mfsreg("push", fam["vocab-ext"], "--family", "fam", "--version", "vocab", env=home_env)
    mfsreg("delete", "fam", "vocab", env=home_env)
    text = mfsreg("prune", env=home_env).stdout  # the default grace period: what was stored just now stays
    assert "deleted 0 chunks" in text
    assert mfsreg_json("prune", "--min-age", "0", env=home_env)["deleted_chunks"] > 0


@pytest.mark.parametrize(
    "args, what",
    [(["--min-age", "5x"], "min-age"), (["--min-age", "-1h"], "min-age"), (["--max-unused", "1.5"], "max unused")],
)
def test_cli_prune_bad_arguments(home_env, args, what):
    proc = mfsreg("prune", *args, env=home_env, check=False)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and what in proc.stderr


def test_a_version_pushed_again_after_prune_survives_the_next_prune(reg, fam, tmp_path):
    """Pack names are never reused: the same bytes pushed again go to new packs, so deleting the
    blobs of the packs prune retired cannot take the new version's bytes with them."""
    assert chat_retired(reg, fam).waiting_packs > 0  # retired, blobs kept for now
    reg.push(fam["lora-chat"], "fam", "lora-chat")  # the same bytes again, encoded the same way
    age(reg, unlisted_packs, "since")
    assert reg.prune(min_age=HOUR, max_unused=0).deleted_packs > 0
    pulls_whole(reg, fam, tmp_path, "base", "lora-chat")


def test_chunks_in_flight_keep_the_bases_of_their_deltas(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    push = InFlightPush(reg, fam["full-med"], "full-med", parent="base").plan()
    assert push.bases  # full-med is stored as deltas against base's chunks
    push.upload()
    reg.delete("fam", "base")
    with write_tx(reg.engine) as conn:  # base's chunks are old; full-med's, just uploaded, are not
        conn.execute(update(chunks).where(chunks.c.id.in_(set(push.bases.values()))).values(created_at=LONG_AGO))
    reg.prune(min_age=HOUR, max_unused=0)
    assert set(reg.locate(set(push.bases.values()))) == set(push.bases.values())
    push.parent = None  # its parent is gone; the deltas still decode against the kept bases
    push.commit()
    pulls_whole(reg, fam, tmp_path, "full-med")


def after_the_decision(monkeypatch, action) -> None:
    """Run ``action`` once prune has decided on its snapshot and before it takes the writers' lock
    to check that choice again: writers go on while it decides."""
    from mfsreg.registry.store import prune as prune_mod

    decide = prune_mod.decide

    def then_act(*args, **kw):
        plan = decide(*args, **kw)
        action()
        return plan

    monkeypatch.setattr(prune_mod, "decide", then_act)


def test_a_version_committed_while_prune_decides_keeps_its_chunks_and_their_bases(reg, fam, tmp_path, monkeypatch):
    """Chosen for deletion on the snapshot, needed by the time writers wait: base's chunks (plain,
    and the bases of full-med's deltas) and full-med's deltas, pushed again as new versions while
    prune read every chunk row. The check under the lock keeps them, down their chains."""
    reg.push(fam["base"], "fam", "base")
    reg.push(fam["full-med"], "fam", "full-med", parent="base")
    reg.push(fam["lora-chat"], "fam", "lora-chat", parent="base")
    needed = set(reg.manifest("fam", "full-med")[1].chunk_ids()) | set(reg.manifest("fam", "base")[1].chunk_ids())
    deltas = {i: c.basis_id for i, c in reg.locate(needed).items() if c.basis_id}
    assert deltas  # full-med's, against base's chunks
    for name in ("base", "full-med", "lora-chat"):
        reg.delete("fam", name)
    age(reg, chunks, "created_at")

    def push_again():
        reg.push(fam["full-med"], "fam", "full-med-again")  # every chunk found stored: its deltas and their bases
        reg.push(fam["base"], "fam", "base-again")

    after_the_decision(monkeypatch, push_again)
    res = reg.prune(min_age=HOUR, max_unused=0)
    assert res.deleted_chunks > 0  # lora-chat's own chunks, which nothing pushed again
    assert set(reg.locate(needed)) == needed and set(deltas.values()) <= needed
    for name, source in (("full-med-again", "full-med"), ("base-again", "base")):
        reg.pull("fam", name, tmp_path / name)
        assert filecmp.cmp(tmp_path / name, fam[source], shallow=False), name
    res = reg.prune(min_age=HOUR, max_unused=0)  # nothing more to find: the first deleted what it should
    assert res.deleted_chunks == 0


def test_a_delta_recorded_while_prune_decides_keeps_its_basis(reg, fam, tmp_path, monkeypatch):
    """A push uploads deltas against chunks the snapshot found unneeded (their version deleted):
    the check under the lock keeps those bases, so the push commits and pulls whole."""
    reg.push(fam["base"], "fam", "base")
    push = InFlightPush(reg, fam["full-med"], "full-med", parent="base").plan()
    assert push.bases
    reg.delete("fam", "base")
    age(reg, chunks, "created_at")
    after_the_decision(monkeypatch, push.upload)
    res = reg.prune(min_age=HOUR, max_unused=0)
    assert res.deleted_chunks > 0  # base's chunks that no delta is against
    bases = set(push.bases.values())
    assert set(reg.locate(bases)) == bases
    push.parent = None  # deleted; the deltas decode against the kept bases
    push.commit()
    pulls_whole(reg, fam, tmp_path, "full-med")


def test_a_repack_counts_the_chunks_the_check_kept_among_the_bytes_it_moved(reg, fam, tmp_path, monkeypatch):
    """base deleted, lora-chat keeping most of its chunks: base's packs are to be repacked with the
    shared part. base pushed again while prune decides keeps the rest too, and the repack copies
    those chunks as well: moved_bytes said only what the decision planned to move."""
    reg.push(fam["base"], "fam", "base")
    reg.push(fam["lora-chat"], "fam", "lora-chat")
    ids = set(reg.manifest("fam", "base")[1].chunk_ids())
    was = reg.locate(ids)
    reg.delete("fam", "base")
    age(reg, chunks, "created_at")
    after_the_decision(monkeypatch, lambda: reg.push(fam["base"], "fam", "base-again"))
    res = reg.prune(min_age=HOUR, max_unused=0)
    now = reg.locate(ids)
    assert set(now) == ids and res.deleted_chunks == 0 and res.repacked_packs > 0
    moved = [c for c in now.values() if c.pack_id != was[c.id].pack_id]
    unused = set(ids) - set(reg.manifest("fam", "lora-chat")[1].chunk_ids())
    assert unused and unused <= {c.id for c in moved}  # the chunks the check kept went along
    assert res.moved_bytes == sum(c.stored_size for c in moved)
    reg.pull("fam", "base-again", tmp_path / "base")
    assert filecmp.cmp(tmp_path / "base", fam["base"], shallow=False)


def test_the_check_keeps_a_chosen_chain_down_to_its_plain_chunk(reg, fam):
    """still_unneeded walks the bases of what it keeps: a delta recorded meanwhile against a chosen
    delta keeps that delta and the plain chunk beneath it (no synthetic member stores a delta
    against a delta, so the newer one is a row written here, and rolled back)."""
    from mfsreg.registry.store import prune as prune_mod

    reg.push(fam["base"], "fam", "base")
    reg.push(fam["full-med"], "fam", "full-med", parent="base")
    _, med = reg.manifest("fam", "full-med")
    delta = next(c for c in reg.locate(med.chunk_ids()).values() if c.basis_id)
    plain = reg.locate([delta.basis_id])[delta.basis_id]
    assert plain.basis_id is None
    state = lambda c: prune_db.ChunkState(c.id, c.pack_id, c.stored_size, c.basis_id, False, True)
    other = next(c for c in reg.locate(med.chunk_ids()).values() if c.id not in (delta.id, plain.id))
    chosen = [state(delta), state(plain), state(other)]  # as a decision on a snapshot would have them
    with write_tx(reg.engine) as conn:
        assert prune_mod.still_unneeded(conn, chosen) == []  # full-med needs them all
        conn.execute(text("DELETE FROM version_chunks"))  # as if every version were deleted
        assert prune_mod.still_unneeded(conn, chosen) == chosen
        conn.execute(
            insert(chunks).values(
                id="f" * 32,
                size=delta.size,
                encoding=delta.encoding,
                stored_size=1,
                pack_id=delta.pack_id,
                offset=0,
                basis_id=delta.id,
                depth=2,
            )
        )
        assert prune_mod.still_unneeded(conn, chosen) == [state(other)]
        conn.rollback()


def test_a_push_whose_basis_was_pruned_meanwhile_stores_those_chunks_plain(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    push = InFlightPush(reg, fam["full-med"], "full-med", parent="base").plan()  # bases chosen in base
    gone = set(push.bases.values())
    assert gone
    reg.delete("fam", "base")
    age(reg, chunks, "created_at")
    reg.prune(min_age=HOUR)  # base's chunks go; their packs' blobs stay for the grace period
    assert not reg.locate(gone)

    # A pack holding a delta against a deleted basis is never recorded: it could not be decoded.
    writer = RecordedPacks(reg)
    writer.add("d" * 32, 100, "esub", b"x" * 10, min(gone), 1)
    with pytest.raises(Pruned, match="deleted by a prune meanwhile"):
        writer.flush()
    assert not reg.locate(["d" * 32])

    push.upload()  # the refused pack's chunks, and the rest, are stored again without those bases
    stored = reg.locate(push.missing)
    assert set(stored) == push.missing
    assert not [c.id for c in stored.values() if c.basis_id in gone]
    push.parent = None  # its parent is gone
    push.commit()
    pulls_whole(reg, fam, tmp_path, "full-med")


def test_a_push_whose_pack_a_prune_took_for_abandoned_writes_it_again(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    reg.settings = dataclasses.replace(reg.settings, pack_size=64 << 10)  # the push writes several packs
    # prune with --min-age 0 runs after the first pack is announced, before its blob is written
    reg.blobs = OnFirst(reg.blobs, "put", lambda: reg.prune(min_age=0))
    tally = Tally()
    res = reg.push(fam["full-med"], "fam", "full-med", progress=tally)
    assert reg.blobs.calls >= 3 and res.new_bytes > 0  # the claimed pack, then its chunks again with the rest
    assert tally.done["send"] == tally.total["send"] > 0  # each chunk counted once, sent once or twice
    assert pack_blobs(reg) == table_packs(reg)  # the writer deleted the claimed pack's blob
    pulls_whole(reg, fam, tmp_path, "full-med", "base")


def test_a_plain_copy_whose_pack_a_prune_took_for_abandoned_leaves_no_blob(reg, fam):
    """The plain copies a scoped push makes of chunks whose delta chains pass through another
    family's (registry/store/access.py) are written in announced packs too: one that a prune claims
    before its blob is written is refused, and its writer deletes the blob (it was left in the
    store, listed nowhere, for good)."""
    from mfsreg.registry.errors import Pruned
    from mfsreg.registry.store.access import _PlainCopies

    reg.push(fam["base"], "fam", "base")
    _, manifest = reg.manifest("fam", "base")
    c = manifest.files[0].chunks[-1]
    raw = fam["base"].read_bytes()[c.offset : c.offset + c.size]
    before = table_packs(reg)
    reg.blobs = OnFirst(reg.blobs, "put", lambda: reg.prune(min_age=0))
    writer = _PlainCopies(reg)
    writer.add(c.id, c.size, "raw", raw)
    with pytest.raises(Pruned):
        writer.flush()
    assert reg.blobs.calls == 1
    assert pack_blobs(reg) == table_packs(reg) == before  # no blob of the refused pack is left


def test_the_servers_batch_upload_stores_plain_what_a_prune_took_the_basis_of(reg, fam, tmp_path):
    """receive_batch, as the API calls it: the first pack it writes holds deltas against base's
    chunks, and a prune deletes them while that pack is written."""
    reg.push(fam["base"], "fam", "base")
    base_packs = table_packs(reg)
    manifest = hash_source(open_source(fam["full-med"]), reg.settings.chunk_size, NullProgress())
    neg = service.negotiate(reg, "fam", "full-med", manifest.to_doc())
    gone = set(neg["bases"].values())
    assert gone and neg["missing"]
    data = fam["full-med"].read_bytes()
    refs = {c.id: c for f in manifest.files for c in f.chunks}
    body = build_batch(
        [
            (
                Entry(i, refs[i].size, "raw", refs[i].size, neg["bases"].get(i), refs[i].itemsize),
                data[refs[i].offset : refs[i].offset + refs[i].size],
            )
            for i in neg["missing"]
        ]
    )

    def delete_and_prune():
        reg.delete("fam", "base")
        age(reg, chunks, "created_at")
        reg.prune(min_age=HOUR)

    reg.blobs = OnFirst(reg.blobs, "put", delete_and_prune)
    service.receive_batch(reg, "fam", body)
    assert not reg.locate(gone)
    # left in storage besides the recorded packs: base's (retired, in their grace period) and the refused one
    (refused,) = pack_blobs(reg) - table_packs(reg) - base_packs
    assert base_packs <= pack_blobs(reg) and reg.blobs.calls >= 2
    stored = reg.locate(neg["missing"])
    assert set(stored) == set(neg["missing"]) and not [c for c in stored.values() if c.basis_id in gone]
    service.commit(reg, "fam", "full-med", None, manifest.to_doc())
    pulls_whole(reg, fam, tmp_path, "full-med")


def delete_base_and_prune_at_once(reg) -> set[str]:
    """base deleted and a prune with --min-age 0: its chunks and their packs' blobs go at once;
    returns the ids of the chunks it had."""
    ids = set(reg.manifest("fam", "base")[1].chunk_ids())
    reg.delete("fam", "base")
    reg.prune(min_age=0)
    assert not reg.locate(ids)
    return ids


def test_a_push_whose_bases_blobs_a_prune_deletes_before_it_reads_them_stores_those_chunks_plain(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    base_blobs = pack_blobs(reg)
    gone: set[str] = set()
    # the push chose its bases in base (the family's only member); the prune runs as it reads the first
    reg.blobs = OnFirst(reg.blobs, "get_ranges", lambda: gone.update(delete_base_and_prune_at_once(reg)))
    res = reg.push(fam["full-med"], "fam", "full-med")
    assert reg.blobs.calls >= 1 and gone and not base_blobs & pack_blobs(reg)
    stored = reg.locate(reg.manifest("fam", "full-med")[1].chunk_ids())
    assert res.new_bytes > 0 and not [c for c in stored.values() if c.basis_id in gone]
    pulls_whole(reg, fam, tmp_path, "full-med")


def test_the_servers_batch_upload_stores_plain_what_a_prune_deleted_the_bases_blobs_of(reg, fam, tmp_path):
    """receive_batch, as the API calls it, with a prune (--min-age 0) between its lookup of the
    bases the client named and its read of them."""
    reg.push(fam["base"], "fam", "base")
    manifest = hash_source(open_source(fam["full-med"]), reg.settings.chunk_size, NullProgress())
    neg = service.negotiate(reg, "fam", "full-med", manifest.to_doc())
    assert neg["bases"] and neg["missing"]
    data = fam["full-med"].read_bytes()
    refs = {c.id: c for f in manifest.files for c in f.chunks}
    body = build_batch(
        [
            (
                Entry(i, refs[i].size, "raw", refs[i].size, neg["bases"].get(i), refs[i].itemsize),
                data[refs[i].offset : refs[i].offset + refs[i].size],
            )
            for i in neg["missing"]
        ]
    )
    gone: set[str] = set()
    reg.blobs = OnFirst(reg.blobs, "get_ranges", lambda: gone.update(delete_base_and_prune_at_once(reg)))
    service.receive_batch(reg, "fam", body)
    assert reg.blobs.calls >= 1 and set(neg["bases"].values()) <= gone
    stored = reg.locate(neg["missing"])
    assert set(stored) == set(neg["missing"]) and not [c for c in stored.values() if c.basis_id]
    service.commit(reg, "fam", "full-med", None, manifest.to_doc())
    pulls_whole(reg, fam, tmp_path, "full-med")


def test_a_proof_reads_again_where_a_prune_moved_the_stored_chunks(reg, fam, caplog):
    """A scoped upload of stored chunks is compared with the stored bytes (access.compare_stored). A
    prune that repacks their pack between the lookup and the read (its blob deleted at once, with a
    grace period of 0) makes the first read fail: the chunks are looked up again, once, and compared
    in their new pack, and the upload passes."""
    from mfsreg.registry.auth import Principal
    from tests.proofs import check_proofs

    # lora-chat first: its pack holds the chunks base shares with it, and its own, which die with it
    reg.push(fam["lora-chat"], "fam", "lora-chat")
    reg.push(fam["base"], "fam", "base")
    reg.delete("fam", "lora-chat")
    m = hash_source(open_source(fam["base"]), reg.settings.chunk_size, NullProgress())
    data = fam["base"].read_bytes()
    raw = {c.id: data[c.offset : c.offset + c.size] for f in m.files for c in f.chunks}
    before = {i: c.pack_id for i, c in reg.locate(list(raw)).items()}
    pruned = []
    reg.blobs = OnFirst(reg.blobs, "get_ranges", lambda: pruned.append(reg.prune(min_age=0, max_unused=0)))
    with caplog.at_level("WARNING", logger="mfsreg"):
        assert check_proofs(reg, Principal("push", "qwen*"), "qwen", raw) == set(
            raw
        )  # every one compared and claimable
    assert pruned[0].repacked_packs > 0
    moved = [i for i, c in reg.locate(list(raw)).items() if c.pack_id != before[i]]
    assert moved and not set(map(pack_key, {before[i] for i in moved})) & pack_blobs(reg)  # their old blob is gone
    assert "(attempt 1 of 2)" in caplog.text and "(attempt 2 of 2)" not in caplog.text


def test_a_push_whose_found_chunks_are_pruned_before_its_commit_stores_them_and_commits(reg, fam, tmp_path):
    reg.push(fam["base"], "fam", "base")
    reg.push(fam["lora-chat"], "fam", "chat")
    reg.delete("fam", "chat")  # its own chunks stay stored, used by no version
    unused = chunk_bytes(reg) - reg.stats("fam")["stored_bytes"]
    assert unused > 0
    # pushed again: every chunk is found stored, then a prune (min-age 0) deletes the unused ones
    hook = OnSend(lambda: reg.prune(min_age=0))
    res = reg.push(fam["lora-chat"], "fam", "chat-again", progress=hook)
    (pruned,) = hook.results
    assert pruned.deleted_chunks > 0
    assert res.new_chunks == pruned.deleted_chunks and res.new_bytes > 0  # stored again, then committed
    pulls_whole(reg, {**fam, "chat-again": fam["lora-chat"]}, tmp_path, "chat-again", "base")


def test_a_pack_whose_writer_died_is_deleted_after_the_grace_period(reg):
    class Dies(RecordedPacks):  # announces its pack, writes it, and dies before recording it
        def _record(self, pack_id, size, stored):
            raise RuntimeError("killed before recording its pack")

    writer = Dies(reg)
    writer.add("c" * 32, 100, "raw", b"x" * 100)
    with pytest.raises(RuntimeError):
        writer.flush()
    (leftover,) = pack_blobs(reg)
    assert reg.prune(min_age=HOUR).waiting_packs == 1 and pack_blobs(reg) == {leftover}
    age(reg, unlisted_packs, "since")
    assert reg.prune(min_age=HOUR).deleted_packs == 1 and pack_blobs(reg) == set()


def test_a_commit_waits_while_prune_decides(reg, fam):
    """Prune's decision and a commit never interleave (Postgres: advisory lock; SQLite: the write lock)."""
    reg.push(fam["base"], "fam", "base")
    push = InFlightPush(reg, fam["lora-chat"], "chat").plan()
    push.upload()
    deciding, ended = threading.Event(), []

    def prune_deciding():
        with write_tx(reg.engine) as conn:
            exclude_writers(conn)
            deciding.set()
            time.sleep(1.0)
            ended.append(time.monotonic())

    t = threading.Thread(target=prune_deciding)
    t.start()
    deciding.wait(10)
    push.commit()
    committed = time.monotonic()
    t.join()
    assert committed >= ended[0]


def test_a_pack_prune_took_for_abandoned_is_refused_and_its_writer_deletes_it(reg):
    """A writer so slow that prune (here with --min-age 0) claims its announced pack before the blob
    is written: recording is refused, and the writer deletes the blob nobody else would."""

    class Slow(RecordedPacks):
        def _announce(self, pack_id, size):
            super()._announce(pack_id, size)
            assert reg.prune(min_age=0).waiting_packs == 0  # claimed and "deleted" before the put

    writer = Slow(reg)
    writer.add("c" * 32, 100, "raw", b"x" * 100)
    with pytest.raises(Pruned, match="taken for abandoned"):
        writer.flush()
    assert pack_blobs(reg) == set() and not reg.locate(["c" * 32])


def test_a_prune_that_died_after_claiming_leaves_the_next_one_its_claims(reg, fam, tmp_path):
    chat_retired(reg, fam)  # lora-chat's packs retired, their blobs kept for now
    before = pack_blobs(reg)
    age(reg, unlisted_packs, "since")
    with write_tx(reg.engine) as conn:  # what the next prune does before its deletes, and then it dies
        claimed = prune_db.claim_due(conn, prune_db.db_now(conn))
    assert claimed and pack_blobs(reg) == before  # nothing deleted yet, and nothing forgotten
    with read_tx(reg.engine) as conn:
        assert {i for i, _ in prune_db.unlisted(conn)} == {i for i, _ in claimed}
        assert not prune_db.is_announced(conn, claimed[0][0])  # claimed: no writer may list it now

    res = reg.prune(min_age=HOUR, max_unused=0)  # claims are due whatever the grace period
    assert res.deleted_packs == len(claimed) and res.waiting_packs == 0
    assert pack_blobs(reg) == table_packs(reg)
    pulls_whole(reg, fam, tmp_path, "base")


def test_a_pack_an_older_writer_lists_again_is_not_deleted(reg, fam):
    """A writer of the previous release names packs by their bytes and lists them without announcing:
    pushing bytes prune retired, it lists the retired name again, and that blob must stay."""
    chat_retired(reg, fam)
    with read_tx(reg.engine) as conn:
        (pack_id, size), *_ = prune_db.unlisted(conn)
    with write_tx(reg.engine) as conn:  # what the older writer's record_pack does: the pack and its chunk rows
        conn.execute(insert(packs).values(id=pack_id, size=size))
        conn.execute(
            insert(chunks).values(id="d" * 32, size=size, encoding="raw", stored_size=size, pack_id=pack_id, offset=0)
        )
    age(reg, unlisted_packs, "since")
    reg.prune(min_age=HOUR, max_unused=0)
    assert pack_key(pack_id) in pack_blobs(reg)
    with read_tx(reg.engine) as conn:
        assert pack_id not in {i for i, _ in prune_db.unlisted(conn)}


def test_the_postgres_run_lock_leaves_no_transaction_open(pg_database):
    """The lock that keeps one prune at a time is held on a connection in autocommit: idle in a
    transaction for the whole run, a server's idle_in_transaction_session_timeout would end it."""
    engine = create_db_engine(pg_database)
    try:
        with prune_db.one_prune_at_a_time(engine):
            with engine.connect() as conn:
                states = (
                    conn.execute(
                        text(
                            "SELECT state FROM pg_stat_activity WHERE datname = current_database() "
                            "AND pid <> pg_backend_pid()"
                        )
                    )
                    .scalars()
                    .all()
                )
        assert states == ["idle"]  # the lock holder, outside any transaction
    finally:
        engine.dispose()


def test_a_pull_whose_version_is_deleted_and_pruned_meanwhile_says_so(reg, fam, tmp_path):
    """Deleted and pruned while its bytes were being read: 'deleted while it was being pulled'
    (exit 2), not the data-loss error a pack lost under a living version gets; nothing written."""

    class DeleteAndPrune(NullProgress):  # runs as the pull starts writing, after it has located its chunks
        def start(self, task: str, total: int) -> None:
            if task == "write":
                reg.delete("fam", "v1")
                reg.prune(min_age=0)

    reg.push(fam["lora-chat"], "fam", "v1")
    with pytest.raises(NotFound, match="fam/v1 was deleted while it was being pulled"):
        reg.pull("fam", "v1", tmp_path / "out.safetensors", progress=DeleteAndPrune())
    assert not (tmp_path / "out.safetensors").exists()


def _cut_short(reg, pack_id: str) -> None:
    """A pack's blob cut to half its bytes (a bad disk, a copy that stopped): damage prune finds."""
    key = pack_key(pack_id)
    data = reg.blobs.get(key)
    reg.blobs.delete(key)
    reg.blobs.put(key, data[: len(data) // 2])


def _plan_now(reg, max_unused: float = 0.0):
    from mfsreg.registry.store import prune as prune_mod

    with read_tx(reg.engine) as conn:
        return prune_mod.decide(conn, prune_db.db_now(conn), prune_db.pack_sizes(conn), max_unused)


def _one_bad_pack_to_repack(reg, fam):
    """A family with packs to delete and packs to repack, one of which is cut short; returns
    (the damaged pack, the packs to retire, the packs to repack)."""
    for name in ("base", "lora-chat", "vocab-ext"):
        reg.push(fam[name], "fam", name)
    reg.delete("fam", "base")  # lora-chat keeps most of base's chunks: base's packs are to be repacked
    reg.delete("fam", "vocab-ext")  # its own packs (its deltas' bases are base's chunks) are to be deleted
    plan = _plan_now(reg)
    assert plan.retire and plan.repack, (plan.retire, plan.repack)
    bad = plan.repack[0]
    _cut_short(reg, bad)
    return bad, plan.retire, plan.repack


def test_a_pack_cut_short_found_by_a_repack_is_a_storage_error_and_the_deletions_go_on(reg, fam, tmp_path):
    """A pack that storage cut short, found by a repack: a storage error that names it and says what
    to do (it was a NotFound, exit 2, and it stopped the prune before it deleted any blob, every
    time); any other packs are repacked, the retired blobs deleted, and the damaged pack stays as
    it was, listed."""
    from mfsreg.registry.errors import StorageError

    bad, retire, repack = _one_bad_pack_to_repack(reg, fam)
    before = reg.blobs.get(pack_key(bad))
    with pytest.raises(
        StorageError,
        match=f"could not repack pack {bad}.*restore its blob from a backup.*The rest of "
        f"the prune ran: .* {len(repack) - 1} packs repacked",
    ):
        reg.prune(min_age=0, max_unused=0)
    blobs = pack_blobs(reg)
    assert not {pack_key(p) for p in retire + repack[1:]} & blobs  # deleted, and repacked then deleted
    assert pack_key(bad) in blobs and pack_key(bad) in table_packs(reg) and reg.blobs.get(pack_key(bad)) == before
    # the next prune has nothing else to do and says the same of the same pack
    with pytest.raises(StorageError, match=f"could not repack pack {bad}"):
        reg.prune(min_age=0, max_unused=0)


def test_cli_prune_over_a_pack_cut_short_in_s3_exits_5_naming_it(home_env, fam, s3_blob_url):
    blob_url, endpoint = s3_blob_url
    env = dict(home_env, MFSREG_BLOB_URL=blob_url, MFSREG_S3_ENDPOINT_URL=endpoint, MFSREG_PACK_SIZE="1M")
    with Registry(Settings.from_env(env)) as reg:
        bad, retire, _ = _one_bad_pack_to_repack(reg, fam)
    proc = mfsreg("prune", "--min-age", "0", "--max-unused", "0", env=env, check=False)
    assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"could not repack pack {bad}" in proc.stderr and "backup" in proc.stderr, proc.stderr
    with Registry(Settings.from_env(env)) as reg:
        assert not {pack_key(p) for p in retire} & pack_blobs(reg) and pack_key(bad) in pack_blobs(reg)
