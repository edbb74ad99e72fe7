"""The BlobStore contract (registry/blobs/base.py), checked on every backend by one shared suite.

``store`` is each backend in turn: a local directory, and S3 on a real endpoint on loopback (moto's
server, see tests/s3server.py). A backend-specific test sits at the end only where a failure mode
exists on that backend alone (unreachable endpoint, missing bucket, multipart).
"""

from __future__ import annotations

import hashlib
import http.server
import os
import socket
import threading
import time

import boto3
import pytest

from mfsreg.registry.blobs.base import BlobStore
from mfsreg.registry.blobs.packs import PackWriter, StoredChunk, read_payloads
from mfsreg.registry.blobs.s3 import MULTIPART_CHUNK, MULTIPART_THRESHOLD, S3BlobStore
from mfsreg.registry.blobs.stores import open_blob_store
from mfsreg.registry.config import Settings
from mfsreg.registry.errors import InvalidRequest, NotFound, StorageError

DATA = bytes(range(256)) * 40 + b"tail"  # 10244 bytes, every offset distinguishable


@pytest.fixture(params=["local", "s3"])
def store(request, tmp_path) -> BlobStore:
    if request.param == "local":
        return open_blob_store((tmp_path / "blobs").as_uri())
    endpoint_url, bucket = request.getfixturevalue("s3_bucket")
    return open_blob_store(f"s3://{bucket}/reg/blobs", endpoint_url)


def big_data(mib: int) -> bytes:
    """Incompressible, cheap to make: one random MiB repeated, each copy stamped with its index."""
    block = os.urandom(1 << 20)
    return b"".join(i.to_bytes(8, "little") + block[8:] for i in range(mib))


def test_put_get_round_trip(store):
    store.put("packs/aa/one.pack", DATA)
    assert store.get("packs/aa/one.pack") == DATA
    assert store.get("packs/aa/one.pack", 0, len(DATA)) == DATA
    assert store.get("packs/aa/one.pack", 10000) == DATA[10000:]
    assert store.size("packs/aa/one.pack") == len(DATA)


def test_put_accepts_memoryview(store):
    store.put("mv", memoryview(DATA)[100:200])
    assert store.get("mv") == DATA[100:200]


def test_get_range(store):
    store.put("k", DATA)
    assert store.get("k", 5, 17) == DATA[5:17]
    assert store.get("k", len(DATA) - 1, len(DATA)) == DATA[-1:]
    assert store.get("k", 0, 1) == DATA[:1]


def test_zero_length_ranges(store):
    store.put("k", DATA)
    assert store.get("k", 7, 7) == b""
    assert store.get("k", len(DATA), len(DATA)) == b""
    assert store.get("k", len(DATA)) == b""
    with pytest.raises(NotFound):
        store.get("k", len(DATA) + 1, len(DATA) + 1)
    with pytest.raises(NotFound):
        store.get("nope", 0, 0)


def test_empty_object(store):
    store.put("empty", b"")
    assert store.size("empty") == 0
    assert store.get("empty") == b""
    with pytest.raises(NotFound):
        store.get("empty", 0, 1)


@pytest.mark.parametrize(
    "start,end",
    [
        (5, len(DATA) + 1),
        (len(DATA), len(DATA) + 10),
        (len(DATA) + 5, len(DATA) + 10),
        (len(DATA) + 1, None),
        (-1, 4),
        (9, 3),
    ],
)
def test_range_outside_object_raises_not_found(store, start, end):
    store.put("k", DATA)
    with pytest.raises(NotFound):
        store.get("k", start, end)
    with pytest.raises(NotFound):
        store.get_ranges("k", [(0, 4), (start, end)])


def test_missing_key(store):
    with pytest.raises(NotFound):
        store.get("missing/key")
    with pytest.raises(NotFound):
        store.get("missing/key", 0, 10)
    with pytest.raises(NotFound):
        store.size("missing/key")
    with pytest.raises(NotFound):
        store.get_ranges("missing/key", [(0, 1), (2, 3)])
    assert not store.exists("missing/key")


def test_exists(store):
    assert not store.exists("a/b")
    store.put("a/b", DATA)
    assert store.exists("a/b")


def test_put_is_idempotent(store):
    store.put("k", DATA)
    store.put("k", DATA)
    store.put("k", memoryview(DATA))
    assert store.get("k") == DATA
    assert list(store.list()) == ["k"]


