"""A real S3 endpoint on loopback for the tests: moto's standalone server, one per test session.

The server is moto's HTTP server, so boto3 goes through its whole stack (signing, retries, ranges,
multipart) exactly as against MinIO or AWS; nothing of ours is mocked. Fixtures:
- ``s3_server``: the endpoint URL; also puts dummy AWS credentials and a region in os.environ.
- ``s3_bucket``: ``(endpoint_url, bucket)``, a fresh bucket emptied and removed after the test.
- ``s3_blob_url``: ``(blob_url, endpoint_url)`` for Settings / open_blob_store, in a fresh bucket.
"""

from __future__ import annotations

import functools
import logging
import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import boto3
import pytest

_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    # without these a developer's own profile or session token would be mixed into the requests
    "AWS_SESSION_TOKEN": None,
    "AWS_PROFILE": None,
}


# One server per process even when the fixture is imported into several modules (conftest.py and a
# test module each make their own session fixture from the same function): count the users.
_shared: dict = {"users": 0}


@pytest.fixture(scope="session")
def s3_server():
    if not _shared["users"]:
        from moto.server import ThreadedMotoServer

        _shared["saved"] = {k: os.environ.get(k) for k in _ENV}
        _set_env(_ENV)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)  # port 0: a free one
        server.start()
        logging.getLogger("werkzeug").setLevel(logging.WARNING)  # one INFO line per request otherwise
        host, port = server.get_host_and_port()
        _shared.update(server=server, endpoint=f"http://{host}:{port}")
    _shared["users"] += 1
    try:
        yield _shared["endpoint"]
    finally:
        _shared["users"] -= 1
        if not _shared["users"]:
            _shared["server"].stop()
            _set_env(_shared["saved"])


def _set_env(values: dict) -> None:
    for k, v in values.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@functools.cache
def _client(endpoint_url: str):
    # one client per endpoint: building one parses the S3 service model, about 0.1 s each time
    return boto3.session.Session().client("s3", endpoint_url=endpoint_url, region_name="us-east-1")


@pytest.fixture
def s3_bucket(s3_server):
    with scratch_bucket(s3_server) as bucket:
        yield s3_server, bucket


@contextmanager
def scratch_bucket(endpoint_url: str) -> Iterator[str]:
    """A new bucket on the server at ``endpoint_url``, emptied and removed afterwards."""
    bucket = f"mfsreg-test-{uuid.uuid4().hex[:16]}"
    s3 = _client(endpoint_url)
    s3.create_bucket(Bucket=bucket)
    try:
        yield bucket
    finally:
        # the server keeps objects in memory for the whole session: free them with the bucket
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket):
            for obj in page.get("Contents", []):
                s3.delete_object(Bucket=bucket, Key=obj["Key"])
        for up in s3.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            s3.abort_multipart_upload(Bucket=bucket, Key=up["Key"], UploadId=up["UploadId"])
        s3.delete_bucket(Bucket=bucket)


@pytest.fixture
def s3_blob_url(s3_bucket):
    endpoint_url, bucket = s3_bucket
    return f"s3://{bucket}/blobs", endpoint_url
