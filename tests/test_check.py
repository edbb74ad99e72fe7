"""`mfsreg check`: lost and damaged packs are found, with the versions they break, and nothing changes.
Each verdict is checked against what a pull of every version actually does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mfsreg.registry.blobs.packs import pack_key
from mfsreg.registry.client.remote import RemoteRegistry
from mfsreg.registry.config import Settings
from mfsreg.registry.errors import IntegrityError, NotFound, StorageError
from mfsreg.registry.registry import Registry
from mfsreg.registry.store.service import version_doc
from tests.cli_run import mfsreg, mfsreg_json
from tests.dialects import sqlite_only
from tests.server import client_env, token
from tests.test_bad_input import snapshot
from tests.test_tiers import expected_tiers


def _push_family(reg: Registry, fam: dict) -> None:
    for name, path in fam.items():
        reg.push(path, "fam", name, parent=None if name == "base" else "base")


def _pullable(reg: Registry, fam: dict, tmp_path: Path) -> dict[str, bool]:
    """Which versions a pull rebuilds (a lost pack or a damaged chunk fails it)."""
    out = {}
    for name in fam:
        try:
            reg.pull("fam", name, tmp_path / f"pulled-{name}")
            out[name] = True
        except (StorageError, IntegrityError, NotFound):
            out[name] = False
    return out


def _pack_of_a_delta(reg: Registry, version: str) -> str:
    """The pack of a chunk that ``version`` stores as a delta (its basis lies elsewhere)."""
    _, manifest = reg.manifest("fam", version)
    located = reg.locate(manifest.chunk_ids())
    return next(c.pack_id for c in located.values() if c.basis_id)


def test_a_whole_registry_checks_clean(reg, fam, tmp_path):
    _push_family(reg, fam)
    res = reg.check()
    assert res.ok and res.versions == len(fam) and not res.broken_versions and res.read_bytes == 0
    ids = {i for name in fam for i in reg.manifest("fam", name)[1].chunk_ids()}
    located = reg.locate(ids)
    assert res.chunks == len(located) and res.packs == len({c.pack_id for c in located.values()})
    assert res.stored_bytes == sum(c.stored_size for c in located.values())
    read = reg.check(read_data=True)
    assert read.ok and read.read_bytes >= read.stored_bytes and not read.damaged_chunks
    assert all(_pullable(reg, fam, tmp_path).values())


@sqlite_only
def test_a_lost_pack_names_exactly_the_versions_that_cannot_be_pulled(reg, fam, tmp_path):
    _push_family(reg, fam)
    pack = _pack_of_a_delta(reg, "full-med")
    reg.blobs.delete(pack_key(pack))
    for read_data in (False, True):
        res = reg.check(read_data=read_data)
        assert not res.ok and list(res.lost_packs) == [pack] and "missing" in res.lost_packs[pack]
        assert not res.damaged_chunks and res.unreadable_chunks > 0
        pulls = _pullable(reg, fam, tmp_path)
        assert (
            res.broken_versions == [f"fam/{v}" for v in fam if not pulls[v]] and "fam/full-med" in res.broken_versions
        )
        assert any(pulls.values())  # the other packs still serve some versions


@sqlite_only
def test_a_pack_cut_short_is_lost_too(reg, fam, tmp_path):
    _push_family(reg, fam)
    pack = _pack_of_a_delta(reg, "lora-chat")
    data = reg.blobs.get(pack_key(pack))
    reg.blobs.delete(pack_key(pack))
    reg.blobs.put(pack_key(pack), data[: len(data) // 2])
    res = reg.check()
    assert list(res.lost_packs) == [pack] and "bytes where its chunks need" in res.lost_packs[pack]
    pulls = _pullable(reg, fam, tmp_path)
    assert res.broken_versions == [f"fam/{v}" for v in fam if not pulls[v]] and "fam/lora-chat" in res.broken_versions


@sqlite_only
def test_damaged_bytes_are_found_by_read_data_alone_with_what_leans_on_them(reg, fam, tmp_path):
    """Flipped bytes keep a pack's size: only reading finds them; the versions named are those
    whose pull fails, including those whose deltas lean on a damaged basis."""
    _push_family(reg, fam)
    _, manifest = reg.manifest("fam", "base")
    located = reg.locate(manifest.chunk_ids())
    basis_ids = {
        c.basis_id for name in fam for c in reg.locate(reg.manifest("fam", name)[1].chunk_ids()).values() if c.basis_id
    }
    victim = next(c for c in located.values() if c.id in basis_ids)  # a base chunk that deltas decode against
    _damage(reg, victim)
    assert reg.check().ok  # sizes alone look whole
    res = reg.check(read_data=True)
    assert not res.ok and not res.lost_packs and victim.id in res.damaged_chunks
    assert res.damaged_packs[victim.pack_id]["chunks"] == len(res.damaged_chunks)
    pulls = _pullable(reg, fam, tmp_path)
    assert res.broken_versions == [f"fam/{v}" for v in fam if not pulls[v]]
    assert "fam/base" in res.broken_versions and len(res.broken_versions) > 1  # a delta's basis: others break too


@sqlite_only
def test_a_chunk_row_the_database_lost_is_named_too(reg, fam, tmp_path):
    """No foreign key ties a version's chunk list to the chunk rows: a row deleted by hand leaves a
    version that names a chunk the registry cannot locate, which its pull cannot rebuild."""
    from sqlalchemy import delete

    from mfsreg.registry.db.engine import write_tx
    from mfsreg.registry.db.models import chunks

    _push_family(reg, fam)
    own = set(reg.manifest("fam", "vocab-ext")[1].chunk_ids()) - set(reg.manifest("fam", "base")[1].chunk_ids())
    gone = sorted(own)[0]
    with write_tx(reg.engine) as conn:
        conn.execute(delete(chunks).where(chunks.c.id == gone))
    res = reg.check()
    assert not res.ok and res.unrecorded_chunks == 1 and not res.lost_packs
    pulls = _pullable(reg, fam, tmp_path)
    assert res.broken_versions == [f"fam/{v}" for v in fam if not pulls[v]] and "fam/vocab-ext" in res.broken_versions


def test_check_on_s3_finds_a_lost_pack(tmp_path, fam, s3_blob_url):
    blob_url, endpoint = s3_blob_url
    settings = Settings.from_env(
        {"MFSREG_HOME": str(tmp_path / "home")},
        blob_url=blob_url,
        s3_endpoint_url=endpoint,
        chunk_size=64 << 10,
        pack_size=1 << 20,
    )
    with Registry(settings, migrate=True) as reg:
        _push_family(reg, fam)
        assert reg.check(read_data=True).ok
        pack = _pack_of_a_delta(reg, "vocab-ext")
        reg.blobs.delete(pack_key(pack))
        res = reg.check(read_data=True)
        pulls = _pullable(reg, fam, tmp_path)
        assert list(res.lost_packs) == [pack] and res.broken_versions == [f"fam/{v}" for v in fam if not pulls[v]]


def test_the_command_says_what_is_wrong_and_changes_nothing(home_env, fam, tmp_path):
    home = Path(home_env["MFSREG_HOME"])
    for name, path in fam.items():
        mfsreg("push", path, "--family", "fam", "--version", name, env=home_env)
    clean = mfsreg("check", "--read-data", env=home_env)
    assert "all intact" in clean.stdout and clean.stderr == ""
    packs = sorted((home / "blobs").rglob("*.pack"))
    lost = packs[-1]
    lost.rename(tmp_path / lost.name)  # moved away by hand
    before = snapshot(home)
    proc = mfsreg("check", env=home_env, check=False)
    assert proc.returncode == 4 and "Traceback" not in proc.stderr, proc.stderr
    assert f"pack {lost.stem}: " in proc.stdout and "cannot be pulled: fam/" in proc.stdout, proc.stdout
    assert "restore the lost packs from a backup" in proc.stdout, proc.stdout
    as_json = mfsreg("check", "--json", env=home_env, check=False)
    assert as_json.returncode == 4
    res = json.loads(as_json.stdout)
    assert res["ok"] is False and list(res["lost_packs"]) == [lost.stem]
    for version in res["broken_versions"]:
        pulled = mfsreg("pull", *version.split("/"), "-o", tmp_path / "out", env=home_env, check=False)
        assert pulled.returncode == 5, pulled.stderr
    assert snapshot(home) == before  # a check writes nothing
    (tmp_path / lost.name).rename(lost)  # restored from the backup
    assert mfsreg_json("check", "--family", "fam", env=home_env)["ok"] is True


def test_the_server_checks_its_store_for_an_admin(servers, server_env, fam, tmp_path):
    """Over HTTP (Postgres, S3): the same verdict; the whole registry needs an admin token for every
    family, one family an admin token for it; a read token is refused (exit 3 / 403)."""
    (srv,) = servers(1)
    pusher = client_env(tmp_path, srv.url, token(server_env, "push"))
    for name, path in fam.items():
        mfsreg("push", path, "--family", "fam", "--version", name, env=pusher)
    mfsreg("push", fam["base"], "--family", "other", "--version", "base", env=pusher)
    admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
    assert mfsreg_json("check", "--read-data", env=admin)["ok"] is True
    with Registry(Settings.from_env(server_env)) as reg:
        pack = _pack_of_a_delta(reg, "lora-chat")
        reg.blobs.delete(pack_key(pack))
        pulls = _pullable(reg, fam, tmp_path)
    proc = mfsreg("check", "--json", env=admin, check=False)
    assert proc.returncode == 4, proc.stderr
    res = json.loads(proc.stdout)
    assert list(res["lost_packs"]) == [pack] and res["broken_versions"] == [f"fam/{v}" for v in fam if not pulls[v]]
    # through the client, the wait for the server's answer is one task of unknown size (a bar that pulses)
    started = []

    class Told:
        def start(self, task, total):
            started.append((task, total))

        def advance(self, task, n):
            pass

    admin_token = admin["MFSREG_TOKEN"]
    with RemoteRegistry(srv.url, token=admin_token) as remote:
        assert remote.check(progress=Told()).lost_packs == res["lost_packs"] and started == [("server", None)]
    scoped = client_env(tmp_path, srv.url, token(server_env, "admin", "fam"))
    one = mfsreg("check", "--family", "fam", env=scoped, check=False)
    assert one.returncode == 4 and "cannot be pulled: fam/lora-chat" in one.stdout, one.stdout + one.stderr
    for env, args, says in (
        (scoped, [], "give --family"),
        (client_env(tmp_path, srv.url, token(server_env, "read")), ["--family", "fam"], "admin"),
    ):
        refused = mfsreg("check", *args, env=env, check=False)
        assert refused.returncode == 3 and refused.stderr.count("\n") == 1 and says in refused.stderr, refused.stderr


def test_the_command_refuses_what_it_cannot_check_in_one_line(home_env, fam):
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=home_env)
    for args, env, code, says in (
        (["--family", "nofam"], home_env, 2, "family 'nofam' does not exist"),
        (["--family", "../x"], home_env, 2, "family"),
        (["--bogus"], home_env, 2, "No such option"),
    ):
        proc = mfsreg("check", *args, env=env, check=False)
        assert proc.returncode == code and proc.stderr.count("\n") == 1 and says in proc.stderr, (args, proc.stderr)


def test_an_empty_registry_checks_clean(home_env):
    res = mfsreg_json("check", env=home_env)
    assert res["ok"] is True and res["versions"] == 0 and res["chunks"] == 0
    assert "checked 0 versions of the registry" in mfsreg("check", env=home_env).stdout


def _damage(reg: Registry, chunk) -> None:
    """Flip bytes of ``chunk`` where its pack holds them, keeping the pack's size (bit rot, a bad
    copy): only reading finds it."""
    key = pack_key(chunk.pack_id)
    data = bytearray(reg.blobs.get(key))
    for at in range(chunk.offset, chunk.offset + chunk.stored_size, 97):
        data[at] ^= 0x5A
    reg.blobs.delete(key)
    reg.blobs.put(key, bytes(data))


def _basis_of_a_delta(reg: Registry, version: str):
    """A chunk of base's, plain, that a delta of ``version`` (not itself in ``version``) decodes against."""
    base = reg.locate(reg.manifest("fam", "base")[1].chunk_ids())
    ids = set(reg.manifest("fam", version)[1].chunk_ids())
    bases = {c.basis_id for i, c in reg.locate(ids).items() if i in ids and c.basis_id}
    return next(c for i, c in sorted(base.items()) if i in bases and i not in ids and not c.basis_id)


