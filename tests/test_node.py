"""The inference node: node cache, fetch of missing chunks only, tensors from the cache, in-place switch.
All against a real `mfsreg serve` on Postgres and moto's S3 server."""

from __future__ import annotations

import errno
import filecmp
import gc
import http.server
import json
import mmap
import os
import select
import shutil
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import boto3
import httpx
import pytest
import torch
from safetensors.torch import load_file

from mfsreg.registry.client import ResidentModel, load_tensors
from mfsreg.registry.client.cache import NodeCache
from mfsreg.registry.client.direct import taken as takes_direct
from mfsreg.registry.client.node import refetcher
from mfsreg.registry.client.remote import RemoteRegistry
from mfsreg.registry.client.torch_loader import (
    Copier,
    FetchAhead,
    Node,
    build,
    chunk_ids,
    collection_held,
    fill,
    layout,
)
from mfsreg.registry.config import parse_size
from mfsreg.registry.format.chunking import chunk_id
from mfsreg.registry.format.manifest import Manifest
from tests import synth
from tests.cli_run import MFSREG, mfsreg, mfsreg_json
from tests.pagecache import resident_fraction
from tests.server import client_env, module_server, token


def publish(fam: dict, env: dict) -> None:
    for name, path in fam.items():
        mfsreg_json(
            "push",
            path,
            "--family",
            "fam",
            "--version",
            name,
            *(["--parent", "base"] if name != "base" else []),
            env=env,
        )


@pytest.fixture(scope="module")
def family_server(s3_server, fam, tmp_path_factory):
    """One server per module holding the synthetic family, for the tests that only read from it
    (each with a node cache of its own): (server, push token)."""
    where = tmp_path_factory.mktemp("family-server")
    with module_server(s3_server, where) as (srv, env):
        tok = token(env, "push")
        publish(fam, client_env(where, srv.url, tok))
        yield srv, tok


@pytest.fixture
def published(family_server, tmp_path):
    """The shared server holding the synthetic family, and a node environment with an empty cache.
    A test that changes what the server holds takes ``published_alone``."""
    srv, tok = family_server
    return srv, client_env(tmp_path, srv.url, tok)


@pytest.fixture
def published_alone(servers, server_env, fam, tmp_path):
    """A server of the test's own (on ``server_env``) holding the synthetic family, and a node
    environment with an empty cache: for a test that pushes, deletes or damages what it holds."""
    (srv,) = servers(1)
    env = client_env(tmp_path, srv.url, token(server_env, "push"))
    publish(fam, env)
    return srv, env


@pytest.fixture(params=["direct", "page cache"])
def writes(request, published, tmp_path) -> str:
    """Pulls write big files through the page cache (the default) or around it (O_DIRECT, with
    MFSREG_PULL_DIRECT=1, where the filesystem takes it): tests that use this run both ways."""
    _, env = published
    env["MFSREG_PULL_DIRECT"] = "1" if request.param == "direct" else "0"
    # the tests' temp directory must take O_DIRECT, or the direct case would quietly test the page
    # cache (test_direct.py asks the same of it)
    assert request.param != "direct" or takes_direct(tmp_path), "the tests' temp directory should take O_DIRECT"
    return request.param


def assert_written(path: Path, writes: str) -> None:
    """Call before anything reads ``path``: a file written around the page cache has no page there.
    (A filesystem that takes O_DIRECT but buffers anyway, as ZFS before 2.3 does, would fail this:
    the tests' temp directory is expected on a plain disk filesystem.)"""
    if writes == "direct":
        assert resident_fraction(path) < 0.01, path
    else:
        assert resident_fraction(path) > 0.99, path


def needed(env: dict, version: str) -> dict:
    """chunk id -> [encoding, stored bytes, basis, raw bytes, tier], for what the version needs."""
    return Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"]).remote.version_doc("fam", version)[
        "chunks"
    ]


def client_fds(cache: Path, port: int | None = None) -> list[str]:
    """The open files of this process in ``cache``, and its TCP connections to ``port`` on loopback."""
    to_port = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6") if port else ():
        with open(table) as fh:
            for row in list(fh)[1:]:
                cols = row.split()
                if int(cols[2].rsplit(":", 1)[1], 16) == port:  # the remote end is the server
                    to_port.add(f"socket:[{cols[9]}]")
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed since the listing
            continue
        if link.startswith(str(cache)) or link in to_port:
            held.append(link)
    return held


def cached_ids(env: dict) -> list[str]:
    return [
        p.name
        for p in (Path(env["MFSREG_CACHE_DIR"]) / "chunks").rglob("*")
        if p.is_file() and not p.name.startswith(".")
    ]


def test_clients_share_one_verifying_tls_context_per_ca_setting(tmp_path, monkeypatch):
    """Making a client reads no CA bundle after the first (34 ms of the 48 a Node took, http URLs
    too): every client shares one verifying context per SSL_CERT_FILE / SSL_CERT_DIR, and a client
    made after either changes gets a context made with the new one."""
    import ssl

    import certifi

    from mfsreg.registry.client.remote import tls_context

    def context_of(client: RemoteRegistry) -> ssl.SSLContext:
        return client.http._transport._pool._ssl_context  # (httpx's transport, httpcore's pool)

    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    monkeypatch.delenv("SSL_CERT_DIR", raising=False)
    with RemoteRegistry("http://127.0.0.1:9") as a, RemoteRegistry("https://127.0.0.1:9") as b:
        assert context_of(a) is context_of(b) is tls_context()
    ctx = tls_context()
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    bundle = tmp_path / "ca.pem"
    shutil.copyfile(certifi.where(), bundle)
    monkeypatch.setenv("SSL_CERT_FILE", str(bundle))
    with RemoteRegistry("https://127.0.0.1:9") as c:
        assert context_of(c) is not ctx and context_of(c) is tls_context()


def test_pull_with_base_cached_fetches_only_what_is_not_shared(published, writes, fam, tmp_path):
    _, env = published
    warm = mfsreg_json("cache", "warm", "fam", "--tier", "base", env=env)
    assert warm["fetched_bytes"] > 0 and warm["pinned"]
    base_ids = set(cached_ids(env))
    for member in ("lora-chat", "vocab-ext", "full-med"):
        have = set(cached_ids(env))
        chunks = needed(env, member)
        expected = sum(row[1] for i, row in chunks.items() if i not in have)
        res = mfsreg_json("pull", "fam", member, "-o", tmp_path / f"{member}.out", env=env)
        assert res["fetched_bytes"] == expected, member
        # full-med shares no chunk outright: its deltas decode against the cached base chunks
        assert (res["cached_bytes"] > 0) == (member != "full-med")
        assert res["fetched_bytes"] < 0.5 * fam[member].stat().st_size
        assert res["logical_bytes"] == fam[member].stat().st_size
        assert_written(tmp_path / f"{member}.out", writes)
        assert filecmp.cmp(tmp_path / f"{member}.out", fam[member], shallow=False)
    # with the base tier cached, a LoRA member moves far less than its size
    lora = needed(env, "lora-chat")
    assert sum(r[1] for i, r in lora.items() if i not in base_ids) < 0.25 * fam["lora-chat"].stat().st_size
    again = mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "again.out", env=env)
    assert again["fetched_bytes"] == 0


def test_load_tensors_equals_safetensors_for_every_member(published, fam):
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        for member, path in fam.items():
            got = load_tensors("fam", member, node=node)
            want = load_file(str(path))
            assert got.keys() == want.keys()
            for name, t in want.items():
                assert got[name].dtype == t.dtype and got[name].shape == t.shape
                assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), (member, name)
    finally:
        node.close()
    assert not list(Path(env["MFSREG_CACHE_DIR"]).rglob("*.safetensors"))  # no file was written


def test_load_tensors_gives_every_tensor_in_the_files_order_those_without_bytes_too(reg, tmp_path):
    """Tensors are made as the load first copies into them (after the fetch has started); the
    answer still holds every tensor in the file's order, an empty one and a scalar included, each
    equal to the file's."""
    from safetensors.torch import save_file

    want = {
        "z.weight": torch.arange(300_000, dtype=torch.float32).reshape(600, 500),
        "a.empty": torch.zeros((0, 7), dtype=torch.bfloat16),
        "m.scalar": torch.tensor(3.5, dtype=torch.float64),
        "b.bias": torch.ones(4096, dtype=torch.float16),
    }
    path = tmp_path / "m.safetensors"
    save_file(want, str(path))
    reg.push(path, "fam", "v1")
    order = _offset_order(path)
    node = Node(registry=reg, cache_dir=str(tmp_path / "c"))
    try:
        got = load_tensors("fam", "v1", node=node)
    finally:
        node.close()
    assert list(got) == order and set(order) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and got[name].shape == t.shape and torch.equal(got[name], t), name


def _offset_order(path: Path) -> list[str]:
    """The tensor names of a safetensors file in the order their bytes lie in it."""
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = {k: v for k, v in json.loads(raw[8 : 8 + n]).items() if k != "__metadata__"}
    return sorted(header, key=lambda k: header[k]["data_offsets"][0])


def test_a_load_from_a_kept_document_waits_for_the_registry(published_alone, server_env, fam, tmp_path, monkeypatch):
    """A node that holds a version's document lays the tensors out from it while it asks whether it
    is current (torch_loader.build), every chunk still cached each time: tiers that moved keep the
    tensors, a version deleted and pushed again with other bytes loads as those bytes, and a version
    deleted is the registry's one-line error, not tensors of what it was."""
    from mfsreg.registry.errors import NotFound

    srv, env = published_alone
    admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
    monkeypatch.setenv("MFSREG_VERSION_MAX_AGE", "0")  # every load asks (the window is tested below)
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        _equal_to_file(load_tensors("fam", "lora-chat", node=node), fam["lora-chat"])
        kept = node.fetcher.kept("fam", "lora-chat")
        mfsreg("family", "quorum", "fam", "0.5", env=server_env)  # a new document for the same bytes
        resident = ResidentModel("fam", "lora-chat", node=node)
        _equal_to_file(resident.tensors, fam["lora-chat"])
        assert node.fetcher.kept("fam", "lora-chat") is not kept and resident.info.tiers != kept.tiers
        # the cache's index learned the new tiers, not the kept ones (a pin keeps the base tier)
        ids = chunk_ids(layout(resident.info))
        with sqlite3.connect(Path(env["MFSREG_CACHE_DIR"]) / "index.db") as db:
            rows = {k for (k,) in db.execute("SELECT key FROM family_base WHERE family = 'fam'")}
        now, before = ({i for i in ids if tiers[i] == "base"} for tiers in (resident.info.tiers, kept.tiers))
        assert rows & set(ids) == now != before
        del resident
        mfsreg("delete", "fam", "lora-chat", env=admin)
        mfsreg("push", fam["last-code"], "--family", "fam", "--version", "lora-chat", env=env)
        _equal_to_file(load_tensors("fam", "lora-chat", node=node), fam["last-code"])
        mfsreg("delete", "fam", "lora-chat", env=admin)
        index = Path(env["MFSREG_CACHE_DIR"]) / "index.db"
        with sqlite3.connect(index) as db:
            used = dict(db.execute("SELECT key, last_used FROM entries"))
        with pytest.raises(NotFound, match="version fam/lora-chat does not exist"):
            load_tensors("fam", "lora-chat", node=node)
        with sqlite3.connect(index) as db:  # the load from the kept document told the index nothing
            assert dict(db.execute("SELECT key, last_used FROM entries")) == used
        # the same where the load from the kept document fails first: the node cache lost its chunks
        # and the registry's storage its packs, so that load's refetch fails (a 503); the registry's
        # answer to the version is the error raised
        for p in (Path(env["MFSREG_CACHE_DIR"]) / "chunks").rglob("*"):
            if p.is_file():
                p.unlink()
        bucket = server_env["MFSREG_BLOB_URL"].split("/")[2]
        s3 = boto3.client("s3", endpoint_url=server_env["MFSREG_S3_ENDPOINT_URL"], region_name="us-east-1")
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for o in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=o["Key"])
        with pytest.raises(NotFound, match="version fam/lora-chat does not exist"):
            load_tensors("fam", "lora-chat", node=node)
    finally:
        node.close()


def test_a_load_from_a_kept_document_fetches_nothing_on_its_word(
    published_alone, server_env, fam, tmp_path, monkeypatch
):
    """A chunk found damaged while tensors are laid out from a kept document is dropped, and fetched
    again only if the registry's answer still needs it: here lora-chat was deleted and pushed again
    as last-code's bytes, so a damaged chunk of the old lora-chat is not fetched (a copy of the old
    lora-chat keeps it in the family, so the stale document's word would have brought it)."""
    srv, env = published_alone
    admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
    monkeypatch.setenv("MFSREG_VERSION_MAX_AGE", "0")
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        lora, base, code = (set(needed(env, v)) for v in ("lora-chat", "base", "last-code"))
        mfsreg("push", fam["lora-chat"], "--family", "fam", "--version", "lora-copy", "--parent", "base", env=env)
        load_tensors("fam", "lora-chat", node=node)  # fetched, and its document kept
        victim = sorted(lora - base - code)[0]
        _damage(env, victim, victim)  # a flipped byte, and cut short
        mfsreg("delete", "fam", "lora-chat", env=admin)
        mfsreg("push", fam["last-code"], "--family", "fam", "--version", "lora-chat", env=env)
        _equal_to_file(load_tensors("fam", "lora-chat", node=node), fam["last-code"])
        assert not _cache_file(env, victim).exists()  # dropped, not fetched again on the stale word
        _equal_to_file(load_tensors("fam", "lora-copy", node=node), fam["lora-chat"])  # needed: it comes back
        assert chunk_id(_cache_file(env, victim).read_bytes()) == victim
    finally:
        node.close()


def _mapped_from(cache_dir: str) -> bool:
    with open("/proc/self/maps") as f:
        return str(Path(cache_dir) / "chunks") in f.read()


@pytest.mark.skipif(sys.platform != "linux", reason="reads /proc/self/maps")
def test_a_document_confirmed_within_its_max_age_is_used_without_asking(published_alone, server_env, fam, tmp_path):
    """Loads and switches trust a version document the registry confirmed less than
    MFSREG_VERSION_MAX_AGE seconds ago (no round trip: a switch's fixed cost); past it they ask
    again, and a version deleted meanwhile is the registry's one-line error."""
    from mfsreg.registry.errors import NotFound

    srv, env = published_alone
    admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    model = ResidentModel("fam", "base", node=node)
    try:
        assert node.fetcher.max_age == 30.0  # the default
        node.fetcher.max_age = 3600.0  # a slow test machine must not see the window pass
        model.switch("lora-chat")
        model.switch("base")
        mfsreg("delete", "fam", "lora-chat", env=admin)
        assert model.switch("lora-chat") > 0  # within the window: from the cache, nothing asked
        _equal_to_file(load_tensors("fam", "lora-chat", node=node), fam["lora-chat"])
        model.switch("base")
        node.fetcher.expire()  # as when the window has passed
        with pytest.raises(NotFound, match="fam/lora-chat"):
            model.switch("lora-chat")
        with pytest.raises(NotFound, match="fam/lora-chat"):
            load_tensors("fam", "lora-chat", node=node)
        _equal_to_file(model.tensors, fam["base"])
    finally:
        model.close()
        node.close()


def test_a_max_age_that_is_not_seconds_is_one_line(published, monkeypatch):
    from mfsreg.registry.errors import InvalidRequest

    _, env = published
    for bad in ("soon", "-1", "2d"):
        monkeypatch.setenv("MFSREG_VERSION_MAX_AGE", bad)
        with pytest.raises(InvalidRequest, match="MFSREG_VERSION_MAX_AGE=.* is not a number of seconds"):
            Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    monkeypatch.setenv("MFSREG_VERSION_MAX_AGE", "0")
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    node.close()
    assert node.fetcher.max_age == 0


def test_a_load_maps_from_the_kept_document_while_the_registry_answers(published, fam):
    """The round trip that asks whether a kept document is current overlaps the mapping: here the
    registry's answer is held back until this process has chunk files of the cache mapped."""
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        load_tensors("fam", "lora-chat", node=node)  # fetched and kept; its tensors are freed at once
        gc.collect()
        assert not _mapped_from(env["MFSREG_CACHE_DIR"])
        real = node.fetcher.version

        def answer_once_mapped(family, version):
            deadline = time.monotonic() + 30
            while not _mapped_from(env["MFSREG_CACHE_DIR"]):
                assert time.monotonic() < deadline, "the load waited for the registry's answer before mapping"
                time.sleep(0.01)
            return real(family, version)

        node.fetcher.version = answer_once_mapped
        _equal_to_file(load_tensors("fam", "lora-chat", node=node), fam["lora-chat"])
    finally:
        node.close()


def test_loads_and_switches_hold_off_garbage_collection_then_set_it_back(published, fam):
    """A full collection inside a load walks every object of the process while the load waits: a
    load, a switch and a load that fails run with automatic collection off (seen from inside, as
    each asks the registry for its document), and leave it as they found it, off included."""
    from mfsreg.registry.errors import NotFound

    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    real, seen = node.fetcher.version, []

    def version(family, version, fresh=False):
        seen.append(gc.isenabled())
        return real(family, version, fresh)

    node.fetcher.version = version
    assert gc.isenabled()
    try:
        _equal_to_file(load_tensors("fam", "lora-chat", node=node), fam["lora-chat"])
        assert seen == [False] and gc.isenabled()
        model = ResidentModel("fam", "base", node=node)
        try:
            node.fetcher.expire()  # the switch asks too
            model.switch("lora-chat")
            _equal_to_file(model.tensors, fam["lora-chat"])
        finally:
            model.close()
        assert seen == [False] * 3 and gc.isenabled()
        with pytest.raises(NotFound, match="no-such-version"):
            load_tensors("fam", "no-such-version", node=node)
        assert len(seen) == 4 and not any(seen) and gc.isenabled()
        gc.disable()  # the process's own choice stands
        try:
            _equal_to_file(load_tensors("fam", "base", node=node), fam["base"])
            assert not gc.isenabled()
        finally:
            gc.enable()
    finally:
        node.close()


