"""The API over real HTTP: uvicorn on loopback, Postgres metadata, packs in moto's S3 server."""

from __future__ import annotations

import filecmp
import hashlib
import json
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import boto3
import httpx
import pytest
import torch

from mfsreg.registry.format.chunking import chunk_id
from mfsreg.registry.format.hashing import hash_source
from mfsreg.registry.format.source import open_source
from mfsreg.registry.format.wire import Entry, build_batch
from mfsreg.registry.progress import NullProgress
from tests import synth
from tests.cli_run import MFSREG, mfsreg, mfsreg_json
from tests.dialects import sqlite_only
from tests.hooks import OnSend
from tests.server import client_env, counter, free_port, token


def bucket_keys(env: dict) -> list[str]:
    bucket = env["MFSREG_BLOB_URL"].split("/")[2]
    s3 = boto3.client("s3", endpoint_url=env["MFSREG_S3_ENDPOINT_URL"], region_name="us-east-1")
    return [
        o["Key"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket)
        for o in page.get("Contents", [])
    ]


def test_push_pull_ls_show_stats_delete_over_http(servers, server_env, fam, tmp_path):
    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "admin"))
    pushed = {}
    for name in ("base", "lora-chat", "vocab-ext"):
        pushed[name] = mfsreg_json("push", fam[name], "--family", "fam", "--version", name, env=env)
    assert pushed["lora-chat"]["sent_bytes"] < pushed["base"]["sent_bytes"] / 2
    for name in pushed:
        out = tmp_path / f"{name}.out"
        res = mfsreg_json("pull", "fam", name, "-o", out, env=env)
        assert res["digest"] == pushed[name]["digest"]
        assert filecmp.cmp(out, fam[name], shallow=False)
    assert mfsreg_json("ls", env=env)["families"] == [
        {"family": "fam", "versions": 3, "base_quorum": 1.0, "chunk_size": 64 << 10}
    ]
    assert [v["version"] for v in mfsreg_json("ls", "fam", env=env)["versions"]] == ["base", "lora-chat", "vocab-ext"]
    show = mfsreg_json("show", "fam", "lora-chat", env=env)
    assert show["digest"] == pushed["lora-chat"]["digest"] and show["files"][0]["tensors"] > 0
    stats = mfsreg_json("stats", env=env)
    assert sum(t["bytes"] for t in stats["tiers"].values()) == stats["stored_bytes"]
    assert stats["stored_bytes"] == sum(p["new_bytes"] for p in pushed.values())
    assert mfsreg_json("delete", "fam", "vocab-ext", env=env)["version"] == "vocab-ext"
    assert [v["version"] for v in mfsreg_json("ls", "fam", env=env)["versions"]] == ["base", "lora-chat"]
    assert any(k.endswith(".pack") for k in bucket_keys(server_env))
    assert not Path(env["MFSREG_HOME"]).exists()  # remote mode writes nothing under MFSREG_HOME


def test_sharded_directory_over_http(servers, server_env, tmp_path):
    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "push", "llama*"))
    src = tmp_path / "ckpt"
    src.mkdir()
    synth.sharded_dir(src, synth.base_tensors())
    (src / "empty.txt").write_bytes(b"")  # a file of no chunks at all
    mfsreg_json("push", src, "--family", "llama-3", "--version", "v1", env=env)
    mfsreg("pull", "llama-3", "v1", "-o", tmp_path / "out", env=env)
    for p in src.iterdir():
        assert filecmp.cmp(p, tmp_path / "out" / p.name, shallow=False)


@pytest.mark.parametrize("scope,family,status", [(None, "*", 401), ("read", "*", 403), ("push", "qwen*", 403)])
def test_push_without_the_right_token_stores_nothing(scope, family, status, servers, server_env, fam, tmp_path):
    (srv,) = servers(1)
    tok = token(server_env, scope, family) if scope else None
    env = client_env(tmp_path, srv.url, tok)
    proc = mfsreg("push", fam["base"], "--family", "llama", "--version", "v1", env=env, check=False)
    assert proc.returncode == 3 and len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    # the upload endpoint itself refuses too, even for a batch that would be valid
    payload = b"\x01" * 64
    body = build_batch([(Entry(chunk_id(payload), 64, "raw", 64), payload)])
    headers = {"Authorization": f"Bearer {tok}"} if tok else {}
    r = httpx.post(f"{srv.url}/v1/families/llama/chunks", content=body, headers=headers)
    assert r.status_code == status and r.headers["content-type"].startswith("application/problem+json")
    assert bucket_keys(server_env) == []
    admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
    stats = mfsreg_json("stats", env=admin)
    assert stats["versions_count"] == 0 and stats["pack_bytes"] == 0


def test_chunk_that_does_not_match_its_id_is_refused(servers, server_env, tmp_path):
    (srv,) = servers(1)
    tok = token(server_env, "push")
    good = b"\x02" * 4096
    bad = b"\x03" * 4096
    body = build_batch(
        [(Entry(chunk_id(good), 4096, "raw", 4096), good), (Entry(chunk_id(good)[:-1] + "0", 4096, "raw", 4096), bad)]
    )
    r = httpx.post(f"{srv.url}/v1/families/fam/chunks", content=body, headers={"Authorization": f"Bearer {tok}"})
    assert r.status_code == 422 and "do not match" in r.json()["detail"]
    assert bucket_keys(server_env) == []
    # a commit naming chunks that were never stored is refused, and no version appears
    path = synth.write(tmp_path / "m.safetensors", synth.base_tensors())
    doc = hash_source(open_source(path), 64 << 10, NullProgress()).to_doc()
    r = httpx.post(
        f"{srv.url}/v1/families/fam/versions/v1/commit",
        json={"manifest": doc},
        headers={"Authorization": f"Bearer {tok}"},
    )
    assert r.status_code == 404 and "not stored" in r.json()["detail"]
    r = httpx.get(f"{srv.url}/v1/families/fam/versions/v1", headers={"Authorization": f"Bearer {tok}"})
    assert r.status_code == 404


def test_a_batch_that_sends_a_chunk_twice_is_refused(servers, server_env, tmp_path):
    """A batch holding one id twice, the first copy's bytes wrong, was stored with a 200: one entry
    per id was kept, so only the last copy was checked. A repeated id is a 400 now, whatever the
    copies hold, and nothing is stored; a client's own push sends each chunk once."""
    (srv,) = servers(1)
    tok = token(server_env, "push")
    h = {"Authorization": f"Bearer {tok}"}
    good = b"\x02" * 4096
    for copies in ((b"\x03" * 4096, good), (good, good)):
        body = build_batch([(Entry(chunk_id(good), 4096, "raw", 4096), c) for c in copies])
        r = httpx.post(f"{srv.url}/v1/families/fam/chunks", content=body, headers=h)
        assert r.status_code == 400, r.text
        assert f"chunk {chunk_id(good)} appears more than once in the batch: send each chunk once" in r.json()["detail"]
    assert bucket_keys(server_env) == []
    # a push whose file holds one chunk many times (a tensor of zeros) sends it once and pulls whole
    path = synth.write(tmp_path / "zeros.safetensors", {"w": torch.zeros(64, 4096), "v": torch.zeros(64, 4096)})
    env = client_env(tmp_path, srv.url, tok)
    res = mfsreg_json("push", path, "--family", "fam", "--version", "zeros", env=env)
    assert res["chunks"] < 10 and res["new_chunks"] == res["chunks"], res
    mfsreg("pull", "fam", "zeros", "-o", tmp_path / "out", env=env)
    assert filecmp.cmp(tmp_path / "out", path, shallow=False)


def test_bad_requests_get_problem_details(servers, server_env, tmp_path):
    (srv,) = servers(1)
    h = {"Authorization": f"Bearer {token(server_env, 'admin')}"}
    r = httpx.post(f"{srv.url}/v1/families/fam/versions/v1/negotiate", json={"manifest": {"files": "nope"}}, headers=h)
    assert r.status_code == 400 and r.json()["detail"].startswith("malformed manifest")
    bad_types = {
        "single_file": True,
        "files": [
            {
                "path": 7,
                "kind": "safetensors",
                "size": "1",
                "sha256": "0" * 64,
                "chunks": [["0" * 32, 0, "1", 1]],
                "tensors": [],
            }
        ],
    }
    r = httpx.post(f"{srv.url}/v1/families/fam/versions/v1/negotiate", json={"manifest": bad_types}, headers=h)
    assert r.status_code == 400 and r.json()["detail"].startswith("malformed manifest")
    # a zstd frame that claims far more bytes than its chunk is refused without being inflated
    import zstandard

    bomb = zstandard.ZstdCompressor().compress(b"\0" * (64 << 20))
    r = httpx.post(
        f"{srv.url}/v1/families/fam/chunks",
        headers=h,
        content=build_batch([(Entry(chunk_id(b"\0" * 1000), 1000, "zstd", len(bomb)), bomb)]),
    )
    assert r.status_code == 422
    # nor are frames whose sizes add up to far more than the body, however small each payload
    from mfsreg.registry.config import Settings
    from mfsreg.registry.format.manifest import MAX_CHUNK_BYTES
    from mfsreg.registry.format.wire import RAW_PER_BODY

    over = RAW_PER_BODY * Settings.from_env({}).max_body // MAX_CHUNK_BYTES + 1  # the server runs the default
    many = [(Entry(chunk_id(bytes([i])), MAX_CHUNK_BYTES, "zstd", 1), b"x") for i in range(over)]
    r = httpx.post(f"{srv.url}/v1/families/fam/chunks", headers=h, content=build_batch(many))
    assert r.status_code == 413 and "send fewer chunks per request" in r.json()["detail"]
    # two Authorization headers (a proxy adding its own): which was meant is not guessed, even
    # where one of them is good
    for pair in ((h["Authorization"], "Bearer mfs_nope"), ("Bearer mfs_nope", h["Authorization"])):
        r = httpx.get(f"{srv.url}/v1/families", headers=[("Authorization", v) for v in pair])
        assert r.status_code == 400 and "2 Authorization headers: send one" in r.json()["detail"], r.text
    # a JSON route's body sent unlabelled, not JSON, too deep to parse, or empty: each says what to send
    for body, ctype, status, says in (
        (b'{"ids": []}', None, 422, "sent with no Content-Type: send it as JSON, with Content-Type: application/json"),
        (b'{"ids": []}', "text/plain", 422, "sent with Content-Type 'text/plain': send it as JSON"),
        (b'{"ids": [', "application/json", 422, "not valid JSON (Expecting value at character 9)"),
        (b"[" * 100_000, "application/json", 400, "100,000 arrays and objects in 100,000 bytes, more than one per 16"),
        (b"", "application/json", 422, "the request body is empty: send a JSON object"),
        (b'{"ids": []}', "text/json", 422, "sent with Content-Type 'text/json': send it as JSON"),
        (b'["x"]', "application/json", 422, "the request body is JSON but not an object: send a JSON object"),
    ):
        r = httpx.post(
            f"{srv.url}/v1/families/fam/chunks/download",
            content=body,
            headers={**h, **({"Content-Type": ctype} if ctype else {})},
        )
        assert r.status_code == status and says in r.json()["detail"], (body[:20], r.text)
    r = httpx.head(f"{srv.url}/healthz")  # a load balancer's probe
    assert r.status_code == 200
    ops = [
        op["operationId"]
        for path in httpx.get(f"{srv.url}/openapi.json").json()["paths"].values()
        for op in path.values()
    ]
    assert len(ops) == len(set(ops))  # HEAD is not a second operation of the same id
    # the token is checked before the body is read: a caller without one gets a 401, not a parse
    # (FastAPI parses a JSON body before a route's dependencies run: without the early check, a 422)
    for body in (b"{not json", build_batch(many)):
        for path in ("versions/v1/negotiate", "versions/v1/commit", "chunks", "chunks/download"):
            for auth, says in (
                ({"Authorization": "Bearer mfs_nope"}, "unknown or revoked token"),
                ({}, "missing token"),
            ):
                r = httpx.post(
                    f"{srv.url}/v1/families/fam/{path}",
                    content=body,
                    headers={"Content-Type": "application/json", **auth},
                )
                assert r.status_code == 401 and says in r.json()["detail"]
    # clients send raw or plain-compressed chunks: deltas are the server's to make, and unknown
    # encodings are refused
    raw = b"\x05" * 4096
    for encoding, says in (
        ("esubn-p2", "not accepted"),
        ("subn-p2", "not accepted"),
        ("xor-p2", "not accepted"),
        ("esub-p1", "unknown chunk encoding"),
        ("lz4", "unknown chunk encoding"),
    ):
        r = httpx.post(
            f"{srv.url}/v1/families/fam/chunks",
            headers=h,
            content=build_batch([(Entry(chunk_id(raw), 4096, encoding, 4096, itemsize=2), raw)]),
        )
        assert r.status_code == 400 and says in r.json()["detail"]
    assert bucket_keys(server_env) == []
    r = httpx.post(f"{srv.url}/v1/families/fam/chunks", content=b"\xff\xff\xff\x7fgarbage", headers=h)
    assert r.status_code == 400 and "malformed chunk batch" in r.json()["detail"]
    r = httpx.get(f"{srv.url}/v1/families/nofam/versions/v1", headers=h)
    assert r.status_code == 404 and r.json()["status"] == 404
    r = httpx.get(f"{srv.url}/v1/families/fam/versions/.hidden", headers=h)
    assert r.status_code == 400 and "invalid version name" in r.json()["detail"]
    r = httpx.get(f"{srv.url}/v1/families/.hidden/versions", headers=h)
    assert r.status_code == 400 and "invalid family name" in r.json()["detail"]
    schema = httpx.get(f"{srv.url}/openapi.json").json()
    assert "/v1/families/{family}/versions/{version}/commit" in schema["paths"]


