"""Blob URLs and S3 endpoints: parsed and checked before anything connects. Imports no store, so
that the settings (registry/config.py) and each store can use it without importing one another."""

from __future__ import annotations

import ipaddress
import os
import re
import shlex
from typing import NoReturn
from urllib.parse import unquote, urlsplit

from mfsreg.registry.blobs.base import check_key
from mfsreg.registry.errors import InvalidRequest, shown

# S3's rules for a bucket name: 3 to 63 lowercase letters, digits, dots and hyphens, starting and
# ending with a letter or digit, no two dots in a row, not shaped like an IP address.
_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IPV4 = re.compile(r"\d+\.\d+\.\d+\.\d+")
_AWS_CREDENTIALS = "give credentials the usual AWS way (AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE)"
_CREDENTIALS = f"{_AWS_CREDENTIALS} and the endpoint as MFSREG_S3_ENDPOINT_URL"


def parse_blob_url(url: str) -> tuple[str, str, str]:
    """``("file", directory, "")`` or ``("s3", bucket, prefix)`` for MFSREG_BLOB_URL, or
    InvalidRequest in one line. A message never quotes what could hold a secret: the part of an
    s3 URL before an '@', a query or a fragment."""
    # (over 60 lines: one refusal per malformed form of the two URL kinds, in the order a
    # reader checks a URL)
    try:
        parsed = urlsplit(url)
    except ValueError:  # an unclosed '[' (urllib's "Invalid IPv6 URL")
        parsed = None
    if parsed is not None and parsed.scheme == "file":
        if parsed.query or parsed.fragment:
            raise InvalidRequest(
                "MFSREG_BLOB_URL holds a '?' or '#', which a file URL would drop: give the "
                "directory alone, e.g. file:///srv/mfsreg/blobs"
            )
        if parsed.netloc not in ("", "localhost"):  # file://relative/x names host "relative" and path /x
            raise InvalidRequest(
                f"MFSREG_BLOB_URL={url!r} names host {parsed.netloc!r}: a file URL takes an absolute "
                f"path after three slashes, e.g. file:///srv/mfsreg/blobs"
            )
        if not parsed.path.startswith("/"):  # file:// (no path), file:blobs (relative to wherever a command runs)
            raise InvalidRequest(
                f"MFSREG_BLOB_URL={url!r} has no absolute path: a file URL takes one after three "
                f"slashes, e.g. file:///srv/mfsreg/blobs"
            )
        # A file URL's path is percent-encoded: the default, (MFSREG_HOME / "blobs").as_uri(), writes
        # a space in MFSREG_HOME as %20, which read literally named another directory outside it.
        return "file", unquote(parsed.path), ""
    if parsed is None or parsed.scheme != "s3":
        # not quoted: another scheme's URL (https://user:password@...) may hold a secret
        raise InvalidRequest(
            "MFSREG_BLOB_URL is neither a file:///path nor an s3://bucket/prefix URL: use one of those"
        )
    if "@" in parsed.netloc:
        raise InvalidRequest(
            "MFSREG_BLOB_URL holds credentials (a part before '@'), which mfsreg does not read from "
            f"it: give it as s3://bucket/prefix alone, and {_CREDENTIALS}"
        )
    if parsed.query or parsed.fragment:
        raise InvalidRequest(
            "MFSREG_BLOB_URL holds a '?' or '#', which an s3 URL does not take: give it as "
            f"s3://bucket/prefix alone, and {_CREDENTIALS}"
        )
    bucket = parsed.netloc
    if ":" in bucket:
        raise InvalidRequest(
            f"MFSREG_BLOB_URL names a port ({shown(bucket, 60)}): an s3 URL takes a bucket, "
            "s3://bucket/prefix; give the server as MFSREG_S3_ENDPOINT_URL, e.g. http://127.0.0.1:9000"
        )
    if not bucket:
        raise InvalidRequest(
            "MFSREG_BLOB_URL names no bucket: use s3://bucket/prefix (three slashes are for file URLs)"
        )
    if not _BUCKET.fullmatch(bucket) or ".." in bucket or _IPV4.fullmatch(bucket):
        raise InvalidRequest(
            f"MFSREG_BLOB_URL names bucket {shown(bucket, 70)}, which is not a bucket name: S3 takes "
            "3 to 63 lowercase letters, digits, dots and hyphens, starting and ending with a letter or "
            "digit, e.g. s3://mfsreg-packs/prod"
        )
    prefix = parsed.path.strip("/")
    if prefix:
        try:
            check_key(prefix)
        except InvalidRequest:
            raise InvalidRequest(
                f"MFSREG_BLOB_URL's prefix {shown(prefix, 70)} is not usable: give one of letters, "
                "digits, '.', '_', '-' and single '/', without '..', e.g. s3://mfsreg-packs/prod"
            ) from None
    return "s3", bucket, prefix