def _needing(reg: Registry, fam: dict, chunk_id: str) -> list[str]:
    """The versions whose chunks, down the delta chains as stored now, include ``chunk_id``: worked
    out from their manifests and the chunk rows, not from the chunk lists the registry recorded."""
    return [f"fam/{v}" for v in fam if chunk_id in reg.locate(reg.manifest("fam", v)[1].chunk_ids())]


@sqlite_only
def test_a_repush_with_mend_damaged_stores_damaged_chunks_again(reg, fam, tmp_path):
    """A damaged chunk (its pack present, its bytes wrong) is not mended by an identical re-push,
    which only looks packs up; with mend_damaged the re-push reads, decodes and hashes every chunk the
    version needs, down its deltas' chains, and stores again (plain) those that do not read back.
    A delta leaning on a damaged basis the version does not use is stored again itself, leaving the
    basis damaged for base; base's own re-push then mends the basis for every version."""
    import filecmp

    _push_family(reg, fam)
    victim = _basis_of_a_delta(reg, "full-med")
    _damage(reg, victim)
    res = reg.check(read_data=True)
    assert not res.ok and victim.id in res.damaged_chunks and "fam/full-med" in res.broken_versions

    plain = reg.push(fam["full-med"], "fam", "full-med", parent="base")
    assert plain.existed and plain.mended_chunks == 0 and plain.new_bytes == 0  # looked up only: nothing seen
    assert reg.check(read_data=True).broken_versions == res.broken_versions

    tag = version_doc(reg, "fam", "full-med")[1]
    med = reg.push(fam["full-med"], "fam", "full-med", parent="base", mend_damaged=True)
    assert med.existed and med.mended_chunks > 0 and med.new_chunks == med.mended_chunks and med.new_bytes > 0, med
    reg.pull("fam", "full-med", tmp_path / "med.out")
    assert filecmp.cmp(tmp_path / "med.out", fam["full-med"], shallow=False)
    # the basis, which full-med no longer leans on, is base's to mend: full-med no longer needs it,
    # so check passes full-med, and the tiers and its document count it for the others alone
    after = reg.check(read_data=True)
    assert list(after.damaged_chunks) == [victim.id] and "fam/base" in after.broken_versions
    assert after.broken_versions == _needing(reg, fam, victim.id) and "fam/full-med" not in after.broken_versions
    assert reg.check("fam", read_data=True).broken_versions == after.broken_versions
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam")
    doc, moved = version_doc(reg, "fam", "full-med")
    assert moved != tag and victim.id not in doc["chunks"]  # a node's copy of the document is out of date

    base = reg.push(fam["base"], "fam", "base", mend_damaged=True)
    assert base.existed and base.mended_chunks > 0, base
    assert reg.locate([victim.id])[victim.id].pack_id != victim.pack_id  # the row points at the new copy
    assert reg.check(read_data=True).ok
    assert all(_pullable(reg, fam, tmp_path).values())
    reg.pull("fam", "base", tmp_path / "base.out")
    assert filecmp.cmp(tmp_path / "base.out", fam["base"], shallow=False)
    again = reg.push(fam["base"], "fam", "base", mend_damaged=True)
    assert again.existed and again.mended_chunks == 0 and again.new_bytes == 0  # nothing damaged: nothing stored
    assert len(reg.versions("fam")) == len(fam)  # nothing committed