def test_negotiate_takes_a_draft_and_commit_does_not(servers, server_env, tmp_path):
    """A client negotiates while its file digests still run (sha256 null); the commit must carry them."""
    (srv,) = servers(1)
    h = {"Authorization": f"Bearer {token(server_env, 'push')}"}
    path = synth.write(tmp_path / "m.safetensors", synth.base_tensors())
    doc = hash_source(open_source(path), 64 << 10, NullProgress()).to_doc()
    draft = {**doc, "files": [{**f, "sha256": None} for f in doc["files"]]}
    r = httpx.post(f"{srv.url}/v1/families/fam/versions/v1/negotiate", json={"manifest": draft}, headers=h)
    assert r.status_code == 200
    neg = r.json()
    assert neg["digest"] is None and not neg["exists"] and neg["missing"] and neg["chunks"] == len(neg["missing"])
    r = httpx.post(f"{srv.url}/v1/families/fam/versions/v1/commit", json={"manifest": draft}, headers=h)
    assert r.status_code == 400 and "sha256" in r.json()["detail"]
    assert httpx.get(f"{srv.url}/v1/families/fam/versions/v1", headers=h).status_code == 404
    assert bucket_keys(server_env) == []


def test_malformed_requests_get_a_400_and_store_nothing(servers, server_env, fam, tmp_path):
    """Inputs that once reached a 500 (or, for the huge chunk, planned its cuts for seconds): a
    batch index nested too deep or holding Infinity, a manifest naming a chunk far over the limit,
    a negotiate naming a parent that does not exist (refused before any upload), a prune grace
    period past what dates can hold."""
    (srv,) = servers(1)
    admin = {"Authorization": f"Bearer {token(server_env, 'admin')}"}
    for index, status, says in (
        (b"[" * 100_000, 413, "a chunk batch may hold at most 4096 chunks"),  # refused before it is parsed
        (b"[" * 1_000 + b"]" * 1_000, 400, "malformed chunk batch"),
        (
            json.dumps([{"id": "0" * 32, "size": float("inf"), "encoding": "raw", "length": 1}]).encode(),
            400,
            "malformed chunk batch",
        ),
    ):
        r = httpx.post(
            f"{srv.url}/v1/families/fam/chunks", content=struct.pack("<I", len(index)) + index + b"x", headers=admin
        )
        assert r.status_code == status and says in r.json()["detail"], r.text
    # counts that are not JSON integers were once rounded or cast ("size": "1", 1.9 and true all
    # stored a 1-byte chunk); each is named, with the entry it is in
    one = {"id": chunk_id(b"x"), "size": 1, "encoding": "raw", "length": 1}
    for entry, says in (
        ({**one, "size": "1"}, "entry 0's 'size' must be a non-negative integer, not \"1\""),
        ({**one, "size": 1.9}, "'size' must be a non-negative integer, not 1.9"),
        ({**one, "length": True}, "'length' must be a non-negative integer, not true"),
        ({**one, "itemsize": 3}, "itemsize 3 is not 1, 2, 4 or 8"),
        ({**one, "encoding": 7}, "'encoding' must be a string"),
        ({k: v for k, v in one.items() if k != "length"}, "entry 0 has no 'length'"),
        ("x", "entry 0 is not an object"),
        ({**one, "basis_id": "nope"}, "entry 0: invalid chunk id 'nope'"),
    ):
        index = json.dumps([entry]).encode()
        r = httpx.post(
            f"{srv.url}/v1/families/fam/chunks", content=struct.pack("<I", len(index)) + index + b"x", headers=admin
        )
        assert r.status_code == 400 and says in r.json()["detail"], r.text
    index = json.dumps(one).encode()
    r = httpx.post(
        f"{srv.url}/v1/families/fam/chunks", content=struct.pack("<I", len(index)) + index + b"x", headers=admin
    )
    assert r.status_code == 400 and "expected a JSON list of entries" in r.json()["detail"], r.text
    huge = 1 << 50
    doc = {
        "format": 1,
        "single_file": False,
        "files": [
            {
                "path": "x.bin",
                "kind": "blob",
                "size": huge,
                "sha256": "0" * 64,
                "chunks": [["0" * 32, 0, huge, 1]],
                "tensors": [],
            }
        ],
    }
    for route, body in (("commit", {"manifest": doc, "chunk_size": 4096}), ("negotiate", {"manifest": doc})):
        r = httpx.post(f"{srv.url}/v1/families/fam/versions/v1/{route}", json=body, headers=admin, timeout=30)
        assert r.status_code == 400 and "byte limit" in r.json()["detail"], r.text
    good = hash_source(open_source(fam["base"]), 64 << 10, NullProgress()).to_doc()
    r = httpx.post(
        f"{srv.url}/v1/families/fam/versions/v1/negotiate", json={"manifest": good, "parent": "nope"}, headers=admin
    )
    assert r.status_code == 404 and "parent version fam/nope does not exist" in r.json()["detail"], r.text
    for age in ("inf", "1e300"):
        r = httpx.post(f"{srv.url}/v1/prune", params={"min_age": age, "dry_run": "true"}, headers=admin)
        assert r.status_code == 400 and "min age" in r.json()["detail"], r.text
    # a negotiation or commit without chunk_size whose cuts imply a size out of range starts no
    # family: a 400 naming the size read off the cuts (it was accepted at negotiation, and refused
    # at commit with a 409 saying the family that did not exist was cut at 2 MiB)
    parts = [b"xxx", b"x"]
    r = httpx.post(
        f"{srv.url}/v1/families/tiny/chunks",
        headers=admin,
        content=build_batch([(Entry(chunk_id(b), len(b), "raw", len(b)), b) for b in parts]),
    )
    assert r.status_code == 200, r.text

    def blob(cuts: list, size: int = 10) -> dict:
        return {
            "format": 1,
            "single_file": False,
            "files": [
                {
                    "path": "t.bin",
                    "kind": "blob",
                    "size": size,
                    "sha256": hashlib.sha256(b"x" * size).hexdigest(),
                    "chunks": cuts,
                    "tensors": [],
                }
            ],
        }

    for doc, read in (
        (blob([[chunk_id(b"xxx"), o, 3, 1] for o in (0, 3, 6)] + [[chunk_id(b"x"), 9, 1, 1]]), 3),
        (blob([[chunk_id(b"x"), o, 1, 1] for o in range(10)]), 1),
    ):
        for route in ("negotiate", "commit"):
            r = httpx.post(f"{srv.url}/v1/families/tiny/versions/v1/{route}", json={"manifest": doc}, headers=admin)
            assert r.status_code == 400, (route, r.text)
            assert (
                f"the manifest is cut in chunks of {read} bytes, which new family 'tiny' would take: a chunk "
                "size is 4,096 to 268,435,456 bytes" in r.json()["detail"]
            ), (route, r.text)
    assert httpx.get(f"{srv.url}/v1/families/tiny", headers=admin).status_code == 404
    # cuts of no family's size, sent to one that exists, are told that family's size (a 409)
    r = httpx.post(
        f"{srv.url}/v1/families/tiny/versions/v1/commit",
        json={"manifest": blob([[chunk_id(b"xxx"), 0, 3, 1]], 3)},
        headers=admin,
    )
    assert r.status_code == 201, r.text  # one chunk: cut at no size in particular, the family takes 2 MiB
    for route in ("negotiate", "commit"):
        r = httpx.post(f"{srv.url}/v1/families/tiny/versions/v2/{route}", json={"manifest": doc}, headers=admin)
        assert r.status_code == 409 and "is cut in chunks of 2,097,152 bytes" in r.json()["detail"], (route, r.text)
    proc = mfsreg(
        "push",
        fam["lora-chat"],
        "--family",
        "fam",
        "--version",
        "v2",
        "--parent",
        "nope",
        env=client_env(tmp_path, srv.url, token(server_env, "push")),
        check=False,
    )
    assert proc.returncode == 2 and "parent version fam/nope does not exist" in proc.stderr, proc.stderr
    assert len(bucket_keys(server_env)) == 1  # the two tiny chunks' pack; the refused push uploaded nothing


def test_hostile_manifests_get_a_400(servers, server_env, fam, tmp_path):
    """Manifests that once reached a 500, named a node's files outside its cache, or would have
    planned a file's cuts by the hundred million: refused with a 400 before anything is stored."""
    (srv,) = servers(1)
    admin = {"Authorization": f"Bearer {token(server_env, 'admin')}"}
    good = hash_source(open_source(fam["base"]), 64 << 10, NullProgress()).to_doc()

    def with_file(**changes) -> dict:
        return {**good, "files": [{**good["files"][0], **changes}, *good["files"][1:]]}

    # a node names a materialised file by its digest: this one would be /tmp/evil on the node
    escape = "/tmp/" + "./" * 27 + "/evil"
    assert len(escape) == 64
    cases = [
        (with_file(sha256=escape), "bad kind or sha256"),
        (with_file(sha256="F" * 64), "bad kind or sha256"),
        (with_file(path="a\ud800.safetensors"), "unsafe or repeated path"),  # a lone surrogate: no UTF-8 for it
        (with_file(path="a\u0000b.safetensors"), "unsafe or repeated path"),  # NUL: two manifests would hash alike
        (with_file(path="a\nb.safetensors"), "unsafe or repeated path"),
        (with_file(path="x" * 256 + ".safetensors"), "unsafe or repeated path"),
    ]
    for doc, says in cases:
        body = json.dumps({"manifest": doc}).encode()  # ASCII escapes: the lone surrogate goes as "\\ud800"
        for route in ("negotiate", "commit"):
            r = httpx.post(
                f"{srv.url}/v1/families/fam/versions/v1/{route}",
                content=body,
                headers={**admin, "Content-Type": "application/json"},
            )
            assert r.status_code == 400 and says in r.json()["detail"], (route, says, r.text)
    # 300 chunks at the largest size claim a 75 GiB file in 30 KB of JSON: compared with the cuts at
    # 4 KiB, it differs at its first chunk (planned whole, 20 million cuts: most of a minute and GBs)
    from mfsreg.registry.format.manifest import MAX_CHUNK_BYTES

    n = 300
    big = {
        "format": 1,
        "single_file": False,
        "files": [
            {
                "path": "x.bin",
                "kind": "blob",
                "size": n * MAX_CHUNK_BYTES,
                "sha256": "0" * 64,
                "chunks": [["0" * 32, i * MAX_CHUNK_BYTES, MAX_CHUNK_BYTES, 1] for i in range(n)],
                "tensors": [],
            }
        ],
    }
    r = httpx.post(
        f"{srv.url}/v1/families/fam/versions/v1/commit",
        json={"manifest": big, "chunk_size": 4096},
        headers=admin,
        timeout=20,
    )
    assert r.status_code == 400 and "not cut at the chunk size it names" in r.json()["detail"], r.text
    assert bucket_keys(server_env) == []
    assert httpx.get(f"{srv.url}/v1/families/fam", headers=admin).status_code == 404