def test_put_replaces_whole_object(store):
    store.put("k", DATA[:100])
    store.put("k", DATA)  # another size: written again, all of it
    assert store.get("k") == DATA


def test_reader_never_sees_part_of_a_put(store):
    data = big_data(4)
    seen: list[int] = []
    whole: list[bool] = []  # whether the first full read held exactly the bytes put (checked here,
    errors: list[BaseException] = []  # not in the thread, where a failed assert fails nothing)
    done = threading.Event()

    def reader():
        try:
            while not done.is_set():
                try:
                    got = store.get("atomic")
                except NotFound:
                    seen.append(0)
                    continue
                seen.append(len(got))
                whole.append(got == data)
                return
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    try:
        store.put("atomic", data)
        t.join(timeout=30)
    finally:
        done.set()
        t.join(timeout=30)
    assert not t.is_alive() and errors == []
    assert seen and set(seen) <= {0, len(data)} and whole == [True]
    assert store.get("atomic") == data


def test_delete(store):
    store.delete("never/there")
    store.put("k", DATA)
    store.delete("k")
    assert not store.exists("k")
    store.delete("k")


def test_list_with_prefix(store):
    keys = ["packs/ab/1.pack", "packs/cd/2.pack", "packs2/x", "other/y", "z"]
    for k in keys:
        store.put(k, k.encode())
    assert sorted(store.list()) == sorted(keys)
    assert sorted(store.list("packs/")) == ["packs/ab/1.pack", "packs/cd/2.pack"]
    assert sorted(store.list("packs")) == ["packs/ab/1.pack", "packs/cd/2.pack", "packs2/x"]
    assert list(store.list("nothing/")) == []


def test_get_ranges_in_request_order(store):
    store.put("k", DATA)
    ranges = [(9000, 10244), (0, 5), (5, 5), (300, 301), (0, 5), (1000, 3000)]
    assert store.get_ranges("k", ranges) == [DATA[s:e] for s, e in ranges]
    assert store.get_ranges("k", []) == []


@pytest.mark.parametrize("key", ["../x", "/abs", "a//b", "a/../b", "", ".hidden", "sp ace"])
def test_invalid_keys(store, key):
    for call in (
        lambda: store.put(key, b"x"),
        lambda: store.get(key),
        lambda: store.get_ranges(key, [(0, 1)]),
        lambda: store.size(key),
        lambda: store.exists(key),
        lambda: store.delete(key),
    ):
        with pytest.raises(InvalidRequest):
            call()


def test_large_object_by_ranges(store):
    data = big_data(80)
    store.put("big/one.pack", data)
    assert store.size("big/one.pack") == len(data)
    c = MULTIPART_CHUNK
    ranges = [(0, 1 << 20), (c - 10, c + 10), (3 * c - 1, 4 * c + 1), (len(data) - 100, len(data))]
    assert store.get_ranges("big/one.pack", ranges) == [data[s:e] for s, e in ranges]
    assert hashlib.sha256(store.get("big/one.pack")).digest() == hashlib.sha256(data).digest()
    store.put("big/one.pack", data)  # a retried put of the same bytes leaves the object as it was
    assert store.size("big/one.pack") == len(data) and store.get("big/one.pack", len(data) - 100) == data[-100:]


def test_packs_interop(store):
    flushed: list[StoredChunk] = []
    writer = PackWriter(store, pack_size=4096, on_flush=lambda pid, n, chunks: flushed.extend(chunks))
    payloads = {f"c{i:03d}": os.urandom(100 + 37 * i) for i in range(60)}
    for cid, p in payloads.items():
        writer.add(cid, len(p), "raw", p)
    writer.flush()
    assert {c.id for c in flushed} == set(payloads)
    assert len({c.pack_id for c in flushed}) > 1
    wanted = flushed[::3] + flushed[1::7]  # a scattered subset, in several packs
    got = {c.id: bytes(b) for c, b in read_payloads(store, wanted)}
    assert got == {c.id: payloads[c.id] for c in wanted}


# S3 alone -------------------------------------------------------------------------------------