def test_a_load_copies_its_cached_tensors_once_its_first_request_is_out(published, fam):
    """The tensors already cached are mapped and checked only once the fetch of the others has sent
    its first request: started at once, they took the interpreter from the fetch thread. Here the
    fetch thread is held back a moment before it asks, and the copies wait for it."""
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        load_tensors("fam", "base", node=node)  # lora-chat's shared tensors are cached
        events: list[str] = []
        real_ensure = node.fetcher.ensure

        def slow_ensure(*args, **kwargs):
            time.sleep(0.3)
            told = kwargs["sending"]

            def sending():
                events.append("request")  # before the load is told: no race with its copies
                told()

            return real_ensure(*args, **(kwargs | {"sending": sending}))

        copier = Copier(node.cache, torch.device("cpu"), node.remote.pool)
        real_copy = copier.copy_many

        def copy_many(work):
            events.append("copy")
            return real_copy(work)

        node.fetcher.ensure, copier.copy_many = slow_ensure, copy_many
        _, tensors = build(node, "fam", "lora-chat", copier)
        _equal_to_file(tensors, fam["lora-chat"])
        assert events[0] == "request" and "copy" in events, events
    finally:
        node.close()


def test_collection_comes_back_when_the_last_of_overlapping_holds_ends():
    """Loads on several threads share one hold: the first to begin may end first, and collection
    stays off for the other until it ends too."""
    second_in, first_out, second_seen = threading.Event(), threading.Event(), []

    def second():
        with collection_held():
            second_in.set()
            assert first_out.wait(30)
            second_seen.append(gc.isenabled())  # the first hold has ended: still off for this one

    t = threading.Thread(target=second)
    with collection_held():
        t.start()
        assert second_in.wait(30)
    first_out.set()
    t.join()
    assert second_seen == [False] and gc.isenabled()


def test_a_fetch_ahead_closed_early_stops_its_thread(published):
    """A copy that fails mid-load closes the fetch-ahead: its thread stops instead of waiting for
    ever to hand over the next batch."""
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        info = node.fetcher.version("fam", "base")
        ids = chunk_ids(layout(info))
        before = set(threading.enumerate())
        landed = FetchAhead(node.fetcher, info, [ids[k::6] for k in range(6)])
        assert next(iter(landed)) == 0
        workers = [t for t in threading.enumerate() if t.name == "mfsreg-fetch-ahead" and t not in before]
        landed.close()
        # joined by the close itself: no batch lands in the cache after the caller's lease is gone
        assert workers and not any(t.is_alive() for t in workers)
    finally:
        node.close()


def test_a_fetch_ahead_fetches_before_it_is_read(published):
    """The fetch starts when the fetch-ahead is made, not at its first ``next``: a load copies the
    tensors already cached meanwhile, and until now the first request waited for those copies."""
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        info = node.fetcher.version("fam", "base")
        ids = [i for i in chunk_ids(layout(info)) if not node.cache.has(i)]
        assert ids
        with FetchAhead(node.fetcher, info, [ids]) as landed:
            deadline = time.monotonic() + 30
            while not all(node.cache.has(i) for i in ids) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert all(node.cache.has(i) for i in ids)  # landed, and not one ``next`` yet
            assert list(landed) == [0]
    finally:
        node.close()


def _equal_to_file(got: dict, path: Path) -> None:
    want = load_file(str(path))
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name


_COPY_EVICTED = """
import sys
import torch
from safetensors.torch import load_file
from mfsreg.registry.client.fetch import Fetcher
from mfsreg.registry.client.node import refetcher
from mfsreg.registry.client.remote import RemoteRegistry
from mfsreg.registry.client.torch_loader import PIECES_PER_TASK, Copier, Node, layout

url, token, cache_dir, path = sys.argv[1:5]
node = Node(url, token, cache_dir)
node.remote.close()
node.remote = RemoteRegistry(url, token=token, workers=2)  # the copies and the fetch's decoding share it
node.fetcher = Fetcher(node.remote, node.cache)
info = node.fetcher.version("small", "small-chunks")
lay = layout(info)
longest = max(len(pieces) for _, pieces in lay.values())
assert -(-longest // PIECES_PER_TASK) >= 2, longest  # a tensor's runs can hold both pool threads at once
copier = Copier(node.cache, torch.device("cpu"), node.remote.pool)
copier.refetch = refetcher(node.fetcher, info)
got = {name: copier.empty(span) for name, (span, _) in lay.items()}
# no fetch ahead: every copy finds its chunk file gone; the first tensor one at a time, the rest at once
(first, (_, pieces)), *rest = lay.items()
copier.copy(got[first], pieces)
copier.copy_many([(got[name], pieces) for name, (_, pieces) in rest])
want = load_file(path)
assert got.keys() == want.keys()
for name, t in want.items():
    assert torch.equal(got[name].view(torch.uint8), t.view(torch.uint8)), name
node.close()
print("whole")
"""


@pytest.mark.process
def test_copies_fetch_again_what_another_process_evicted(published_alone, fam):
    """Chunk files that vanish between the fetch and the copy (another process evicted them) are
    fetched again and the tensors still come out whole. Re-fetching from inside the copy threads
    once waited on the very pool those threads occupy and hung, so this runs in a process with a
    deadline."""
    _, env = published_alone
    # 4 KiB chunks: every tensor spans several, so its chunks are copied on the pool's threads (in a
    # family of its own: a push to "fam" would cut at that family's size)
    mfsreg_json(
        "push",
        fam["full-med"],
        "--family",
        "small",
        "--version",
        "small-chunks",
        env={**env, "MFSREG_CHUNK_SIZE": str(4 << 10)},
    )
    assert not cached_ids(env)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                _COPY_EVICTED,
                env["MFSREG_URL"],
                env["MFSREG_TOKEN"],
                env["MFSREG_CACHE_DIR"],
                str(fam["full-med"]),
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except subprocess.TimeoutExpired:
        pytest.fail("the copies hung fetching evicted chunks again")
    assert proc.returncode == 0 and proc.stdout.strip() == "whole", proc.stderr
    assert cached_ids(env)  # fetched back into the cache


def test_load_tensors_replaces_a_damaged_cached_chunk(published, fam):
    """A cache file with a flipped byte, and one cut short, are dropped and fetched again, and the
    tensors still equal the pushed file's."""
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        load_tensors("fam", "lora-chat", node=node)
        # chunks that are mapped into their tensors (page-aligned): the flipped one is mapped and fails
        # its check; the one cut short is refused by the mapping (its size is wrong) and read instead
        pieces = [(span, p) for span, ps in layout(node.fetcher.version("fam", "lora-chat")).values() for p in ps]
        mapped = [
            p.chunk.id
            for span, p in pieces
            if p.start % mmap.PAGESIZE == 0
            and p.chunk.size >= 2 * mmap.PAGESIZE
            and (p.chunk.size % mmap.PAGESIZE == 0 or p.start + p.chunk.size == span.nbytes)
        ]
        flipped, cut = list(dict.fromkeys(mapped))[:2]
        _damage(env, flipped, cut)
        _equal_to_file(load_tensors("fam", "lora-chat", node=node), fam["lora-chat"])
        for victim in (flipped, cut):
            assert chunk_id(_cache_file(env, victim).read_bytes()) == victim
    finally:
        node.close()


def test_an_unverified_load_trusts_the_cache_and_a_scrub_finds_what_rotted(published, fam):
    """verify=False checks chunks as they are fetched, not again as they are loaded: a cache file
    cut short is still fetched again (its size is wrong), while one that rotted in place is handed
    out as it is, until `cache verify` drops it; the default load catches it (test above)."""
    from mfsreg.registry.client.scrub import verify_cache

    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        _equal_to_file(load_tensors("fam", "lora-chat", node=node, verify=False), fam["lora-chat"])  # fetched, checked
        pieces = [(span, p) for span, ps in layout(node.fetcher.version("fam", "lora-chat")).values() for p in ps]
        mapped = [
            (span.name, p)
            for span, p in pieces
            if p.start % mmap.PAGESIZE == 0
            and p.chunk.size >= 2 * mmap.PAGESIZE
            and (p.chunk.size % mmap.PAGESIZE == 0 or p.start + p.chunk.size == span.nbytes)
        ]
        (name, first), (_, second) = mapped[0], next(m for m in mapped if m[1].chunk.id != mapped[0][1].chunk.id)
        flipped, cut = first.chunk.id, second.chunk.id
        _damage(env, flipped, cut)
        got = load_tensors("fam", "lora-chat", node=node, verify=False)
        assert chunk_id(_cache_file(env, cut).read_bytes()) == cut  # cut short: fetched again
        want = load_file(str(fam["lora-chat"]))[name].reshape(-1).view(torch.uint8)
        rotten = got[name].reshape(-1).view(torch.uint8)[first.start : first.start + first.chunk.size]
        assert not torch.equal(rotten, want[first.start : first.start + first.chunk.size])  # trusted as it lies
        assert verify_cache(node.cache)["damaged_chunks"] == [flipped]
        # a file longer than its chunk is refused by the read path too (the mapping checks its size)
        long_file = _cache_file(env, cut)
        long_file.chmod(0o644)
        long_file.write_bytes(long_file.read_bytes() + b"extra")
        assert not node.cache.read_into(cut, memoryview(bytearray(second.chunk.size)))
        _equal_to_file(load_tensors("fam", "lora-chat", node=node, verify=False), fam["lora-chat"])
        model = ResidentModel("fam", "base", node=node, verify=False)
        model.switch("lora-chat")
        _equal_to_file(model.tensors, fam["lora-chat"])
    finally:
        node.close()