def test_body_limit(server_env, servers, tmp_path):
    server_env["MFSREG_MAX_BODY"] = str(1 << 20)
    (srv,) = servers(1)
    h = {"Authorization": f"Bearer {token(server_env, 'push')}"}
    r = httpx.post(f"{srv.url}/v1/families/fam/chunks", content=b"\0" * (2 << 20), headers=h)
    assert r.status_code == 413 and "limit" in r.json()["detail"]
    # without a Content-Length (chunked transfer) the body is counted as it arrives, JSON bodies too
    pieces = (b"[" + b"0," * (1 << 16) for _ in range(40))
    r = httpx.post(
        f"{srv.url}/v1/families/fam/versions/v1/negotiate",
        content=pieces,
        headers={**h, "Content-Type": "application/json"},
    )
    assert r.status_code == 413
    r = httpx.post(f"{srv.url}/v1/families/fam/chunks", content=(b"\0" * (1 << 16) for _ in range(40)), headers=h)
    assert r.status_code == 413


def test_a_push_of_very_compressible_chunks_cuts_its_batches_at_the_decoded_cap(server_env, servers, tmp_path):
    """The server refuses a batch whose chunks decode to more than RAW_PER_BODY x its body limit (a
    few compressed bytes may claim gigabytes): a client whose batches fill slowly, because its
    chunks compress to almost nothing, cuts them by decoded size as well."""
    from mfsreg.registry.format.manifest import MAX_CHUNK_BYTES
    from mfsreg.registry.format.wire import RAW_PER_BODY

    # the smallest body limit whose cap is not the floor (one chunk of the largest size always fits)
    limit = MAX_CHUNK_BYTES // RAW_PER_BODY + (1 << 20)
    server_env["MFSREG_MAX_BODY"] = str(limit)
    (srv,) = servers(1)
    weights = torch.zeros(160, 2 << 20, dtype=torch.uint8)  # 160 chunks of 2 MiB, each zeros but for its number
    weights[:, 0] = torch.arange(160, dtype=torch.uint8)
    path = synth.write(tmp_path / "sparse.safetensors", {"w": weights})
    del weights
    assert path.stat().st_size > RAW_PER_BODY * limit  # one batch by compressed size alone: refused
    env = {**client_env(tmp_path, srv.url, token(server_env, "push")), "MFSREG_CHUNK_SIZE": str(2 << 20)}
    res = mfsreg_json("push", path, "--family", "fam", "--version", "v1", env=env)
    assert res["new_chunks"] == res["chunks"] >= 160 and res["sent_bytes"] < (1 << 20)
    mfsreg("pull", "fam", "v1", "-o", tmp_path / "out", env=env)
    assert filecmp.cmp(tmp_path / "out", path, shallow=False)


def test_the_default_body_limit_takes_a_batch_of_the_largest_chunk():
    """A family may be cut at up to 256 MiB: one such chunk, uncompressible, goes in a batch alone."""
    from mfsreg.registry.config import Settings
    from mfsreg.registry.format.manifest import MAX_CHUNK_BYTES
    from mfsreg.registry.format.wire import encode_index

    index = encode_index([Entry("f" * 32, MAX_CHUNK_BYTES, "raw", MAX_CHUNK_BYTES, "e" * 32, 8)])
    assert len(index) + MAX_CHUNK_BYTES <= Settings.from_env({}).max_body


def test_anonymous_reads_when_opened(server_env, servers, fam, tmp_path):
    server_env["MFSREG_ANONYMOUS_READ"] = "1"
    (srv,) = servers(1)
    mfsreg_json(
        "push",
        fam["base"],
        "--family",
        "fam",
        "--version",
        "v1",
        env=client_env(tmp_path, srv.url, token(server_env, "push")),
    )
    anon = client_env(tmp_path, srv.url, None)
    assert [v["version"] for v in mfsreg_json("ls", "fam", env=anon)["versions"]] == ["v1"]
    proc = mfsreg("push", fam["lora-chat"], "--family", "fam", "--version", "v2", env=anon, check=False)
    assert proc.returncode == 3 and "token" in proc.stderr