def leave_a_partial_put(store: BlobStore, key: str, data: bytes) -> None:
    """What a writer killed mid-put leaves: for a local store, its temp file beside the blob's name
    (written as put writes it); for S3, a multipart upload with a part stored, never completed."""
    if isinstance(store, S3BlobStore):
        raw = boto3.session.Session().client("s3", endpoint_url=store.endpoint_url)
        full = f"{store.prefix}/{key}"
        up = raw.create_multipart_upload(Bucket=store.bucket, Key=full)
        raw.upload_part(Bucket=store.bucket, Key=full, UploadId=up["UploadId"], PartNumber=1, Body=data)
        return
    path = store.root / key
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.parent / f".{path.name}.0123456789abcdef0123456789abcdef.tmp").write_bytes(data)


def test_what_a_killed_put_leaves_is_listed_apart_and_removed(store):
    store.put("packs/aa/kept.pack", DATA)
    leave_a_partial_put(store, "packs/bb/cut.pack", DATA[:5000])
    (left,) = list(store.leftovers())
    assert left.size == 5000 and 0 <= left.age < 60, left
    assert list(store.list()) == ["packs/aa/kept.pack"] and not store.exists("packs/bb/cut.pack")
    store.remove_leftover(left)
    store.remove_leftover(left)  # gone already: removed all the same
    assert list(store.leftovers()) == []
    assert store.get("packs/aa/kept.pack") == DATA


def test_s3_url_and_prefix_isolation(s3_bucket):
    endpoint_url, bucket = s3_bucket
    a = open_blob_store(f"s3://{bucket}/p", endpoint_url)
    b = S3BlobStore(bucket, "p2", endpoint_url=endpoint_url)
    assert a.url == f"s3://{bucket}/p" and b.url == f"s3://{bucket}/p2"
    a.put("k", b"in a")
    b.put("k", b"in b")
    assert list(a.list()) == ["k"] and a.get("k") == b"in a"
    raw = boto3.session.Session().client("s3", endpoint_url=endpoint_url)
    assert raw.get_object(Bucket=bucket, Key="p2/k")["Body"].read() == b"in b"


