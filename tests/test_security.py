"""What a client, or another user of the machine, may learn: nothing of the server's internals in an
answer (the request id leads the operator to them in the log), and nothing of an embedded registry
through its files' modes."""

from __future__ import annotations

import filecmp
import os
import re
import stat
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest

from mfsreg.registry.config import Settings
from mfsreg.registry.db import chunks as chunk_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.format.manifest import Manifest
from mfsreg.registry.registry import Registry
from tests.cli_run import mfsreg, mfsreg_json
from tests.dialects import sqlite_only
from tests.faults import FaultProxy
from tests.server import Servers, client_env, make_server_env, token


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_an_embedded_registry_is_this_users_alone(umask, fam, tmp_path):
    """registry.db and the packs were made 0644 and their folders 0755: every user of the machine
    could read the weights and the tokens' hashes. New ones are 0600 and 0700, less a stricter umask."""
    home = tmp_path / "home"
    old = os.umask(umask)
    try:
        with Registry(Settings.from_env({"MFSREG_HOME": str(home)})) as reg:
            reg.push(fam["base"], "fam", "base")
            reg.push(fam["lora-chat"], "fam", "lora-chat", parent="base")
    finally:
        os.umask(old)
    made = [home, *home.rglob("*")]
    assert any(p.name.endswith(".pack") for p in made) and (home / "registry.db").exists()
    for path in made:
        mode = stat.S_IMODE(path.lstat().st_mode)
        wanted = 0o700 if path.is_dir() else 0o600
        assert mode == wanted & ~umask, (path.relative_to(tmp_path), oct(mode))


@pytest.fixture
def server(migrated_pg, s3_blob_url, tmp_path):
    """A server on Postgres whose S3 endpoint is reached through a proxy the test can cut:
    (server, admin client environment, the proxy, the server's environment)."""
    blob_url, endpoint = s3_blob_url
    s3 = urlsplit(endpoint)
    proxy = FaultProxy((s3.hostname, s3.port))
    env = make_server_env(migrated_pg, (blob_url, proxy.url), tmp_path)
    started = Servers(env, tmp_path)
    try:
        (srv,) = started(1)
        yield srv, client_env(tmp_path, srv.url, token(env, "admin")), proxy, env
    finally:
        proxy.heal()
        started.stop()
        proxy.close()


def test_every_answer_carries_its_request_id(server):
    srv, env, _, _ = server
    ok = httpx.get(f"{srv.url}/healthz")
    assert re.fullmatch(r"[0-9a-f]{32}", ok.headers["x-request-id"])
    refused = httpx.get(f"{srv.url}/v1/families")  # no token
    assert refused.status_code == 401 and refused.json()["request_id"] == refused.headers["x-request-id"]
    assert refused.headers["x-request-id"] != ok.headers["x-request-id"]
    given = httpx.get(f"{srv.url}/v1/families", headers={"X-Request-ID": "lb-7f3a.2"})
    assert given.headers["x-request-id"] == "lb-7f3a.2" == given.json()["request_id"]
    for bad in ("x" * 65, "two words", "a\tb"):  # not a short plain token: a new id instead
        other = httpx.get(f"{srv.url}/v1/families", headers={"X-Request-ID": bad})
        assert re.fullmatch(r"[0-9a-f]{32}", other.headers["x-request-id"]), bad


def test_a_storage_failure_names_no_endpoint_bucket_or_key_to_the_client(server, fam, caplog):
    """S3 errors were sent to clients whole: the server's internal endpoint, its bucket and the pack's
    key. The client gets what happened and a request id; the server's log has the rest under that id."""
    srv, env, proxy, server_env = server
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    proxy.cut()  # the endpoint is gone
    ran = mfsreg(
        "push", fam["lora-chat"], "--family", "fam", "--version", "lora-chat", "--parent", "base", env=env, check=False
    )
    bucket = server_env["MFSREG_BLOB_URL"].split("/")[2]
    assert ran.returncode == 5 and ran.stderr.count("\n") == 1, ran.stderr
    for secret in (bucket, f"127.0.0.1:{proxy.port}", "packs/", "s3://"):
        assert secret not in ran.stderr, (secret, ran.stderr)
    rid = re.search(r"request id ([0-9a-f]{32})", ran.stderr)
    assert rid, ran.stderr
    logged = [r.getMessage() for r in caplog.records if rid[1] in r.getMessage()]
    assert logged and f"127.0.0.1:{proxy.port}" in logged[0], logged


# -- a version lends its readers only bytes of its own family -----------------------------------------