def test_a_post_is_refused_for_its_role_before_its_body_is_parsed(server_env, servers, tmp_path):
    """A token without the role a POST needs (or no token, where reads are open) gets its 401 or
    403 before the server reads the body: malformed JSON gets the same answer, not a 422, so no
    parse happened. A download's list of ids has a body limit of its own."""
    server_env["MFSREG_ANONYMOUS_READ"] = "1"
    (srv,) = servers(1)
    callers = {
        "read": ({"Authorization": f"Bearer {token(server_env, 'read')}"}, 403, "the operation needs 'push'"),
        "push elsewhere": (
            {"Authorization": f"Bearer {token(server_env, 'push', 'other*')}"},
            403,
            "limited to families",
        ),
        "anonymous": ({}, 401, "needs a token"),
    }
    for who, (auth, status, says) in callers.items():
        for path in ("fam/versions/v1/negotiate", "fam/versions/v1/commit", "fam/chunks"):
            r = httpx.post(
                f"{srv.url}/v1/families/{path}",
                content=b"{not json" + b"[]," * 1000,
                headers={"Content-Type": "application/json", **auth},
            )
            assert r.status_code == status and says in r.json()["detail"], (who, path, r.text)
        r = httpx.post(
            f"{srv.url}/v1/prune", content=b"{not json", headers={"Content-Type": "application/json", **auth}
        )
        assert r.status_code in (401, 403) and r.json()["status"] == r.status_code, (who, r.text)
    reader = callers["read"][0]
    r = httpx.post(f"{srv.url}/v1/families/fam/chunks/download", content=b"{not json", headers=reader)
    assert r.status_code == 422  # a reader may download: its body is parsed, and refused as JSON
    from mfsreg.api.posts import MAX_DOWNLOAD_BODY

    for body in (b" " * (MAX_DOWNLOAD_BODY + 1), (b" " * (1 << 20) for _ in range(MAX_DOWNLOAD_BODY // (1 << 20) + 1))):
        r = httpx.post(f"{srv.url}/v1/families/fam/chunks/download", content=body, headers=reader)
        assert r.status_code == 413 and f"{MAX_DOWNLOAD_BODY} byte limit" in r.json()["detail"], r.text
        assert "chunk ids a request" in r.json()["detail"]


@pytest.mark.process
def test_killed_push_rerun_sends_only_the_rest(servers, server_env, tmp_path):
    (srv,) = servers(1)
    admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
    env = dict(admin, MFSREG_UPLOAD_BATCH=str(1 << 20))
    g = torch.Generator().manual_seed(5)
    src = synth.write(tmp_path / "big.safetensors", {f"w.{i}": torch.randn(1024, 1024, generator=g) for i in range(12)})
    proc = subprocess.Popen(
        [MFSREG, "push", str(src), "--family", "fam", "--version", "big"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if mfsreg_json("stats", env=admin)["unreferenced_bytes"] >= 4 << 20:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "push finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    # the server may still be storing the batch it was receiving: wait until what it holds is stable
    stats, deadline = mfsreg_json("stats", env=admin), time.monotonic() + 30
    while time.monotonic() < deadline:
        time.sleep(0.3)
        again = mfsreg_json("stats", env=admin)
        if again["unreferenced_bytes"] == stats["unreferenced_bytes"]:
            break
        stats = again
    assert stats["versions_count"] == 0
    stored_before = stats["unreferenced_bytes"]
    rerun = mfsreg_json("push", src, "--family", "fam", "--version", "big", env=env)
    total = mfsreg_json("stats", "--family", "fam", env=admin)["stored_bytes"]
    assert rerun["sent_bytes"] == total - stored_before  # only the chunks not yet stored were sent
    assert 0 < rerun["sent_bytes"] < total
    mfsreg("pull", "fam", "big", "-o", tmp_path / "big.out", env=admin)
    assert filecmp.cmp(tmp_path / "big.out", src, shallow=False)


@pytest.mark.process
def test_two_api_processes_take_concurrent_pushes(servers, server_env, tmp_path):
    a_srv, b_srv = servers(2, process=True)
    tok = token(server_env, "push")
    g = torch.Generator().manual_seed(9)
    shared = {f"shared.{i}": torch.randn(512, 1024, generator=g) for i in range(8)}
    files = {}
    for v, seed in (("a", 1), ("b", 2)):
        gg = torch.Generator().manual_seed(seed)
        own = {f"own.{i}": torch.randn(256, 1024, generator=gg) for i in range(4)}
        files[v] = synth.write(tmp_path / f"{v}.safetensors", {**shared, **own})
    procs = [
        subprocess.Popen(
            [MFSREG, "push", str(files[v]), "--family", "fam", "--version", v, "--json"],
            env=client_env(tmp_path, srv.url, tok),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for v, srv in (("a", a_srv), ("b", b_srv))
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        assert json.loads(out)["version"] in ("a", "b")
    for v, srv in (("a", b_srv), ("b", a_srv)):  # each read back through the other process
        mfsreg("pull", "fam", v, "-o", tmp_path / f"{v}.out", env=client_env(tmp_path, srv.url, tok))
        assert filecmp.cmp(tmp_path / f"{v}.out", files[v], shallow=False)
    stats = mfsreg_json("stats", "--family", "fam", env=client_env(tmp_path, a_srv.url, tok))
    assert stats["versions_count"] == 2
    assert stats["tiers"]["base"]["chunks"] == 8 * (2 << 20) // (64 << 10) + 1  # shared tensors + same header


def test_unreachable_server_is_one_line(fam, tmp_path):
    env = client_env(tmp_path, f"http://127.0.0.1:{free_port()}", "mfs_whatever")
    for args in (
        ("ls",),
        ("push", fam["base"], "--family", "fam", "--version", "v1"),
        ("pull", "fam", "v1", "-o", tmp_path / "o"),
    ):
        proc = mfsreg(*args, env=env, check=False)
        assert proc.returncode == 5 and "cannot reach the registry" in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    env["MFSREG_URL"] = "ftp://example"
    proc = mfsreg("ls", env=env, check=False)
    assert proc.returncode == 2 and "must start with http" in proc.stderr


def test_a_url_with_a_path_the_api_is_not_at_is_one_line(servers, server_env, fam, tmp_path):
    """MFSREG_URL with a path an mfsreg server has no API under: its 404 for the route (an mfsreg
    problem of type http_error) read as "Not Found" of the family or version, exit 2."""
    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url + "/api", token(server_env, "admin"))
    for args in (
        ("ls",),
        ("show", "fam", "v1"),
        ("push", fam["base"], "--family", "fam", "--version", "v1"),
        ("pull", "fam", "v1", "-o", tmp_path / "o"),
        ("cache", "warm", "fam"),
    ):
        proc = mfsreg(*args, env=env, check=False)
        assert proc.returncode != 0 and "no mfsreg API there" in proc.stderr and "MFSREG_URL" in proc.stderr, (
            args,
            proc.stderr,
        )
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert bucket_keys(server_env) == []


@pytest.mark.process
def test_a_url_that_is_not_an_mfsreg_server_is_one_line(tmp_path):
    """A static web server where MFSREG_URL should be: its 200 pages are not JSON."""
    site = tmp_path / "site"
    (site / "v1" / "families").mkdir(parents=True)  # GET /v1/families/ answers a 200 directory listing
    port = free_port()
    web = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1", "-d", str(site)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        env = client_env(tmp_path, f"http://127.0.0.1:{port}", "mfs_whatever")
        for _ in range(100):
            try:
                httpx.get(f"http://127.0.0.1:{port}/")
                break
            except httpx.TransportError:
                time.sleep(0.05)
        proc = mfsreg("ls", env=env, check=False)
        assert proc.returncode == 2 and "is not JSON" in proc.stderr and "MFSREG_URL" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1
    finally:
        web.terminate()
        web.wait()


def test_a_request_of_the_wrong_shape_is_not_taken_for_damaged_bytes(servers, server_env, tmp_path):
    """The server answers 422 both for a chunk that fails its check and for a body of the wrong
    shape; the client tells them apart by the problem's type."""
    from mfsreg.registry.client.remote import RemoteRegistry
    from mfsreg.registry.errors import IntegrityError, InvalidRequest

    (srv,) = servers(1)
    with RemoteRegistry(srv.url, token=token(server_env, "admin")) as remote:
        with pytest.raises(InvalidRequest, match="ids"):
            remote._json("POST", "/v1/families/fam/chunks/download", json={"ids": 5})
        good = b"\x02" * 4096
        batch = build_batch([(Entry(chunk_id(good)[:-1] + "0", 4096, "raw", 4096), good)])
        with pytest.raises(IntegrityError, match="do not match"):
            remote._json("POST", "/v1/families/fam/chunks", content=batch)


def test_server_stores_uploaded_near_duplicates_as_deltas(servers, server_env, fam, tmp_path):
    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "push"))
    base = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    full = mfsreg_json("push", fam["full-med"], "--family", "fam", "--version", "full-med", "--parent", "base", env=env)
    assert full["new_bytes"] < 0.5 * base["new_bytes"]  # stored as deltas against the base's chunks
    stats = mfsreg_json("stats", "--family", "fam", env=env)
    assert stats["encodings"]["esubn-p2"]["chunks"] > 0
    mfsreg("pull", "fam", "full-med", "-o", tmp_path / "out", env=env)
    assert filecmp.cmp(tmp_path / "out", fam["full-med"], shallow=False)


def test_token_scoped_to_one_family_cannot_read_another(servers, server_env, fam, tmp_path):
    (srv,) = servers(1)
    admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
    mfsreg_json("push", fam["base"], "--family", "secret", "--version", "v1", env=admin)
    mfsreg_json("push", fam["base"], "--family", "qwen", "--version", "v1", env=admin)
    tok = token(server_env, "read", "qwen*")
    h = {"Authorization": f"Bearer {tok}"}
    assert httpx.get(f"{srv.url}/v1/families/secret/versions/v1", headers=h).status_code == 403
    assert [f["family"] for f in httpx.get(f"{srv.url}/v1/families", headers=h).json()] == ["qwen"]
    ids = list(httpx.get(f"{srv.url}/v1/families/qwen/versions/v1", headers=h).json()["chunks"])
    assert httpx.post(f"{srv.url}/v1/families/secret/chunks/download", json={"ids": ids}, headers=h).status_code == 403
    # both families hold the same bytes, but a chunk id is only served through a family that uses it
    r = httpx.post(f"{srv.url}/v1/families/qwen/chunks/download", json={"ids": ids[:1] + ["f" * 32]}, headers=h)
    assert r.status_code == 404
    prefix = tok[:10]
    mfsreg("token", "revoke", prefix, env=server_env)
    assert httpx.get(f"{srv.url}/v1/families", headers=h).status_code == 401


def test_a_version_committed_with_another_files_digests_is_not_taken_for_that_file(servers, server_env, tmp_path):
    """The server checks each chunk against its id, not whole files against their sha256 (that
    would read every byte of every commit): a commit may claim one file's chunks under another's
    digest. An honest push of that other file under that name was then answered 'existed', sent
    nothing and exited 0, the first file's bytes stored under it."""
    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "admin"))
    one, two = (
        synth.write(tmp_path / d / "m.safetensors", synth.base_tensors(seed=s)) for d, s in (("1", 0), ("2", 5))
    )
    mfsreg_json("push", one, "--family", "fam", "--version", "one", env=env)
    h = {"Authorization": f"Bearer {token(server_env, 'push', 'fam')}"}
    forged = hash_source(open_source(one), 64 << 10, NullProgress()).to_doc()
    honest = hash_source(open_source(two), 64 << 10, NullProgress())
    forged["files"][0]["sha256"] = honest.files[0].sha256  # the same path and size
    r = httpx.post(f"{srv.url}/v1/families/fam/versions/victim/commit", json={"manifest": forged}, headers=h)
    assert r.status_code == 201, r.text
    neg = httpx.post(
        f"{srv.url}/v1/families/fam/versions/victim/negotiate", json={"manifest": honest.to_doc()}, headers=h
    ).json()
    assert neg["exists"] and neg["existing_digest"] == honest.digest and neg["existing_layout"] != honest.layout
    proc = mfsreg("push", two, "--family", "fam", "--version", "victim", env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "already exists with other content: the same file digests, other chunks" in proc.stderr, proc.stderr
    # the same, committed directly: a 409 rather than 'existed'
    r = httpx.post(f"{srv.url}/v1/families/fam/versions/victim/commit", json={"manifest": honest.to_doc()}, headers=h)
    assert r.status_code == 409 and "other chunks" in r.json()["detail"], r.text
    # what was committed, committed again, is still 'existed'
    r = httpx.post(f"{srv.url}/v1/families/fam/versions/victim/commit", json={"manifest": forged}, headers=h)
    assert r.status_code == 200 and r.json()["existed"], r.text
    assert mfsreg_json("push", one, "--family", "fam", "--version", "one", env=env)["existed"]


def test_a_scoped_token_uses_another_familys_chunks_only_by_sending_their_bytes(servers, server_env, fam, tmp_path):
    (srv,) = servers(1)
    admin_tok, scoped_tok = token(server_env, "admin"), token(server_env, "push", "qwen*")
    admin, scoped = ({"Authorization": f"Bearer {t}"} for t in (admin_tok, scoped_tok))
    admin_env = client_env(tmp_path, srv.url, admin_tok)
    for name in ("base", "lora-chat"):
        mfsreg_json("push", fam[name], "--family", "secret", "--version", name, env=admin_env)
    keys = sorted(bucket_keys(server_env))
    m = hash_source(open_source(fam["base"]), 64 << 10, NullProgress())
    doc, ids, data = m.to_doc(), m.chunk_ids(), fam["base"].read_bytes()
    url = f"{srv.url}/v1/families/qwen"
    # naming the ids of another family's chunks is not enough: the commit is refused, and no version
    # appears; the answer is the one chunks stored nowhere get, so it does not say they are stored
    r = httpx.post(f"{url}/versions/v1/commit", json={"manifest": doc}, headers=scoped)
    assert r.status_code == 404 and r.json()["detail"].startswith(
        f"{len(ids)} chunks of qwen/v1 are not stored for this family"
    )
    assert httpx.get(f"{url}/versions/v1", headers=scoped).status_code == 404
    # a manifest naming chunks stored nowhere (the grown vocabulary's) and chunks another family
    # stores (the tensors it shares with the base): all counted together
    mixed = hash_source(open_source(fam["vocab-ext"]), 64 << 10, NullProgress())
    assert set(mixed.chunk_ids()) & set(ids) and set(mixed.chunk_ids()) - set(ids)
    r = httpx.post(f"{url}/versions/v1/commit", json={"manifest": mixed.to_doc()}, headers=scoped)
    assert r.status_code == 404 and r.json()["detail"].startswith(
        f"{len(mixed.chunk_ids())} chunks of qwen/v1 are not stored for this family"
    )
    # nor is another family's header read for such a commit: its parse errors would describe that model
    lying = json.loads(json.dumps(doc))
    lying["files"][0]["tensors"][0][0] = "guessed." + lying["files"][0]["tensors"][0][0]
    r = httpx.post(f"{url}/versions/v1/commit", json={"manifest": lying}, headers=scoped)
    assert r.status_code == 404 and "not stored for this family" in r.json()["detail"], r.json()
    neg = httpx.post(f"{url}/versions/v1/negotiate", json={"manifest": doc}, headers=scoped).json()
    assert sorted(neg["missing"]) == sorted(ids)
    # an upload of a stored id is re-hashed like any other: other bytes are refused
    raw = {c.id: data[c.offset : c.offset + c.size] for f in m.files for c in f.chunks}
    head = raw[ids[0]]
    forged = build_batch([(Entry(ids[0], len(head), "raw", len(head)), bytes(len(head)))])
    assert httpx.post(f"{url}/chunks", content=forged, headers=scoped).status_code == 422
    body = build_batch([(Entry(i, len(b), "raw", len(b)), b) for i, b in raw.items()])
    r = httpx.post(f"{url}/chunks", content=body, headers=scoped)
    # nor does the answer say the registry held them: they count as new, at the size sent
    assert r.status_code == 200 and r.json()["new_bytes"] == sum(map(len, raw.values()))
    assert sorted(bucket_keys(server_env)) == keys
    # what a push proved lasts the grace period: a prune past it forgets an upload nobody committed
    assert httpx.post(f"{srv.url}/v1/prune", params={"min_age": 0}, headers=admin).status_code == 200
    assert httpx.post(f"{url}/versions/v1/commit", json={"manifest": doc}, headers=scoped).status_code == 404
    assert httpx.post(f"{url}/chunks", content=body, headers=scoped).status_code == 200
    assert httpx.post(f"{url}/versions/v1/commit", json={"manifest": doc}, headers=scoped).status_code == 201
    assert sorted(bucket_keys(server_env)) == keys  # the bytes are still stored once
    # a family the token may read counts: another qwen* family uses them without sending
    neg = httpx.post(
        f"{srv.url}/v1/families/qwen2/versions/v1/negotiate", json={"manifest": doc}, headers=scoped
    ).json()
    assert neg["missing"] == []
    # and a token for every family dedups against every family, as before
    neg = httpx.post(f"{srv.url}/v1/families/other/versions/v1/negotiate", json={"manifest": doc}, headers=admin).json()
    assert neg["missing"] == []
    # the client does all this by itself: it sends the chunks qwen lacks, the registry stores none of them
    scoped_env = client_env(tmp_path, srv.url, scoped_tok)
    res = mfsreg_json("push", fam["lora-chat"], "--family", "qwen", "--version", "chat", env=scoped_env)
    assert res["sent_bytes"] > 0 and res["new_bytes"] == res["sent_bytes"]
    assert sorted(bucket_keys(server_env)) == keys
    # chunks new to the registry, stored as deltas against qwen's own: new_bytes is what was sent too,
    # or its size would tell them from chunks another family holds
    res = mfsreg_json("push", fam["full-med"], "--family", "qwen", "--version", "med", "--parent", "v1", env=scoped_env)
    assert res["new_chunks"] > 0 and res["new_bytes"] == res["sent_bytes"]
    assert len(bucket_keys(server_env)) > len(keys)
    mfsreg("pull", "qwen", "chat", "-o", tmp_path / "chat.out", env=scoped_env)
    assert filecmp.cmp(tmp_path / "chat.out", fam["lora-chat"], shallow=False)


def test_a_scoped_negotiation_names_no_other_familys_lost_chunks_under_mend(servers, server_env, fam, tmp_path):
    """A token scoped to qwen* negotiating a file whose chunks only another family stores, in a pack
    the blob store lost: they are listed missing, as chunks stored nowhere are, and none under mend
    (which would tell the token that the registry holds them, and that they are damaged), with or
    without mend_damaged. A token that reads every family is told what to mend, as before."""
    from mfsreg.registry.blobs.packs import pack_key
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    (srv,) = servers(1)
    admin_tok, scoped_tok = token(server_env, "admin"), token(server_env, "push", "qwen*")
    mfsreg_json(
        "push", fam["base"], "--family", "secret", "--version", "base", env=client_env(tmp_path, srv.url, admin_tok)
    )
    m = hash_source(open_source(fam["base"]), 64 << 10, NullProgress())
    with Registry(Settings.from_env(server_env)) as local:
        for p in {c.pack_id for c in local.locate(set(m.chunk_ids())).values()}:
            local.blobs.delete(pack_key(p))
    url = f"{srv.url}/v1/families/qwen/versions/v1/negotiate"
    for mend_damaged in (False, True):
        body = {"manifest": m.to_doc(), "mend_damaged": mend_damaged}
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {scoped_tok}"})
        assert r.status_code == 200, r.text
        assert sorted(r.json()["missing"]) == sorted(m.chunk_ids()) and r.json()["mend"] == [], r.json()["mend"]
        r = httpx.post(url, json=body, headers={"Authorization": f"Bearer {admin_tok}"})
        assert r.status_code == 200 and sorted(r.json()["mend"]) == sorted(m.chunk_ids()), r.text
    assert (
        httpx.get(
            f"{srv.url}/v1/families/qwen/versions/v1", headers={"Authorization": f"Bearer {admin_tok}"}
        ).status_code
        == 404
    )


@sqlite_only
def test_a_stored_chunk_proves_a_scoped_upload_only_by_equal_bytes(reg, fam):
    """A chunk id is an xxh3-128, not built to resist forged collisions: an upload through a scoped
    token claims a chunk another family stored only if its bytes are the stored ones, plain or
    delta. (Bytes that hash to a stored id but differ cannot be made in a test; they reach this
    check after the re-hash, with the same answer a hash mismatch gets.)"""
    from mfsreg.registry.auth import Principal
    from mfsreg.registry.errors import IntegrityError
    from tests.proofs import check_proofs

    reg.push(fam["base"], "secret", "base")
    reg.push(fam["full-med"], "secret", "med", parent="base")
    m = hash_source(open_source(fam["full-med"]), reg.settings.chunk_size, NullProgress())
    data = fam["full-med"].read_bytes()
    raw = {c.id: data[c.offset : c.offset + c.size] for f in m.files for c in f.chunks}
    deltas = {i for i, c in reg.locate(list(raw)).items() if c.basis_id}
    assert deltas
    scoped, everyone = Principal("push", "qwen*"), Principal("admin", "*")
    assert check_proofs(reg, scoped, "qwen", raw) == set(raw)  # the stored bytes, decoded from their deltas
    some = min(deltas)
    forged = {**raw, some: bytes(len(raw[some]))}
    with pytest.raises(IntegrityError, match=f"chunk {some}: bytes do not match the id"):
        check_proofs(reg, scoped, "qwen", forged)
    assert check_proofs(reg, everyone, "qwen", forged) == set(
        forged
    )  # a token for every family proves nothing: it may use them all
    assert check_proofs(reg, Principal("push", "sec*"), "secret", forged) == set(
        forged
    )  # nor need chunks its own family uses
    # a chunk deleted meanwhile (a prune) is compared with nothing, so it is not the push's to claim
    from sqlalchemy import delete

    from mfsreg.registry.db.engine import write_tx
    from mfsreg.registry.db.models import chunks

    with write_tx(reg.engine) as conn:
        conn.execute(delete(chunks).where(chunks.c.id == some))
    assert check_proofs(reg, scoped, "qwen", raw) == set(raw) - {some}


@pytest.mark.process
def test_a_scoped_upload_is_compared_with_the_stored_chunk(servers, server_env, fam, tmp_path):
    """The server reads back a stored chunk that a scoped token uploads, to compare the bytes
    (access.compare_stored): with that chunk's pack damaged in storage the comparison cannot be made,
    and the upload is refused with a 503 that names neither the pack nor the chunk's family, and
    claims nothing. (With equal bytes it passes: the tests above.)"""
    (srv,) = servers(1, process=True)  # the test reads the process's log
    admin_tok, scoped_tok = token(server_env, "admin"), token(server_env, "push", "qwen*")
    mfsreg_json(
        "push", fam["base"], "--family", "secret", "--version", "base", env=client_env(tmp_path, srv.url, admin_tok)
    )
    (key,) = [k for k in bucket_keys(server_env) if k.endswith(".pack")]
    bucket = server_env["MFSREG_BLOB_URL"].split("/")[2]
    s3 = boto3.client("s3", endpoint_url=server_env["MFSREG_S3_ENDPOINT_URL"], region_name="us-east-1")
    pack = bytearray(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    pack[len(pack) // 2 :] = bytes(len(pack) - len(pack) // 2)
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(pack))
    m = hash_source(open_source(fam["base"]), 64 << 10, NullProgress())
    data = fam["base"].read_bytes()
    raw = {c.id: data[c.offset : c.offset + c.size] for f in m.files for c in f.chunks}
    body = build_batch([(Entry(i, len(b), "raw", len(b)), b) for i, b in raw.items()])
    scoped = {"Authorization": f"Bearer {scoped_tok}"}
    r = httpx.post(f"{srv.url}/v1/families/qwen/chunks", content=body, headers=scoped)
    assert r.status_code == 503 and r.json()["detail"].startswith("the registry could not read back stored chunks"), (
        r.text
    )
    assert key not in r.text and "secret" not in r.text
    # the operator finds what happened in the server's log, in uvicorn's format
    log = Path(srv.log.name).read_text()
    assert "WARNING:  could not read back stored chunks to compare a scoped upload with (attempt 2 of 2)" in log, log
    r = httpx.post(f"{srv.url}/v1/families/qwen/versions/v1/commit", json={"manifest": m.to_doc()}, headers=scoped)
    assert r.status_code == 404 and "not stored for this family" in r.json()["detail"]  # nothing was claimed


def test_a_scoped_push_whose_proofs_lapse_before_its_commit_uploads_again(servers, server_env, fam, tmp_path):
    """A prune between a scoped push's upload and its commit forgets the claims that upload made
    (an admin's prune with a grace period of 0): the commit is told to upload, and the client asks
    again what is missing, sends it and commits, by itself."""
    from mfsreg.registry.client.remote import RemoteRegistry
    from mfsreg.registry.progress import NullProgress as Quiet

    (srv,) = servers(1)
    admin_tok, scoped_tok = token(server_env, "admin"), token(server_env, "push", "qwen*")
    mfsreg_json(
        "push", fam["base"], "--family", "secret", "--version", "base", env=client_env(tmp_path, srv.url, admin_tok)
    )
    keys = sorted(bucket_keys(server_env))
    pruned = []

    class PruneOnceSent(Quiet):
        def start(self, task, total):
            self.total, self.done = total, 0

        def advance(self, task, n):
            self.done += n
            if task == "send" and self.done == self.total and not pruned:
                r = httpx.post(
                    f"{srv.url}/v1/prune", params={"min_age": 0}, headers={"Authorization": f"Bearer {admin_tok}"}
                )
                pruned.append(r.status_code)

    with RemoteRegistry(srv.url, token=scoped_tok, chunk_size=64 << 10) as client:
        res = client.push(fam["base"], "qwen", "v1", progress=PruneOnceSent())
    from mfsreg.registry.format import codec

    m = hash_source(open_source(fam["base"]), 64 << 10, NullProgress())
    data = fam["base"].read_bytes()
    once = sum(
        len(codec.encode(data[c.offset : c.offset + c.size], c.itemsize)[1])
        for c in {c.id: c for f in m.files for c in f.chunks}.values()
    )
    assert pruned == [200]
    assert res.sent_bytes == 2 * once  # every chunk sent again after the prune
    assert sorted(bucket_keys(server_env)) == keys  # and stored once, by the first family
    env = client_env(tmp_path, srv.url, scoped_tok)
    mfsreg("pull", "qwen", "v1", "-o", tmp_path / "out", env=env)
    assert filecmp.cmp(tmp_path / "out", fam["base"], shallow=False)


def test_a_scoped_push_gets_plain_copies_of_chunks_stored_against_another_familys(servers, server_env, fam, tmp_path):
    """A chunk the push holds, stored as a delta against a chunk of a family the token may not read,
    would lend that basis: the version would list it, and its readers could download it."""
    from mfsreg.registry.format.manifest import Manifest

    (srv,) = servers(1)
    admin_tok, scoped_tok = token(server_env, "admin"), token(server_env, "push", "qwen*")
    admin, scoped = ({"Authorization": f"Bearer {t}"} for t in (admin_tok, scoped_tok))
    admin_env, scoped_env = (client_env(tmp_path, srv.url, t) for t in (admin_tok, scoped_tok))
    mfsreg_json("push", fam["base"], "--family", "secret", "--version", "base", env=admin_env)
    mfsreg_json("push", fam["full-med"], "--family", "secret", "--version", "med", "--parent", "base", env=admin_env)
    before = httpx.get(f"{srv.url}/v1/families/secret/versions/med", headers=admin).json()["chunks"]
    deltas = {i for i, row in before.items() if row[2]}
    assert deltas
    # a commit refused for its parent changes nothing stored: no plain copies are made for it first
    m = hash_source(open_source(fam["full-med"]), 64 << 10, NullProgress())
    neg = httpx.post(
        f"{srv.url}/v1/families/qwen/versions/med/negotiate", json={"manifest": m.to_doc()}, headers=scoped
    ).json()
    data = fam["full-med"].read_bytes()
    raw = {c.id: data[c.offset : c.offset + c.size] for f in m.files for c in f.chunks if c.id in set(neg["missing"])}

    def upload(ids):
        r = httpx.post(
            f"{srv.url}/v1/families/qwen/chunks",
            headers=scoped,
            content=build_batch([(Entry(i, len(raw[i]), "raw", len(raw[i])), raw[i]) for i in ids]),
        )
        assert r.status_code == 200, r.text

    # nor does a commit refused for a chunk it has not uploaded (the copies were made first)
    held_back = min(set(raw) - deltas)
    upload(sorted(set(raw) - {held_back}))
    r = httpx.post(f"{srv.url}/v1/families/qwen/versions/med/commit", json={"manifest": m.to_doc()}, headers=scoped)
    assert r.status_code == 404 and "upload them, then commit again" in r.json()["detail"], r.text
    assert httpx.get(f"{srv.url}/v1/families/secret/versions/med", headers=admin).json()["chunks"] == before
    upload([held_back])
    r = httpx.post(
        f"{srv.url}/v1/families/qwen/versions/med/commit",
        json={"manifest": m.to_doc(), "parent": "nope"},
        headers=scoped,
    )
    assert r.status_code == 404 and "parent version qwen/nope does not exist" in r.json()["detail"], r.text
    assert httpx.get(f"{srv.url}/v1/families/secret/versions/med", headers=admin).json()["chunks"] == before
    mfsreg_json("push", fam["full-med"], "--family", "qwen", "--version", "med", env=scoped_env)
    doc = httpx.get(f"{srv.url}/v1/families/qwen/versions/med", headers=scoped).json()
    own = set(Manifest.from_doc(doc["manifest"]).chunk_ids())
    assert set(doc["chunks"]) == own  # no basis of the secret family's among what it needs
    secret_only = sorted(
        set(httpx.get(f"{srv.url}/v1/families/secret/versions/base", headers=admin).json()["chunks"]) - own
    )
    r = httpx.post(f"{srv.url}/v1/families/qwen/chunks/download", json={"ids": secret_only[:3]}, headers=scoped)
    assert r.status_code == 404
    after_doc = httpx.get(f"{srv.url}/v1/families/secret/versions/med", headers=admin).json()
    after = after_doc["chunks"]
    assert not any(after[i][2] for i in deltas & own)  # the shared chunks are plain now, for both families
    # and secret's med needs no longer the bases they leaned on: its list is its chunks' closure now
    need, todo = set(), set(Manifest.from_doc(after_doc["manifest"]).chunk_ids())
    while todo:
        need |= todo
        todo = {after[i][2] for i in todo if i in after and after[i][2]} - need
    assert set(after) == need and set(before) - need
    for family, env in (("qwen", scoped_env), ("secret", admin_env)):
        mfsreg("pull", family, "med", "-o", tmp_path / f"{family}.out", env=env)
        assert filecmp.cmp(tmp_path / f"{family}.out", fam["full-med"], shallow=False)


def test_pushes_through_the_api_follow_the_familys_chunk_size(servers, server_env, fam, tmp_path):
    """A client cuts at the family's chunk size (GET /v1/families/{family}), not its own, so it
    dedups against what is stored; a commit cut at another size is refused and stores nothing."""
    from mfsreg.registry.client.remote import RemoteRegistry

    (srv,) = servers(1)
    tok = token(server_env, "push")
    with RemoteRegistry(srv.url, token=tok, chunk_size=32 << 10) as first:
        first.push(fam["base"], "fam", "base")
    with RemoteRegistry(srv.url, token=tok, chunk_size=128 << 10) as second:
        assert second.family("fam").chunk_size == 32 << 10
        copy = second.push(fam["base"], "fam", "base-again")
        second.push(fam["base"], "new-fam", "base")
        sizes = {f.name: f.chunk_size for f in second.families()}
    assert copy.sent_bytes == 0 and copy.new_chunks == 0 and copy.reused_chunks == copy.chunks
    assert sizes == {"fam": 32 << 10, "new-fam": 128 << 10}
    h = {"Authorization": f"Bearer {tok}"}
    doc = hash_source(open_source(fam["lora-chat"]), 128 << 10, NullProgress()).to_doc()
    url = f"{srv.url}/v1/families/fam/versions/lora/commit"
    r = httpx.post(url, json={"manifest": doc, "chunk_size": 128 << 10}, headers=h)
    assert r.status_code == 409 and "chunks of 32,768 bytes" in r.json()["detail"], r.text
    r = httpx.post(url, json={"manifest": doc, "chunk_size": 5}, headers=h)
    assert r.status_code == 400 and "out of range" in r.json()["detail"], r.text
    assert httpx.get(f"{srv.url}/v1/families/fam/versions/lora", headers=h).status_code == 404
    r = httpx.get(f"{srv.url}/v1/families/nope", headers=h)
    assert r.status_code == 404 and "does not exist" in r.json()["detail"]


def test_a_push_cut_otherwise_than_its_family_is_refused_before_it_uploads(servers, server_env, fam, tmp_path):
    """A client older than family chunk sizes names no size and cuts at its own: the server reads the
    size off the manifest's cuts. A new family takes it; a push cut otherwise than an existing family
    is refused with a 409 at negotiation, before a byte is uploaded, and at commit."""
    (srv,) = servers(1)
    h = {"Authorization": f"Bearer {token(server_env, 'push')}"}
    cut = {size: hash_source(open_source(fam["base"]), size, NullProgress()).to_doc() for size in (32 << 10, 128 << 10)}
    base = f"{srv.url}/v1/families/old-client"
    neg = httpx.post(f"{base}/versions/v1/negotiate", json={"manifest": cut[32 << 10]}, headers=h).json()
    entries = {}  # each chunk once, as a client sends it (a file may hold one chunk many times)
    with open(fam["base"], "rb") as f:
        data = f.read()
    for fdoc in cut[32 << 10]["files"]:
        for cid, off, size, _ in fdoc["chunks"]:
            if cid in neg["missing"]:
                entries[cid] = (Entry(cid, size, "raw", size), data[off : off + size])
    r = httpx.post(f"{base}/chunks", content=build_batch(entries.values()), headers=h)
    assert r.status_code == 200, r.text
    r = httpx.post(
        f"{base}/versions/v1/commit", json={"manifest": cut[32 << 10]}, headers=h
    )  # no chunk_size: an old client
    assert r.status_code == 201 and not r.json()["existed"], r.text
    # the same commit again (a client retrying after a lost answer) creates nothing: 200, existed
    r = httpx.post(f"{base}/versions/v1/commit", json={"manifest": cut[32 << 10]}, headers=h)
    assert r.status_code == 200 and r.json()["existed"], r.text
    assert httpx.get(base, headers=h).json()["chunk_size"] == 32 << 10
    keys = bucket_keys(server_env)
    for step in ("negotiate", "commit"):
        r = httpx.post(f"{base}/versions/v2/{step}", json={"manifest": cut[128 << 10]}, headers=h)
        assert r.status_code == 409 and "chunks of 32,768 bytes" in r.json()["detail"], r.text
    assert bucket_keys(server_env) == keys
    assert httpx.get(f"{base}/versions/v2", headers=h).status_code == 404


def test_a_push_over_http_survives_a_prune_between_its_negotiation_and_its_commit(servers, server_env, fam, tmp_path):
    from mfsreg.registry.client.cache import NodeCache
    from mfsreg.registry.client.remote import RemoteRegistry

    (srv,) = servers(1)
    with RemoteRegistry(srv.url, token=token(server_env, "admin")) as remote:
        remote.push(fam["base"], "fam", "base")
        remote.push(fam["lora-chat"], "fam", "chat")
        remote.delete("fam", "chat")
        # pushed again, every chunk is found stored; then a prune deletes the unused ones
        hook = OnSend(lambda: remote.prune(min_age=0, max_unused=0.1))
        res = remote.push(fam["lora-chat"], "fam", "chat-again", progress=hook)
        (pruned,) = hook.results
        assert pruned.deleted_chunks > 0 and res.new_chunks == pruned.deleted_chunks and res.sent_bytes > 0
        out = tmp_path / "chat-again.out"
        cache = NodeCache(tmp_path / "node-cache")
        try:
            remote.pull("fam", "chat-again", out, cache=cache)
        finally:
            cache.close()
    assert filecmp.cmp(out, fam["lora-chat"], shallow=False)


def test_a_version_document_is_tagged_and_a_node_keeps_it_while_the_family_is_unchanged(
    servers, server_env, fam, tmp_path
):
    from mfsreg.registry.client import Node

    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "admin"))
    for name in ("base", "lora-chat"):
        mfsreg("push", fam[name], "--family", "fam", "--version", name, env=env)
    h = {"Authorization": f"Bearer {env['MFSREG_TOKEN']}"}
    url = f"{srv.url}/v1/families/fam/versions/lora-chat"
    first = httpx.get(url, headers=h)
    tag = first.headers["etag"]
    again = httpx.get(url, headers={**h, "If-None-Match": tag})
    assert again.status_code == 304 and again.content == b"" and again.headers["etag"] == tag
    assert httpx.get(url, headers={**h, "If-None-Match": '"0.0"'}).json() == first.json()

    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        kept = node.fetcher.version("fam", "lora-chat")
        assert node.fetcher.version("fam", "lora-chat") is kept  # a 304: the parsed document is reused
        # the operator lowers the base quorum (on the server's host): lora-chat's own chunks join base
        mfsreg("family", "quorum", "fam", "0.5", env=server_env)
        moved = httpx.get(url, headers={**h, "If-None-Match": tag})
        assert moved.status_code == 200 and moved.headers["etag"] != tag
        assert moved.json()["chunks"] != first.json()["chunks"]
        fresh = node.fetcher.version("fam", "lora-chat")
        assert fresh is not kept and fresh.tiers == {i: row[4] for i, row in moved.json()["chunks"].items()}
        # the same name for other bytes (deleted and pushed again) is never taken for the kept one
        mfsreg("delete", "fam", "lora-chat", env=env)
        mfsreg("push", fam["last-code"], "--family", "fam", "--version", "lora-chat", env=env)
        other = node.fetcher.version("fam", "lora-chat")
        assert other.digest != fresh.digest and other.manifest != fresh.manifest
        out = tmp_path / "lora-chat.out"
        mfsreg("pull", "fam", "lora-chat", "-o", out, env=env)
        assert filecmp.cmp(out, fam["last-code"], shallow=False)
    finally:
        node.close()


def test_a_node_keeps_the_documents_it_read_last(servers, server_env, fam, tmp_path, monkeypatch):
    from mfsreg.registry.client import Node, fetch

    monkeypatch.setattr(fetch, "KEPT_VERSIONS", 2)
    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "admin"))
    names = ("base", "lora-chat", "last-code")
    for name in names:
        mfsreg("push", fam[name], "--family", "fam", "--version", name, env=env)
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        first = {n: node.fetcher.version("fam", n) for n in names}  # base, the oldest, is dropped
        assert node.fetcher.version("fam", "last-code") is first["last-code"]
        assert node.fetcher.version("fam", "lora-chat") is first["lora-chat"]  # now the newest
        again = node.fetcher.version("fam", "base")  # read and parsed anew; last-code is dropped for it
        assert again is not first["base"] and again == first["base"]
        assert node.fetcher.version("fam", "lora-chat") is first["lora-chat"]
        assert node.fetcher.version("fam", "last-code") is not first["last-code"]
    finally:
        node.close()