def _shared_plain_chunk(reg: Registry, version: str, other: str):
    """A plain chunk that ``version`` stores and ``other`` uses too (a new push of its file reuses it)."""
    ids = set(reg.manifest("fam", version)[1].chunk_ids())
    theirs = set(reg.manifest("fam", other)[1].chunk_ids())
    return next(c for i, c in sorted(reg.locate(ids).items()) if i in ids & theirs and not c.basis_id)


@sqlite_only
def test_a_new_push_with_mend_damaged_stores_the_damaged_chunks_it_reuses_again(reg, fam, tmp_path, caplog):
    """A new version that reuses a stored chunk whose bytes are damaged: without the flag it commits
    over it (a pack's size shows nothing), and check names it broken; with mend_damaged the push
    reads the chunks it reuses, stores the damaged one again, plain, and commits a version that
    pulls byte for byte. The row moves to the new copy, so base, which shares it, is mended too."""
    import filecmp

    reg.push(fam["base"], "fam", "base")
    reg.push(fam["vocab-ext"], "fam", "ext0", parent="base")
    victim = _shared_plain_chunk(reg, "base", "ext0")
    _damage(reg, victim)

    plain = reg.push(fam["vocab-ext"], "fam", "ext", parent="base")
    assert not plain.existed and plain.mended_chunks == 0, plain
    res = reg.check(read_data=True)
    assert list(res.damaged_chunks) == [victim.id] and {"fam/base", "fam/ext0", "fam/ext"} <= set(res.broken_versions)

    with caplog.at_level("WARNING", logger="mfsreg"):
        med = reg.push(fam["vocab-ext"], "fam", "ext2", parent="base", mend_damaged=True)
    assert not med.existed and med.mended_chunks == 1 and med.new_chunks >= 1 and med.new_bytes > 0, med
    assert any(victim.id in r.getMessage() and "damaged" in r.getMessage() for r in caplog.records), caplog.text
    assert reg.locate([victim.id])[victim.id].pack_id != victim.pack_id  # the row points at the new copy
    reg.pull("fam", "ext2", tmp_path / "ext2.out")
    assert filecmp.cmp(tmp_path / "ext2.out", fam["vocab-ext"], shallow=False)
    after = reg.check(read_data=True)
    assert after.ok and not after.damaged_chunks, after  # ext and base use the same row: mended with it
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam")

    copy = tmp_path / "copy.safetensors"  # every chunk reused, none damaged now: nothing stored again
    copy.write_bytes(fam["base"].read_bytes())
    again = reg.push(copy, "fam", "copy", mend_damaged=True)
    assert not again.existed and again.mended_chunks == 0 and again.new_bytes == 0, again