def borrowed_tensor(fam: dict, tmp_path) -> Path:
    """A file of one tensor of "full-med", a dense fine-tune whose chunks the registry stores as deltas
    against "base"'s: pushed into another family, it reuses those deltas."""
    from safetensors.torch import load_file, save_file

    name = "model.layers.0.mlp.up_proj.weight"
    path = tmp_path / "borrowed.safetensors"
    save_file({name: load_file(str(fam["full-med"]))[name]}, str(path))
    return path


def lent_to(reg, family: str, version: str) -> set[str]:
    """Chunks a version needs beyond those of its own files: what it lends its readers besides."""
    from mfsreg.registry.store.service import version_doc

    doc, _ = version_doc(reg, family, version, None)
    own = {c[0] for f in doc["manifest"]["files"] for c in f["chunks"]}
    return set(doc["chunks"]) - own


@sqlite_only
def test_an_embedded_push_lends_no_basis_of_another_familys(reg, fam, tmp_path):
    """Repro 1: a push that reused a chunk another family stores as a delta put that family's basis
    into the new version's chunk table, and the new family's readers could download its bytes."""
    reg.push(fam["base"], "b2", "base")
    reg.push(fam["full-med"], "b2", "ft", parent="base")
    borrowed = borrowed_tensor(fam, tmp_path)
    with read_tx(reg.engine) as conn:  # the tensor's chunks are stored as deltas against b2's base
        ids = Manifest.from_bytes(
            version_db.read_manifest(conn, version_db.get_version(conn, "b2", "ft").id)
        ).chunk_ids()
        assert any(c.basis_id for c in chunk_db.locate(conn, ids).values())
    reg.push(borrowed, "a5", "v1")
    assert lent_to(reg, "a5", "v1") == set()
    assert lent_to(reg, "b2", "ft")  # b2's own deltas keep their bases
    out = tmp_path / "ft.out"
    reg.pull("b2", "ft", out)
    assert filecmp.cmp(out, fam["full-med"], shallow=False)
    assert reg.check(read_data=True).ok


@pytest.mark.parametrize("pattern", ["*", "[ab]*"])
def test_a_push_through_a_token_that_reads_both_families_lends_no_basis(pattern, server, fam, tmp_path):
    """The same over HTTP, with a push token for every family and one that reads both: a read token
    for a* downloaded b2/base's tensor by naming its chunk id (200); it is now not part of a5 (404)."""
    srv, admin, _, server_env = server
    mfsreg("push", fam["base"], "--family", "b2", "--version", "base", env=admin)
    mfsreg("push", fam["full-med"], "--family", "b2", "--version", "ft", "--parent", "base", env=admin)
    pusher = client_env(tmp_path, srv.url, token(server_env, "push", pattern))
    mfsreg("push", borrowed_tensor(fam, tmp_path), "--family", "a5", "--version", "v1", env=pusher)
    reader = {"Authorization": f"Bearer {token(server_env, 'read', 'a*')}"}
    doc = httpx.get(f"{srv.url}/v1/families/a5/versions/v1", headers=reader).json()
    own = {c[0] for f in doc["manifest"]["files"] for c in f["chunks"]}
    assert set(doc["chunks"]) == own
    with Registry(Settings.from_env(server_env)) as reg:
        with read_tx(reg.engine) as conn:
            b2_bases = {c.basis_id for c in chunk_db.locate_closure(conn, lent_to(reg, "b2", "ft") | own).values()}
        b2_bases.discard(None)
    for basis in b2_bases - own:
        r = httpx.post(f"{srv.url}/v1/families/a5/chunks/download", json={"ids": [basis]}, headers=reader)
        assert r.status_code == 404, (basis, r.status_code)
    out = tmp_path / "ft.out"
    mfsreg("pull", "b2", "ft", "-o", out, env=admin)
    assert filecmp.cmp(out, fam["full-med"], shallow=False)