def test_a_node_behind_a_proxy_that_drops_tags_reads_each_document_whole(servers, server_env, fam, tmp_path):
    """As against a server older than tags: no ETag comes back, so the node keeps nothing and never
    sends If-None-Match, and what it reads still follows the family."""
    from mfsreg.registry.client import Node
    from mfsreg.registry.client.node import pull

    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "admin"))
    for name in ("base", "lora-chat"):
        mfsreg("push", fam[name], "--family", "fam", "--version", name, env=env)
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    asked: list[str | None] = []

    def drop_tag(response: httpx.Response) -> None:
        response.headers.pop("etag", None)

    http = node.fetcher.remote.http
    http.event_hooks = {"request": [lambda r: asked.append(r.headers.get("if-none-match"))], "response": [drop_tag]}
    try:
        one = node.fetcher.version("fam", "lora-chat")
        two = node.fetcher.version("fam", "lora-chat")
        assert one is not two and one == two and asked == [None, None]
        mfsreg("family", "quorum", "fam", "0.5", env=server_env)  # lora-chat's own chunks join base
        three = node.fetcher.version("fam", "lora-chat")
        assert three.tiers != two.tiers and set(three.tiers.values()) == {"base"}
        out = tmp_path / "lora-chat.out"
        pull(node.fetcher, "fam", "lora-chat", out)
        assert filecmp.cmp(out, fam["lora-chat"], shallow=False)
    finally:
        node.close()


