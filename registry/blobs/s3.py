"""A BlobStore on S3 or any S3-compatible server (MinIO, Ceph): the shared deployment backend.

Atomicity comes from S3 itself: an object becomes visible only once its PUT (or the completion of a
multipart upload) succeeds, so readers never see a part. A key names one blob for good (packs get
fresh random ids and are written once), so a retried put of the same bytes replaces the object
atomically. Every botocore failure is turned into NotFound, InvalidRequest or a one-line
StorageError here; no botocore exception leaves this module.
"""

from __future__ import annotations

import io
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from datetime import UTC, datetime

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    ConnectionError,
    CredentialRetrievalError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from mfsreg.registry.blobs.base import BlobStore, Leftover, check_key
from mfsreg.registry.blobs.urls import check_endpoint_url, configured_endpoint
from mfsreg.registry.config import DEFAULT_S3_CONNECT_TIMEOUT, DEFAULT_S3_MAX_ATTEMPTS, DEFAULT_S3_READ_TIMEOUT
from mfsreg.registry.errors import InvalidRequest, NotFound, StorageError

MiB = 1 << 20
# Every pack is one PUT: a pack is flushed once it holds MFSREG_PACK_SIZE (64 MiB by default), so it
# runs up to one chunk (256 MiB at most) past that, and with the threshold at the pack size every
# full pack went multipart. A multipart upload that its writer dies in (kill -9, OOM, an evicted
# pod) stays in the bucket, billed and invisible to listings, until something aborts it; one PUT
# leaves nothing. A single PUT may hold 5 GiB; only bigger objects (none that mfsreg writes at its
# defaults) go multipart, where a failed part is retried alone.
MULTIPART_THRESHOLD = 512 * MiB
MULTIPART_CHUNK = 16 * MiB
# botocore retries whole requests, but not a body stream that breaks half-way; re-read those.
_STREAM_ERRORS = (IncompleteReadError, ResponseStreamingError, ReadTimeoutError)
_STREAM_TRIES = 3
_STREAM_BACKOFF = 0.2  # seconds before the second read, doubled for each one after