@sqlite_only
def test_a_repush_that_mends_a_lost_basis_frees_it_once_no_version_needs_it(reg, fam, tmp_path):
    """The pack of a basis that a delta of full-med decodes against is lost: full-med's re-push stores
    those chunks again, plain, and from then on full-med no longer needs that basis. Check passes
    it while the versions that still need the basis stay broken, its tiers and its document say
    so, and once those versions are deleted, prune deletes the basis (rows, and the lost pack)."""
    import filecmp

    _push_family(reg, fam)
    victim = _basis_of_a_delta(reg, "full-med")
    reg.blobs.delete(pack_key(victim.pack_id))
    assert "fam/full-med" in reg.check().broken_versions
    tag = version_doc(reg, "fam", "full-med")[1]

    med = reg.push(fam["full-med"], "fam", "full-med", parent="base")
    assert med.existed and med.mended_chunks > 0, med
    assert victim.id not in reg.locate(reg.manifest("fam", "full-med")[1].chunk_ids())
    for read_data in (False, True):
        res = reg.check(read_data=read_data)
        assert list(res.lost_packs) == [victim.pack_id] and "fam/full-med" not in res.broken_versions
        pulls = _pullable(reg, fam, tmp_path)
        assert res.broken_versions == [f"fam/{v}" for v in fam if not pulls[v]] and pulls["full-med"]
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam")
    doc, moved = version_doc(reg, "fam", "full-med")
    assert moved != tag and victim.id not in doc["chunks"]

    for name in fam:
        if name != "full-med":
            reg.delete("fam", name)
    assert reg.check().ok  # nothing left needs the lost pack
    reg.prune(min_age=0)
    assert victim.id not in reg.locate([victim.id])  # the old basis is gone with the versions that needed it
    assert reg.chunk_tiers("fam") == expected_tiers(reg, "fam")
    assert reg.check(read_data=True).ok
    reg.pull("fam", "full-med", tmp_path / "med.out")
    assert filecmp.cmp(tmp_path / "med.out", fam["full-med"], shallow=False)