def test_prune_over_http(servers, server_env, fam, tmp_path):
    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "admin"))
    for name in ("base", "last-code"):
        mfsreg("push", fam[name], "--family", "fam", "--version", name, env=env)
    mfsreg("delete", "fam", "last-code", env=env)
    packs_before = [k for k in bucket_keys(server_env) if k.endswith(".pack")]

    # prune acts on the whole registry: a push token, or an admin token for some families only, may not
    for tok in (token(server_env, "push"), token(server_env, "admin", "fam*")):
        proc = mfsreg("prune", "--min-age", "0", env={**env, "MFSREG_TOKEN": tok}, check=False)
        assert proc.returncode == 3 and len(proc.stderr.strip().splitlines()) == 1
    assert "--family '*'" in proc.stderr

    dry = mfsreg_json("prune", "--min-age", "0", "--dry-run", env=env)
    res = mfsreg_json("prune", "--min-age", "0", env=env)
    assert dry["dry_run"] and not res["dry_run"] and res["deleted_chunks"] == dry["deleted_chunks"] > 0
    assert res["freed_bytes"] > 0 and mfsreg_json("stats", env=env)["unreferenced_bytes"] == 0
    assert len([k for k in bucket_keys(server_env) if k.endswith(".pack")]) < len(packs_before)
    out = tmp_path / "base.out"
    mfsreg("pull", "fam", "base", "-o", out, env={**env, "MFSREG_CACHE_DIR": str(tmp_path / "fresh-cache")})
    assert filecmp.cmp(out, fam["base"], shallow=False)


def test_a_method_a_path_does_not_take_is_answered_with_the_methods_it_does(servers, server_env):
    """A 405 came without its Allow header (the error handler dropped the exception's headers), and
    said only "Method Not Allowed". It carries Allow now, naming every method of the path (Starlette
    names only its first route's: a version's GET, not its DELETE), and the detail says the same."""
    (srv,) = servers(1)
    admin = {"Authorization": f"Bearer {token(server_env, 'admin')}"}
    for method, path, allow in (
        ("GET", "/v1/prune", "POST"),
        ("PUT", "/v1/families/fam/versions/v1", "DELETE, GET"),
        ("GET", "/v1/families/fam/versions/v1/commit", "POST"),
        ("DELETE", "/v1/families/fam/chunks", "GET, POST"),
    ):
        r = httpx.request(method, srv.url + path, headers=admin)
        assert r.status_code == 405 and r.headers.get("allow") == allow, (path, r.headers, r.text)
        assert r.json()["detail"] == f"method {method!r} is not allowed on this path: use {allow}", r.text
        assert r.headers["content-type"].startswith("application/problem+json")


