"""Opening the blob store a URL names: a local directory or an S3 bucket."""

from __future__ import annotations

from urllib.parse import urlsplit

from mfsreg.registry.blobs.base import BlobStore
from mfsreg.registry.blobs.urls import check_not_left_behind, parse_blob_url


def open_blob_store(url: str, s3_endpoint_url: str | None = None, **s3_options) -> BlobStore:
    """Open the blob store named by ``url``: ``file:///dir`` or ``s3://bucket/prefix``; ``s3_options``
    (connect_timeout, read_timeout, max_attempts) go to S3BlobStore."""
    scheme, where, prefix = parse_blob_url(url)
    if scheme == "file":
        from mfsreg.registry.blobs.local import LocalBlobStore

        check_not_left_behind(urlsplit(url).path, where)
        return LocalBlobStore(where)
    from mfsreg.registry.blobs.s3 import S3BlobStore

    return S3BlobStore(where, prefix, endpoint_url=s3_endpoint_url, **s3_options)