def test_a_mend_waits_for_a_commit_in_flight(reg, fam):
    """A mend changes chains, and with them what versions need, which a commit reads: a commit that
    read the old chains beside it would record the old bases. So recording a mended pack waits for
    every transaction holding the lock commits hold (Postgres: taken exclusively; SQLite: the write
    lock), here one that holds it a second."""
    import threading
    import time

    from mfsreg.registry.db.engine import write_tx
    from mfsreg.registry.db.locks import exclude_prune

    _push_family(reg, fam)
    reg.blobs.delete(pack_key(_pack_of_a_delta(reg, "full-med")))
    holding, ended = threading.Event(), []

    def commit_in_flight():
        with write_tx(reg.engine) as conn:
            exclude_prune(conn)
            holding.set()
            time.sleep(1.0)
            ended.append(time.monotonic())

    t = threading.Thread(target=commit_in_flight)
    t.start()
    holding.wait(10)
    assert reg.push(fam["full-med"], "fam", "full-med", parent="base").mended_chunks > 0
    mended = time.monotonic()
    t.join()
    assert mended >= ended[0]


def test_the_command_names_mend_damaged_and_the_push_mends_a_pack_damaged_on_disk(home_env, fam, tmp_path):
    """A byte flipped inside a pack file of MFSREG_HOME's blob store: check --read-data says to push
    again with --mend-damaged; a plain re-push mends nothing and says nothing of it, the flagged one
    says what it mended, and then check finds all intact and the pull is byte for byte."""
    import filecmp

    mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", env=home_env)
    with Registry(Settings.from_env(home_env)) as reg:
        _, manifest = reg.manifest("fam", "v1")
        chunk = sorted(reg.locate(manifest.chunk_ids()).values(), key=lambda c: c.id)[0]
    (path,) = (Path(home_env["MFSREG_HOME"]) / "blobs").rglob(f"{chunk.pack_id}.pack")
    with open(path, "r+b") as f:
        f.seek(chunk.offset + chunk.stored_size // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0xFF]))
    told = mfsreg("check", "--read-data", env=home_env, check=False)
    assert told.returncode == 4 and "1 chunk damaged" in told.stdout, told.stdout
    assert "again with --mend-damaged" in told.stdout, told.stdout

    plain = mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", env=home_env).stdout
    assert plain.startswith("already stored fam/v1") and "mended" not in plain, plain
    assert mfsreg("check", "--read-data", env=home_env, check=False).returncode == 4

    out = mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", "--mend-damaged", env=home_env)
    assert (
        out.stdout.startswith("already stored fam/v1")
        and "; mended 1 chunks that the blob store had lost or damaged (" in out.stdout
    ), out.stdout
    assert "damaged" in out.stderr and out.stderr.count("\n") == 1, out.stderr  # one warning, no traceback
    assert mfsreg("check", "--read-data", env=home_env).returncode == 0
    mfsreg("pull", "fam", "v1", "-o", tmp_path / "v1.out", env=home_env)
    assert filecmp.cmp(tmp_path / "v1.out", fam["base"], shallow=False)


def test_a_repush_over_http_with_mend_damaged_mends_a_damaged_chunk(servers, server_env, fam, tmp_path):
    """Through a server (Postgres, S3) and a token scoped to the family: negotiation reads the stored
    version when asked (mend_damaged) and lists its damaged chunks under ``mend``; the upload reads
    them again, finds them damaged and stores them anew. Without the flag nothing is sent or mended."""
    import filecmp

    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "push", "fam"))
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    mfsreg("push", fam["full-med"], "--family", "fam", "--version", "med", "--parent", "base", env=env)
    with Registry(Settings.from_env(server_env)) as local:
        ids = set(local.manifest("fam", "base")[1].chunk_ids())
        victim = next(c for i, c in sorted(local.locate(ids).items()) if i in ids)
        _damage(local, victim)
    admin = client_env(tmp_path, srv.url, token(server_env, "admin", "fam"))
    told = mfsreg("check", "--family", "fam", "--read-data", env=admin, check=False)
    assert told.returncode == 4 and "again with --mend-damaged" in told.stdout, told.stdout

    plain = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    assert plain["existed"] and plain["sent_bytes"] == 0 and plain["mended_chunks"] == 0, plain
    assert mfsreg("pull", "fam", "base", "-o", tmp_path / "broken", env=env, check=False).returncode != 0

    mended = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", "--mend-damaged", env=env)
    assert mended["existed"] and mended["mended_chunks"] >= 1 and mended["sent_bytes"] > 0, mended
    assert mfsreg_json("check", "--family", "fam", "--read-data", env=admin)["ok"] is True
    for name, src in (("base", "base"), ("med", "full-med")):
        mfsreg("pull", "fam", name, "-o", tmp_path / f"{name}.out", env=env)
        assert filecmp.cmp(tmp_path / f"{name}.out", fam[src], shallow=False), name
    again = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", "--mend-damaged", env=env)
    assert again["existed"] and again["sent_bytes"] == 0 and again["mended_chunks"] == 0, again


