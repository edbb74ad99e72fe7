"""Blob stores: where packs (and nothing else) are kept. See base.BlobStore for the contract."""

from __future__ import annotations

import re
import os
import shlex
from urllib.parse import unquote, urlsplit

from registry.blobs.base import BlobStore, check_key
from registry.errors import InvalidRequest, shown

# S3's rules for a bucket name: 3 to 63 lowercase letters, digits, dots and hyphens, starting and
# ending with a letter or digit, no two dots in a row, not shaped like an IP address.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IPV4 = re.compile(r"\d+\.\d+\.\d+\.\d+")
_CREDENTIALS = ("give credentials the usual AWS way (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE) "
                "and the endpoint as MFSREG_S3_ENDPOINT_URL")


def parse_blob_url(url: str) -> tuple[str, str, str]:
    """``("file", directory, "")`` or ``("s3", bucket, prefix)`` for MFSREG_BLOB_URL, or
    InvalidRequest in one line. A message never quotes what could hold a secret: the part of an
    s3 URL before an '@', a query or a fragment."""
    try:
        parsed = urlsplit(url)
    except ValueError:  # an unclosed '[' (urllib's "Invalid IPv6 URL")
        parsed = None
    if parsed is not None and parsed.scheme == "file":
        if parsed.query or parsed.fragment:
            raise InvalidRequest("MFSREG_BLOB_URL holds a '?' or '#', which a file URL would drop: give the "
                                 "directory alone, e.g. file:///srv/mfsreg/blobs")
        if parsed.netloc not in ("", "localhost"):  # file://relative/x names host "relative" and path /x
            raise InvalidRequest(f"MFSREG_BLOB_URL={url!r} names host {parsed.netloc!r}: a file URL takes an absolute "
                                 f"path after three slashes, e.g. file:///srv/mfsreg/blobs")
        if not parsed.path.startswith("/"):  # file:// (no path), file:blobs (relative to wherever a command runs)
            raise InvalidRequest(f"MFSREG_BLOB_URL={url!r} has no absolute path: a file URL takes one after three "
                                 f"slashes, e.g. file:///srv/mfsreg/blobs")
        # A file URL's path is percent-encoded: the default, (MFSREG_HOME / "blobs").as_uri(), writes
        # a space in MFSREG_HOME as %20, which read literally named another directory outside it.
        return "file", unquote(parsed.path), ""
    if parsed is None or parsed.scheme != "s3":
        # not quoted: another scheme's URL (https://user:password@...) may hold a secret
        raise InvalidRequest("MFSREG_BLOB_URL is neither a file:///path nor an s3://bucket/prefix URL: use one of those")
    if "@" in parsed.netloc:
        raise InvalidRequest("MFSREG_BLOB_URL holds credentials (a part before '@'), which mfsreg does not read from "
                             f"it: give it as s3://bucket/prefix alone, and {_CREDENTIALS}")
    if parsed.query or parsed.fragment:
        raise InvalidRequest("MFSREG_BLOB_URL holds a '?' or '#', which an s3 URL does not take: give it as "
                             f"s3://bucket/prefix alone, and {_CREDENTIALS}")
    bucket = parsed.netloc
    if ":" in bucket:
        raise InvalidRequest(f"MFSREG_BLOB_URL names a port ({shown(bucket, 60)}): an s3 URL takes a bucket, "
                             "s3://bucket/prefix; give the server as MFSREG_S3_ENDPOINT_URL, e.g. http://127.0.0.1:9000")
    if not bucket:
        raise InvalidRequest("MFSREG_BLOB_URL names no bucket: use s3://bucket/prefix (three slashes are for file URLs)")
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IPV4.fullmatch(bucket):
        raise InvalidRequest(f"MFSREG_BLOB_URL names bucket {shown(bucket, 70)}, which is not a bucket name: S3 takes "
                             "3 to 63 lowercase letters, digits, dots and hyphens, starting and ending with a letter or "
                             "digit, e.g. s3://mfsreg-packs/prod")
    prefix = parsed.path.strip("/")
    if prefix:
        try:
            check_key(prefix)
        except InvalidRequest:
            raise InvalidRequest(f"MFSREG_BLOB_URL's prefix {shown(prefix, 70)} is not usable: give one of letters, "
                                 "digits, '.', '_', '-' and single '/', without '..', e.g. s3://mfsreg-packs/prod") from None
    return "s3", bucket, prefix


def _check_not_left_behind(literal: str, where: str) -> None:
    """Until the path was decoded, a store whose URL held a %-escape (MFSREG_HOME with a space) was
    kept at the literal path, e.g. /srv/my%20home/blobs; opening the decoded one would find none of
    its packs, so that store must be moved, not silently forgotten."""
    if literal != where and os.path.isdir(literal) and not os.path.exists(where):
        raise InvalidRequest(f"this registry's packs are in {literal}, where an earlier mfsreg read the blob URL's "
                             f"%-escapes literally; it now reads them as {where}: move that directory there "
                             f"(mv {shlex.quote(literal)} {shlex.quote(where)})")


def open_blob_store(url: str, s3_endpoint_url: str | None = None, **s3_options) -> BlobStore:
    """Open the blob store named by ``url``: ``file:///dir`` or ``s3://bucket/prefix``; ``s3_options``
    (connect_timeout, read_timeout, max_attempts) go to S3BlobStore."""
    scheme, where, prefix = parse_blob_url(url)
    if scheme == "file":
        from registry.blobs.local import LocalBlobStore

        _check_not_left_behind(urlsplit(url).path, where)
        return LocalBlobStore(where)
    from registry.blobs.s3 import S3BlobStore

    return S3BlobStore(where, prefix, endpoint_url=s3_endpoint_url, **s3_options)