def test_a_query_parameter_a_route_does_not_take_or_given_twice_is_refused(servers, server_env, fam):
    """`POST /v1/prune?dry-run=true` (a typo) ran a real prune, and so did
    `?dry_run=true&dry_run=false` (the last value won); `?Tier=base` listed every tier. Each is a
    400 naming the parameter, and nothing runs."""
    (srv,) = servers(1)
    env = client_env(Path(server_env["MFSREG_HOME"]).parent, srv.url, token(server_env, "push"))
    mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    mfsreg_json(
        "delete",
        "fam",
        "base",
        env=client_env(Path(server_env["MFSREG_HOME"]).parent, srv.url, token(server_env, "admin")),
    )
    admin = {"Authorization": f"Bearer {token(server_env, 'admin')}"}
    before = mfsreg_json("stats", env=server_env)
    for route, query, says in (
        (
            "POST /v1/prune",
            "min_age=0&dry-run=true",
            "unknown query parameter 'dry-run': this route takes dry_run, max_unused, min_age",
        ),
        ("POST /v1/prune", "min_age=0&dry_run=true&dry_run=false", "query parameter 'dry_run' is given more than once"),
        ("GET /v1/families/fam/chunks", "Tier=base", "unknown query parameter 'Tier'"),
        ("GET /v1/stats", "family=fam&family=other", "query parameter 'family' is given more than once"),
        ("GET /v1/families", "x" * 5000 + "=1", "unknown query parameter '" + "x" * 64 + "...': this route takes none"),
    ):
        method, path = route.split()
        r = httpx.request(method, f"{srv.url}{path}?{query}", headers=admin)
        assert r.status_code == 400 and says in r.json()["detail"] and len(r.text) < 500, (route, r.text[:300])
    assert mfsreg_json("stats", env=server_env) == before  # the deleted version's chunks are all still there
    r = httpx.post(f"{srv.url}/v1/prune", params={"min_age": 0, "dry_run": "true"}, headers=admin)
    assert r.status_code == 200 and r.json()["dry_run"] is True and r.json()["deleted_chunks"] > 0, r.text


def test_a_callers_huge_value_is_quoted_short(servers, server_env, fam):
    """An error quoted the caller's value whole: a 200 KB chunk id, a megabyte encoding name or
    manifest path came back in a detail as long. Each is a short one-line 400 now, and a download
    naming what cannot be a chunk id is a 400 before anything is looked up."""
    (srv,) = servers(1)
    admin = {"Authorization": f"Bearer {token(server_env, 'admin')}"}
    good = hash_source(open_source(fam["base"]), 64 << 10, NullProgress()).to_doc()
    raw = b"\x05" * 4096
    cases = [
        ("GET", "/v1/families/" + "a" * 5000 + "/versions", {}, "invalid family name 'aaaa"),
        ("POST", "/v1/families/fam/chunks/download", {"json": {"ids": ["z" * 200_000]}}, "invalid chunk id 'zzzz"),
        ("POST", "/v1/families/fam/chunks/download", {"json": {"ids": ["A" * 32]}}, "expected 32 lowercase hex digits"),
        (
            "POST",
            "/v1/families/fam/chunks",
            {"content": build_batch([(Entry(chunk_id(raw), 4096, "e" * 1_000_000, 4096), raw)])},
            "unknown chunk encoding 'eeee",
        ),
        (
            "POST",
            "/v1/families/fam/versions/v1/negotiate",
            {"json": {"manifest": {**good, "files": [{**good["files"][0], "path": "../" + "x" * 500_000}]}}},
            "unsafe or repeated path '../xxx",
        ),
    ]
    for method, path, kw, says in cases:
        r = httpx.request(method, srv.url + path, headers=admin, timeout=30, **kw)
        assert r.status_code == 400 and says in r.json()["detail"] and len(r.text) < 1200, (
            path,
            r.status_code,
            r.text[:300],
        )
    r = httpx.post(f"{srv.url}/v1/families/fam/chunks/download", json={"ids": ["0" * 32]}, headers=admin)
    assert r.status_code == 404 and "family 'fam' does not exist" in r.json()["detail"], (
        r.text
    )  # a good id is looked up
    assert bucket_keys(server_env) == []


def test_a_manifest_that_could_never_be_pulled_or_says_other_types_is_refused(servers, server_env):
    """A commit whose files are 'a' and 'a/b' was stored (201) and every pull of it failed; a
    manifest with "single_file": "false" was stored as a single-file version, and "format": 99 as
    format 1. Each is a 400 now, and no version appears."""
    (srv,) = servers(1)
    admin = {"Authorization": f"Bearer {token(server_env, 'admin')}"}
    data = b"side file bytes\n" * 16
    r = httpx.post(
        f"{srv.url}/v1/families/fam/chunks",
        headers=admin,
        content=build_batch([(Entry(chunk_id(data), len(data), "raw", len(data)), data)]),
    )
    assert r.status_code == 200, r.text

    def blob(path):
        return {
            "path": path,
            "kind": "blob",
            "size": len(data),
            "sha256": hashlib.sha256(data).hexdigest(),
            "chunks": [[chunk_id(data), 0, len(data), 1]],
            "tensors": [],
        }

    good = {"format": 1, "single_file": False, "files": [blob("a")]}
    for doc, says in (
        ({**good, "files": [blob("a"), blob("a/b")]}, "'a' is a file, but 'a/b' needs it as a folder"),
        ({**good, "files": [blob("x/a"), blob("x/a/b/c")]}, "'x/a' is a file, but 'x/a/b/c' needs it as a folder"),
        ({**good, "single_file": "false"}, "single_file must be true or false"),
        ({**good, "format": 99}, "format '99': this server reads format 1"),
        ({**good, "format": True}, "format 'True'"),
    ):
        for route in ("negotiate", "commit"):
            r = httpx.post(f"{srv.url}/v1/families/fam/versions/v1/{route}", json={"manifest": doc}, headers=admin)
            assert r.status_code == 400 and says in r.json()["detail"], (route, r.text)
    assert httpx.get(f"{srv.url}/v1/families/fam/versions/v1", headers=admin).status_code == 404
    r = httpx.post(f"{srv.url}/v1/families/fam/versions/v1/commit", json={"manifest": good}, headers=admin)
    assert r.status_code == 201, r.text  # the same chunk, as a manifest that can be pulled


def test_a_manifest_of_the_wrong_shape_is_refused_naming_the_field(servers, server_env, fam):
    """Manifests of the wrong shape were refused in Python's words ("KeyError 'files'", "TypeError
    string indices must be integers", "ValueError not enough values to unpack"), and an unknown
    dtype or itemsize as cuts that are off. Each 400 now names the field, quotes the value and
    says what it must be, at negotiation and at commit, and nothing is stored."""
    (srv,) = servers(1)
    admin = {"Authorization": f"Bearer {token(server_env, 'admin')}"}
    good = hash_source(open_source(fam["base"]), 64 << 10, NullProgress()).to_doc()
    head = good["files"][0]

    def with_file(**changes) -> dict:
        return {**good, "files": [{**head, **changes}]}

    tensors = head["tensors"]
    chunks = head["chunks"]
    cases = [
        ({}, "malformed manifest: no 'format': a manifest says \"format\": 1"),
        ({"format": 1, "single_file": True}, "malformed manifest: no 'files': a manifest lists its files"),
        (
            {**good, "files": "abc"},
            "files must be a list of file objects (path, kind, size, sha256, chunks, tensors), not 'abc'",
        ),
        ({**good, "files": [1]}, "files[0] must be an object with path, kind, size, sha256, chunks, tensors, not 1"),
        (with_file(chunks="abcd"), "files[0].chunks must be a list of [id, offset, size, itemsize] rows, not 'abcd'"),
        (with_file(chunks=["abcd"]), "files[0].chunks[0] must be a list [id, offset, size, itemsize], not 'abcd'"),
        (with_file(size="1"), "files[0].size must be a non-negative integer, not '1'"),
        (
            with_file(tensors=[[tensors[0][0], tensors[0][1], 5, *tensors[0][3:]], *tensors[1:]]),
            "files[0].tensors[0] shape must be a list of non-negative integers, not 5",
        ),
        (
            with_file(tensors=[[tensors[0][0], "F99", *tensors[0][2:]], *tensors[1:]]),
            f"tensor {tensors[0][0]!r} has unknown dtype 'F99': use one of BOOL, U8",
        ),
        (
            with_file(chunks=[chunks[0], [*chunks[1][:3], 3], *chunks[2:]]),
            f"chunk 1 at offset {chunks[1][1]} has itemsize 3: use 1, 2, 4 or 8",
        ),
        (with_file(path=7), "files[0].path must be a string, not 7"),
        (with_file(kind="pickle"), "bad kind or sha256: kind 'pickle' is not 'safetensors' or 'blob'"),
    ]
    for doc, says in cases:
        for route in ("negotiate", "commit"):
            r = httpx.post(f"{srv.url}/v1/families/fam/versions/v1/{route}", json={"manifest": doc}, headers=admin)
            detail = r.json()["detail"]
            assert r.status_code == 400 and says in detail and "\n" not in detail, (route, says, r.text)
            assert "Error" not in detail and len(detail) < 300, detail
    assert bucket_keys(server_env) == []
    r = httpx.post(f"{srv.url}/v1/families/fam/versions/v1/negotiate", json={"manifest": good}, headers=admin)
    assert r.status_code == 200, r.text  # the same manifest, whole


@pytest.mark.process
def test_a_chunked_request_cut_short_by_the_client_is_not_carried_out(servers, server_env):
    """A commit sent with chunked transfer whose client closes before the last chunk was replayed
    to the route as if whole, and the version appeared; it is dropped now, and no traceback is logged."""
    import socket

    (srv,) = servers(1, process=True)  # the test reads the process's log
    tok = token(server_env, "admin")
    data = b"side file bytes\n" * 16
    r = httpx.post(
        f"{srv.url}/v1/families/fam/chunks",
        headers={"Authorization": f"Bearer {tok}"},
        content=build_batch([(Entry(chunk_id(data), len(data), "raw", len(data)), data)]),
    )
    assert r.status_code == 200, r.text
    doc = {
        "format": 1,
        "single_file": False,
        "files": [
            {
                "path": "a",
                "kind": "blob",
                "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
                "chunks": [[chunk_id(data), 0, len(data), 1]],
                "tensors": [],
            }
        ],
    }
    body = json.dumps({"manifest": doc}).encode()
    with socket.create_connection(("127.0.0.1", srv.port)) as s:
        s.sendall(
            b"POST /v1/families/fam/versions/cut/commit HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Authorization: Bearer {tok}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            + f"{len(body):x}\r\n".encode()
            + body
            + b"\r\n"
        )  # and no closing 0-length chunk
        time.sleep(0.5)
    time.sleep(0.5)
    assert (
        httpx.get(f"{srv.url}/v1/families/fam/versions/cut", headers={"Authorization": f"Bearer {tok}"}).status_code
        == 404
    )
    srv.log.flush()
    assert "Traceback" not in Path(srv.log.name).read_text()