def test_s3_large_put_is_multipart(s3_bucket):
    endpoint_url, bucket = s3_bucket
    store = S3BlobStore(bucket, "m", endpoint_url=endpoint_url, multipart_threshold=2 * MULTIPART_CHUNK)
    data = big_data(2 * MULTIPART_CHUNK // (1 << 20) + 1)
    store.put("big", data)
    raw = boto3.session.Session().client("s3", endpoint_url=endpoint_url)
    etag = raw.head_object(Bucket=bucket, Key="m/big")["ETag"].strip('"')
    assert etag.endswith(f"-{-(-len(data) // MULTIPART_CHUNK)}")  # "<md5>-<parts>" marks multipart
    assert store.get("big", 1, len(data) - 1) == data[1:-1]


def test_s3_a_full_pack_is_one_put(s3_bucket):
    """A pack is flushed once it holds the pack size (64 MiB by default), so it runs past it by up
    to a chunk: with the threshold at the pack size every full pack went multipart, and a writer
    killed mid-upload left an invisible, billed upload in the bucket. One PUT leaves nothing."""
    endpoint_url, bucket = s3_bucket
    store = S3BlobStore(bucket, "one", endpoint_url=endpoint_url)
    data = big_data(64 + 2)  # a default pack plus a 2 MiB chunk
    assert len(data) < MULTIPART_THRESHOLD
    store.put("pack", data)
    raw = boto3.session.Session().client("s3", endpoint_url=endpoint_url)
    assert "-" not in raw.head_object(Bucket=bucket, Key="one/pack")["ETag"].strip('"')
    assert store.get("pack", len(data) - 10) == data[-10:]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _one_line(exc: BaseException) -> str:
    msg = str(exc)
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def test_s3_unreachable_endpoint(monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    store = S3BlobStore("bucket", "p", endpoint_url=endpoint, max_attempts=1, connect_timeout=1)
    for call in (
        lambda: store.put("k", b"x"),
        lambda: store.get("k"),
        lambda: store.size("k"),
        lambda: list(store.list()),
    ):
        with pytest.raises(StorageError) as info:
            call()
        msg = _one_line(info.value)
        assert endpoint in msg and "MFSREG_S3_ENDPOINT_URL" in msg


@pytest.mark.parametrize("variable", ["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"])
def test_s3_an_endpoint_set_the_aws_way_is_addressed_path_style(variable, s3_bucket, monkeypatch, tmp_path):
    """An endpoint in botocore's own variables instead of MFSREG_S3_ENDPOINT_URL: the client got no
    path-style setting of ours, so an AWS config file's addressing_style = virtual (or a botocore
    that does not force path style for configured endpoints) sent requests to bucket.host, which a
    MinIO or moto server by name does not answer. It is now treated as MFSREG_S3_ENDPOINT_URL is."""
    endpoint, bucket = s3_bucket
    by_name = endpoint.replace("127.0.0.1", "localhost")  # an IP would be addressed path-style anyway
    config = tmp_path / "aws-config"
    config.write_text("[default]\ns3 =\n    addressing_style = virtual\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    monkeypatch.delenv("AWS_ENDPOINT_URL_S3", raising=False)
    monkeypatch.setenv(variable, by_name)
    store = S3BlobStore(bucket, "p", max_attempts=1, connect_timeout=2, read_timeout=5)
    sent: list[str] = []
    store._s3.meta.events.register("before-send", lambda request, **_: sent.append(request.url))
    store.put("k", b"hello")
    assert store.get("k") == b"hello" and store.size("k") == 5
    assert sent and all(u.startswith(f"{by_name}/{bucket}/") for u in sent), sent
    assert store.endpoint_url == by_name and store.endpoint_setting == variable
    monkeypatch.setenv("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "true")  # botocore's switch, kept
    assert S3BlobStore(bucket, "p").endpoint_setting == "MFSREG_S3_ENDPOINT_URL"


def test_s3_a_bad_or_dead_endpoint_set_the_aws_way_is_named_as_such(monkeypatch):
    """Messages named MFSREG_S3_ENDPOINT_URL (\"MFSREG_S3_ENDPOINT_URL=None: Invalid endpoint\") for an
    endpoint that came from AWS_ENDPOINT_URL_S3; they name the variable it came from."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", "not a url")
    with pytest.raises(InvalidRequest) as info:
        S3BlobStore("bucket", "p")
    assert _one_line(info.value).startswith("AWS_ENDPOINT_URL_S3='not a url': ")
    endpoint = f"http://127.0.0.1:{_closed_port()}"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", endpoint)
    with pytest.raises(StorageError) as info:
        S3BlobStore("bucket", "p", max_attempts=1, connect_timeout=1).size("k")
    msg = _one_line(info.value)
    assert endpoint in msg and "check AWS_ENDPOINT_URL_S3 " in msg, msg
    with pytest.raises(StorageError) as info:  # the explicit setting comes first, and is named
        S3BlobStore("bucket", "p", endpoint_url=endpoint, max_attempts=1, connect_timeout=1).size("k")
    assert "check MFSREG_S3_ENDPOINT_URL " in _one_line(info.value)


def test_s3_missing_bucket(s3_server):
    store = S3BlobStore("no-such-bucket-mfsreg", "p", endpoint_url=s3_server)
    for call in (
        lambda: store.put("k", b"x"),
        lambda: store.get("k"),
        lambda: store.size("k"),
        lambda: list(store.list()),
    ):
        with pytest.raises(StorageError) as info:
            call()
        assert "does not exist" in _one_line(info.value)


def test_s3_no_credentials(s3_bucket, monkeypatch, tmp_path):
    endpoint_url, bucket = s3_bucket
    for var in (
        "AWS_ACCESS_KEY_ID",
        "AWS_SECRET_ACCESS_KEY",
        "AWS_SESSION_TOKEN",
        "AWS_PROFILE",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
        "AWS_CONTAINER_CREDENTIALS_FULL_URI",
        "AWS_WEB_IDENTITY_TOKEN_FILE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # else botocore waits on the metadata service
    store = S3BlobStore(bucket, "p", endpoint_url=endpoint_url, max_attempts=1)
    with pytest.raises(StorageError) as info:
        store.get("k")
    assert "AWS_ACCESS_KEY_ID" in _one_line(info.value)


def test_s3_an_aws_profile_that_does_not_exist_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("AWS_PROFILE", "no-such-profile-mfsreg")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    with pytest.raises(InvalidRequest) as info:  # was botocore's ProfileNotFound: an internal error
        S3BlobStore("bucket", "p", endpoint_url="http://127.0.0.1:9")
    msg = _one_line(info.value)
    assert "no-such-profile-mfsreg" in msg and "AWS_PROFILE" in msg


class _NotS3(http.server.BaseHTTPRequestHandler):
    """Another web server where the S3 endpoint should be: an HTML 404 to every request."""

    def _answer(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        body = b"<html><body><h1>404 Not Found</h1></body></html>"
        self.send_response(404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _answer

    def log_message(self, *args) -> None:
        pass


def test_s3_a_404_from_what_is_not_s3_is_not_a_missing_blob(monkeypatch):
    """A put, delete or list answered 404 names no missing blob (it said 'blob k is missing', exit
    2, even for a put): the endpoint is not the bucket's S3, and the message says what to check."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _NotS3)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        endpoint = f"http://127.0.0.1:{server.server_address[1]}"
        store = S3BlobStore("bucket", "p", endpoint_url=endpoint, max_attempts=1)
        for call in (lambda: store.put("k", b"x"), lambda: store.delete("k"), lambda: list(store.list())):
            with pytest.raises(StorageError) as info:
                call()
            msg = _one_line(info.value)
            assert endpoint in msg and "MFSREG_S3_ENDPOINT_URL" in msg, msg
    finally:
        server.shutdown()
        server.server_close()


class _DropsFirstStream(http.server.BaseHTTPRequestHandler):
    """An S3 endpoint whose first answer to a GET breaks off halfway through its body."""

    body = bytes(range(256)) * 64
    gets = 0

    def do_GET(self) -> None:
        cls = type(self)
        cls.gets += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(cls.body)))
        self.send_header("Content-Type", "application/octet-stream")
        self.end_headers()
        self.wfile.write(cls.body if cls.gets > 1 else cls.body[: len(cls.body) // 2])
        self.close_connection = True

    def log_message(self, *args) -> None:
        pass


def test_s3_a_stream_that_breaks_off_is_read_again(monkeypatch):
    """botocore retries a request that fails, not a body that breaks off once the answer began:
    the store asks again and returns the whole object, never the part it got."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    _DropsFirstStream.gets = 0
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DropsFirstStream)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        store = S3BlobStore("bucket", "p", endpoint_url=f"http://127.0.0.1:{server.server_address[1]}", max_attempts=1)
        assert store.get("k") == _DropsFirstStream.body and _DropsFirstStream.gets == 2
    finally:
        server.shutdown()
        server.server_close()


def test_s3_bad_url():
    with pytest.raises(InvalidRequest):
        open_blob_store("s3:///prefix-only")


def silent_endpoint() -> tuple[socket.socket, str]:
    """An S3 endpoint that takes connections (the kernel's backlog does) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_s3_an_endpoint_that_never_answers_fails_in_bounded_time_naming_it(monkeypatch):
    """A request the endpoint takes and never answers: botocore's retries, then one line that names
    the endpoint and the settings that bound the wait, after attempts x read timeout (it was 60 s x
    5 attempts, more with the body's own retries: six minutes of silence)."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    sock, endpoint = silent_endpoint()
    try:
        settings = Settings.from_env(
            {"MFSREG_HOME": "/nonexistent-mfsreg", "MFSREG_S3_READ_TIMEOUT": "1s", "MFSREG_S3_MAX_ATTEMPTS": "2"}
        )
        store = open_blob_store(
            "s3://mfsreg-packs/p",
            endpoint,
            read_timeout=settings.s3_read_timeout,
            max_attempts=settings.s3_max_attempts,
        )
        for call in (lambda: store.get("k", 0, 10), lambda: store.size("k")):
            t0 = time.monotonic()
            with pytest.raises(StorageError) as info:
                call()
            assert time.monotonic() - t0 < 8
            msg = _one_line(info.value)
            assert endpoint in msg and "did not answer" in msg and "MFSREG_S3_READ_TIMEOUT" in msg, msg
    finally:
        sock.close()


def test_s3_opening_a_store_sends_nothing_to_its_endpoint(monkeypatch):
    """Opening an S3 store makes its client and nothing more: the first request is the first use's
    (a Registry opens its store only for the commands that use it, and an admin's database-only
    commands must run while the endpoint is down). The endpoint is one that takes connections, so a
    request sent at opening would show as one waiting to be accepted."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    sock, endpoint = silent_endpoint()
    try:
        sock.settimeout(0)
        store = open_blob_store("s3://mfsreg-packs/p", endpoint, read_timeout=1, max_attempts=1)
        with pytest.raises(BlockingIOError):  # nobody connected
            sock.accept()
        with pytest.raises(StorageError):
            store.size("k")
        sock.accept()[0].close()  # the first use did: the check above can fail
    finally:
        sock.close()


def test_s3_timeouts_default_to_about_a_minute_and_bad_settings_are_refused(s3_server):
    config = S3BlobStore("mfsreg-packs", "p", endpoint_url=s3_server)._s3.meta.config
    assert config.connect_timeout == 5 and config.read_timeout == 20
    assert config.retries == {"mode": "standard", "total_max_attempts": 3}  # three tries in all, not 1 + 3
    s = Settings.from_env(
        {
            "MFSREG_HOME": "/x",
            "MFSREG_S3_CONNECT_TIMEOUT": "2",
            "MFSREG_S3_READ_TIMEOUT": "1m",
            "MFSREG_S3_MAX_ATTEMPTS": "1",
        }
    )
    assert (s.s3_connect_timeout, s.s3_read_timeout, s.s3_max_attempts) == (2, 60, 1)
    s3 = {"MFSREG_HOME": "/x", "MFSREG_BLOB_URL": "s3://mfsreg-packs/p"}
    for name, value in (
        ("MFSREG_S3_READ_TIMEOUT", "0"),
        ("MFSREG_S3_READ_TIMEOUT", "soon"),
        ("MFSREG_S3_CONNECT_TIMEOUT", "-1"),
        ("MFSREG_S3_MAX_ATTEMPTS", "0"),
        ("MFSREG_S3_MAX_ATTEMPTS", "2.5"),
        ("MFSREG_S3_MAX_ATTEMPTS", "99"),
        ("MFSREG_S3_ENDPOINT_URL", "ftp://x"),
        ("AWS_ENDPOINT_URL_S3", "http://host:notaport"),
    ):
        with pytest.raises(InvalidRequest, match=name):
            Settings.from_env({**s3, name: value})
        # a command that never opens the store reads the settings all the same, and the refusal
        # comes where an S3 store is opened; a local directory store takes none of them
        deferred = Settings.from_env({**s3, name: value}, blobs=False)
        with pytest.raises(InvalidRequest, match=name):
            deferred.blob_store_options()
        assert Settings.from_env({"MFSREG_HOME": "/x", name: value}).blob_store_options() == {}


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:9000",
        "http://minio:9000/",
        "https://s3.us-east-1.amazonaws.com",
        "http://[::1]:9000",
        "http://minio.internal.:9000",
        "HTTP://127.0.0.1:9000",
        "https://gateway.example/s3/prefix",
    ],
)
def test_the_usual_s3_endpoints_are_taken(url):
    from mfsreg.registry.blobs import check_endpoint_url

    assert check_endpoint_url(url) == url


@pytest.mark.parametrize(
    "url",
    [
        "minioadmin:s3cret@localhost:9000",
        "http:/user:s3cret@host:9000",
        "http:///user:s3cret@host",
        "http://user:s3cret@host:9000",
    ],
)
def test_an_endpoint_with_credentials_is_refused_without_quoting_them(url):
    from mfsreg.registry.blobs import check_endpoint_url

    with pytest.raises(InvalidRequest) as err:
        check_endpoint_url(url)
    assert "s3cret" not in str(err.value) and "MFSREG_S3_ENDPOINT_URL" in str(err.value), err.value


def test_a_local_put_still_writing_is_not_a_leftover(tmp_path):
    """A put holds a lock on its temp file while it writes: a prune, even with --min-age 0, takes
    only the temp files no live writer holds."""
    from mfsreg.registry.format.durable import hold, temp_beside

    store = open_blob_store((tmp_path / "blobs").as_uri())
    tmp = temp_beside(store.root / "packs" / "aa" / "x.pack")
    tmp.parent.mkdir(parents=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        hold(fd)
        os.write(fd, DATA)
        assert list(store.leftovers()) == []
    finally:
        os.close(fd)  # the writer dies: its lock goes with it
    assert [(left.name, left.size) for left in store.leftovers()] == [
        (tmp.relative_to(store.root).as_posix(), len(DATA))
    ]