def test_a_new_push_over_http_with_mend_damaged_mends_the_damaged_chunks_it_reuses(servers, server_env, fam, tmp_path):
    """Through a server (Postgres, S3) and a token scoped to the family: a copy of base's file pushed
    under a new name reuses every chunk. Without the flag it commits over a damaged one, which check
    then names; with it the negotiation reads the reused chunks, lists the damaged one under
    ``mend`` (answering mend_damaged for a new version too), the upload reads it again and stores it
    anew, and the version commits and pulls byte for byte."""
    import filecmp

    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "push", "fam"))
    copy = tmp_path / "copy.safetensors"
    copy.write_bytes(fam["base"].read_bytes())
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    with Registry(Settings.from_env(server_env)) as local:
        ids = set(local.manifest("fam", "base")[1].chunk_ids())
        victim = next(c for i, c in sorted(local.locate(ids).items()) if i in ids and not c.basis_id)
        _damage(local, victim)
    admin = client_env(tmp_path, srv.url, token(server_env, "admin", "fam"))

    plain = mfsreg_json("push", copy, "--family", "fam", "--version", "copy", env=env)
    assert not plain["existed"] and plain["sent_bytes"] == 0 and plain["mended_chunks"] == 0, plain
    told = json.loads(mfsreg("check", "--family", "fam", "--read-data", "--json", env=admin, check=False).stdout)
    assert list(told["damaged_chunks"]) == [victim.id] and "fam/copy" in told["broken_versions"], told

    mended = mfsreg_json("push", copy, "--family", "fam", "--version", "copy2", "--mend-damaged", env=env)
    assert not mended["existed"] and mended["mended_chunks"] == 1 and mended["sent_bytes"] > 0, mended
    assert mfsreg_json("check", "--family", "fam", "--read-data", env=admin)["ok"] is True  # one row, mended for all
    for name in ("copy2", "copy", "base"):
        mfsreg("pull", "fam", name, "-o", tmp_path / f"{name}.out", env=env)
        assert filecmp.cmp(tmp_path / f"{name}.out", fam["base"], shallow=False), name
    again = mfsreg_json("push", copy, "--family", "fam", "--version", "copy3", "--mend-damaged", env=env)
    assert not again["existed"] and again["sent_bytes"] == 0 and again["mended_chunks"] == 0, again