@pytest.mark.process
@pytest.mark.parametrize("batch", ["small, read whole first", "large, streamed"])
def test_an_s3_endpoint_that_dies_mid_download_is_one_line_on_both_sides(batch, server_env, fam, tmp_path):
    """S3 breaks off while the server reads a batch. A small batch (service.EAGER_BYTES: every batch
    a node asks for) is read whole before the answer starts: `mfsreg pull` exits 5 with a 503's one
    line and its request id. A large one (sent here in one request by the client's fetch, as an
    older or another client may) is streamed once its packs are found whole, so the break comes with
    the index already sent: the client says the download broke, in one line. The server's log says
    why in one line."""
    from urllib.parse import urlsplit

    import numpy as np
    from safetensors.numpy import save_file

    from mfsreg.registry.store.service import EAGER_BYTES
    from tests.faults import CutProxy
    from tests.server import Server

    if batch.startswith("large"):  # random bytes: stored as they are, one batch over EAGER_BYTES
        path = tmp_path / "big.safetensors"
        save_file({"w": np.random.default_rng(0).integers(0, 255, EAGER_BYTES + (4 << 20), dtype=np.uint8)}, path)
        says = ["broke off a download", "try again"]
    else:
        path = fam["base"]
        says = ["the registry's database or blob store failed", "request id"]
    s3 = urlsplit(server_env["MFSREG_S3_ENDPOINT_URL"])
    proxy = CutProxy((s3.hostname, s3.port))
    srv = Server(dict(server_env, MFSREG_S3_ENDPOINT_URL=proxy.url), tmp_path / "server.log", process=True)
    try:
        env = client_env(tmp_path, srv.url, token(server_env, "admin"))
        mfsreg("push", path, "--family", "fam", "--version", "base", env=env)
        proxy.arm(256 << 10)  # a quarter of a pack's bytes, then the endpoint is gone
        if batch.startswith("large"):
            from mfsreg.registry.client.remote import RemoteRegistry
            from mfsreg.registry.errors import StorageError

            with RemoteRegistry(srv.url, token=env["MFSREG_TOKEN"]) as client:
                located, _ = client.chunk_table(client.version_doc("fam", "base"))
                assert sum(c.stored_size for c in located.values()) > EAGER_BYTES
                with pytest.raises(StorageError) as broke:
                    list(client.fetch("fam", list(located.values())))  # one request: under DOWNLOAD_BATCH
            assert "\n" not in str(broke.value) and all(s in str(broke.value) for s in says), broke.value
        else:
            out = tmp_path / "base.out"
            proc = mfsreg("pull", "fam", "base", "-o", out, env=env, check=False)
            assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
            assert all(s in proc.stderr for s in says), proc.stderr
            assert not out.exists()
    finally:
        srv.stop()
        proxy.close()
    log = (tmp_path / "server.log").read_text()
    assert "Traceback" not in log, log[-3000:]
    lines = [line for line in log.splitlines() if "download" in line or "S3" in line]
    assert len(lines) == 1 and "S3" in lines[0], log[-3000:]


@pytest.mark.process
@pytest.mark.parametrize("what", ["missing bucket", "endpoint down"])
def test_serve_refuses_to_start_on_a_blob_store_it_cannot_use(what, server_env, tmp_path):
    """A bucket that does not exist, or an S3 endpoint nobody listens on: `mfsreg serve` stops at
    once with one line saying what to do (exit 5), instead of starting and answering ok."""
    env = dict(server_env)
    if what == "missing bucket":
        env["MFSREG_BLOB_URL"] = "s3://mfsreg-no-such-bucket/packs"
        says = ["bucket mfsreg-no-such-bucket does not exist", "create it", "MFSREG_BLOB_URL"]
    else:
        env["MFSREG_S3_ENDPOINT_URL"] = f"http://127.0.0.1:{free_port()}"
        says = ["cannot reach S3 endpoint", env["MFSREG_S3_ENDPOINT_URL"]]
    proc = subprocess.run(
        [MFSREG, "serve", "--port", str(free_port())], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
    assert all(s in proc.stderr for s in says) and "Traceback" not in proc.stderr, proc.stderr


def test_readyz_answers_503_while_the_bucket_is_gone(servers, server_env, caplog):
    """Readiness reflects the blob store: a running server whose bucket goes away answers /readyz
    (GET and HEAD) with a 503, and ok again once it is back, while /healthz (the process is up)
    stays 200. The answer names neither the bucket nor the endpoint; the server's log does, beside
    the request id the answer gives. The 503 is counted as the blob store's in /metrics."""
    (srv,) = servers(1)
    bucket = server_env["MFSREG_BLOB_URL"].split("/")[2]
    endpoint = server_env["MFSREG_S3_ENDPOINT_URL"]
    s3 = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1")
    assert httpx.get(f"{srv.url}/readyz").json() == {"status": "ok"}
    before = counter(srv.url, "mfsreg_storage_errors", backend="blob_store")
    s3.delete_bucket(Bucket=bucket)  # nothing pushed: empty
    try:
        r = httpx.get(f"{srv.url}/readyz")
        rid = r.headers["x-request-id"]
        assert r.status_code == 503 and r.json()["request_id"] == rid and rid in r.json()["detail"], r.text
        assert bucket not in r.text and endpoint.split("//")[1] not in r.text, r.text
        logged = [rec.getMessage() for rec in caplog.records if rid in rec.getMessage()]
        assert len(logged) == 1 and f"bucket {bucket} does not exist" in logged[0], logged
        assert httpx.head(f"{srv.url}/readyz").status_code == 503
        assert httpx.get(f"{srv.url}/healthz").status_code == 200  # the process is up
        assert counter(srv.url, "mfsreg_storage_errors", backend="blob_store") == before + 2
    finally:
        s3.create_bucket(Bucket=bucket)
    assert httpx.get(f"{srv.url}/readyz").status_code == 200


def test_a_push_over_http_mends_chunks_whose_pack_was_lost_before_or_during_it(servers, server_env, fam, tmp_path):
    """A pack object deleted from the bucket by hand: a push reusing its chunks was told nothing was
    missing (sent 0), committed, and the version could not be pulled. Negotiation now lists those
    chunks as missing, the upload stores them again, and the lost copies' rows point at the new
    ones; a pack lost after the negotiation is caught by the commit's own check (the client
    negotiates, uploads and commits again). Every version then pulls byte for byte."""
    from mfsreg.registry.blobs.packs import pack_key
    from mfsreg.registry.client.cache import NodeCache
    from mfsreg.registry.client.remote import RemoteRegistry
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    (srv,) = servers(1)
    local = Registry(Settings.from_env(server_env))

    def lose_a_pack_of(version: str) -> str:
        """Delete a pack every chunk of which ``version`` uses, so that its push mends all it lost."""
        from mfsreg.registry.db import reclaim as prune_db
        from mfsreg.registry.db.engine import read_tx

        ids = set(local.manifest("fam", version)[1].chunk_ids())
        with read_tx(local.engine) as conn:
            pack_id = next(
                p
                for p in sorted({c.pack_id for c in local.locate(ids).values()})
                if {r[0] for r in prune_db.chunks_in(conn, p)} <= ids
            )
        local.blobs.delete(pack_key(pack_id))
        return pack_id

    try:
        with RemoteRegistry(srv.url, token=token(server_env, "admin")) as remote:
            remote.push(fam["base"], "fam", "base")
            lose_a_pack_of("base")
            again = remote.push(fam["base"], "fam", "base-again")
            assert again.new_chunks > 0 and again.sent_bytes > 0 and again.mended_chunks == again.new_chunks, again
            remote.push(fam["lora-chat"], "fam", "chat")
            hook = OnSend(lambda: lose_a_pack_of("chat"))  # after negotiation, before the commit
            late = remote.push(fam["lora-chat"], "fam", "chat-again", progress=hook)
            assert hook.results and late.sent_bytes > 0 and late.mended_chunks > 0, late
            cache = NodeCache(tmp_path / "node-cache")
            try:
                for name, src in (
                    ("base", "base"),
                    ("base-again", "base"),
                    ("chat", "lora-chat"),
                    ("chat-again", "lora-chat"),
                ):
                    remote.pull("fam", name, tmp_path / f"{name}.out", cache=cache)
                    assert filecmp.cmp(tmp_path / f"{name}.out", fam[src], shallow=False), name
            finally:
                cache.close()
    finally:
        local.close()


@pytest.mark.parametrize("when", ["before the push", "after its negotiation"])
def test_a_push_over_http_whose_basis_pack_was_lost_stores_its_chunks_without_it(
    when, servers, server_env, fam, tmp_path
):
    """The bases a server picks for a push's new chunks lie in packs deleted from the bucket by
    hand: the upload stopped with a 503 (exit 5, 'restore it from a backup'), though the push needs
    none of those bytes. Lost before the negotiation, no basis there is suggested; lost after it,
    the upload finds the basis unreadable: either way the chunks are stored plain, the push commits,
    and the version pulls byte for byte."""
    from mfsreg.registry.blobs.packs import pack_key
    from mfsreg.registry.client.cache import NodeCache
    from mfsreg.registry.client.remote import RemoteRegistry
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    (srv,) = servers(1)
    local = Registry(Settings.from_env(server_env))

    def lose_the_base() -> set[str]:
        ids = set(local.manifest("fam", "base")[1].chunk_ids())
        packs = {c.pack_id for i, c in local.locate(ids).items() if i in ids}
        for p in packs:
            local.blobs.delete(pack_key(p))
        return packs

    try:
        with RemoteRegistry(srv.url, token=token(server_env, "admin")) as remote:
            remote.push(fam["base"], "fam", "base")
            hook = OnSend(lose_the_base) if when == "after its negotiation" else None
            lost = lose_the_base() if hook is None else None
            res = remote.push(fam["full-med"], "fam", "full-med", parent="base", progress=hook)
            lost = lost if hook is None else hook.results[0]
            assert res.new_chunks > 0 and lost
            located = local.locate(local.manifest("fam", "full-med")[1].chunk_ids())
            assert not {c.pack_id for c in located.values()} & lost
            cache = NodeCache(tmp_path / "node-cache")
            try:
                remote.pull("fam", "full-med", tmp_path / "out", cache=cache)
            finally:
                cache.close()
            assert filecmp.cmp(tmp_path / "out", fam["full-med"], shallow=False)
    finally:
        local.close()


def test_a_repush_over_http_of_an_existing_version_mends_what_its_lost_pack_held(servers, server_env, fam, tmp_path):
    """Pushing the file of a version that cannot be pulled (a pack deleted from the bucket by hand)
    again under its own name: negotiation said it exists and the client stopped, 'already stored',
    mending nothing. Now negotiation lists the chunks that lay in the lost pack (and those leaning on
    them as deltas) under ``mend``, the client uploads them and commits nothing, and the version pulls
    byte for byte; through a token scoped to the family, as the mend of a new version's push allows.
    With nothing lost the re-push sends nothing; other content under the name is refused as before."""
    from mfsreg.registry.blobs.packs import pack_key
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "push", "fam"))
    mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    mfsreg_json("push", fam["full-med"], "--family", "fam", "--version", "med", "--parent", "base", env=env)
    same = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    assert same["existed"] and same["sent_bytes"] == 0 and same["mended_chunks"] == 0, same
    with Registry(Settings.from_env(server_env)) as local:
        ids = set(local.manifest("fam", "base")[1].chunk_ids())
        packs = {c.pack_id for i, c in local.locate(ids).items() if i in ids}
        for p in packs:
            local.blobs.delete(pack_key(p))
    for name in ("base", "med"):
        broken = mfsreg("pull", "fam", name, "-o", tmp_path / f"{name}.broken", env=env, check=False)
        assert broken.returncode == 5 and "storage lost data" in broken.stderr, broken.stderr
    other = mfsreg("push", fam["lora-chat"], "--family", "fam", "--version", "base", env=env, check=False)
    assert other.returncode == 2 and "already exists with other content" in other.stderr, other.stderr

    said = mfsreg("push", fam["full-med"], "--family", "fam", "--version", "med", "--parent", "base", env=env)
    assert said.stdout.startswith("already stored fam/med") and "; mended " in said.stdout, said.stdout
    assert "chunks that the blob store had lost (" in said.stdout and " sent)" in said.stdout, said.stdout
    mended = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    assert mended["existed"] and mended["mended_chunks"] > 0 and mended["sent_bytes"] > 0, mended
    assert mended["new_chunks"] == mended["mended_chunks"], mended
    for name, src in (("base", "base"), ("med", "full-med")):
        mfsreg("pull", "fam", name, "-o", tmp_path / f"{name}.out", env=env)
        assert filecmp.cmp(tmp_path / f"{name}.out", fam[src], shallow=False), name
    again = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    assert again["existed"] and again["sent_bytes"] == 0 and again["mended_chunks"] == 0, again
    with Registry(Settings.from_env(server_env)) as local:
        located = local.locate(set(local.manifest("fam", "med")[1].chunk_ids()) | ids)
        assert not {c.pack_id for c in located.values()} & packs