def test_a_scoped_tokens_stats_do_not_depend_on_other_families(server, fam, tmp_path):
    """Repro 2: `stats -f a1` through a token for a* counted unique_bytes over the whole registry, so
    pushing another family's file into a1 showed 0 (one of its tensors halved it): an oracle of what
    other families hold. Every figure such a token sees is now the same whatever b1 holds."""
    srv, admin, _, server_env = server
    scoped = client_env(tmp_path, srv.url, token(server_env, "push", "a*"))
    mfsreg("push", fam["base"], "--family", "a1", "--version", "v1", env=scoped)
    mfsreg("push", fam["lora-chat"], "--family", "a1", "--version", "v2", "--parent", "v1", env=scoped)
    alone = mfsreg_json("stats", "--family", "a1", env=scoped)
    assert all(v["unique_bytes"] > 0 for v in alone["versions"]), alone
    mfsreg("push", fam["base"], "--family", "b1", "--version", "copy", env=admin)
    mfsreg("push", fam["lora-chat"], "--family", "b1", "--version", "copy2", "--parent", "copy", env=admin)
    assert mfsreg_json("stats", "--family", "a1", env=scoped) == alone
    # the registry's own view still counts every family: an admin for '*' sees the bytes shared
    shared = mfsreg_json("stats", "--family", "a1", env=admin)
    assert [v["unique_bytes"] for v in shared["versions"]] == [0, 0], shared


# -- what one request may cost ---------------------------------------------------------------------


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@pytest.mark.process
def test_hostile_json_bodies_are_refused_before_they_are_parsed(servers, server_env):
    """Repro 4: a 30 MB negotiate body of "[]," took a server from 244 to 808 MB, and kept it: JSON
    parsing builds an object per 3 bytes. Such a body is refused (400) before it is parsed, a body
    over a manifest's limit with 413, and the server's memory stays within twice its idle level
    plus the largest request it takes."""
    from mfsreg.api.posts import MAX_MANIFEST_BODY

    (srv,) = servers(1, process=True)
    auth = {"Authorization": f"Bearer {token(server_env, 'admin')}", "Content-Type": "application/json"}
    url = f"{srv.url}/v1/families/fam/versions/v1/negotiate"
    assert httpx.get(f"{srv.url}/healthz").status_code == 200
    idle = rss(srv.proc.pid)
    flood = b'{"manifest": {"files": [' + b"[]," * (10 << 20) + b"[]]}}"
    for _ in range(3):
        r = httpx.post(url, content=flood, headers=auth, timeout=120)
        assert r.status_code == 400 and "arrays and objects" in r.json()["detail"], r.text[:300]
    deep = b'{"manifest": ' + b"[" * (1 << 20) + b"]" * (1 << 20) + b"}"
    assert httpx.post(url, content=deep, headers=auth, timeout=120).status_code == 400
    big = b'{"manifest": {"x": "' + b"a" * MAX_MANIFEST_BODY + b'"}}'
    r = httpx.post(url, content=big, headers=auth, timeout=120)
    assert r.status_code == 413 and f"{MAX_MANIFEST_BODY} byte limit" in r.json()["detail"], r.text[:300]
    assert "manifest is larger than this server takes" in r.json()["detail"]
    assert rss(srv.proc.pid) <= 2 * idle + MAX_MANIFEST_BODY, (idle, rss(srv.proc.pid))


def test_an_upload_of_many_tiny_chunks_is_refused_before_it_is_parsed(server, fam):
    """Repro 5: one 17 MB upload of 200,000 three-byte chunks took 29 s of server time and left
    200,028 chunk rows. An upload holds at most MAX_UPLOAD_CHUNKS chunks: past that, 413 naming the
    limit, before the index is parsed, and nothing is stored."""
    from mfsreg.registry.format.chunking import chunk_id
    from mfsreg.registry.format.wire import MAX_UPLOAD_CHUNKS, Entry, build_batch

    srv, env, _, server_env = server
    tiny = [i.to_bytes(3, "little") for i in range(200_000)]
    body = build_batch([(Entry(chunk_id(b), 3, "raw", 3), b) for b in tiny])
    before = mfsreg_json("stats", env=env)
    r = httpx.post(
        f"{srv.url}/v1/families/fam/chunks",
        content=body,
        headers={"Authorization": f"Bearer {env['MFSREG_TOKEN']}"},
        timeout=120,
    )
    assert r.status_code == 413 and f"at most {MAX_UPLOAD_CHUNKS} chunks" in r.json()["detail"], r.text[:300]
    assert r.elapsed.total_seconds() < 5, r.elapsed
    assert mfsreg_json("stats", env=env) == before