@sqlite_only
def test_a_new_push_whose_basis_is_damaged_stores_its_chunks_plain(reg, fam, tmp_path, caplog):
    """A fine-tune pushed anew while a base chunk it would lean on is damaged in its pack is stored
    (those chunks plain, with one warning that names the chunk and what to run), where the push
    failed on a chunk it does not even store; the damage stays for base, as check says."""
    import filecmp

    reg.push(fam["base"], "fam", "base")
    reg.push(fam["full-med"], "fam", "full-med", parent="base")
    victim = _basis_of_a_delta(reg, "full-med")
    reg.delete("fam", "full-med")
    reg.prune(min_age=0)  # full-med's deltas are gone: a new push must encode them again
    _damage(reg, reg.locate([victim.id])[victim.id])
    with caplog.at_level("WARNING", logger="mfsreg"):
        res = reg.push(fam["full-med"], "fam", "med2", parent="base")
    assert res.new_chunks > 0 and not res.existed
    said = [r.getMessage() for r in caplog.records if victim.id in r.getMessage()]
    assert len(said) == 1 and "--mend-damaged" in said[0], caplog.text
    reg.pull("fam", "med2", tmp_path / "med2.out")
    assert filecmp.cmp(tmp_path / "med2.out", fam["full-med"], shallow=False)
    assert reg.locate([i for i in reg.manifest("fam", "med2")[1].chunk_ids()])  # recorded
    after = reg.check(read_data=True)
    assert list(after.damaged_chunks) == [victim.id] and "fam/med2" not in after.broken_versions, after


def test_a_new_push_over_http_whose_basis_is_damaged_is_stored(servers, server_env, fam, tmp_path):
    """The same through a server: the client asks for the basis it was offered, the server cannot
    read it back, and the push still lands, byte-identical."""
    import filecmp

    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "push", "fam"))
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    mfsreg("push", fam["full-med"], "--family", "fam", "--version", "med", "--parent", "base", env=env)
    with Registry(Settings.from_env(server_env)) as local:
        victim = _basis_of_a_delta(local, "med")
        local.delete("fam", "med")
        local.prune(min_age=0)
        _damage(local, local.locate([victim.id])[victim.id])
    done = mfsreg(
        "push", fam["full-med"], "--family", "fam", "--version", "med2", "--parent", "base", env=env, check=False
    )
    assert done.returncode == 0, done.stderr
    mfsreg("pull", "fam", "med2", "-o", tmp_path / "med2.out", env=env)
    assert filecmp.cmp(tmp_path / "med2.out", fam["full-med"], shallow=False)


def _tied_to_base(fam: dict, tmp_path: Path) -> Path:
    """full-med's tensors, each new and planned against base's at its place, with one of base's
    tensors again under another name (tied weights): a push of it reuses that tensor's stored chunk
    and plans a delta of full-med's tensor there against the same chunk."""
    from safetensors.torch import load_file

    from tests import synth

    tensors = load_file(fam["full-med"])
    tensors["tied.q_proj.weight"] = load_file(fam["base"])["model.layers.0.self_attn.q_proj.weight"]
    return synth.write(tmp_path / "tied.safetensors", tensors, {"member": "tied"})