# botocore reads an endpoint from these too (the S3 one first), as it reads credentials from the
# environment; MFSREG_S3_ENDPOINT_URL comes before them, as a client's endpoint_url does in botocore
_ENDPOINT_VARIABLES = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL")
# a host name as botocore takes one: labels of letters, digits and inner hyphens
_HOST_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)", re.IGNORECASE)
_ENDPOINT_HINT = "give the S3 server's URL, http(s)://host[:port], e.g. http://127.0.0.1:9000"


def configured_endpoint(endpoint_url: str | None, env=None) -> tuple[str | None, str]:
    """The endpoint to give the S3 client, and the setting it came from (for messages): an endpoint
    set the AWS way (in ``env``, else the environment) is given to the client as
    MFSREG_S3_ENDPOINT_URL's is, so that it gets the same path-style requests, whatever botocore's
    version or an AWS config file's addressing_style."""
    env = os.environ if env is None else env
    if endpoint_url:
        return endpoint_url, "MFSREG_S3_ENDPOINT_URL"
    if env.get("AWS_IGNORE_CONFIGURED_ENDPOINT_URLS", "").strip().lower() != "true":  # botocore's switch
        for name in _ENDPOINT_VARIABLES:
            if env.get(name, "").strip():
                return env[name].strip(), name
    return None, "MFSREG_S3_ENDPOINT_URL"


def check_endpoint_url(url: str, setting: str = "MFSREG_S3_ENDPOINT_URL") -> str:
    """``url`` if it can be an S3 client's endpoint (http or https, a host, a port of 1 to 65535 if
    any, a path if any), else InvalidRequest in one line. botocore refuses only some ("Invalid
    endpoint", once the database was open) and takes others (ftp://x, http://host:notaport) whose
    every request then fails. A message never quotes a part before '@', a query or a fragment."""
    try:
        parsed = urlsplit(url)
    except ValueError:  # an unclosed '[' (urllib's "Invalid IPv6 URL")
        parsed = None
    if "@" in url:  # anywhere: "key:secret@host" without a scheme has no netloc to look in
        raise InvalidRequest(
            f"{setting} holds credentials (a part before '@'), which mfsreg does not read from it: "
            f"{_ENDPOINT_HINT}; {_AWS_CREDENTIALS}"
        )
    if parsed is not None and (parsed.query or parsed.fragment):
        raise InvalidRequest(f"{setting} holds a '?' or '#', which an S3 endpoint does not take: {_ENDPOINT_HINT}")

    def refuse(why: str) -> NoReturn:
        raise InvalidRequest(f"{setting}={shown(url)}: {why}: {_ENDPOINT_HINT}")

    if parsed is None:
        refuse("is not a URL")
    if parsed.scheme.lower() not in ("http", "https"):
        refuse("is not an http:// or https:// URL")
    if not url.isprintable() or any(ch.isspace() for ch in url):
        refuse("holds a space or a control character")
    host = parsed.hostname or ""
    if not host:
        refuse("names no host")
    if parsed.netloc.startswith("["):
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            refuse(f"names host {shown(host, 60)}, which is not an IPv6 address")
    elif len(host) > 255 or not all(_HOST_LABEL.fullmatch(label) for label in host.removesuffix(".").split(".")):
        refuse(f"names host {shown(host, 60)}, which is not a host name or address (letters, digits, '-' and '.')")
    try:
        port = parsed.port
    except ValueError:  # not a number, or past 65535
        port = 0
    if port == 0:
        refuse("has a port that is not a number from 1 to 65535")
    return url


def check_not_left_behind(literal: str, where: str) -> None:
    """Until the path was decoded, a store whose URL held a %-escape (MFSREG_HOME with a space) was
    kept at the literal path, e.g. /srv/my%20home/blobs; opening the decoded one would find none of
    its packs, so that store must be moved, not silently forgotten."""
    if literal != where and os.path.isdir(literal) and not os.path.exists(where):
        raise InvalidRequest(
            f"this registry's packs are in {literal}, where an earlier mfsreg read the blob URL's "
            f"%-escapes literally; it now reads them as {where}: move that directory there "
            f"(mv {shlex.quote(literal)} {shlex.quote(where)})"
        )