class S3BlobStore(BlobStore):
    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        *,
        max_attempts: int = DEFAULT_S3_MAX_ATTEMPTS,
        connect_timeout: float = DEFAULT_S3_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_S3_READ_TIMEOUT,
        max_workers: int = 8,
        multipart_threshold: int = MULTIPART_THRESHOLD,
    ):
        if not bucket:
            raise InvalidRequest("s3 blob URL without a bucket: use s3://bucket/prefix")
        self.bucket = bucket
        self.prefix = check_key(prefix.strip("/")) if prefix.strip("/") else ""
        self.url = f"s3://{bucket}/{self.prefix}" if self.prefix else f"s3://{bucket}"
        self.max_workers = max_workers
        self.read_timeout, self.max_attempts = read_timeout, max_attempts
        endpoint_url, self.endpoint_setting = configured_endpoint(endpoint_url)
        if endpoint_url:  # refused in one line here, not by botocore (or, for some, by every request)
            check_endpoint_url(endpoint_url, self.endpoint_setting)
        config = Config(
            # total_max_attempts counts the first try; botocore's "max_attempts" counts only the
            # retries (5 of them made six tries of 60 s each against an endpoint gone silent)
            retries={"mode": "standard", "total_max_attempts": max_attempts},
            connect_timeout=connect_timeout,
            read_timeout=read_timeout,
            # range readers (max_workers per get_ranges, several at once in a server) and multipart
            # parts share the pool: past its size each request opens a connection of its own, and
            # urllib3 warns on stderr for every one
            max_pool_connections=max(32, 4 * max_workers),
            # MinIO and most self-hosted servers only serve path-style requests
            s3={"addressing_style": "path"} if endpoint_url else None,
            # Reads are not checked against the object's CRC: every payload read is checked against
            # its chunk's xxh3-128 id where it is decoded (here or on the node), which a CRC adds
            # nothing to; the CRC took a fifth of a node's download request. Uploads keep theirs.
            response_checksum_validation="when_required",
        )
        try:
            # a private session: boto3's default session is not safe to share between threads
            session = boto3.session.Session()
            self._s3 = session.client(
                "s3", endpoint_url=endpoint_url, region_name=session.region_name or "us-east-1", config=config
            )
        except ValueError as exc:  # botocore's "Invalid endpoint: ..."
            raise InvalidRequest(
                f"{self.endpoint_setting}={endpoint_url!r}: {exc}: give a URL such as http://127.0.0.1:9000"
            ) from None
        except BotoCoreError as exc:  # an AWS_PROFILE that does not exist, an AWS config file that does not parse
            raise InvalidRequest(
                f"the AWS configuration for {self.url} cannot be used: {exc}: fix AWS_PROFILE or "
                "the AWS config files (~/.aws/config, ~/.aws/credentials)"
            ) from None
        self.endpoint_url = self._s3.meta.endpoint_url
        self.multipart_threshold = multipart_threshold
        self._transfer = TransferConfig(
            multipart_threshold=multipart_threshold, multipart_chunksize=MULTIPART_CHUNK, max_concurrency=4
        )
        self._bucket_seen = False

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    @contextmanager
    def _errors(self, op: str, key: str = ""):
        """Translate botocore failures into the registry's error tree, with what to do about them."""
        try:
            yield
        except ClientError as exc:
            err = exc.response.get("Error", {})
            code = str(err.get("Code", ""))
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if code == "NoSuchBucket":
                raise self._no_bucket() from None
            if op == "delete" and code == "NoSuchKey":
                return  # a store that answers a delete of a missing key with 404: deleted all the same
            if (code in ("NoSuchKey", "NotFound") or status == 404) and op in ("get", "head", "head_bucket"):
                raise NotFound(f"blob {key} is missing from {self.url}") from None
            if status == 404:
                # a 404 to a put, delete or list names no missing blob: whatever answered is not
                # the bucket's S3 (another server's page, a proxy's path)
                raise StorageError(
                    f"S3 {op} of {key or self.url} was answered 404 ({code or 'no S3 error code'}) by "
                    f"{self.endpoint_url}: check {self.endpoint_setting} and MFSREG_BLOB_URL"
                ) from None
            if code == "InvalidRange" or status == 416:
                raise NotFound(f"blob {key}: requested range is outside the object") from None
            if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") or status == 403:
                raise StorageError(
                    f"S3 refused {op} on {self.url} ({code}): check the AWS credentials and bucket policy"
                ) from None
            raise StorageError(
                f"S3 {op} of {key or self.url} failed: {code} {err.get('Message', '')}".strip()
            ) from None
        except (NoCredentialsError, PartialCredentialsError, CredentialRetrievalError):
            raise StorageError(
                f"no AWS credentials for {self.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"
            ) from None
        except ReadTimeoutError:  # botocore's retries spent: say how long it waited, not "Read timeout on endpoint URL"
            tries = f"{self.max_attempts} times" if self.max_attempts > 1 else "once"
            raise StorageError(
                f"S3 endpoint {self.endpoint_url} did not answer {op} of {key or self.url} within {self.read_timeout:g} s, "
                f"{tries}: check that the server is up and not overloaded (MFSREG_S3_READ_TIMEOUT and "
                "MFSREG_S3_MAX_ATTEMPTS say how long to wait)"
            ) from None
        except ConnectionError:
            raise StorageError(
                f"cannot reach S3 endpoint {self.endpoint_url}: check {self.endpoint_setting} and that the server is up"
            ) from None
        except (BotoCoreError, Boto3Error) as exc:
            raise StorageError(f"S3 {op} of {key or self.url} failed: {exc}") from None

    def _no_bucket(self) -> StorageError:
        return StorageError(
            f"bucket {self.bucket} does not exist at {self.endpoint_url}: create it or fix MFSREG_BLOB_URL"
        )

    def _missing(self, key: str) -> NotFound:
        """A HEAD 404 carries no error code, so tell a missing key from a missing bucket, once."""
        if not self._bucket_seen:
            try:
                with self._errors("head_bucket"):
                    self._s3.head_bucket(Bucket=self.bucket)
            except NotFound:
                raise self._no_bucket() from None
            self._bucket_seen = True
        return NotFound(f"blob {key} is missing from {self.url}")

    def check(self) -> None:
        """One HEAD of the bucket: the endpoint answers, the credentials are taken, the bucket exists."""
        try:
            with self._errors("head_bucket"):
                self._s3.head_bucket(Bucket=self.bucket)
        except NotFound:  # a HEAD's 404 carries no error code
            raise self._no_bucket() from None
        self._bucket_seen = True

    def size(self, key: str) -> int:
        k = self._key(key)
        try:
            with self._errors("head", key):
                return int(self._s3.head_object(Bucket=self.bucket, Key=k)["ContentLength"])
        except NotFound:
            raise self._missing(key) from None

    def put(self, key: str, data: bytes | memoryview) -> None:
        k = self._key(key)
        n = memoryview(data).nbytes
        # No HEAD first: pack ids are random, so the key is new, and a retried put of the same
        # bytes simply replaces the object atomically (S3 has no partial objects).
        with self._errors("put", key):
            if n < self.multipart_threshold:
                # botocore sends a CRC32 checksum with the body, so the server rejects damaged bytes
                self._s3.put_object(Bucket=self.bucket, Key=k, Body=bytes(data))
            else:
                # the object appears only when CompleteMultipartUpload succeeds; a failed upload is
                # aborted by the transfer manager, leaving nothing visible under the key
                self._s3.upload_fileobj(io.BytesIO(data), self.bucket, k, Config=self._transfer)

    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes:
        return self.get_ranges(key, [(start, end)])[0]

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int | None]]) -> list[bytes]:
        k = self._key(key)
        # S3 has no syntax for an empty range, and an invalid Range header is ignored (the whole
        # object comes back), so those ranges are checked against a HEAD and never sent.
        if any(end is None and start != 0 or end is not None and end <= start for start, end in ranges):
            total = self.size(key)
            bounded = [(s, total if e is None else e) for s, e in ranges]
            for start, end in bounded:
                if start < 0 or start > end or end > total:
                    raise NotFound(f"blob {key}: range {start}-{end} is outside its {total} bytes")
            ranges = bounded
        for s, e in ranges:
            if s < 0 or e is not None and e < s:
                raise NotFound(f"blob {key}: range {s}-{e} is invalid")
        if len(ranges) <= 1:
            return [self._fetch(k, key, *r) for r in ranges]
        # boto3 clients are thread-safe; a few concurrent range GETs hide the per-request latency
        with ThreadPoolExecutor(max_workers=min(self.max_workers, len(ranges))) as pool:
            return list(pool.map(lambda r: self._fetch(k, key, *r), ranges))

    def _fetch(self, k: str, key: str, start: int, end: int | None) -> bytes:
        if end == start:
            return b""  # bounds already checked against the object's size
        args = {"Bucket": self.bucket, "Key": k}
        if end is not None:
            args["Range"] = f"bytes={start}-{end - 1}"
        with self._errors("get", key):
            for attempt in range(_STREAM_TRIES):
                resp = self._s3.get_object(**args)
                try:
                    data = resp["Body"].read()
                    break
                except _STREAM_ERRORS:
                    if attempt == _STREAM_TRIES - 1:
                        raise
                    # a moment before asking again, as botocore's own retries wait: an endpoint
                    # that drops streams under load is asked again at once otherwise
                    time.sleep(_STREAM_BACKOFF * 2**attempt)
        want = int(resp["ContentLength"]) if end is None else end - start
        if len(data) != want:
            # S3 answers a range that runs past the end with the bytes it has: a short read would
            # silently corrupt a chunk, so it is reported like any range outside the object
            raise NotFound(f"blob {key}: range {start}-{end} is outside the object ({resp.get('ContentRange')})")
        return data

    def delete(self, key: str) -> None:
        with self._errors("delete", key):
            self._s3.delete_object(Bucket=self.bucket, Key=self._key(key))  # a missing key is a 204

    def list(self, prefix: str = "") -> Iterator[str]:
        # the trailing '/' keeps a store at 'p' from listing the keys of a sibling store at 'p2'
        base = f"{self.prefix}/" if self.prefix else ""
        pages = self._s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=base + prefix)
        with self._errors("list", prefix):
            for page in pages:
                for obj in page.get("Contents", []):
                    yield obj["Key"][len(base) :]

    def leftovers(self) -> Iterator[Leftover]:
        """Multipart uploads under this store's prefix that were started and never completed nor
        aborted (their parts are stored, and billed, until they are)."""
        base = f"{self.prefix}/" if self.prefix else ""
        now = datetime.now(UTC)
        with self._errors("list multipart uploads", base):
            for page in self._s3.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=base):
                for up in page.get("Uploads", []):
                    parts = self._s3.get_paginator("list_parts").paginate(
                        Bucket=self.bucket, Key=up["Key"], UploadId=up["UploadId"]
                    )
                    listed = [p for page in parts for p in page.get("Parts", [])]
                    # since its last part: an upload started long ago may still be sending
                    last = max([up["Initiated"], *(p["LastModified"] for p in listed)])
                    age = max(0.0, (now - last).total_seconds())
                    size = sum(p["Size"] for p in listed)
                    yield Leftover(f"{up['Key'][len(base) :]} {up['UploadId']}", size, age)

    def remove_leftover(self, leftover: Leftover) -> None:
        key, _, upload_id = leftover.name.partition(" ")
        base = f"{self.prefix}/" if self.prefix else ""
        with self._errors("abort multipart upload", key):
            try:
                self._s3.abort_multipart_upload(Bucket=self.bucket, Key=base + key, UploadId=upload_id)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") != "NoSuchUpload":  # aborted meanwhile: gone
                    raise