def _reused_basis(reg: Registry, path: Path):
    """The stored plain chunk that a push of ``path`` (from _tied_to_base) reuses: also the basis
    that delta planning picks for the new chunk at its place."""
    from mfsreg.registry.format.hashing import hash_source
    from mfsreg.registry.format.source import open_source
    from mfsreg.registry.progress import NullProgress

    ids = hash_source(open_source(path), 64 << 10, NullProgress()).chunk_ids()
    (chunk,) = [c for i, c in reg.locate(ids).items() if i in ids and not c.basis_id]
    return chunk


class _Reads:
    """A registry's blob store that records the byte ranges read from it; all else goes to the store."""

    def __init__(self, store):
        self.store = store
        self.ranges: list[tuple[str, tuple[int, int | None]]] = []

    def __getattr__(self, name: str):
        return getattr(self.store, name)

    def get_ranges(self, key: str, ranges: list[tuple[int, int | None]]) -> list[bytes]:
        self.ranges += [(key, r) for r in ranges]
        return self.store.get_ranges(key, ranges)

    def of(self, chunk) -> int:
        """How many reads took in ``chunk``'s stored bytes."""
        end = chunk.offset + chunk.stored_size
        return sum(
            1
            for key, (a, b) in self.ranges
            if key == pack_key(chunk.pack_id) and a < end and (b is None or b > chunk.offset)
        )


@sqlite_only
def test_a_new_push_with_mend_damaged_plans_no_delta_against_what_its_read_found_damaged(reg, fam, tmp_path, caplog):
    """A new version reuses a stored chunk whose bytes are damaged and would lean a new chunk on it.
    The mend's read finds it damaged; delta planning takes that for known, as it does a lost pack:
    the new chunk is planned plain, so the damaged bytes are read once and said once, where the
    basis reader read them again and warned a second time. The version pulls byte for byte, and
    the mend leaves nothing damaged."""
    import filecmp

    reg.push(fam["base"], "fam", "base")
    tied = _tied_to_base(fam, tmp_path)
    victim = _reused_basis(reg, tied)
    _damage(reg, victim)
    reads = _Reads(reg.blobs)
    reg.blobs = reads
    try:
        with caplog.at_level("WARNING", logger="mfsreg"):
            med = reg.push(tied, "fam", "tied", parent="base", mend_damaged=True)
    finally:
        reg.blobs = reads.store
    assert not med.existed and med.mended_chunks == 1, med
    said = [r.getMessage() for r in caplog.records if victim.id in r.getMessage()]
    assert len(said) == 1 and "damaged" in said[0], caplog.text
    assert reads.of(victim) == 1, reads.ranges
    reg.pull("fam", "tied", tmp_path / "tied.out")
    assert filecmp.cmp(tmp_path / "tied.out", tied, shallow=False)
    assert reg.check(read_data=True).ok
    assert all(_pullable(reg, {"base": fam["base"], "tied": tied}, tmp_path).values())


@pytest.mark.process
def test_a_new_push_over_http_with_mend_damaged_is_warned_of_a_damaged_basis_once(servers, server_env, fam, tmp_path):
    """The same through a server: the negotiation's read finds the reused chunk damaged and
    suggests it as no basis, so the upload does not try it as one: the server's log names it once."""
    import filecmp

    (srv,) = servers(1, process=True)  # the test reads the process's log
    env = client_env(tmp_path, srv.url, token(server_env, "push", "fam"))
    admin = client_env(tmp_path, srv.url, token(server_env, "admin", "fam"))
    tied = _tied_to_base(fam, tmp_path)
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    with Registry(Settings.from_env(server_env)) as local:
        victim = _reused_basis(local, tied)
        _damage(local, victim)
    med = mfsreg_json(
        "push", tied, "--family", "fam", "--version", "tied", "--parent", "base", "--mend-damaged", env=env
    )
    assert not med["existed"] and med["mended_chunks"] == 1, med
    srv.log.flush()
    log = Path(srv.log.name).read_text()
    said = [line for line in log.splitlines() if victim.id in line]
    assert len(said) == 1 and "damaged" in said[0], log
    assert mfsreg_json("check", "--family", "fam", "--read-data", env=admin)["ok"] is True
    mfsreg("pull", "fam", "tied", "-o", tmp_path / "tied.out", env=env)
    assert filecmp.cmp(tmp_path / "tied.out", tied, shallow=False)