def test_an_unverified_load_from_a_kept_document_fetches_a_chunk_another_process_evicted(published, fam):
    """An unchecked load from a kept document looks for no chunk file before it maps (build): one
    another process evicted since is found missing by the mapping, fetched again on the registry's
    answer, and the tensors come out whole."""
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        _equal_to_file(load_tensors("fam", "lora-chat", node=node, verify=False), fam["lora-chat"])  # its document kept
        ids = chunk_ids(layout(node.fetcher.kept("fam", "lora-chat")))
        gone = ids[len(ids) // 2]
        _cache_file(env, gone).unlink()
        _equal_to_file(load_tensors("fam", "lora-chat", node=node, verify=False), fam["lora-chat"])
        assert chunk_id(_cache_file(env, gone).read_bytes()) == gone
    finally:
        node.close()


def test_a_resident_model_that_cannot_load_closes_what_it_opened(published):
    """A failed first load leaves no object to close: the client, its connections and the cache's
    index go at once, not whenever the garbage collector runs."""
    srv, env = published

    def open_fds() -> int:
        """This process's files in the node cache and connections to the server (a server running
        in this process has sockets of its own, which come and go with other tests' connections)."""
        return len(client_fds(Path(env["MFSREG_CACHE_DIR"]), srv.port))

    node_env = {
        "MFSREG_URL": env["MFSREG_URL"],
        "MFSREG_TOKEN": env["MFSREG_TOKEN"],
        "MFSREG_CACHE_DIR": env["MFSREG_CACHE_DIR"],
    }
    saved = {k: os.environ.get(k) for k in node_env}
    os.environ.update(node_env)
    gc.collect()
    gc.disable()  # what a failed load leaves must go without it
    try:
        before = open_fds()
        for _ in range(5):
            with pytest.raises(Exception, match="does not exist"):
                ResidentModel("fam", "nope")
        assert open_fds() == before
    finally:
        gc.enable()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_resident_model_switch_copies_only_differing_chunks(published, fam):
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    model = ResidentModel("fam", "base", node=node)
    try:
        ptrs = {n: t.data_ptr() for n, t in model.tensors.items()}
        for target in ("lora-chat", "vocab-ext", "lora-chat", "base"):
            old = model.info
            copied = model.switch(target)
            old_pieces = {
                (c.offset - t.start, c.size, c.id, t.name)
                for f in old.manifest.files
                for t in f.tensors
                for c in f.chunks
                if t.start <= c.offset < t.end
            }
            new_pieces = {
                (c.offset - t.start, c.size, c.id, t.name)
                for f in model.info.manifest.files
                for t in f.tensors
                for c in f.chunks
                if t.start <= c.offset < t.end
            }
            old_shapes = {t.name: t.shape for f in old.manifest.files for t in f.tensors}
            new_shapes = {t.name: t.shape for f in model.info.manifest.files for t in f.tensors}
            reshaped = {n for n in new_shapes if old_shapes.get(n) != new_shapes[n]}
            expected = sum(
                size
                for off, size, cid, name in new_pieces
                if name in reshaped or (off, size, cid, name) not in old_pieces
            )
            assert copied == expected, target
            assert copied < fam[target].stat().st_size / 2
            want = load_file(str(fam[target]))
            assert model.tensors.keys() == want.keys()
            for name, t in want.items():
                assert torch.equal(model.tensors[name].view(torch.uint8), t.view(torch.uint8)), (target, name)
            # tensors whose shape did not change were updated in place
            for name in want:
                if name not in reshaped and name in ptrs and old_shapes.get(name) == new_shapes[name]:
                    assert model.tensors[name].data_ptr() == ptrs[name]
            ptrs = {n: t.data_ptr() for n, t in model.tensors.items()}
    finally:
        model.close()
        node.close()


def test_a_switch_to_a_member_with_renamed_tensors_copies_only_what_differs(published_alone, fam, tmp_path):
    """A member saved under other names (PEFT's "base_model.model." prefix) with two tensors changed:
    matched by name alone the switch reallocated and refilled every tensor. Each renamed tensor now
    takes over the one whose chunks it shares, in place, and only the changed chunks are copied."""
    _, env = published_alone
    base = load_file(str(fam["base"]))
    changed = synth.lora(base, targets=("q_proj",))
    renamed = {f"base_model.model.{k}": v for k, v in changed.items()}
    renamed["base_model.model.lm_head.weight"] = base["lm_head.weight"][:-8].clone()  # shape changed: reallocated
    path = synth.write(tmp_path / "renamed.safetensors", renamed)
    mfsreg_json("push", path, "--family", "fam", "--version", "renamed", "--parent", "base", env=env)
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    model = ResidentModel("fam", "base", node=node)
    try:
        ptrs = {n: t.data_ptr() for n, t in model.tensors.items()}
        old = {name: {(p.start, p.chunk.id) for p in pieces} for name, (_, pieces) in layout(model.info).items()}
        copied = model.switch("renamed")
        want = load_file(str(path))
        assert model.tensors.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(model.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
        new = layout(model.info)
        reshaped = "base_model.model.lm_head.weight"
        expected = sum(
            p.chunk.size
            for name, (_, pieces) in new.items()
            for p in pieces
            if name == reshaped or (p.start, p.chunk.id) not in old[name.removeprefix("base_model.model.")]
        )
        assert copied == expected and 0 < copied < path.stat().st_size / 4, (copied, expected)
        for name in want:  # taken over in place, not reallocated
            if name != reshaped:
                assert model.tensors[name].data_ptr() == ptrs[name.removeprefix("base_model.model.")], name
        assert model.switch("base") == expected - new[reshaped][0].nbytes + base["lm_head.weight"].nbytes
        for name, t in base.items():
            assert torch.equal(model.tensors[name].view(torch.uint8), t.view(torch.uint8)), name
    finally:
        model.close()
        node.close()


def _lose_pack_of(server_env: dict, chunk: str) -> str:
    """Delete, on the server's blob store, the pack that holds ``chunk`` (storage that lost data)."""
    from mfsreg.registry.blobs.packs import pack_key
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    reg = Registry(Settings.from_env(server_env))
    try:
        pack_id = reg.locate([chunk])[chunk].pack_id
        reg.blobs.delete(pack_key(pack_id))
    finally:
        reg.close()
    return pack_id


def test_a_switch_whose_fetch_fails_leaves_the_model_as_it_was(published_alone, server_env, fam, tmp_path):
    """A switch brings what it copies into the node cache before it touches a tensor: a chunk the
    registry can no longer send leaves the model whole at its version (before, the grown embedding
    was reallocated, empty, and .version still said base), in one line that says it was the switch."""
    from mfsreg.registry.errors import StorageError

    srv, env = published_alone
    node = Node(srv.url, env["MFSREG_TOKEN"], str(tmp_path / "cold"))
    model = ResidentModel("fam", "base", node=node)
    try:
        have = set(chunk_ids(layout(model.info)))
        victim = sorted(i for i in chunk_ids(layout(node.fetcher.version("fam", "vocab-ext"))) if i not in have)[-1]
        _lose_pack_of(server_env, victim)
        with pytest.raises(
            StorageError,
            match=r"^switch of fam to vocab-ext failed: .*storage lost data.*; "
            r"nothing changed: the model still holds base$",
        ) as got:
            model.switch("vocab-ext")
        assert "\n" not in str(got.value)
        assert model.version == "base" and model.info.version == "base"
        _equal_to_file(model.tensors, fam["base"])
    finally:
        node.close()


def test_a_switch_that_fails_while_copying_says_the_model_is_a_mix(published_alone, server_env, fam):
    """A cached chunk found damaged while a switch copies, and the registry unable to send it again:
    the tensors are part old, part new, so .version is None (it said the old version) and the error
    says to switch again; a switch after it refills every tensor."""
    from mfsreg.registry.errors import StorageError

    _, env = published_alone
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    model = ResidentModel("fam", "base", node=node)
    try:
        load_tensors("fam", "lora-chat", node=node)  # every chunk of lora-chat cached
        have = set(chunk_ids(layout(model.info)))
        victim = sorted(i for i in chunk_ids(layout(node.fetcher.version("fam", "lora-chat"))) if i not in have)[-1]
        path = _cache_file(env, victim)
        path.chmod(0o644)
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x40
        path.write_bytes(data)
        _lose_pack_of(server_env, victim)
        with pytest.raises(
            StorageError,
            match=r"^switch of fam to lora-chat stopped partway: .*storage lost data.*; "
            r"the tensors are a mix of base and lora-chat, and \.version is None: "
            r"switch again",
        ) as got:
            model.switch("lora-chat")
        assert "\n" not in str(got.value)
        assert model.version is None and model.info is None
        model.switch("base")  # every chunk of base is cached, whole
        assert model.version == "base"
        _equal_to_file(model.tensors, fam["base"])
    finally:
        node.close()


def test_a_closed_resident_model_or_node_says_so(published, fam, monkeypatch):
    """A switch after close(), or a load through a closed Node, raised httpx's RuntimeError ("the
    client has been closed") from deep inside; now one line that says what to do."""
    from mfsreg.registry.errors import InvalidRequest

    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    mine = ResidentModel("fam", "base", node=node)
    for k in ("MFSREG_URL", "MFSREG_TOKEN", "MFSREG_CACHE_DIR"):
        monkeypatch.setenv(k, env[k])
    own = ResidentModel("fam", "base")  # its own node
    own.close()
    own.close()  # twice is no error
    with pytest.raises(InvalidRequest, match="^this ResidentModel is closed: make a new one"):
        own.switch("lora-chat")
    _equal_to_file(own.tensors, fam["base"])  # the tensors stay
    node.close()
    with pytest.raises(InvalidRequest, match="^the Node this ResidentModel loads through is closed: make a new one"):
        mine.switch("lora-chat")
    assert mine.version == "base"
    for load in (lambda: load_tensors("fam", "base", node=node), lambda: ResidentModel("fam", "base", node=node)):
        with pytest.raises(InvalidRequest, match="^this Node is closed: make a new one"):
            load()
    with pytest.raises(InvalidRequest, match="^this RemoteRegistry is closed: make a new one$"):
        node.remote.version_doc("fam", "base")


def test_an_edit_in_place_stays_where_a_switch_copies_nothing(published, fam):
    """What the README says of edits to .tensors: a switch copies only the chunks that differ
    between the two versions, so an edit to a tensor the target shares stays, and one to a tensor
    whose chunks differ is overwritten there."""
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        model = ResidentModel("fam", "base", node=node)
        old, new = layout(model.info), layout(node.fetcher.version("fam", "lora-chat"))
        shared = sorted(
            n for n in new if n in old and [p.chunk.id for p in old[n][1]] == [p.chunk.id for p in new[n][1]]
        )
        changed = sorted(
            n for n in new if n in old and not {p.chunk.id for p in old[n][1]} & {p.chunk.id for p in new[n][1]}
        )
        assert shared and changed
        for name in (shared[0], changed[0]):
            model.tensors[name].view(torch.uint8).fill_(7)
        model.switch("lora-chat")
        want = load_file(str(fam["lora-chat"]))
        assert bool((model.tensors[shared[0]].view(torch.uint8) == 7).all())  # the edit stayed
        assert torch.equal(model.tensors[changed[0]].view(torch.uint8), want[changed[0]].view(torch.uint8))
    finally:
        node.close()


def test_many_openers_of_a_new_cache_all_get_in(tmp_path):
    """Turning a new cache index to WAL needs the database to itself, and SQLite answered "database is
    locked" at once to whoever lost the race (two pulls starting together on a fresh node failed so).
    Openers that collide now wait their turn. Threads collide the same way processes do, only cheaper:
    before the fix about one round in twenty failed, so 200 rounds."""
    import threading

    failures = []
    for k in range(200):
        gate = threading.Barrier(8)

        def open_cache(root=tmp_path / f"c{k}", gate=gate):
            gate.wait()
            try:
                NodeCache(root).close()
            except Exception as exc:  # any failure to open is the bug
                failures.append(exc)

        threads = [threading.Thread(target=open_cache) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert failures == []


@pytest.mark.process
def test_two_processes_pull_into_one_cache(published, fam, tmp_path):
    _, env = published
    procs = [
        subprocess.Popen(
            [MFSREG, "pull", "fam", m, "-o", str(tmp_path / f"{m}.out"), "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for m in ("lora-chat", "last-code")
    ]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        json.loads(out)
    for m in ("lora-chat", "last-code"):
        assert filecmp.cmp(tmp_path / f"{m}.out", fam[m], shallow=False)
    wanted = {**needed(env, "lora-chat"), **needed(env, "last-code")}
    assert set(cached_ids(env)) == set(wanted)
    # each chunk once: the bytes on disk are exactly the distinct chunks' raw bytes, and the index
    # that sizes the cache counts each of them once
    on_disk = sum(p.stat().st_size for p in (Path(env["MFSREG_CACHE_DIR"]) / "chunks").rglob("*") if p.is_file())
    assert on_disk == sum(row[3] for row in wanted.values())
    stats = mfsreg_json("cache", "stats", env=env)
    assert stats["chunks"] == len(wanted) and stats["bytes"] == on_disk
    assert not [p for p in Path(env["MFSREG_CACHE_DIR"]).rglob(".*.tmp")]


def test_cache_limit_holds_and_base_is_evicted_last(published, fam, tmp_path):
    _, env = published
    base = needed(env, "base")
    base_tier = {i for i, r in base.items() if r[4] == "base"}
    base_bytes = sum(r[3] for i, r in base.items() if i in base_tier)
    # a pull keeps every chunk of its own version, so the limit must hold the largest member; what
    # it cannot hold as well is the other members' chunks
    members = ("full-med", "last-code", "lora-chat")
    limit = max(base_bytes, *(fam[m].stat().st_size for m in members)) + 200_000
    small = dict(env, MFSREG_CACHE_MAX=str(limit))
    mfsreg_json("cache", "warm", "fam", "--tier", "base", "--no-pin", env=small)
    for m in members:
        mfsreg_json("pull", "fam", m, "-o", tmp_path / f"{m}.out", env=small)
        assert filecmp.cmp(tmp_path / f"{m}.out", fam[m], shallow=False)
        stats = mfsreg_json("cache", "stats", env=small)
        assert stats["bytes"] <= limit
    # the cache was full of other members' chunks, yet the base tier is what stayed
    assert base_tier <= set(cached_ids(env))
    # an explicit prune goes below the base tier only once nothing else is left
    pruned = mfsreg_json("cache", "prune", "--max-size", str(base_bytes // 2), env=small)
    assert pruned["bytes"] <= base_bytes // 2
    assert len(set(cached_ids(env)) & base_tier) < len(base_tier)


_LEASE_AND_DIE = """
import os, sys
from mfsreg.registry.client.cache import NodeCache
cache = NodeCache(sys.argv[1])
with cache.leased(sys.argv[2:]):
    print("leased", flush=True)
    os._exit(0)  # killed mid-pull: its lease is never released
"""


@pytest.mark.process
def test_another_process_eviction_passes_over_what_a_running_pull_leases(tmp_path):
    """A chunk another process is using (leased: a pull, load or switch running) stays through this
    process's eviction, the cache above its limit meanwhile; once released it goes like any other.
    A lease left by a process that died holds nothing."""
    user, evictor = NodeCache(tmp_path / "c"), NodeCache(tmp_path / "c", max_bytes=0)
    try:
        data = [bytes([k + 1]) * 4096 for k in range(3)]
        ids = [chunk_id(d) for d in data]
        user.put_many([(i, d, "unique", "fam") for i, d in zip(ids, data)])
        with user.leased(ids[:2]):
            assert evictor.evict() == (1, 4096)
            assert [user.has(i) for i in ids] == [True, True, False]
            assert evictor.stats()["bytes"] == 2 * 4096  # counted, over the limit, while leased
            env = dict(os.environ, MFSREG_CACHE_DIR=str(tmp_path / "c"))
            res = mfsreg_json("cache", "prune", "--max-size", "1", env=env)  # says what it had to keep
            assert res["removed"] == 0 and res["bytes"] == res["in_use_bytes"] == 2 * 4096, res
            said = mfsreg("cache", "prune", "--max-size", "1", env=env).stdout
            assert "8.00 KiB in use by running pulls, loads or switches stays until they end" in said, said
        assert evictor.leased_keys() == set()
        assert evictor.evict() == (2, 2 * 4096) and not any(user.has(i) for i in ids)

        user.put_many([(i, d, "unique", "fam") for i, d in zip(ids, data)])
        proc = subprocess.run(
            [sys.executable, "-c", _LEASE_AND_DIE, str(tmp_path / "c"), *ids],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0 and proc.stdout.strip() == "leased", proc.stderr
        assert evictor.leased_keys() == set(ids)  # its rows stayed ...
        assert evictor.evict() == (3, 3 * 4096)  # ... and held nothing: its lock went with it
        assert evictor.leased_keys() == set()
        assert not any((tmp_path / "c" / "holders").iterdir())  # nor does its lock file stay
    finally:
        user.close()
        evictor.close()


_LEASE_AND_WAIT = """
import sys
from mfsreg.registry.client.cache import NodeCache
cache = NodeCache(sys.argv[1])
with cache.leased(sys.argv[2:]):
    print("leased", flush=True)
    sys.stdin.read()  # a pull that runs until it is killed
"""


def _first_line(proc: subprocess.Popen, timeout: float = 60) -> str:
    """The child's first line of output, or a failure once ``timeout`` passes (never a hung run)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output from the child within {timeout} s"
    return proc.stdout.readline().strip()


@pytest.mark.process
def test_a_lease_holds_while_its_holder_runs_whatever_pid_it_recorded(tmp_path):
    """Processes sharing a cache from containers each see pids of their own: the pid a holder in
    another container records names no process here (or another one), though it runs. Its lease
    holds all the same, and holds nothing once it is killed. The row's pid is set to one that just
    ended, as such a holder's reads from here."""
    evictor = NodeCache(tmp_path / "c", max_bytes=0)
    proc = None
    try:
        data = [bytes([k + 1]) * 4096 for k in range(3)]
        ids = [chunk_id(d) for d in data]
        evictor.put_many([(i, d, "unique", "fam") for i, d in zip(ids, data)])
        proc = subprocess.Popen(
            [sys.executable, "-c", _LEASE_AND_WAIT, str(tmp_path / "c"), *ids[:2]],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert _first_line(proc) == "leased"
        ended = subprocess.Popen([sys.executable, "-c", ""])
        ended.wait()
        with sqlite3.connect(tmp_path / "c" / "index.db") as db:
            db.execute("UPDATE holders SET pid = ?", (ended.pid,))
        assert evictor.evict() == (1, 4096)  # the leased two stay
        assert [evictor.has(i) for i in ids] == [True, True, False]
        assert evictor.leased_keys() == set(ids[:2])
        proc.kill()
        proc.wait(timeout=60)
        assert evictor.evict() == (2, 2 * 4096)
        assert evictor.leased_keys() == set() and not any((tmp_path / "c" / "holders").iterdir())
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        evictor.close()


def test_a_pull_keeps_its_chunks_through_another_process_eviction(published, fam, tmp_path):
    """While a pull writes its file from cached chunks, another process evicts the cache down to
    nothing: the pull's chunks stay (it leases them), so it fetches nothing again and the file is
    whole; only the chunks it does not use go. Before leases the eviction took them from under it,
    and each was fetched again (twice lost, the pull failed: 'keeps leaving the node cache')."""
    from mfsreg.registry.client import node as node_pull
    from mfsreg.registry.client.fetch import Fetcher
    from mfsreg.registry.progress import NullProgress

    _, env = published
    cache_dir = tmp_path / "cache"
    for member in ("base", "lora-chat"):  # cached: lora-chat's chunks, and base's it does not share
        mfsreg(
            "pull", "fam", member, "-o", tmp_path / f"{member}.first", env=dict(env, MFSREG_CACHE_DIR=str(cache_dir))
        )
    cache, other = NodeCache(cache_dir), NodeCache(cache_dir, max_bytes=0)
    remote = RemoteRegistry(env["MFSREG_URL"], token=env["MFSREG_TOKEN"])
    try:
        fetcher = Fetcher(remote, cache)
        ids = set(fetcher.version("fam", "lora-chat").manifest.chunk_ids())
        unused = set(cached_ids(dict(env, MFSREG_CACHE_DIR=str(cache_dir)))) - ids
        assert ids <= set(cached_ids(dict(env, MFSREG_CACHE_DIR=str(cache_dir)))) and unused
        evicted = []

        class EvictAtWrite(NullProgress):  # another process's eviction, as the assembly starts
            def start(self, task: str, total: int) -> None:
                if task == "write":
                    evicted.append(other.evict())

        out = tmp_path / "out.safetensors"
        res = node_pull.pull(fetcher, "fam", "lora-chat", out, EvictAtWrite())
        assert filecmp.cmp(out, fam["lora-chat"], shallow=False)
        assert evicted and evicted[0][0] == len(unused), evicted  # all it could take, and only those
        assert res.fetched_bytes == 0 and res.cached_bytes > 0, res  # nothing fetched again
        assert set(cached_ids(dict(env, MFSREG_CACHE_DIR=str(cache_dir)))) == ids
        assert cache.leased_keys() == set()  # released once the pull is done
    finally:
        remote.close()
        cache.close()
        other.close()


def test_a_load_and_a_switch_keep_what_they_fetched_through_another_process_eviction(published, fam, tmp_path):
    """A load that fetches, and a switch, lease the chunks they copy from the moment they fetch them:
    another process's eviction down to nothing, run just after each fetch, takes none of them (and
    the tensors still equal the files)."""
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], str(tmp_path / "cache"))
    other = NodeCache(tmp_path / "cache", max_bytes=0)
    kept: list[bool] = []
    real_ensure = node.fetcher.ensure

    def ensure_then_evict(family, ids, *args, **kwargs):
        stats = real_ensure(family, ids, *args, **kwargs)
        other.evict()
        kept.append(all(node.cache.has(i) for i in ids))
        return stats

    node.fetcher.ensure = ensure_then_evict
    try:
        _equal_to_file(load_tensors("fam", "base", node=node), fam["base"])
        assert kept and all(kept), kept
        model = ResidentModel("fam", "base", node=node)
        kept.clear()
        assert model.switch("lora-chat") > 0
        assert kept and all(kept), kept
        _equal_to_file(model.tensors, fam["lora-chat"])
        assert node.cache.leased_keys() == set()
    finally:
        other.close()
        node.close()


@pytest.mark.process
def test_an_eviction_removes_the_lock_files_no_running_holder_keeps(tmp_path):
    """A holder killed after it made its lock file and before it wrote its rows leaves a file no row
    names: the next eviction removes it, and leaves the file a running holder has locked."""
    cache = NodeCache(tmp_path / "c", max_bytes=0)
    proc = None
    try:
        data = b"x" * 4096
        cache.put_many([(chunk_id(data), data, "unique", "fam")])
        holders = tmp_path / "c" / "holders"
        holders.mkdir(exist_ok=True)
        (holders / ("ab" * 16)).write_bytes(b"")  # left by a holder killed before its rows
        (holders / "notes.txt").write_bytes(b"")  # not a lock file's name: not ours to remove
        proc = subprocess.Popen(
            [sys.executable, "-c", _LEASE_AND_WAIT, str(tmp_path / "c"), "nothing-cached"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert _first_line(proc) == "leased"
        running = {p.name for p in holders.iterdir()} - {"ab" * 16, "notes.txt"}
        assert len(running) == 1
        assert cache.evict() == (1, 4096)
        assert {p.name for p in holders.iterdir()} == running | {"notes.txt"}
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()
        cache.close()


@pytest.mark.process
def test_lease_rows_without_a_lock_file(tmp_path):
    """Rows of the release before lock files hold while their pid runs on this host, and lapse once
    it is gone; a row naming something other than a lock file lapses, and no file it names is touched."""
    cache = NodeCache(tmp_path / "c", max_bytes=0)
    try:
        data = [bytes([k + 1]) * 4096 for k in range(3)]
        ids = [chunk_id(d) for d in data]
        cache.put_many([(i, d, "unique", "fam") for i, d in zip(ids, data)])
        ended = subprocess.Popen([sys.executable, "-c", ""])
        ended.wait()
        victim = tmp_path / "victim"
        victim.write_bytes(b"keep")
        host = socket.gethostname()
        with sqlite3.connect(tmp_path / "c" / "index.db") as db:
            rows = [
                (f"{host}:{os.getpid()}:{'1' * 32}", os.getpid(), ids[0]),  # an old release's, running
                (f"{host}:{ended.pid}:{'2' * 32}", ended.pid, ids[1]),  # an old release's, ended
                ("flock:../../victim", os.getpid(), ids[2]),
            ]  # no lock file's name
            db.executemany(
                "INSERT INTO holders (holder, host, pid, since) VALUES (?, ?, ?, ?)",
                [(h, host, pid, time.time()) for h, pid, _ in rows],
            )
            db.executemany("INSERT INTO leases (holder, key) VALUES (?, ?)", [(h, k) for h, _, k in rows])
        assert cache.evict() == (2, 2 * 4096)
        assert [cache.has(i) for i in ids] == [True, False, False]
        assert cache.leased_keys() == {ids[0]} and victim.read_bytes() == b"keep"
    finally:
        cache.close()


def test_a_warm_keeps_what_it_fetched_through_another_process_eviction(published, fam, tmp_path, monkeypatch):
    """A warm leases the tier it brings, and each recent member's chunks, while it runs: another
    process's eviction down to nothing, just after each fetch, takes none of them (unpinned, so no
    pin keeps them)."""
    from mfsreg.registry.client.fetch import Fetcher
    from mfsreg.registry.client.warm import warm_cache

    _, env = published
    cache_dir = tmp_path / "cache"
    mfsreg("pull", "fam", "lora-chat", "-o", tmp_path / "first", env=dict(env, MFSREG_CACHE_DIR=str(cache_dir)))
    cache, other = NodeCache(cache_dir), NodeCache(cache_dir, max_bytes=0)
    kept: list[bool] = []
    real_ensure = Fetcher.ensure

    def ensure_then_evict(self, family, ids, *args, **kwargs):
        stats = real_ensure(self, family, ids, *args, **kwargs)
        other.evict()
        kept.append(all(cache.has(i) for i in ids))
        return stats

    monkeypatch.setattr(Fetcher, "ensure", ensure_then_evict)
    try:
        res = warm_cache(
            RemoteRegistry(env["MFSREG_URL"], token=env["MFSREG_TOKEN"]),
            "fam",
            "base",
            recent=1,
            pin=False,
            cache=cache,
        )
        assert len(kept) == 2 and all(kept), kept  # the base tier, then lora-chat's chunks: both kept
        assert res["chunks"] == len(cached_ids(dict(env, MFSREG_CACHE_DIR=str(cache_dir))))
        assert cache.leased_keys() == set()
    finally:
        cache.close()
        other.close()


def test_pinned_base_survives_prune(published, fam, tmp_path):
    _, env = published
    mfsreg_json("cache", "warm", "fam", "--tier", "base", env=env)  # pins the family's base tier
    mfsreg_json("pull", "fam", "full-med", "-o", tmp_path / "f.out", env=env)
    mfsreg_json("cache", "prune", "--max-size", "1", env=env)
    base_tier = {i for i, r in needed(env, "base").items() if r[4] == "base"}
    assert set(cached_ids(env)) == base_tier
    # unpinned, the base tier goes like the rest; a family that is not pinned is one line, exit 2
    assert mfsreg_json("cache", "unpin", "fam", env=env)["pinned_families"] == []
    proc = mfsreg("cache", "unpin", "fam", env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "is not pinned" in proc.stderr, proc.stderr
    mfsreg_json("cache", "prune", "--max-size", "1", env=env)
    assert cached_ids(env) == []


def test_a_pin_keeps_base_chunks_another_family_cached_first(published_alone, fam, tmp_path):
    """Two families share their base's bytes: chunks cached through one are still the other's base,
    and a pin of the other keeps them."""
    _, env = published_alone
    mfsreg_json("push", fam["base"], "--family", "other", "--version", "base", env=env)
    mfsreg_json("pull", "fam", "base", "-o", tmp_path / "base.out", env=env)  # cached through fam, not pinned
    warm = mfsreg_json("cache", "warm", "other", "--tier", "base", env=env)
    assert warm["pinned"] and warm["fetched_bytes"] == 0
    mfsreg_json("cache", "prune", "--max-size", "1", env=env)
    other_base = {
        i
        for i, r in Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
        .remote.version_doc("other", "base")["chunks"]
        .items()
        if r[4] == "base"
    }
    assert other_base and set(cached_ids(env)) == other_base


def test_a_pull_closes_every_connection_to_the_cache_index_when_it_ends(published, fam, tmp_path, monkeypatch):
    """The cache's index kept a connection per pool thread, and close() closed only its own thread's:
    the others held index.db and its log open until the garbage collector found them, and the last
    to close wrote the log back into index.db whenever that was. A long-lived client kept them."""
    _, env = published
    cache = Path(env["MFSREG_CACHE_DIR"])
    monkeypatch.setenv("MFSREG_CACHE_DIR", str(cache))

    gc.collect()
    gc.disable()  # closed by the pull, not found later by the collector
    try:
        with RemoteRegistry(env["MFSREG_URL"], token=env["MFSREG_TOKEN"], workers=4) as remote:
            for member in ("base", "lora-chat"):
                remote.pull("fam", member, tmp_path / f"{member}.out")
                assert client_fds(cache) == [], member
    finally:
        gc.enable()
    assert filecmp.cmp(tmp_path / "lora-chat.out", fam["lora-chat"], shallow=False)


def test_a_node_pull_into_its_cache_is_refused(published, fam, tmp_path):
    """A pull over the cache's index (or into its chunk files) broke the cache for every later pull."""
    _, env = published
    mfsreg_json("pull", "fam", "base", "-o", tmp_path / "base.safetensors", env=env)
    cache = Path(env["MFSREG_CACHE_DIR"])
    index = (cache / "index.db").read_bytes()
    for args in (["-o", cache / "index.db"], ["--to-dir", cache / "chunks"]):
        proc = mfsreg("pull", "fam", "lora-chat", *args, env=env, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"that lies in the node cache ({cache.resolve()})" in proc.stderr, proc.stderr
    assert (cache / "index.db").read_bytes() == index
    res = mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "chat.safetensors", env=env)
    assert filecmp.cmp(res["path"], fam["lora-chat"], shallow=False)


def test_a_single_file_pulled_into_a_directory_reports_the_file(published, fam, tmp_path):
    _, env = published
    (tmp_path / "engine").mkdir()
    res = mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "engine", env=env)
    assert res["path"] == str(tmp_path / "engine" / fam["lora-chat"].name)
    assert filecmp.cmp(res["path"], fam["lora-chat"], shallow=False)


def test_warm_of_the_unique_tier_into_an_empty_cache_fetches_the_bases_of_its_deltas(published, fam, tmp_path):
    """Unique chunks stored as deltas decode against base chunks: the tier document lists those
    bases beside the tier's own chunks (one join over the tier alone left them out, and the warm
    failed, 'its basis ... is missing from the registry')."""
    srv, env = published
    headers = {"Authorization": f"Bearer {env['MFSREG_TOKEN']}"}
    doc = httpx.get(f"{srv.url}/v1/families/fam/chunks", params={"tier": "unique"}, headers=headers).json()["chunks"]
    own = {i for i, row in doc.items() if row[4] == "unique"}
    bases = {row[2] for i, row in doc.items() if i in own and row[2]}
    assert own and bases and bases <= set(doc) and not bases & own  # deltas of unique chunks, their bases listed
    warm = mfsreg_json("cache", "warm", "fam", "--tier", "unique", "--no-pin", env=env)
    assert warm["fetched_bytes"] > 0
    assert own <= set(cached_ids(env))


def test_warm_keeps_the_size_limit_and_refuses_bad_counts_and_tiers(published, fam, tmp_path):
    _, env = published
    base = needed(env, "base")
    limit = sum(r[3] for r in base.values() if r[4] == "base") + 100_000
    small = dict(env, MFSREG_CACHE_MAX=str(limit))
    mfsreg_json("pull", "fam", "full-med", "-o", tmp_path / "f.out", env=small)
    mfsreg_json("cache", "warm", "fam", "--tier", "base", "--recent", "0", env=small)
    assert mfsreg_json("cache", "stats", env=small)["bytes"] <= limit
    before = mfsreg_json("cache", "stats", env=small)
    # past SQLite's integers it was an internal error (OverflowError); an empty tier warmed nothing, exit 0
    for args, says in (
        (["--recent", "-1"], "--recent -1 is out of range"),
        (["--recent", "99999999999999999999999"], "--recent 99999999999999999999999 is out of range"),
        (["--tier", ""], "unknown tier ''"),
    ):
        proc = mfsreg("cache", "warm", "fam", *args, env=small, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, proc.stderr
    assert mfsreg_json("cache", "stats", env=small) == before


def test_warm_of_recent_members_passes_over_one_deleted_since(published_alone, server_env, fam, tmp_path):
    """A member pulled, then deleted on the registry: a warm of recent members warms the others and
    forgets it (it stopped every such warm with 'does not exist' before)."""
    srv, env = published_alone
    for member in ("lora-chat", "vocab-ext"):
        mfsreg_json("pull", "fam", member, "-o", tmp_path / member, env=env)
    admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
    mfsreg_json("delete", "fam", "vocab-ext", env=admin)
    res = mfsreg_json("cache", "warm", "fam", "--recent", "2", env=env)
    assert res["family"] == "fam" and res["chunks"] >= len(needed(env, "lora-chat"))
    cache = NodeCache(env["MFSREG_CACHE_DIR"])
    try:
        assert cache.recent_pulls("fam", 5) == ["lora-chat"]
    finally:
        cache.close()


def test_a_node_pull_whose_version_is_deleted_meanwhile_says_so(published_alone, server_env, tmp_path):
    """Deleted as the node starts fetching: the server then answers that the chunks are not the
    family's; the pull says what happened instead (exit 2), and writes nothing."""
    from mfsreg.registry.errors import NotFound
    from mfsreg.registry.progress import NullProgress

    srv, env = published_alone
    admin = RemoteRegistry(srv.url, token=token(server_env, "admin"))

    class DeleteAtFetch(NullProgress):
        def start(self, task: str, total: int) -> None:
            if task == "fetch":
                admin.delete("fam", "lora-chat")

    cache = NodeCache(tmp_path / "cold")
    try:
        with RemoteRegistry(srv.url, token=env["MFSREG_TOKEN"]) as r:
            with pytest.raises(NotFound, match="fam/lora-chat was deleted while it was being pulled"):
                r.pull("fam", "lora-chat", tmp_path / "out.safetensors", progress=DeleteAtFetch(), cache=cache)
    finally:
        cache.close()
        admin.close()
    assert not (tmp_path / "out.safetensors").exists() and not list(tmp_path.glob(".out.safetensors.*"))


def test_a_load_or_switch_whose_version_is_deleted_meanwhile_says_so(published_alone, server_env, fam, tmp_path):
    """Deleted as the node starts fetching its chunks: load_tensors and switch say that the version
    went, not that chunks the caller never named are 'not part of family'; a switch fetches before
    it touches a tensor, so a resident model so interrupted still holds its version, whole."""
    from mfsreg.registry.errors import NotFound

    srv, env = published_alone
    admin = RemoteRegistry(srv.url, token=token(server_env, "admin"))
    node = Node(srv.url, env["MFSREG_TOKEN"], str(tmp_path / "cold"))
    ensure = node.fetcher.ensure
    doomed: list[str] = []

    def delete_first(family, ids, *args, **kwargs):  # the race, made certain: a delete lands as the fetch starts
        while doomed:
            admin.delete(family, doomed.pop())
        return ensure(family, ids, *args, **kwargs)

    node.fetcher.ensure = delete_first
    try:
        doomed.append("lora-chat")
        with pytest.raises(
            NotFound, match="fam/lora-chat was deleted while it was being loaded: no tensors were handed out"
        ):
            load_tensors("fam", "lora-chat", node=node)
        model = ResidentModel("fam", "base", node=node)
        doomed.append("full-med")
        with pytest.raises(
            NotFound,
            match="fam/full-med was deleted while it was being switched to: nothing changed: "
            "the model still holds base",
        ):
            model.switch("full-med")
        assert model.version == "base"
        _equal_to_file(model.tensors, fam["base"])
        model.switch("vocab-ext")
        expected = load_file(str(fam["vocab-ext"]))
        assert model.tensors.keys() == expected.keys()
        assert all(torch.equal(model.tensors[k], expected[k]) for k in expected)
    finally:
        node.close()
        admin.close()


def test_to_dir_hardlinks_from_the_cache(published, writes, fam, tmp_path):
    _, env = published
    a = mfsreg_json("pull", "fam", "lora-chat", "--to-dir", tmp_path / "engine-a", env=env)
    fa, fb = tmp_path / "engine-a" / fam["lora-chat"].name, tmp_path / "engine-b" / fam["lora-chat"].name
    assert_written(fa, writes)
    b = mfsreg_json("pull", "fam", "lora-chat", "--to-dir", tmp_path / "engine-b", env=env)
    assert filecmp.cmp(fa, fam["lora-chat"], shallow=False)
    assert os.stat(fa).st_ino == os.stat(fb).st_ino  # one copy on disk, two engine directories
    assert b["fetched_bytes"] == 0 and a["digest"] == b["digest"]
    tensors = load_file(str(fb))
    assert tensors.keys() == load_file(str(fam["lora-chat"])).keys()
    # The shared file changed in place without its mode changing (root writes through 0444): the
    # next pull rebuilds it instead of linking the changed bytes into another engine directory.
    assert not os.stat(fa).st_mode & 0o222
    os.chmod(fa, 0o644)  # (root needs no such step; another user does)
    with open(fa, "r+b") as f:
        f.seek(os.path.getsize(fa) // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x20]))
    os.chmod(fa, 0o444)
    mfsreg_json("pull", "fam", "lora-chat", "--to-dir", tmp_path / "engine-c", env=env)
    fc = tmp_path / "engine-c" / fam["lora-chat"].name
    assert filecmp.cmp(fc, fam["lora-chat"], shallow=False) and not os.stat(fc).st_mode & 0o222
    assert os.stat(fc).st_ino != os.stat(fa).st_ino


@pytest.mark.process
def test_cache_commands_need_a_registry_and_sane_sizes(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env["MFSREG_CACHE_DIR"] = str(tmp_path / "c")
    proc = mfsreg("cache", "warm", "fam", env=env, check=False)
    assert proc.returncode == 2 and "MFSREG_URL" in proc.stderr
    # under a byte: 0.5 was taken for 0, and emptied the cache
    for size in ("lots", "0", "0.5", "1e-9"):
        proc = mfsreg("cache", "prune", "--max-size", size, env=env, check=False)
        assert proc.returncode == 2 and "not a size" in proc.stderr, (size, proc.stderr)
    assert mfsreg_json("cache", "stats", env=env)["chunks"] == 0
    NodeCache(tmp_path / "c").close()
    # a relative cache directory (or ' ') named a new cache in each directory a command ran from
    for rel in ("rel/cache", " "):
        proc = subprocess.run(
            [MFSREG, "cache", "stats"],
            env=dict(env, MFSREG_CACHE_DIR=rel),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"MFSREG_CACHE_DIR={rel!r} is not an absolute path" in proc.stderr, proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_an_explicit_cache_dir_is_checked_as_mfsreg_cache_dir_is(tmp_path, monkeypatch):
    """Node(cache_dir=...) and NodeCache(root) took any path as it came: '' and a relative one made
    a cache in the directory the code ran from, '~/x' one in a folder named '~'. They are checked
    as MFSREG_CACHE_DIR is (~ expands, the rest refused in one line); a space at the end of either
    is refused too, and a relative XDG_CACHE_HOME is ignored, as the XDG spec has it."""
    from mfsreg.registry.client.cache import default_cache_dir
    from mfsreg.registry.errors import InvalidRequest

    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for env in ("MFSREG_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(env, raising=False)
    for bad, says in (
        ("", "cache_dir='' is empty: give an absolute path"),
        ("rel/cache", "cache_dir='rel/cache' is not an absolute path"),
        (" ", "cache_dir=' ' is not an absolute path"),
        (f"{tmp_path}/c ", "starts or ends with a space"),
        ("~mfsreg-no-such-user/c", "user name this machine does not have"),
    ):
        for make in (lambda: NodeCache(bad), lambda: Node("http://127.0.0.1:9", "t", bad)):
            with pytest.raises(InvalidRequest, match=says) as got:
                make()
            assert "\n" not in str(got.value)
    assert not list(work.iterdir()) and not (tmp_path / "c ").exists()
    NodeCache("~/node-cache").close()
    assert (tmp_path / "home" / "node-cache" / "index.db").exists()
    monkeypatch.setenv("MFSREG_CACHE_DIR", f"{tmp_path}/e ")
    with pytest.raises(InvalidRequest, match="MFSREG_CACHE_DIR=.* starts or ends with a space"):
        NodeCache()
    monkeypatch.delenv("MFSREG_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "rel")
    assert default_cache_dir() == tmp_path / "home" / ".cache" / "mfsreg"
    monkeypatch.setenv("XDG_CACHE_HOME", f"{tmp_path}/xdg ")
    with pytest.raises(
        InvalidRequest, match="XDG_CACHE_HOME=.* starts or ends with a space, .*: remove it, or set MFSREG_CACHE_DIR"
    ):
        NodeCache()
    monkeypatch.setenv("XDG_CACHE_HOME", f"{tmp_path}/xdg")
    assert default_cache_dir() == tmp_path / "xdg" / "mfsreg"
    assert not list(work.iterdir())


def test_an_empty_url_or_token_is_refused_not_read_from_the_environment(tmp_path, monkeypatch):
    """Node(url='') or Node(token='') quietly used MFSREG_URL or MFSREG_TOKEN instead: an argument
    given is used or refused, never swapped for the environment's."""
    from mfsreg.registry.errors import InvalidRequest

    monkeypatch.setenv("MFSREG_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("MFSREG_TOKEN", "from-the-environment")
    for kw, says in (
        ({"url": ""}, "^url='' is empty: give one, or leave url= out to use MFSREG_URL$"),
        ({"token": ""}, "^token='' is empty: give one, or leave token= out to use MFSREG_TOKEN$"),
    ):
        with pytest.raises(InvalidRequest, match=says):
            Node(cache_dir=str(tmp_path / "c"), **kw)
    assert not (tmp_path / "c").exists()
    node = Node(cache_dir=str(tmp_path / "c"))  # left out: the environment's
    try:
        assert node.remote.url == "http://127.0.0.1:9"
        assert node.remote.http.headers["authorization"] == "Bearer from-the-environment"
    finally:
        node.close()


def test_an_empty_token_is_refused_by_the_registry_client_as_by_a_node(tmp_path, monkeypatch):
    """RemoteRegistry(url, token='') sent no token, quietly, where Node(token='') is refused as the
    mistake it most likely is (an unset variable): both refuse it now. An empty MFSREG_TOKEN still
    counts as unset, as every empty MFSREG_* variable does."""
    from mfsreg.registry.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="^token='' is empty: give one, or leave token= out to send none$"):
        RemoteRegistry("http://127.0.0.1:9", token="")
    with RemoteRegistry("http://127.0.0.1:9") as remote:
        assert "authorization" not in remote.http.headers
    monkeypatch.setenv("MFSREG_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("MFSREG_TOKEN", "")
    node = Node(cache_dir=str(tmp_path / "c"))
    try:
        assert "authorization" not in node.remote.http.headers
    finally:
        node.close()
    env = client_env(tmp_path, "http://127.0.0.1:9", None, MFSREG_TOKEN="")
    for args in (("ls",), ("cache", "warm", "fam")):
        proc = mfsreg(*args, env=env, check=False)
        assert proc.returncode == 5 and "cannot reach the registry at http://127.0.0.1:9" in proc.stderr, proc.stderr


def test_cache_commands_that_only_read_make_no_cache(tmp_path):
    """cache stats, unpin, prune and verify on a MFSREG_CACHE_DIR that is not there (mistyped): an
    empty answer (the pin refused), and no directory made (each made the whole tree, an empty cache)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env["MFSREG_CACHE_DIR"] = str(tmp_path / "typo" / "deep" / "cache")
    s = mfsreg_json("cache", "stats", env=env)
    assert s["chunks"] == 0 and s["bytes"] == 0 and s["path"] == env["MFSREG_CACHE_DIR"] and s["pinned_families"] == []
    assert "no cache there yet" in mfsreg("cache", "stats", env=env).stdout
    proc = mfsreg("cache", "unpin", "fam", env=env, check=False)
    assert proc.returncode == 2 and "not pinned in this cache (pinned: none)" in proc.stderr, proc.stderr
    # nor do prune and verify, which find nothing to do there (they made the tree too)
    assert mfsreg_json("cache", "prune", "--max-size", "1G", env=env)["removed"] == 0
    assert "no cache there yet, nothing to prune" in mfsreg("cache", "prune", "--max-size", "1G", env=env).stdout
    assert mfsreg_json("cache", "verify", env=env)["chunks"] == 0
    assert "no cache there yet, nothing to verify" in mfsreg("cache", "verify", env=env).stdout
    proc = mfsreg("cache", "prune", "--max-size", "abc", env=env, check=False)
    assert proc.returncode == 2 and "not a size" in proc.stderr
    assert not (tmp_path / "typo").exists()


def test_a_tier_the_registry_does_not_name_keeps_the_rank_the_cache_holds(tmp_path):
    """A delta's basis comes in a tier document without a tier of its own: set_tiers took that for
    unique, so a base chunk a `cache warm --tier unique` listed fell to the bottom of the eviction
    order (under the pin, until an unpin)."""
    cache = NodeCache(tmp_path / "c")
    try:
        data = os.urandom(5000)
        cache.put(chunk_id(data), data, tier="base", family="fam")
        rank = lambda: (
            cache.index.conn().execute("SELECT rank FROM entries WHERE key = ?", (chunk_id(data),)).fetchone()[0]
        )
        base = rank()
        cache.set_tiers({chunk_id(data): None}, "fam")
        cache.set_tiers({chunk_id(data): None})
        assert rank() == base
        cache.set_tiers({chunk_id(data): "unique"}, "fam")  # a tier that is named still moves it
        assert rank() < base
    finally:
        cache.close()


def test_a_cache_index_held_or_not_ours_to_write_is_not_called_damaged(tmp_path):
    """A lock another process holds, or an index this user may not write: the error says so, and
    not to delete the shared index as a damaged one (the advice it gave for every SQLite error)."""
    import sqlite3

    from mfsreg.registry.client.indexdb import index_error

    NodeCache(tmp_path / "c").close()
    index = tmp_path / "c" / "index.db"
    holder = sqlite3.connect(index, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.raises(sqlite3.OperationalError) as locked:
            sqlite3.connect(index, timeout=0, isolation_level=None).execute("BEGIN IMMEDIATE")  # as a writer does
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    with pytest.raises(sqlite3.OperationalError) as readonly:
        sqlite3.connect(f"file:{index}?mode=ro", uri=True).execute("DELETE FROM pins")
    said = str(index_error(index, locked.value))
    assert "is locked" in said and "do not delete it" in said and "damaged" not in said, said
    said = str(index_error(index, readonly.value))
    assert "may not write" in said and "MFSREG_CACHE_DIR" in said and "delete it" not in said, said


def test_a_damaged_cache_index_is_one_line_and_a_new_one_recovers_the_chunks(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env["MFSREG_CACHE_DIR"] = str(tmp_path / "c")
    cache = NodeCache(tmp_path / "c")
    data = os.urandom(5000)
    cache.put(chunk_id(data), data)
    cache.close()
    index = tmp_path / "c" / "index.db"
    for leftover in index.parent.glob("index.db-*"):  # the WAL's files, checkpointed at close
        leftover.unlink()
    index.write_bytes(b"this is not a database, it was overwritten" * 100)
    for args in (["cache", "stats"], ["cache", "prune"], ["cache", "verify"]):
        proc = mfsreg(*args, env=env, check=False)
        assert proc.returncode == 5 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert "index" in proc.stderr and "delete it" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert "the next opening of the cache records them again" in proc.stderr, proc.stderr
    index.unlink()  # as the message says: the chunk files stay and are recorded again
    assert mfsreg_json("cache", "stats", env=env)["chunks"] == 1  # by the opening that made the new index
    assert mfsreg_json("cache", "prune", "--max-size", "1G", env=env)["unrecorded_files_found"] == 0


def _on_disk(env: dict) -> list[int]:
    """The sizes of the chunk and materialised files in the cache (temp files left out)."""
    root = Path(env["MFSREG_CACHE_DIR"])
    return [
        p.stat().st_size
        for d in ("chunks", "files")
        for p in (root / d).rglob("*")
        if p.is_file() and not p.name.startswith(".")
    ]


def test_a_new_index_records_the_chunks_already_cached(published, fam, tmp_path):
    """An index deleted (found damaged) or lost beside a full cache: the new one knew none of the
    chunk files until a `cache prune` or `cache verify`, so `cache stats` said the cache was empty
    and the size limit let it grow past itself. The opening that makes the new index records them."""
    _, env = published
    for m in ("lora-chat", "last-code"):
        mfsreg_json("pull", "fam", m, "-o", tmp_path / f"{m}.out", env=env)
    before = mfsreg_json("cache", "stats", env=env)
    on_disk = _on_disk(env)
    assert before["chunks"] == len(on_disk) and before["bytes"] == sum(on_disk), before
    index = Path(env["MFSREG_CACHE_DIR"]) / "index.db"
    for f in index.parent.glob("index.db*"):
        f.unlink()
    stats = mfsreg_json("cache", "stats", env=env)
    assert stats["chunks"] == len(on_disk) and stats["bytes"] == sum(on_disk), stats
    assert not (index.parent / "unrecorded").exists()
    # the limit counts them: a pull of a third member evicts the others' chunks down to it
    limit = fam["full-med"].stat().st_size + 200_000
    assert sum(on_disk) > limit
    mfsreg_json("pull", "fam", "full-med", "-o", tmp_path / "full-med.out", env=dict(env, MFSREG_CACHE_MAX=str(limit)))
    assert filecmp.cmp(tmp_path / "full-med.out", fam["full-med"], shallow=False)
    on_disk = _on_disk(env)
    assert sum(on_disk) <= limit, (sum(on_disk), limit)
    stats = mfsreg_json("cache", "stats", env=env)
    assert stats["chunks"] == len(on_disk) and stats["bytes"] == sum(on_disk), stats


def _cache_file(env: dict, chunk_id: str) -> Path:
    return Path(env["MFSREG_CACHE_DIR"]) / "chunks" / chunk_id[:2] / chunk_id


def _damage(env: dict, flipped: str, cut: str) -> None:
    """Flip one byte in the cache file of ``flipped`` and cut 7 bytes off the one of ``cut``."""
    for victim in (flipped, cut):
        _cache_file(env, victim).chmod(0o644)
    data = bytearray(_cache_file(env, flipped).read_bytes())
    data[len(data) // 2] ^= 0x40
    _cache_file(env, flipped).write_bytes(data)
    _cache_file(env, cut).write_bytes(_cache_file(env, cut).read_bytes()[:-7])


def test_a_damaged_cached_chunk_is_fetched_again(published, writes, fam, tmp_path):
    """Every chunk is checked as it is placed: a cache file with a flipped byte, or cut short, is
    dropped, fetched again, and the pull still writes the exact file."""
    _, env = published
    mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "first.out", env=env)
    doc = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"]).remote.version_doc("fam", "lora-chat")
    rows, in_file = doc["chunks"], set(Manifest.from_doc(doc["manifest"]).chunk_ids())
    flipped, cut = sorted(i for i in in_file if rows[i][3] > 100)[:2]
    _damage(env, flipped, cut)
    res = mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "again.out", env=env)
    assert_written(tmp_path / "again.out", writes)
    assert filecmp.cmp(tmp_path / "again.out", fam["lora-chat"], shallow=False)
    assert res["fetched_bytes"] == rows[flipped][1] + rows[cut][1]  # the two chunks' stored bytes, and no more
    # found cached, then fetched again: counted once, as fetched
    assert res["cached_bytes"] == sum(rows[i][3] for i in in_file) - rows[flipped][3] - rows[cut][3]
    for victim in (flipped, cut):
        assert chunk_id(_cache_file(env, victim).read_bytes()) == victim
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_a_directory_at_a_cached_chunks_name_is_found_by_verify(published, fam, tmp_path):
    """A directory made where a chunk's file was: `cache verify` passed it over (it lists plain
    files), and a pull failed naming a temp file of its own. The pull says what is in the way and
    what removes it; verify reports and removes it, and the next pull writes the exact file."""
    _, env = published
    mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "first.out", env=env)
    doc = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"]).remote.version_doc("fam", "lora-chat")
    victim = sorted(Manifest.from_doc(doc["manifest"]).chunk_ids())[0]
    _cache_file(env, victim).unlink()
    (_cache_file(env, victim) / "inside").mkdir(parents=True)
    proc = mfsreg("pull", "fam", "lora-chat", "-o", tmp_path / "again.out", env=env, check=False)
    assert proc.returncode != 0 and "a directory stands at that name in the node cache" in proc.stderr, proc.stderr
    assert "`mfsreg cache verify` removes it" in proc.stderr and ".tmp" not in proc.stderr, proc.stderr
    assert not (tmp_path / "again.out").exists()
    proc = mfsreg("cache", "verify", "--json", env=env, check=False)
    assert proc.returncode == 4 and json.loads(proc.stdout)["damaged_chunks"] == [victim], proc.stdout + proc.stderr
    assert not _cache_file(env, victim).exists()
    mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "again.out", env=env)
    assert filecmp.cmp(tmp_path / "again.out", fam["lora-chat"], shallow=False)
    assert chunk_id(_cache_file(env, victim).read_bytes()) == victim
    # the same for a materialised file (what --to-dir links from)
    mfsreg_json("pull", "fam", "lora-chat", "--to-dir", tmp_path / "engine-a", env=env)
    [stored] = list((Path(env["MFSREG_CACHE_DIR"]) / "files").iterdir())
    stored.chmod(0o644)
    stored.unlink()
    (stored / "inside").mkdir(parents=True)
    proc = mfsreg("pull", "fam", "lora-chat", "--to-dir", tmp_path / "engine-b", env=env, check=False)
    assert proc.returncode == 5 and "a directory stands at that name in the node cache" in proc.stderr, proc.stderr
    assert not (tmp_path / "engine-b").exists()
    proc = mfsreg("cache", "verify", "--json", env=env, check=False)
    assert proc.returncode == 4 and json.loads(proc.stdout)["damaged_files"] == [stored.name], proc.stdout + proc.stderr
    mfsreg_json("pull", "fam", "lora-chat", "--to-dir", tmp_path / "engine-b", env=env)
    assert filecmp.cmp(tmp_path / "engine-b" / fam["lora-chat"].name, fam["lora-chat"], shallow=False)


def test_a_cache_path_that_is_a_file_is_one_line(tmp_path):
    """A cache directory that is a regular file, or has one above it or at its chunks/: the raw
    NotADirectoryError or FileExistsError of mkdir reached the caller."""
    from mfsreg.registry.errors import InvalidRequest

    (tmp_path / "a-file").write_text("mine")
    (tmp_path / "c" / "chunks").parent.mkdir()
    (tmp_path / "c" / "chunks").write_text("mine")
    for root, blocker in (
        (tmp_path / "a-file", tmp_path / "a-file"),
        (tmp_path / "a-file" / "deeper", tmp_path / "a-file"),
        (tmp_path / "c", tmp_path / "c" / "chunks"),
    ):
        for make in (lambda: NodeCache(root), lambda: Node("http://127.0.0.1:9", "t", str(root))):
            with pytest.raises(
                InvalidRequest, match=f"\\({blocker} is a file\\): a file is where a directory is needed; move it away"
            ) as got:
                make()
            assert "\n" not in str(got.value)
    assert (tmp_path / "a-file").read_text() == "mine" and (tmp_path / "c" / "chunks").read_text() == "mine"


def _mappable_and_not(node: Node, version: str) -> tuple[str, str]:
    """A chunk of ``version`` that a CPU load maps into its tensor, and one it reads instead."""
    pieces = [(span, p) for span, ps in layout(node.fetcher.version("fam", version)).values() for p in ps]

    def maps(span, p) -> bool:
        return (
            p.start % mmap.PAGESIZE == 0
            and p.chunk.size >= mmap.PAGESIZE
            and (p.chunk.size % mmap.PAGESIZE == 0 or p.start + p.chunk.size == span.nbytes)
        )

    mapped = {p.chunk.id for span, p in pieces if maps(span, p)}
    read = [p.chunk.id for span, p in pieces if not maps(span, p) and p.chunk.id not in mapped]
    return sorted(mapped)[0], read[0]


@pytest.mark.process
def test_a_fifo_or_directory_at_a_cached_chunks_name_is_damage_not_a_hang(published, fam, tmp_path):
    """A fifo standing where a chunk's file goes made the mapping's open wait for a writer, forever
    (a load hung), and a pull's; a directory there raised IsADirectoryError from read_into. A fifo
    is now an entry to fetch again, written over; a directory is the one line a pull gives (`mfsreg
    cache verify` removes it)."""
    import signal

    from mfsreg.registry.errors import StorageError

    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])

    def hung(*_):
        raise TimeoutError("the load hung at a fifo in the node cache")

    old = signal.signal(signal.SIGALRM, hung)
    try:
        load_tensors("fam", "lora-chat", node=node)
        victims = _mappable_and_not(node, "lora-chat")
        for verify in (False, True):
            for victim in victims:
                _cache_file(env, victim).unlink()
                os.mkfifo(_cache_file(env, victim))
            signal.alarm(60)
            try:
                _equal_to_file(load_tensors("fam", "lora-chat", node=node, verify=verify), fam["lora-chat"])
            finally:
                signal.alarm(0)
            for victim in victims:
                assert chunk_id(_cache_file(env, victim).read_bytes()) == victim
        for victim in victims:  # a pull, the same
            _cache_file(env, victim).unlink()
            os.mkfifo(_cache_file(env, victim))
        try:
            proc = mfsreg("pull", "fam", "lora-chat", "-o", tmp_path / "pulled", env=env, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail("the pull hung at a fifo in the node cache")
        assert proc.returncode == 0, proc.stderr
        assert filecmp.cmp(tmp_path / "pulled", fam["lora-chat"], shallow=False)
        for victim in victims:
            assert chunk_id(_cache_file(env, victim).read_bytes()) == victim
        for verify in (False, True):
            for victim in victims:
                path = _cache_file(env, victim)
                if path.is_file():
                    path.unlink()
                    path.mkdir()
            with pytest.raises(
                StorageError,
                match="a directory stands at that name in the node cache; `mfsreg cache verify` removes it",
            ) as got:
                load_tensors("fam", "lora-chat", node=node, verify=verify)
            assert "\n" not in str(got.value) and ".tmp" not in str(got.value)
    finally:
        signal.signal(signal.SIGALRM, old)
        node.close()


def test_a_file_at_a_chunk_shards_name_is_damage_the_cache_repairs(published, fam, tmp_path):
    """A regular file standing where a shard directory of the cache goes (chunks/ab, made by hand
    or another tool): a pull raised the raw NotADirectoryError of the temp file it could not make
    there, and `cache verify` passed over it, listing only directories. Now a pull or load puts the
    directory back and fetches the chunks; verify reports the shard, removes what stands there and
    drops the index rows of the chunks that were under it."""
    _, env = published
    mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "first", env=env)
    cached = cached_ids(env)
    victims = sorted({i[:2]: i for i in cached}.values())[:3]  # chunks of three different shards
    shard = lambda i: _cache_file(env, i).parent  # noqa: E731

    def block(i: str) -> None:
        shutil.rmtree(shard(i))
        shard(i).write_text("not a directory")

    block(victims[0])
    res = mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "pulled", env=env)
    assert filecmp.cmp(tmp_path / "pulled", fam["lora-chat"], shallow=False)
    assert shard(victims[0]).is_dir() and chunk_id(_cache_file(env, victims[0]).read_bytes()) == victims[0]
    assert res["fetched_bytes"] > 0
    block(victims[1])  # a load, the same
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        _equal_to_file(load_tensors("fam", "lora-chat", node=node), fam["lora-chat"])
    finally:
        node.close()
    assert chunk_id(_cache_file(env, victims[1]).read_bytes()) == victims[1]
    block(victims[2])
    proc = mfsreg("cache", "verify", "--json", env=env, check=False)
    assert proc.returncode == 4, proc.stdout + proc.stderr
    got = json.loads(proc.stdout)
    assert got["damaged_dirs"] == [f"chunks/{victims[2][:2]}"] and got["damaged_chunks"] == [], got
    assert not os.path.lexists(shard(victims[2]))
    gone = [i for i in cached if i[:2] == victims[2][:2]]
    rows = sqlite3.connect(Path(env["MFSREG_CACHE_DIR"]) / "index.db").execute("SELECT key FROM entries").fetchall()
    assert not {r[0] for r in rows} & set(gone)  # the size limit no longer counts them
    assert mfsreg("cache", "verify", env=env).returncode == 0
    mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "again", env=env)
    assert filecmp.cmp(tmp_path / "again", fam["lora-chat"], shallow=False)


def _bound_by_modes(*args, env: dict) -> subprocess.CompletedProcess:
    """`mfsreg ARGS` as a user whom file modes bind: as root (tests may run so), without the
    capabilities that pass over them, so that a chunk file of mode 000 cannot be opened."""
    cmd = [MFSREG, *map(str, args)]
    if os.geteuid() == 0:
        caps = "-dac_override,-dac_read_search,-fowner"
        cmd = [shutil.which("setpriv"), f"--bounding-set={caps}", f"--inh-caps={caps}", "--", *cmd]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.process
def test_a_cached_chunk_this_user_may_not_read_is_replaced_where_the_cache_is_writable(published, fam, tmp_path):
    """A chunk file of mode 000 (a chmod by hand, a restore that lost modes) stopped every pull in
    one line, though the cache is this user's to write and a rename over the file repairs it, as it
    does a file that fails its check. Now it counts as damage: fetched again and renamed over it,
    and `cache verify` drops it. Only where the user may not write its shard does the one line stay."""
    _, env = published
    mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "first", env=env)
    victim, other = sorted(cached_ids(env))[:2]
    _cache_file(env, victim).chmod(0)
    proc = _bound_by_modes("pull", "fam", "lora-chat", "-o", tmp_path / "pulled", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["fetched_bytes"] > 0
    assert filecmp.cmp(tmp_path / "pulled", fam["lora-chat"], shallow=False)
    assert _cache_file(env, victim).stat().st_mode & 0o777 == 0o444
    assert chunk_id(_cache_file(env, victim).read_bytes()) == victim
    _cache_file(env, other).chmod(0)
    proc = _bound_by_modes("cache", "verify", "--json", env=env)
    assert proc.returncode == 4 and json.loads(proc.stdout)["damaged_chunks"] == [other], proc.stdout + proc.stderr
    assert not _cache_file(env, other).exists()
    shard = _cache_file(env, victim).parent
    _cache_file(env, victim).chmod(0)
    shard.chmod(0o555)
    try:
        for args in (("pull", "fam", "lora-chat", "-o", tmp_path / "again"), ("cache", "verify")):
            proc = _bound_by_modes(*args, env=env)
            assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
            assert (
                f"cannot read {_cache_file(env, victim)} in the node cache: Permission denied: check its "
                "permissions" in proc.stderr
            ), proc.stderr
        assert not (tmp_path / "again").exists()
    finally:
        shard.chmod(0o755)


def test_a_damaged_cached_basis_is_fetched_again(published, fam, tmp_path):
    """A delta decodes against its basis from the node cache: a basis whose cache file rotted is
    dropped and fetched again, not trusted (every pull of the member would fail, blamed on the
    registry's packs)."""
    _, env = published
    mfsreg_json("cache", "warm", "fam", "--tier", "base", env=env)
    rows = needed(env, "full-med")
    basis = next(b for b in sorted({row[2] for row in rows.values() if row[2]}) if _cache_file(env, b).exists())
    expected = sum(row[1] for i, row in rows.items() if not _cache_file(env, i).exists())
    _cache_file(env, basis).chmod(0o644)
    data = bytearray(_cache_file(env, basis).read_bytes())
    data[len(data) // 3] ^= 0x08
    _cache_file(env, basis).write_bytes(data)
    res = mfsreg_json("pull", "fam", "full-med", "-o", tmp_path / "full-med.out", env=env)
    assert filecmp.cmp(tmp_path / "full-med.out", fam["full-med"], shallow=False)
    assert chunk_id(_cache_file(env, basis).read_bytes()) == basis
    basis_stored = (rows.get(basis) or needed(env, "base")[basis])[1]
    assert res["fetched_bytes"] == expected + basis_stored


@pytest.mark.process
def test_a_cached_basis_this_user_may_not_read_is_written_over_once_fetched(published, fam, tmp_path):
    """A delta's basis whose cache file this user may not read (mode 000, in a cache the user may
    write) is fetched to decode the delta, as a damaged one is; but the copy fetched was not written
    over the file (only a missing file was written), so the file stayed unreadable and every later
    decode against that basis fetched it again."""
    _, env = published
    mfsreg_json("cache", "warm", "fam", "--tier", "base", env=env)
    remote = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"]).remote
    doc = remote.version_doc("fam", "full-med")
    rows, own = doc["chunks"], set(remote.manifest_of(doc).chunk_ids())
    # a basis only the deltas reach: one that is also a chunk of full-med is read by the assembly,
    # which writes it over on its own
    basis = next(b for b in sorted({rows[i][2] for i in own if rows[i][2]} - own) if _cache_file(env, b).exists())
    users = [i for i in own if rows[i][2] == basis and not _cache_file(env, i).exists()]
    expected = sum(rows[i][1] for i in own if not _cache_file(env, i).exists())
    basis_stored = rows[basis][1]
    _cache_file(env, basis).chmod(0)
    proc = _bound_by_modes("pull", "fam", "full-med", "-o", tmp_path / "first", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert filecmp.cmp(tmp_path / "first", fam["full-med"], shallow=False)
    assert json.loads(proc.stdout)["fetched_bytes"] == expected + basis_stored
    assert _cache_file(env, basis).stat().st_mode & 0o777 == 0o444  # the fetched copy, renamed over it
    assert chunk_id(_cache_file(env, basis).read_bytes()) == basis
    for i in users:  # the deltas' own chunks gone again (evicted, say): decoding them needs the basis
        _cache_file(env, i).unlink()
    proc = _bound_by_modes("pull", "fam", "full-med", "-o", tmp_path / "again", "--json", env=env)
    assert proc.returncode == 0, proc.stderr
    assert filecmp.cmp(tmp_path / "again", fam["full-med"], shallow=False)
    assert users and json.loads(proc.stdout)["fetched_bytes"] == sum(rows[i][1] for i in users)  # the basis not again


def test_a_pack_lost_behind_the_first_of_a_batch_is_reported_before_the_stream(published_alone, server_env, tmp_path):
    """The server checks every pack of a download batch before it streams: with the first pack it
    would read still there and a later one gone, the pull gets the storage error in one line, not
    a stream that breaks off halfway."""
    from mfsreg.registry.blobs.packs import pack_key
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    _, env = published_alone
    reg = Registry(Settings.from_env(server_env))
    try:
        ids = list(needed(env, "last-code"))
        packs = sorted({c.pack_id for c in reg.locate(ids).values()})
        assert len(packs) >= 2  # 1 MiB packs: the batch spans several
        for pack_id in packs[1:]:  # the server reads packs in pack id order
            reg.blobs.delete(pack_key(pack_id))
    finally:
        reg.close()
    proc = mfsreg("pull", "fam", "last-code", "-o", tmp_path / "out", env=env, check=False)
    assert proc.returncode == 5 and "storage lost data" in proc.stderr and packs[1] in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_pulls_write_through_the_page_cache_unless_asked_otherwise(published, fam, tmp_path):
    """Unset, MFSREG_PULL_DIRECT leaves pulled files in the page cache, where whoever reads them next
    (an engine, a copy) finds them; set to 1, both kinds of pull write around it."""
    _, env = published
    env.pop("MFSREG_PULL_DIRECT", None)
    mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "file.out", env=env)
    assert_written(tmp_path / "file.out", "page cache")
    mfsreg_json("pull", "fam", "lora-chat", "--to-dir", tmp_path / "engine", env=env)
    assert_written(tmp_path / "engine" / fam["lora-chat"].name, "page cache")
    env["MFSREG_PULL_DIRECT"] = "yes"
    assert takes_direct(tmp_path), "the tests' temp directory should take O_DIRECT"
    expected = "direct"
    mfsreg_json("pull", "fam", "last-code", "-o", tmp_path / "direct.out", env=env)
    assert_written(tmp_path / "direct.out", expected)
    mfsreg_json("pull", "fam", "last-code", "--to-dir", tmp_path / "engine-2", env=env)
    assert_written(tmp_path / "engine-2" / fam["last-code"].name, expected)


def test_a_node_pull_over_a_file_keeps_that_files_mode(published, writes, fam, tmp_path):
    """`mfsreg pull -o OUT` over a read-only OUT replaced it with a file of mode 0644: the new file
    takes the permission bits of the one it replaces (as cp's does), both ways a node writes."""
    _, env = published
    out = tmp_path / "out.safetensors"
    out.write_bytes(b"an older pull")
    for kept in (0o444, 0o600):
        out.chmod(kept)
        mfsreg_json("pull", "fam", "lora-chat", "-o", out, env=env)
        assert out.stat().st_mode & 0o7777 == kept and filecmp.cmp(out, fam["lora-chat"], shallow=False)


def test_a_pull_writes_through_the_page_cache_where_o_direct_is_refused(published, fam, tmp_path, monkeypatch):
    """A filesystem that refuses O_DIRECT (at open here; tests/test_direct.py covers a refused
    first write) gets the file through the page cache instead: the same bytes, no error."""
    _, env = published
    real_open = os.open

    def refuse(path, flags, *args, **kwargs):
        if flags & getattr(os, "O_DIRECT", 0):
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse)
    monkeypatch.setenv("MFSREG_PULL_DIRECT", "1")
    with RemoteRegistry(env["MFSREG_URL"], token=env["MFSREG_TOKEN"]) as remote:
        cache = NodeCache(env["MFSREG_CACHE_DIR"])
        try:
            remote.pull("fam", "lora-chat", tmp_path / "l.out", cache=cache)
        finally:
            cache.close()
    assert_written(tmp_path / "l.out", "page cache")
    assert filecmp.cmp(tmp_path / "l.out", fam["lora-chat"], shallow=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp file of either way


def test_a_fetch_that_fails_mid_pull_is_one_line_and_writes_nothing(published_alone, s3_bucket, tmp_path):
    """The fetch runs beside the assembly: when the registry cannot serve the chunks (its packs
    are gone), the pull stops with the registry's error (read before its stream starts, so not a
    broken connection), leaves no file and no temp file, and what the cache held stays."""
    _, env = published_alone
    mfsreg_json("cache", "warm", "fam", "--tier", "base", env=env)
    before = sorted(cached_ids(env))
    endpoint, bucket = s3_bucket
    s3 = boto3.session.Session().client("s3", endpoint_url=endpoint, region_name="us-east-1")
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
        for obj in page.get("Contents", []):
            s3.delete_object(Bucket=bucket, Key=obj["Key"])
    proc = mfsreg("pull", "fam", "last-code", "-o", tmp_path / "out", env=env, check=False)
    assert proc.returncode == 5 and "storage lost data" in proc.stderr and "operator" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert sorted(cached_ids(env)) == before


def test_pull_to_an_impossible_path_is_one_line(published, tmp_path):
    _, env = published
    (tmp_path / "a-file").write_text("not a directory")
    proc = mfsreg("pull", "fam", "lora-chat", "-o", tmp_path / "a-file" / "out", env=env, check=False)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "a-file is a file, not a directory" in proc.stderr, (
        proc.stderr
    )
    assert (tmp_path / "a-file").read_text() == "not a directory"
    # --to-dir onto a file: refused before anything is fetched
    proc = mfsreg("pull", "fam", "lora-chat", "--to-dir", tmp_path / "a-file", env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--to-dir needs a directory" in proc.stderr, (
        proc.stderr
    )
    assert cached_ids(env) == [] and (tmp_path / "a-file").read_text() == "not a directory"
    # a directory where a file of the version goes: one line, and no temp link left beside it
    engine = tmp_path / "engine"
    (engine / "lora-chat.safetensors").mkdir(parents=True)
    proc = mfsreg("pull", "fam", "lora-chat", "--to-dir", engine, env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(os.listdir(engine)) == ["lora-chat.safetensors"]


def test_prune_removes_temp_files_that_killed_writers_left(tmp_path):
    """A writer killed mid-write leaves its hidden temp file; prune removes it once it is old, and
    leaves a fresh one (a live writer's) and every chunk alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env["MFSREG_CACHE_DIR"] = str(tmp_path / "c")
    cache = NodeCache(tmp_path / "c")
    try:
        data = os.urandom(5000)
        cid = chunk_id(data)
        cache.put(cid, data)
        chunk = Path(cache.chunk_file(cid))
        old, fresh = chunk.with_name(f".{cid}.dead.tmp"), chunk.with_name(f".{cid}.live.tmp")
        old_file = cache.root / "files" / ".abc.dead.tmp"
        for p in (old, fresh, old_file):
            p.write_bytes(b"partial")
        hours_ago = time.time() - 2 * 3600
        for p in (old, old_file):
            os.utime(p, (hours_ago, hours_ago))
    finally:
        cache.close()
    res = mfsreg_json("cache", "prune", "--max-size", "1G", env=env)
    assert res["temp_files_removed"] == 2 and res["removed"] == 0 and res["unrecorded_files_found"] == 0
    assert not old.exists() and not old_file.exists() and fresh.exists() and chunk.read_bytes() == data


def _cache_with_an_unrecorded_file(tmp_path) -> tuple[dict, str]:
    """A node cache holding a recorded chunk of 4,000 bytes and, as a writer killed between
    renaming a chunk into place and recording it leaves one, a 6,000-byte chunk file without a
    row; the environment of CLI commands on it, and the recorded chunk's id."""
    from mfsreg.registry.client.cachefiles import atomic_write

    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env["MFSREG_CACHE_DIR"] = str(tmp_path / "c")
    cache = NodeCache(tmp_path / "c")
    try:
        kept, lost = os.urandom(4000), os.urandom(6000)
        cache.put(chunk_id(kept), kept, "base", "fam")
        atomic_write(cache.chunk_file(chunk_id(lost)), lost, mode=0o444)  # the file, and no row
    finally:
        cache.close()
    assert mfsreg_json("cache", "stats", env=env)["bytes"] == 4000
    return env, chunk_id(kept)


def test_prune_counts_and_evicts_files_a_killed_writer_left_unrecorded(tmp_path):
    """A writer killed between renaming a chunk into place and recording it leaves a file the index
    does not know: prune records it, so that the limit counts it and it can be evicted."""
    env, kept = _cache_with_an_unrecorded_file(tmp_path)
    res = mfsreg_json("cache", "prune", "--max-size", "1G", env=env)
    assert res["unrecorded_files_found"] == 1 and res["bytes"] == 10_000
    res = mfsreg_json("cache", "prune", "--max-size", "5000", env=env)
    assert res["unrecorded_files_found"] == 0 and res["removed"] == 1 and res["bytes"] == 4000
    assert cached_ids(env) == [kept]  # the unknown one went first: it ranks as unique


_FULL_INDEX = """
import os, resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
from mfsreg.registry.format.chunking import chunk_id
from mfsreg.registry.client.cache import NodeCache
from mfsreg.registry.errors import StorageError
root, hard = sys.argv[1], resource.getrlimit(resource.RLIMIT_FSIZE)[1]
cache = NodeCache(root)
first = os.urandom(1000)
cache.put(chunk_id(first), first, "base", "fam")
# a chunk file that does not fit, after three that do: the three are renamed into place first
resource.setrlimit(resource.RLIMIT_FSIZE, (200_000, hard))
try:
    cache.put_many((chunk_id(b), b, "base", "fam") for b in [os.urandom(1000 + i) for i in range(3)] + [os.urandom(300_000)])
except StorageError as exc:
    print(exc)
# the chunk files fit, and the index's write-ahead log may not grow: the rows are not written
resource.setrlimit(resource.RLIMIT_FSIZE, (os.path.getsize(root + "/index.db-wal"), hard))
try:
    cache.put_many((chunk_id(b), b, "group", "fam") for b in [os.urandom(2000 + i) for i in range(20)])
except StorageError as exc:
    print(exc)
NodeCache(root).close()  # an opening while the disk is still full: it opens, and cannot record them yet
print(os.path.exists(root + "/unrecorded"))
"""


@pytest.mark.process
def test_stats_count_the_chunks_whose_index_rows_a_full_disk_stopped(tmp_path):
    """A full disk (here a file size limit, ulimit -f, which fails writes with EFBIG as a full disk
    does with ENOSPC) that stops the index's write after a batch of chunk files was renamed into
    place, or stops a chunk file after others of its batch were: those files stood in the cache
    with no rows, and `cache stats` and the size limit left them out until a `cache prune`. Now
    the files written before a failed one are recorded, and a failed index write leaves a marker
    from which the next opening of the cache records them (or `cache verify` does)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env["MFSREG_CACHE_DIR"] = str(tmp_path / "c")
    proc = subprocess.run(
        [sys.executable, "-c", _FULL_INDEX, str(tmp_path / "c")], capture_output=True, text=True, timeout=120
    )
    said = proc.stdout.splitlines()
    assert proc.returncode == 0 and len(said) == 3, proc
    assert (
        said[0].startswith(f"the node cache cannot take {tmp_path / 'c' / 'chunks'}") and "File too large" in said[0]
    ), said
    assert said[1].startswith(f"the node cache's index {tmp_path / 'c' / 'index.db'} cannot be used"), said
    assert said[2] == "True", said  # the marker stays while its files cannot be recorded
    on_disk = [p.stat().st_size for p in (tmp_path / "c" / "chunks").rglob("*") if p.is_file()]
    assert len(on_disk) == 24 and not [p for p in (tmp_path / "c" / "chunks").rglob(".*")]  # no temp file
    stats = mfsreg_json("cache", "stats", env=env)
    assert stats["chunks"] == 24 and stats["bytes"] == sum(on_disk), stats
    # what the registry told of the four recorded in time; the rest are ranked as unknown (unique)
    # until a pull or load that uses them tells their tiers again
    assert stats["by_tier"]["base"]["entries"] == 4 and stats["by_tier"]["unique"]["entries"] == 20, stats
    assert not (tmp_path / "c" / "unrecorded").exists()
    assert mfsreg_json("cache", "verify", env=env)["unrecorded_files_found"] == 0


def test_cache_verify_records_intact_files_that_have_no_row(tmp_path):
    """`cache verify` walks every file: one that passes and has no row (its writer killed, or the
    marker of a failed index write lost) is recorded, as `cache prune` records it."""
    env, _ = _cache_with_an_unrecorded_file(tmp_path)
    res = mfsreg_json("cache", "verify", env=env)
    assert res["unrecorded_files_found"] == 1 and res["damaged_chunks"] == [], res
    assert mfsreg_json("cache", "stats", env=env)["bytes"] == 10_000


def test_cache_verify_drops_what_is_damaged_and_keeps_the_rest(tmp_path):
    """`mfsreg cache verify` hashes every chunk against its name and every materialised file
    against its sha256: a flipped byte, a cut-short chunk and a damaged file are dropped (files and
    index rows); intact entries stay, and a second scrub finds nothing."""
    import hashlib

    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env["MFSREG_CACHE_DIR"] = str(tmp_path / "c")
    cache = NodeCache(tmp_path / "c")
    try:
        blobs = [os.urandom(3000 + i) for i in range(4)]
        ids = [chunk_id(b) for b in blobs]
        cache.put_many((i, b, "base", "fam") for i, b in zip(ids, blobs))
        whole = os.urandom(10_000)
        good_sha, bad_sha = hashlib.sha256(whole).hexdigest(), hashlib.sha256(whole[:-1]).hexdigest()
        for sha, data in ((good_sha, whole), (bad_sha, whole)):  # the second holds bytes of another digest
            cache.file_path(sha).write_bytes(data)
            cache.add_file(sha, len(data))
        flipped, cut = ids[0], ids[1]
        _damage(env, flipped, cut)
    finally:
        cache.close()
    proc = mfsreg("cache", "verify", "--json", env=env, check=False)
    assert proc.returncode == 4, proc.stderr  # dropped something: a script hears of it
    res = json.loads(proc.stdout)
    assert sorted(res["damaged_chunks"]) == sorted([flipped, cut]) and res["damaged_files"] == [bad_sha]
    assert res["chunks"] == 4 and res["files"] == 2
    assert sorted(cached_ids(env)) == sorted(ids[2:])
    assert not (tmp_path / "c" / "files" / bad_sha).exists() and (tmp_path / "c" / "files" / good_sha).exists()
    stats = mfsreg_json("cache", "stats", "--json", env=env)
    assert stats["chunks"] == 2 and stats["by_tier"]["files"]["entries"] == 1
    again = mfsreg_json("cache", "verify", "--json", env=env)
    assert again["damaged_chunks"] == [] and again["damaged_files"] == [] and again["chunks"] == 2
    proc = mfsreg("cache", "verify", env=env)  # exits 0: nothing was damaged
    assert "all intact" in proc.stdout


class _Answers(http.server.BaseHTTPRequestHandler):
    """A registry that answers every GET with one document (self.server.doc)."""

    def do_GET(self):
        body = json.dumps(self.server.doc).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_a_version_document_that_names_files_outside_the_node_is_refused(published, fam, tmp_path):
    """A node builds paths from the document a registry sends: a file's digest names its
    materialised copy in the cache, a chunk id its cache file, a file's path its place under the
    output. One that would reach outside them (a hostile server, or a push that got such a manifest
    past an older server) stops the pull, exit 4, before anything is written."""
    _, env = published
    mfsreg_json("pull", "fam", "lora-chat", "-o", tmp_path / "first.safetensors", env=env)  # every chunk cached
    doc = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"]).remote.version_doc("fam", "lora-chat")
    outside = Path(tempfile.mkdtemp(prefix="e", dir="/tmp"))  # a short name: the digest holds 64 characters
    target = str(outside / "evil")
    escape = "/" * (64 - len(target)) + target  # Linux reads "///tmp/..." as "/tmp/..."
    entry = doc["manifest"]["files"][0]
    some_id = next(iter(doc["chunks"]))
    cases = {
        "digest": {**doc, "manifest": {**doc["manifest"], "files": [{**entry, "sha256": escape}]}},
        "path": {**doc, "manifest": {**doc["manifest"], "files": [{**entry, "path": "../evil"}]}},
        "chunk id": {**doc, "chunks": {**doc["chunks"], "../../../evil" + "0" * 19: doc["chunks"][some_id]}},
    }
    hostile = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=hostile.serve_forever, daemon=True).start()
    try:
        for case, bad in cases.items():
            hostile.doc = bad
            there = dict(env, MFSREG_URL=f"http://127.0.0.1:{hostile.server_address[1]}")
            for how in (["--to-dir", tmp_path / "engine" / "e"], ["-o", tmp_path / "engine" / "e" / "m.safetensors"]):
                proc = mfsreg("pull", "fam", "lora-chat", *how, env=there, check=False)
                assert proc.returncode == 4 and proc.stderr.count("\n") == 1, (case, proc.stderr)
                assert "fails its checks" in proc.stderr and "Traceback" not in proc.stderr, (case, proc.stderr)
                assert os.listdir(outside) == [] and not (tmp_path / "engine" / "evil").exists(), case
                assert not (tmp_path / "engine").exists(), case
    finally:
        hostile.shutdown()
        hostile.server_close()
        shutil.rmtree(outside, ignore_errors=True)


def test_a_chunk_table_with_malformed_rows_is_refused(published, tmp_path):
    """The chunk table of a version or tier document: the fetcher sums its sizes, the cache files a
    delta's basis under its id and ranks chunks by tier. A row of the wrong shape or types, from a
    damaged answer or a server not to be trusted, stops a pull and a warm with one line, exit 4,
    before anything is fetched or written."""
    _, env = published
    doc = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"]).remote.version_doc("fam", "lora-chat")
    some_id, row = next(iter(doc["chunks"].items()))
    rows = {
        "tier a list": row[:4] + [["base"]],
        "unknown tier": row[:4] + ["platinum"],
        "size a string": row[:3] + ["12"] + row[4:],
        "negative stored size": [row[0], -1] + row[2:],
        "encoding a number": [7] + row[1:],
        "basis a path": row[:2] + ["../../evil" + "0" * 22] + row[3:],
        "short row": row[:4],
        "not a list": {"encoding": row[0]},
    }
    cache = Path(env["MFSREG_CACHE_DIR"])
    hostile = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Answers)
    threading.Thread(target=hostile.serve_forever, daemon=True).start()
    try:
        for case, bad in rows.items():
            hostile.doc = {**doc, "chunks": {**doc["chunks"], some_id: bad}}
            there = dict(env, MFSREG_URL=f"http://127.0.0.1:{hostile.server_address[1]}")
            for args in (
                ["pull", "fam", "lora-chat", "-o", tmp_path / "out" / "m.safetensors"],
                ["cache", "warm", "fam", "--tier", "base"],
            ):
                proc = mfsreg(*args, env=there, check=False)
                assert proc.returncode == 4 and proc.stderr.count("\n") == 1, (case, args[0], proc.stderr)
                assert "fails its checks" in proc.stderr and "Traceback" not in proc.stderr, (case, proc.stderr)
                assert not (tmp_path / "out").exists(), case
        assert not cache.exists() or not any(
            p.is_file() and p.stat().st_size > 0 and "evil" in p.name for p in cache.rglob("*")
        )
    finally:
        hostile.shutdown()
        hostile.server_close()


@pytest.mark.parametrize("direct", ["0", "1"])
def test_a_node_pull_that_cannot_write_its_file_names_it_in_one_line(direct, published, tmp_path):
    """As an embedded pull: one line naming the file, exit 5, nothing left beside it, whether the
    file is written through the page cache or around it."""
    from tests.test_bad_input import _pull_under_a_file_size_limit

    _, env = published
    mfsreg("pull", "fam", "base", "-o", tmp_path / "first.safetensors", env=env)  # the cache's files are all there
    assert (tmp_path / "first.safetensors").stat().st_size > 400 << 10
    out = tmp_path / "out" / "base.safetensors"
    proc = _pull_under_a_file_size_limit(dict(env, MFSREG_PULL_DIRECT=direct), out, kib=256)
    assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"cannot write {out}: " in proc.stderr and "make room there" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()  # no temp file, nor the folder the pull made for it


def test_a_to_dir_pull_whose_file_would_land_on_a_directory_fetches_and_writes_nothing(published, fam, tmp_path):
    """--to-dir where a directory holds the file's name: refused before any fetch, one line naming
    it, exit 2 (the link's rename failed at the end, naming its temp file)."""
    _, env = published
    engine = tmp_path / "engine"
    (engine / fam["base"].name).mkdir(parents=True)
    proc = mfsreg("pull", "fam", "base", "--to-dir", engine, env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"cannot write {engine / fam['base'].name}: a directory is there" in proc.stderr, proc.stderr
    assert [p.name for p in engine.iterdir()] == [fam["base"].name]
    assert not Path(env["MFSREG_CACHE_DIR"]).exists() or not list(Path(env["MFSREG_CACHE_DIR"]).rglob("chunks/*/*"))


def test_json_of_ls_show_and_to_dir_pulls_is_the_same_through_a_server(published, home_env, fam, tmp_path):
    """`ls F`, `show` and `pull --to-dir` print the same JSON fields, written the same way, through a
    server as on the embedded default (a server's created_at had a space for the T, and a node's
    --to-dir pull gave the directory as the path of a one-file version)."""
    import re

    _, env = published
    mfsreg("push", fam["lora-chat"], "--family", "fam", "--version", "lora-chat", env=home_env)
    iso = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?([+-]\d\d:\d\d)?$")
    for e in (env, home_env):
        listed = mfsreg_json("ls", "fam", env=e)["versions"]
        shown = mfsreg_json("show", "fam", "lora-chat", env=e)
        assert all(iso.match(v["created_at"]) for v in listed) and iso.match(shown["created_at"]), (listed, shown)
        engine = tmp_path / ("node" if e is env else "embedded")
        pulled = mfsreg_json("pull", "fam", "lora-chat", "--to-dir", engine, env=e)
        assert pulled["path"] == str(engine / fam["lora-chat"].name)
        assert filecmp.cmp(pulled["path"], fam["lora-chat"], shallow=False)


def test_pulling_to_the_same_directory_again_leaves_no_hidden_links(published, fam, tmp_path):
    """A --to-dir pull into a directory that already holds the file links it again: a rename
    between two links of one inode does nothing and left the temp link behind, holding the old
    file's space after the cache let it go, one more per pull."""
    _, env = published
    engine = tmp_path / "current"
    for _ in range(3):
        mfsreg("pull", "fam", "lora-chat", "--to-dir", engine, env=env)
    assert [p.name for p in engine.iterdir()] == [fam["lora-chat"].name]
    # another version's file beside it would be loaded with it: refused (test_bad_input has the rest)
    proc = mfsreg("pull", "fam", "base", "--to-dir", engine, env=env, check=False)
    assert proc.returncode == 2 and f"holds {fam['lora-chat'].name}, which this version does not" in proc.stderr


def test_a_to_dir_pull_over_the_limit_keeps_its_file_and_reuses_it(published, fam, tmp_path):
    """Materialised files go first when the cache must shrink, but not the ones the pull itself made
    (they were, and every --to-dir pull rebuilt its file instead of linking it); a file reused is
    marked used, so that eviction takes the one used longest ago."""
    _, env = published
    size = fam["lora-chat"].stat().st_size
    env = dict(env, MFSREG_CACHE_MAX=str(size + size // 2))
    first = mfsreg_json("pull", "fam", "lora-chat", "--to-dir", tmp_path / "a", env=env)
    second = mfsreg_json("pull", "fam", "lora-chat", "--to-dir", tmp_path / "b", env=env)
    assert os.stat(first["path"]).st_ino == os.stat(second["path"]).st_ino  # one file, linked twice
    cache = NodeCache(Path(env["MFSREG_CACHE_DIR"]))
    try:

        def used(path: str) -> float:
            sha = next(
                k
                for k in cache.index.conn().execute("SELECT key FROM entries WHERE key LIKE 'file:%'").fetchall()
                if os.path.samefile(cache.file_path(k[0][5:]), path)
            )[0]
            return cache.index.conn().execute("SELECT last_used FROM entries WHERE key = ?", (sha,)).fetchone()[0]

        before = used(first["path"])
        time.sleep(0.01)
        mfsreg_json("pull", "fam", "lora-chat", "--to-dir", tmp_path / "c", env=env)
        assert used(first["path"]) > before  # reused, and recorded as used
    finally:
        cache.close()


def test_a_failed_pull_still_holds_the_cache_to_its_limit(published_alone, server_env, fam, tmp_path):
    """A pull that fails (here its version is deleted as its fetch starts) evicts down to the limit
    as a finished one does; the cache stayed over it until some later pull succeeded."""
    from mfsreg.registry.errors import NotFound
    from mfsreg.registry.progress import NullProgress

    srv, env = published_alone
    mfsreg("pull", "fam", "base", "-o", tmp_path / "base.out", env=env)  # fills the cache
    held = NodeCache(Path(env["MFSREG_CACHE_DIR"])).total_bytes()
    limit = held // 2
    admin = RemoteRegistry(srv.url, token=token(server_env, "admin"))

    class DeleteAtFetch(NullProgress):
        def start(self, task: str, total: int) -> None:
            if task == "fetch":
                admin.delete("fam", "full-med")

    cache = NodeCache(Path(env["MFSREG_CACHE_DIR"]), max_bytes=limit)
    try:
        with RemoteRegistry(srv.url, token=env["MFSREG_TOKEN"]) as r:
            with pytest.raises(NotFound, match="was deleted while it was being pulled"):
                r.pull("fam", "full-med", tmp_path / "out.safetensors", progress=DeleteAtFetch(), cache=cache)
        assert cache.total_bytes() <= limit < held
    finally:
        cache.close()
        admin.close()


def test_a_refetch_writes_over_the_cached_file_and_never_removes_it_first(published, fam, tmp_path):
    """Fetching a chunk again (found damaged, or missing) renames the checked bytes over whatever is
    there: the file is never absent meanwhile. It was deleted first, and another process that had
    just fetched and was placing the same chunk found it gone and failed ('keeps leaving the node
    cache'); a damaged file is dropped only if it is still the one found damaged."""
    from mfsreg.registry.client.node import refetcher

    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        info = node.fetcher.version("fam", "lora-chat")
        ids = info.manifest.chunk_ids()[:40]
        node.fetcher.ensure("fam", ids, info.located, info.tiers)
        paths = [node.cache.chunk_file(i) for i in ids]
        seen_missing, stop = [], threading.Event()

        def watch():
            while not stop.is_set():
                seen_missing.extend(p for p in paths if not os.path.exists(p))

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            refetch = refetcher(node.fetcher, info)
            for _ in range(5):
                refetch(ids)
        finally:
            stop.set()
            watcher.join()
        assert seen_missing == []
        assert all(chunk_id(Path(p).read_bytes()) == i for p, i in zip(paths, ids))
        # a damaged file is dropped only while it is still that file
        victim, path = ids[0], Path(paths[0])
        seen = os.stat(path)
        node.cache.put_many([(victim, Path(path).read_bytes(), None, "fam")], replace=True)  # another process's copy
        node.cache.discard(victim, seen)
        assert path.exists() and chunk_id(path.read_bytes()) == victim
        node.cache.discard(victim, os.stat(path))
        assert not path.exists()
    finally:
        node.close()


def _ranked_cache(tmp_path) -> tuple[NodeCache, dict[str, bytes]]:
    """A cache holding three 4 KiB chunks, each a distinct pattern, by id."""
    cache = NodeCache(tmp_path / "ranked")
    chunks = {}
    for k in range(3):
        data = bytes([k + 1]) * 4096
        chunks[chunk_id(data)] = data
    return cache, chunks


def test_a_chunk_two_families_tier_differently_is_evicted_as_its_highest_tier(tmp_path):
    """Each family's word on a cached chunk is kept: a chunk one family holds as base and another
    as unique goes after a group chunk (a warm of the second family's unique tier ranked it unique,
    and eviction took it first)."""
    cache, chunks = _ranked_cache(tmp_path)
    x, y, z = chunks
    try:
        cache.put_many([(x, chunks[x], "base", "f"), (y, chunks[y], "group", "f"), (z, chunks[z], "group", "f")])
        cache.set_tiers({x: "unique"}, "g")  # what `cache warm g --tier unique` tells of the same chunk
        cache.touch([y, z])  # x is the least recently used
        cache.evict(max_bytes=4096)
        assert cache.has(x) and not cache.has(y) and not cache.has(z)
    finally:
        cache.close()


def test_a_tier_that_moves_down_lowers_the_chunks_rank(tmp_path):
    """A chunk its family once held as base and now as group (a member drifted) is evicted as group:
    its rank only ever rose."""
    cache, chunks = _ranked_cache(tmp_path)
    x, y, z = chunks
    try:
        cache.put_many([(x, chunks[x], "base", "f"), (y, chunks[y], "unique", "f")])
        cache.record([(x, 4096, "group", "f")])  # the family's current document, as a pull notes it
        cache.put_many([(z, chunks[z], "group", "f")])  # newer, same tier
        cache.touch([y])
        cache.evict(max_bytes=4096)  # unique y first, then the older group chunk: x
        assert cache.has(z) and not cache.has(x) and not cache.has(y)
    finally:
        cache.close()


def test_a_chunk_recorded_as_used_after_another_process_evicted_it_gets_no_row(tmp_path):
    """A load (or `cache warm`) that found a chunk cached records it as used; where another process
    evicted it in between, that made its row again, for a file that was gone: `cache stats` counted
    its bytes until an eviction picked the row. Two caches over one directory, as two processes."""
    import hashlib

    from mfsreg.registry.client.cachefiles import atomic_write

    cache, chunks = _ranked_cache(tmp_path)
    other = NodeCache(tmp_path / "ranked")
    x, y, _ = chunks
    try:
        cache.put_many([(x, chunks[x], "unique", "f"), (y, chunks[y], "base", "f")])
        data = os.urandom(3000)  # a materialised file, as a --to-dir pull leaves one
        sha = hashlib.sha256(data).hexdigest()
        atomic_write(str(cache.file_path(sha)), data, mode=0o444)
        cache.add_file(sha, len(data))
        assert other.has(x) and other.file_path(sha).exists()  # what the other process found
        cache.evict(max_bytes=4096)  # the file, then the unique chunk
        assert not cache.has(x) and not cache.file_path(sha).exists() and cache.has(y)
        other.record([(x, 4096, "unique", "f"), (y, 4096, "base", "f")])  # as a load notes what it used
        other.add_file(sha, len(data))  # as a --to-dir pull notes the file it linked
        assert other.stats()["bytes"] == 4096 and other.stats()["chunks"] == 1, other.stats()
    finally:
        other.close()
        cache.close()


@pytest.mark.parametrize("how", ["evict", "discard"])
def test_no_row_is_made_between_a_removals_commit_and_its_unlink(tmp_path, monkeypatch, how):
    """Eviction (and the drop of a damaged chunk) committed the rows' deletion and then removed the
    files: a process recording the chunk as used in between made its row again while the file still
    stood, and the file went after. Here the other process records at the moment the file leaves
    its name; the files now go under the index's write lock, so it waits, and finds no file."""
    from mfsreg.registry.client.cachefiles import atomic_write

    cache, chunks = _ranked_cache(tmp_path)
    other = NodeCache(tmp_path / "ranked")
    x, _, _ = chunks
    try:
        if how == "evict":
            cache.put(x, chunks[x], "unique", "f")
        else:  # a file at x's name that is not x's bytes, with its row
            atomic_write(cache.chunk_file(x), b"\0" * 4096, mode=0o444)
            cache.record([(x, 4096, "unique", "f")])
        waited = []

        def while_another_records(real):
            def call(path, *args, **kwargs):
                if os.fspath(path) == cache.chunk_file(x) and not waited:  # the file leaves its name
                    t = threading.Thread(target=other.record, args=([(x, 4096, "unique", "f")],))
                    t.start()
                    t.join(timeout=0.5)  # done at once where nothing holds the lock
                    waited.append(t)
                return real(path, *args, **kwargs)

            return call

        for name in ("unlink", "rename"):  # a drop renames the file aside first
            monkeypatch.setattr(os, name, while_another_records(getattr(os, name)))
        if how == "evict":
            cache.evict(max_bytes=0)
        else:
            assert cache.get_verified(x) is None
        monkeypatch.undo()
        assert waited, "the file never left its name"
        waited[0].join(timeout=60)
        assert not cache.has(x)
        assert other.stats()["chunks"] == 0 and other.stats()["bytes"] == 0, other.stats()
    finally:
        other.close()
        cache.close()


def test_a_good_copy_placed_while_a_damaged_one_is_dropped_stays(tmp_path, monkeypatch):
    """A damaged chunk file is dropped by the one that found it (get_verified, `cache verify`);
    another process fetching the chunk again renames its good copy into place at any moment. The
    drop checked the file at the name was the damaged one, then unlinked the name: a good copy
    renamed in between was deleted. Here the good copy lands before each file-system call the drop
    makes in turn, and stays every time."""
    from mfsreg.registry.client.cachefiles import atomic_write

    good = bytes(range(256)) * 16
    x = chunk_id(good)
    points = 0
    for k in range(10):
        cache = NodeCache(tmp_path / f"c{k}")
        path = cache.chunk_file(x)
        atomic_write(path, b"\0" * len(good), mode=0o444)  # damaged: not x's bytes
        cache.record([(x, len(good), "unique", "f")])
        calls, busy = [], []

        def spy(real):
            def call(*args, **kwargs):
                if not busy and any(os.fspath(a).startswith(os.path.dirname(path)) for a in args[:2]):
                    if len(calls) == k:
                        busy.append(1)  # the other process, renaming its good copy into place
                        atomic_write(path, good, mode=0o444)
                        busy.clear()
                    calls.append(real.__name__)
                return real(*args, **kwargs)

            return call

        for name in ("stat", "lstat", "rename", "replace", "unlink"):
            monkeypatch.setattr(os, name, spy(getattr(os, name)))
        try:
            assert cache.get_verified(x) is None  # the damaged file, found so
        finally:
            monkeypatch.undo()
        try:
            if len(calls) <= k:  # no call left to put the good copy before: every point was tried
                break
            with open(path, "rb") as f:
                assert chunk_id(f.read()) == x, (k, calls)
            assert not [p for p in Path(path).parent.iterdir() if p.name.startswith(".")], (
                k,
                calls,
            )  # nothing left aside
            points += 1
        finally:
            cache.close()
    assert points >= 2, points


def test_a_fetch_that_meets_a_damaged_chunk_keeps_and_counts_the_chunks_it_wrote(reg, fam, tmp_path):
    """A fetch writes each chunk to the cache as it is decoded, and records the batch's rows at its
    end. A batch that meets a damaged chunk fails in one line naming it; the chunks written before
    the failure stay, each recorded (counted by stats and the size limit), and the damaged one is
    not there."""
    from mfsreg.registry.errors import IntegrityError
    from tests.test_check import _damage as damage_in_its_pack

    reg.push(fam["base"], "fam", "base")
    ids = reg.manifest("fam", "base")[1].chunk_ids()
    victim = reg.locate(ids)[ids[-1]]  # decoded last: every other chunk is written before it fails
    damage_in_its_pack(reg, victim)
    node = Node(registry=reg, cache_dir=str(tmp_path / "c"))
    try:
        info = node.fetcher.version("fam", "base")
        assert sum(info.located[i].size for i in ids) < (16 << 20)  # one batch (fetch.MIN_BATCH_BYTES)
        with pytest.raises(IntegrityError, match=f"chunk {victim.id} .*the stored pack is damaged"):
            node.fetcher.ensure("fam", ids, info.located, info.tiers)
        on_disk = {p.name for p in (tmp_path / "c" / "chunks").rglob("*") if p.is_file()}
        assert victim.id not in on_disk and len(on_disk) == len(set(ids)) - 1
        stats = node.cache.stats()
        assert stats["chunks"] == len(on_disk), stats
        assert not (tmp_path / "c" / "unrecorded").exists()
    finally:
        node.close()


def test_a_basis_read_mapped_is_the_files_bytes_read_only_and_a_damaged_one_is_dropped(tmp_path):
    """Bases of deltas are read through a read-only map of their cache file (get_verified's
    mapped=True), not copied: the bytes are the file's, cannot be written through, and a damaged,
    empty-but-wrong or missing file gives None (the damaged one dropped, to be fetched again);
    a fifo at the name is no chunk, and does not block."""
    from mfsreg.registry.client.cachefiles import atomic_write

    cache = NodeCache(tmp_path / "c")
    try:
        good = bytes(range(256)) * 64
        x = chunk_id(good)
        atomic_write(cache.chunk_file(x), good, mode=0o444)
        got = cache.get_verified(x, mapped=True)
        assert isinstance(got, memoryview) and got.readonly and bytes(got) == good
        with pytest.raises(TypeError):
            got[0] = 1  # type: ignore[index]
        del got
        empty = chunk_id(b"")
        atomic_write(cache.chunk_file(empty), b"", mode=0o444)  # nothing to map: read instead
        assert cache.get_verified(empty, mapped=True) == b""
        bad = chunk_id(b"other bytes")
        atomic_write(cache.chunk_file(bad), b"not those bytes", mode=0o444)
        assert cache.get_verified(bad, mapped=True) is None
        assert not cache.has(bad)  # dropped: fetched again by whoever needs it
        assert cache.get_verified(chunk_id(b"never cached"), mapped=True) is None
        fifo = chunk_id(b"a fifo")
        os.makedirs(os.path.dirname(cache.chunk_file(fifo)), exist_ok=True)
        os.mkfifo(cache.chunk_file(fifo))
        assert cache.get_verified(fifo, mapped=True) is None
    finally:
        cache.close()


def test_a_cached_chunk_evicted_during_a_pull_is_fetched_at_once_not_after_the_fetch(published, fam, tmp_path):
    """A chunk the pull found cached, then evicted by another process before the assembly reached
    it, is fetched again at once: the assembly waited for the whole background fetch to end first,
    as if the chunk were still to come from it."""
    from mfsreg.registry.client import node as node_pull
    from mfsreg.registry.client.fetch import Fetcher
    from mfsreg.registry.progress import NullProgress

    _, env = published
    cache_dir = tmp_path / "cache"
    mfsreg("cache", "warm", "fam", "--tier", "base", env=dict(env, MFSREG_CACHE_DIR=str(cache_dir)))
    cache = NodeCache(cache_dir)
    remote = RemoteRegistry(env["MFSREG_URL"], token=env["MFSREG_TOKEN"])
    try:
        fetcher = Fetcher(remote, cache)
        info = fetcher.version("fam", "lora-chat")
        entry = info.manifest.files[0]
        # the assembly waits at the header (this member's own, fetched) until the fetch lands it; the
        # victim comes after it, cached when the fetch looks and evicted as the fetch starts
        assert not cache.has(entry.chunks[0].id)
        victim = next(c.id for c in entry.chunks[1:] if cache.has(c.id))
        events: list[tuple[str, bool]] = []
        real_ensure = fetcher.ensure

        def logged_ensure(*args, again=False, landed=None, **kwargs):
            def landed_then_linger(ids):  # the fetch goes on a while after its batch lands
                landed(ids)
                time.sleep(1.0)

            events.append(("start", again))
            try:
                return real_ensure(*args, again=again, landed=landed_then_linger if landed else None, **kwargs)
            finally:
                events.append(("end", again))

        fetcher.ensure = logged_ensure

        class EvictAtFetch(NullProgress):  # another process's eviction, after the fetch looked
            def start(self, task: str, total: int) -> None:
                if task == "fetch":
                    os.unlink(cache.chunk_file(victim))

        out = tmp_path / "out.safetensors"
        node_pull.pull(fetcher, "fam", "lora-chat", out, EvictAtFetch())
        assert filecmp.cmp(out, fam["lora-chat"], shallow=False)
        assert events.index(("start", True)) < events.index(("end", False)), events
    finally:
        remote.close()
        cache.close()


@pytest.mark.parametrize("how, writes_to", [("-o", "direct"), ("-o", "page cache"), ("--to-dir", "page cache")])
def test_a_node_pull_that_fails_partway_leaves_the_files_there_as_they_were(
    how, writes_to, published_alone, server_env, tmp_path
):
    """A directory version's files are renamed into place together: a node pull of v2 over v1 whose
    last big file needs a chunk the server has lost fails in one line and leaves v1's files, every
    one, with no temp file or link beside them (before, the files before it had replaced v1's); one
    into a new folder leaves no folder."""
    from mfsreg.registry.blobs.packs import pack_key
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    _, env = published_alone
    env["MFSREG_PULL_DIRECT"] = "1" if writes_to == "direct" else "0"
    v1, v2 = synth.two_directory_versions(tmp_path / "src")
    mfsreg_json("push", v1, "--family", "dirs", "--version", "v1", env=env)
    mfsreg_json("push", v2, "--family", "dirs", "--version", "v2", "--parent", "v1", env=env)
    out = tmp_path / "engine"
    mfsreg_json("pull", "dirs", "v1", how, out, env=env)
    mfsreg_json("pull", "dirs", "v2", "-o", tmp_path / "scratch", env=env)  # the cache holds every chunk of v2
    reg = Registry(Settings.from_env(server_env))
    try:
        path, victim = synth.last_file_victim(reg.manifest("dirs", "v1")[1], reg.manifest("dirs", "v2")[1])
        pack_id = reg.locate([victim])[victim].pack_id
        reg.blobs.delete(pack_key(pack_id))  # lost by the server, and dropped from the node's cache
    finally:
        reg.close()
    _cache_file(env, victim).unlink()

    proc = mfsreg("pull", "dirs", "v2", how, out, env=env, check=False)
    assert proc.returncode == 5 and "storage lost data" in proc.stderr and pack_id in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in v1.iterdir())  # nothing stayed beside them
    for f in v1.iterdir():
        assert filecmp.cmp(out / f.name, f, shallow=False), f.name
    proc = mfsreg("pull", "dirs", "v2", how, tmp_path / "new" / "engine", env=env, check=False)
    assert proc.returncode == 5, proc.stderr
    assert not (tmp_path / "new").exists()  # the folders it made for the files went with them


def test_cache_sizes_take_terabytes_and_say_what_a_size_is(tmp_path):
    """A node cache of a terabyte or more was refused ('1T' is not a size); and '0' was refused as
    'not a size' without saying that a size is at least a byte."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env["MFSREG_CACHE_DIR"] = str(tmp_path / "c")
    NodeCache(tmp_path / "c").close()
    assert parse_size("1.5T") == 3 << 39
    assert mfsreg_json("cache", "prune", "--max-size", "2T", env=env)["removed"] == 0
    proc = mfsreg("cache", "prune", env=dict(env, MFSREG_CACHE_MAX="1.5T"), check=False)
    assert proc.returncode == 0, proc.stderr
    proc = mfsreg("cache", "prune", "--max-size", "0", env=env, check=False)
    assert proc.returncode == 2 and "1 byte or more" in proc.stderr and "T" in proc.stderr, proc.stderr


def _fill_all(node: Node, info, copier: Copier, refetch, **kwargs) -> dict[str, torch.Tensor]:
    """Every tensor of ``info`` put in place by fill() from the cache, ``refetch`` called for chunks
    to fetch again."""
    lay = layout(info)
    targets = {n: copier.empty(span) for n, (span, _) in lay.items()}
    todo = {n: pieces for n, (_, pieces) in lay.items()}
    fill(node, info, lay, copier, targets, todo, cached=True, refetch=refetch, **kwargs)
    return targets


def _staged(node: Node, verify: bool = True) -> Copier:
    """A CPU copier that takes the GPU's way (staging buffers, pooled reads, refetch per buffer):
    its logic runs here, where no GPU is lent; only the stream and its events are left out."""
    copier = Copier(node.cache, torch.device("cpu"), node.remote.pool, verify)
    copier.staged = True
    return copier


def test_the_staged_copy_of_the_gpu_path_loads_exactly_and_refetches_in_one_go(published, fam, monkeypatch):
    """The staged path, with buffers smaller than the model so that several fill in turn: the
    tensors equal the file's; two damaged chunks are fetched again in one call; the buffers go
    when the load ends."""
    import mfsreg.registry.client.torch_loader as tl

    _, env = published
    monkeypatch.setattr(tl, "STAGE_BYTES", 64 << 10)
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        load_tensors("fam", "lora-chat", node=node)  # cached
        info = node.fetcher.version("fam", "lora-chat")
        ids = chunk_ids(layout(info))
        _damage(env, ids[0], ids[-1])
        calls = []
        real = refetcher(node.fetcher, info)
        copier = _staged(node)
        _, tensors = build(node, "fam", "lora-chat", copier)
        assert copier.stages is not None and copier.stages[0].numel() == max(
            64 << 10, max(c.size for c in info.located.values())
        )
        _equal_to_file(tensors, fam["lora-chat"])
        # the same again, counting the refetches: one per buffer that met damage, not one per chunk
        _damage(env, ids[1], ids[2])
        targets = _fill_all(node, info, copier, lambda i: (calls.append(list(i)), real(i)))
        _equal_to_file(targets, fam["lora-chat"])
        assert sorted(i for c in calls for i in c) == sorted(ids[1:3]) and len(calls) <= 2, calls
        copier.release()
        assert copier.stages is None
    finally:
        node.close()


def test_a_failure_to_wait_for_queued_copies_does_not_hide_the_error_that_stopped_the_load(published, monkeypatch):
    """fill() waits for queued copies in its ``finally``; where that wait fails too (a CUDA error
    surfaces at the next synchronisation), the error the load stopped on is still the one raised,
    with the other noted on it."""
    from mfsreg.registry.errors import StorageError

    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        load_tensors("fam", "base", node=node)
        info = node.fetcher.version("fam", "base")
        ids = chunk_ids(layout(info))
        _damage(env, ids[0], ids[1])
        copier = _staged(node)

        def finish():
            raise RuntimeError("CUDA error: an illegal memory access was encountered")

        monkeypatch.setattr(copier, "finish", finish)  # the device's failure; the rest is the real copier

        def registry_down(chunk_ids):
            raise StorageError("the registry is unreachable")

        with pytest.raises(StorageError, match="unreachable") as caught:
            _fill_all(node, info, copier, registry_down)
        assert any("illegal memory access" in n for n in getattr(caught.value, "__notes__", []))
    finally:
        node.close()


def test_a_resident_model_gives_back_its_staging_buffers_when_idle_or_closed(published, fam, monkeypatch):
    import mfsreg.registry.client.resident as resident

    _, env = published
    monkeypatch.setattr(resident, "IDLE_RELEASE_S", 0.3)
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    model = ResidentModel("fam", "base", node=node)
    try:
        model.copier.staged = True  # the GPU's way, on the CPU (see _staged)
        model.switch("lora-chat")
        assert model.copier.stages is not None
        _equal_to_file(model.tensors, fam["lora-chat"])
        deadline = time.monotonic() + 30
        while model.copier.stages is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert model.copier.stages is None, "not given back when idle"
        model.switch("base")  # made again by the next switch
        assert model.copier.stages is not None
        _equal_to_file(model.tensors, fam["base"])
        model.close()
        assert model.copier.stages is None, "not given back on close"
    finally:
        model.close()
        node.close()


def test_a_refetch_racing_another_process_eviction_ends_with_the_chunk_present(published, fam, tmp_path):
    """A load meets chunks missing from the cache and fetches them again; another process evicts
    everything it may the moment they land. They are leased until placed, so the load ends whole
    and the chunks stay cached."""
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    other = NodeCache(env["MFSREG_CACHE_DIR"])  # another process's handle on the same cache
    try:
        load_tensors("fam", "lora-chat", node=node)
        info = node.fetcher.version("fam", "lora-chat")
        victims = chunk_ids(layout(info))[:3]
        for i in victims:
            os.unlink(_cache_file(env, i))
        real = refetcher(node.fetcher, info)
        evicted = []

        def refetch_then_evicted(chunk_ids):
            real(chunk_ids)
            evicted.append(other.evict(max_bytes=0))  # everything not leased goes

        copier = Copier(node.cache, torch.device("cpu"), node.remote.pool, True)
        targets = _fill_all(node, info, copier, refetch_then_evicted, record=False)
        assert evicted and evicted[0][0] > 0  # the eviction ran, and took what was not leased
        _equal_to_file(targets, fam["lora-chat"])
        assert all(node.cache.has(i) for i in victims)
    finally:
        other.close()
        node.close()


def test_an_eviction_lets_other_writers_in_while_it_gives_space_back(tmp_path, monkeypatch):
    """A large eviction once unlinked every file under the index's write lock, and every other
    pull waited for the lot. Now the files leave their names in batches under the lock and are
    unlinked after it: another process's write gets in during the unlinks."""
    import mfsreg.registry.client.eviction as eviction

    monkeypatch.setattr(eviction, "EVICT_BATCH", 8)
    cache = NodeCache(tmp_path / "big")
    other = NodeCache(tmp_path / "big")
    try:
        blobs = {}
        for k in range(40):
            data = k.to_bytes(2, "big") * 2048
            blobs[chunk_id(data)] = data
        cache.put_many((i, d, "unique", "f") for i, d in blobs.items())
        late = os.urandom(4096)
        got_in = []
        real_unlink = os.unlink

        def unlink(path, *args, **kwargs):
            if "/evicted/" in os.fspath(path) and not got_in:
                t = threading.Thread(target=other.put, args=(chunk_id(late), late, "base", "f"))
                t.start()
                t.join(timeout=20)  # at once where the lock is free
                got_in.append(not t.is_alive())
            return real_unlink(path, *args, **kwargs)

        monkeypatch.setattr(os, "unlink", unlink)
        removed, freed = cache.evict(max_bytes=4096 * 10)
        monkeypatch.undo()
        assert got_in == [True], "another writer waited for the whole eviction"
        assert removed >= 30 and cache.total_bytes() <= 4096 * 10
        assert not os.listdir(tmp_path / "big" / "evicted")  # every moved file was unlinked
        on_disk = {p.name for p in (tmp_path / "big" / "chunks").glob("*/*")}
        assert chunk_id(late) in on_disk and other.has(chunk_id(late))
        assert on_disk == {r for r in on_disk if cache.has(r)}  # no file without its row, or row without its file
    finally:
        other.close()
        cache.close()


def test_files_a_killed_eviction_left_aside_go_at_the_next(tmp_path):
    cache = NodeCache(tmp_path / "c")
    try:
        (tmp_path / "c" / "evicted").mkdir()
        left = tmp_path / "c" / "evicted" / ("ab" * 16)
        left.write_bytes(b"x" * 10)
        data = b"y" * 8192
        cache.put(chunk_id(data), data, "unique", "f")
        cache.evict(max_bytes=0)
        assert not left.exists() and not cache.has(chunk_id(data))
    finally:
        cache.close()


requires_cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no CUDA device: torch.cuda.is_available() is False"
)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.cuda
@requires_cuda
def test_cuda_load_and_switch_equal_the_files(published, fam, verify, monkeypatch):
    """On a GPU: load_tensors and a ResidentModel's switches hold exactly the files' tensors, through
    staging buffers smaller than the model (several fill in turn), and give the buffers back."""
    import mfsreg.registry.client.torch_loader as tl

    _, env = published
    monkeypatch.setattr(tl, "STAGE_BYTES", 64 << 10)
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        got = load_tensors("fam", "lora-chat", device="cuda", node=node, verify=verify)
        assert all(t.device.type == "cuda" for t in got.values())
        _equal_to_file({n: t.cpu() for n, t in got.items()}, fam["lora-chat"])
        model = ResidentModel("fam", "base", device="cuda", node=node, verify=verify)
        try:
            ptrs = {n: t.data_ptr() for n, t in model.tensors.items()}
            for target in ("lora-chat", "vocab-ext", "base"):
                model.switch(target)
                _equal_to_file({n: t.cpu() for n, t in model.tensors.items()}, fam[target])
            assert (
                model.tensors["model.layers.0.self_attn.q_proj.weight"].data_ptr()
                == ptrs["model.layers.0.self_attn.q_proj.weight"]
            )
            assert model.copier.stages is not None
        finally:
            model.close()
        assert model.copier.stages is None
    finally:
        node.close()


@pytest.mark.cuda
@requires_cuda
def test_cuda_a_damaged_chunk_is_fetched_again_on_the_gpu_path(published, fam):
    _, env = published
    node = Node(env["MFSREG_URL"], env["MFSREG_TOKEN"], env["MFSREG_CACHE_DIR"])
    try:
        load_tensors("fam", "base", node=node)
        ids = chunk_ids(layout(node.fetcher.version("fam", "base")))
        _damage(env, ids[0], ids[-1])
        got = load_tensors("fam", "base", device="cuda", node=node)
        _equal_to_file({n: t.cpu() for n, t in got.items()}, fam["base"])
    finally:
        node.close()


def test_missing_chunks_are_spread_evenly_over_the_requests():
    from mfsreg.registry.client.fetch import BATCH_BYTES, MIN_BATCH_BYTES, batch_limit
    from mfsreg.registry.parallel import sized_batches

    mib = 1 << 20
    sizes = [2 * mib] * 53  # a member's 106 MiB missing, in 2 MiB chunks
    batches = list(sized_batches(range(53), lambda i: sizes[i], batch_limit(sum(sizes), 4)))
    assert len(batches) == 4 and max(map(len, batches)) - min(map(len, batches)) <= 3
    assert batch_limit(7 * mib, 4) == MIN_BATCH_BYTES  # a small member: one request
    assert batch_limit(10 << 30, 4) == BATCH_BYTES  # a large one: requests of at most BATCH_BYTES
    assert batch_limit(0, 4) == MIN_BATCH_BYTES
