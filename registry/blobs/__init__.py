"""Blob stores: where packs (and nothing else) are kept. See base.BlobStore for the contract."""

from __future__ import annotations

from urllib.parse import urlparse

from registry.blobs.base import BlobStore
from registry.errors import InvalidRequest


def open_blob_store(url: str, s3_endpoint_url: str | None = None) -> BlobStore:
    """Open the blob store named by ``url``: ``file:///dir`` or ``s3://bucket/prefix``."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        from registry.blobs.local import LocalBlobStore

        if parsed.netloc not in ("", "localhost"):  # file://relative/x names host "relative" and path /x
            raise InvalidRequest(f"MFSREG_BLOB_URL={url!r} names host {parsed.netloc!r}: a file URL takes an absolute "
                                 f"path after three slashes, e.g. file:///srv/mfsreg/blobs")
        if not parsed.path.startswith("/"):  # file:// (no path), file:blobs (relative to wherever a command runs)
            raise InvalidRequest(f"MFSREG_BLOB_URL={url!r} has no absolute path: a file URL takes one after three "
                                 f"slashes, e.g. file:///srv/mfsreg/blobs")
        return LocalBlobStore(parsed.path)
    if parsed.scheme == "s3":
        from registry.blobs.s3 import S3BlobStore

        return S3BlobStore(parsed.netloc, parsed.path.strip("/"), endpoint_url=s3_endpoint_url)
    raise InvalidRequest(f"MFSREG_BLOB_URL={url!r}: use file:///path or s3://bucket/prefix")