def test_a_push_of_more_chunks_than_an_upload_holds_sends_several_uploads(server, tmp_path):
    """The client cuts its uploads at MAX_UPLOAD_CHUNKS chunks, however small they are."""
    import numpy as np
    from safetensors.numpy import save_file

    from mfsreg.registry.format.wire import MAX_UPLOAD_CHUNKS

    srv, env, _, _ = server
    rng = np.random.default_rng(3)
    many = {f"bias.{i}": rng.standard_normal(4, dtype=np.float32) for i in range(MAX_UPLOAD_CHUNKS + 500)}
    path = tmp_path / "many.safetensors"
    save_file(many, str(path))
    pushed = mfsreg_json("push", path, "--family", "small", "--version", "v1", env=env)
    assert pushed["chunks"] > MAX_UPLOAD_CHUNKS
    out = tmp_path / "out.safetensors"
    mfsreg("pull", "small", "v1", "-o", out, env=env)
    assert filecmp.cmp(out, path, shallow=False)


# -- tokens that expire, their last use, and the audit log ---------------------------------------------


def test_a_token_expires_and_token_list_shows_its_expiry_and_last_use(server, tmp_path):
    from datetime import UTC, datetime, timedelta

    from sqlalchemy import update

    from mfsreg.registry.db.engine import write_tx
    from mfsreg.registry.db.models import tokens

    srv, _, _, server_env = server
    made = mfsreg_json("token", "create", "--scope", "read", "--expires", "30d", env=server_env)
    assert made["expires_in"] == 30 * 86400
    listed = {t["prefix"]: t for t in mfsreg_json("token", "list", env=server_env)["tokens"]}
    mine = listed[made["token"][:10]]
    assert mine["last_used_at"] is None
    expiry = datetime.fromisoformat(mine["expires_at"])
    expiry = expiry if expiry.tzinfo else expiry.replace(tzinfo=UTC)
    assert abs(expiry - datetime.now(UTC) - timedelta(days=30)) < timedelta(minutes=5)
    reader = {"Authorization": f"Bearer {made['token']}"}
    assert httpx.get(f"{srv.url}/v1/families", headers=reader).status_code == 200
    used = {t["prefix"]: t for t in mfsreg_json("token", "list", env=server_env)["tokens"]}[made["token"][:10]]
    assert used["last_used_at"] is not None
    with Registry(Settings.from_env(server_env, blobs=False)) as reg, write_tx(reg.engine) as conn:  # a month on
        conn.execute(
            update(tokens)
            .where(tokens.c.prefix == made["token"][:10])
            .values(expires_at=datetime.now(UTC) - timedelta(seconds=1))
        )
    r = httpx.get(f"{srv.url}/v1/families", headers=reader)
    assert r.status_code == 401 and "expired" in r.json()["detail"] and "token create" in r.json()["detail"], r.text
    for bad in ("0", "-1d", "soon", "11000d"):
        ran = mfsreg("token", "create", "--expires", bad, env=server_env, check=False)
        assert ran.returncode == 2 and ran.stderr.count("\n") == 1, (bad, ran.stderr)


def test_the_audit_log_says_who_deleted_pruned_and_changed_tokens(server, fam, tmp_path):
    srv, admin, _, server_env = server
    scoped_admin = client_env(tmp_path, srv.url, token(server_env, "admin", "fam"))
    reader = client_env(tmp_path, srv.url, token(server_env, "read"))
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=admin)
    mfsreg("push", fam["base"], "--family", "other", "--version", "base", env=admin)
    mfsreg("delete", "fam", "base", env=scoped_admin)
    mfsreg("delete", "other", "base", env=admin)
    mfsreg("prune", "--min-age", "0", env=admin)
    made = mfsreg_json("token", "create", "--scope", "push", env=server_env)
    mfsreg("token", "revoke", made["token"][:10], env=server_env)
    everything = mfsreg_json("audit", env=admin)["entries"]
    done = [(e["action"], e["family"], e["actor"]) for e in everything]
    me = server_env.get("USER") or __import__("getpass").getuser()
    assert done[:5] == [
        ("token-revoke", None, f"local:{me}"),
        ("token-create", None, f"local:{me}"),
        ("prune", None, admin["MFSREG_TOKEN"][:10]),
        ("delete", "other", admin["MFSREG_TOKEN"][:10]),
        ("delete", "fam", scoped_admin["MFSREG_TOKEN"][:10]),
    ], done
    assert '"version":"base"' in everything[4]["detail"]
    # an admin for some families reads only their entries; a reader none
    assert [(e["action"], e["family"]) for e in mfsreg_json("audit", env=scoped_admin)["entries"]] == [
        ("delete", "fam")
    ]
    ran = mfsreg("audit", env=reader, check=False)
    assert ran.returncode == 3 and "needs 'admin'" in ran.stderr, ran.stderr
    assert mfsreg_json("audit", "--limit", "2", env=admin)["entries"] == everything[:2]
