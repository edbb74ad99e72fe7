"""Blob stores: where packs (and nothing else) are kept. See base.BlobStore for the contract."""

from __future__ import annotations

from mfsreg.registry.blobs.base import BlobStore
from mfsreg.registry.blobs.urls import check_endpoint_url, configured_endpoint, parse_blob_url

# open_blob_store is stores.py's: imported from here, it would make every blobs module (and the
# settings, which check blob URLs) depend on the S3 store
__all__ = ["BlobStore", "check_endpoint_url", "configured_endpoint", "parse_blob_url"]
