"""RemoteRegistry: the same operations as registry.Registry, over the HTTP API.

Push hashes locally, asks the server which chunks it lacks, uploads only those in batches (encoding
on a thread pool while the previous batch is in flight), then commits. The server records chunks
batch by batch, so a push that dies midway and is run again sends only what is still missing.
Pull reads the manifest and chunk table, downloads chunk batches as streams, decodes and verifies
every chunk and every file (registry/format/rebuild.py) and writes files atomically.
"""

from __future__ import annotations

import os
import ssl
import threading
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from mfsreg.registry import protocol, pushing
from mfsreg.registry.config import DEFAULT_CHUNK_SIZE, check_chunk_size, size_from_env
from mfsreg.registry.errors import (
    Conflict,
    Forbidden,
    IntegrityError,
    InvalidRequest,
    MissingChunks,
    NoRoute,
    NotFound,
    Pruned,
    RegistryError,
    StorageError,
    TooLarge,
    Unauthorized,
)
from mfsreg.registry.format import rebuild
from mfsreg.registry.format.hashing import HashJob, encoded_chunks, missing_bytes
from mfsreg.registry.format.manifest import Manifest, parse_doc
from mfsreg.registry.format.wire import (
    MAX_UPLOAD_CHUNKS,
    RAW_PER_BODY,
    Entry,
    Located,
    StreamBrokeOff,
    build_batch,
    check_id,
    read_stream,
)
from mfsreg.registry.meta import VersionMeta, check_meta
from mfsreg.registry.names import check_name
from mfsreg.registry.progress import NullProgress, Progress
from mfsreg.registry.results import (
    CheckResult,
    DeleteResult,
    FamilyRow,
    PruneResult,
    PushResult,
    TagEvent,
    TagMove,
    TagRow,
    VersionRow,
    existing_result,
)
from mfsreg.registry.store.tiers import TIERS

UPLOAD_BATCH = 32 << 20  # bytes of payload per upload request: well under the server's body limit (MFSREG_UPLOAD_BATCH)
UPLOAD_INFLIGHT = 2  # upload requests at once
DOWNLOAD_BATCH = 64 << 20  # stored bytes per download request
LEGACY_CHUNK_SIZE = 1 << 20  # the default before families recorded theirs (migration 0005)

# One table from HTTP status to the registry's error tree (the server sends problem details).
_STATUS = {
    400: InvalidRequest,
    401: Unauthorized,
    403: Forbidden,
    404: NotFound,
    409: Conflict,
    413: TooLarge,
    422: IntegrityError,
    503: StorageError,
}
# The problem's type names the kind where a status has several: 422 is a chunk that fails its
# check (IntegrityError) or a request body of the wrong shape (invalid_request, api/problems.py).
_CODES = {k.code: k for k in (MissingChunks, Pruned, InvalidRequest)}


_tls_lock = threading.Lock()
_tls_contexts: dict[tuple[str | None, str | None], ssl.SSLContext] = {}


def tls_context() -> ssl.SSLContext:
    """The verifying TLS context httpx makes by default (certifi's CAs, or those SSL_CERT_FILE and
    SSL_CERT_DIR name), made once per process and per value of those two variables and shared by
    every client: making one reads the whole CA bundle, 34 ms of the 48 that making a Node took,
    paid by every ``load_tensors`` call without a node and every command, even for http:// URLs
    (httpx makes it regardless). A context is safe to share between clients and threads."""
    key = (os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
    with _tls_lock:
        ctx = _tls_contexts.get(key)
        if ctx is None:
            ctx = _tls_contexts[key] = httpx.create_ssl_context()
        return ctx


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _chunk_rows(doc: dict) -> Iterator[tuple[str, tuple]]:
    """(id, (encoding, stored size, basis id or None, size, tier or None)) of each row of a document's
    chunk table, checked: the fetcher does arithmetic on the sizes, the cache files chunks under
    their ids and ranks them by tier."""
    for i, row in doc["chunks"].items():
        check_id(i)
        if not isinstance(row, list) or len(row) != 5:
            raise InvalidRequest(f"chunk {i}'s row is not a list of 5 fields")
        encoding, stored, basis, size, tier = row
        if not isinstance(encoding, str) or not _count(stored) or not _count(size):
            raise InvalidRequest(f"chunk {i}'s row has an encoding that is not a string or a size that is not a count")
        if basis is not None:
            check_id(basis)
        if tier is not None and tier not in TIERS:
            raise InvalidRequest(f"chunk {i}'s tier is not one of {', '.join(TIERS)}")
        yield i, (encoding, stored, basis, size, tier)


class Closable:
    """An object of the node's client whose ``close()`` ends its use: work asked of it afterwards is
    refused in one line (its HTTP client raised httpx's RuntimeError, "the client has been closed",
    which read as an internal error). ``closed_note``: what the error adds, for a class whose
    results outlive it."""

    closed = False
    closed_note = ""

    def check_open(self, user: str = "") -> None:
        """``user``: who works through this object, as the error names it ("this ResidentModel
        loads through ")."""
        if self.closed:
            name = type(self).__name__
            raise InvalidRequest(
                (f"the {name} {user}is closed" if user else f"this {name} is closed")
                + f": make a new one{self.closed_note}"
            )


class DocumentReader:
    """Reading a version or tier document into the node's values, checked as the server checks a
    pushed manifest (shared by RemoteRegistry and the embedded registry's EmbeddedSource)."""

    url: str

    def manifest_of(self, doc: dict) -> Manifest:
        """A version document's manifest, checked as the server checks a pushed one: its file paths
        and digests name files on this machine (a pull's output, the node cache's materialised
        files), so an answer that is damaged, or from a server that is not to be trusted, must not
        reach them as they are."""
        try:
            return parse_doc(doc["manifest"])
        except (InvalidRequest, KeyError, TypeError) as exc:
            raise self._bad_document(exc) from None

    def chunk_table(self, doc: dict) -> tuple[dict[str, Located], dict[str, str | None]]:
        """Where each chunk of a version or tier document is stored, and its tier (None: not yet
        sorted), in one pass over the rows. The ids name files in the node cache (a delta's basis
        too): each is checked to be one, and each row's fields their type."""
        located, tiers = {}, {}
        try:
            for i, (encoding, stored, basis, size, tier) in _chunk_rows(doc):
                located[i] = Located(i, size, encoding, stored, basis)
                tiers[i] = tier
        except (InvalidRequest, KeyError, TypeError, ValueError, AttributeError) as exc:
            raise self._bad_document(exc) from None
        return located, tiers

    def _bad_document(self, exc: Exception) -> IntegrityError:
        detail = str(exc) if isinstance(exc, InvalidRequest) else f"{exc.__class__.__name__} {exc}"
        return IntegrityError(
            f"{self.url} sent a document that fails its checks ({detail}): nothing was written; "
            "check that MFSREG_URL points at an mfsreg server you trust"
        )


class RemoteRegistry(DocumentReader, Closable):
    def __init__(
        self,
        url: str,
        token: str | None = None,
        chunk_size: int | None = None,
        workers: int | None = None,
        timeout: float = 300.0,
    ):
        if not url.startswith(("http://", "https://")):
            raise InvalidRequest(f"registry URL {url!r} must start with http:// or https://")
        _check_url(url)
        self.url = url.rstrip("/")
        if token is not None and not token:  # most likely an unset variable: no token is None, said so
            raise InvalidRequest("token='' is empty: give one, or leave token= out to send none")
        if token and not (token.isascii() and token.isprintable() and " " not in token):
            # an HTTP header cannot carry it (httpx raises UnicodeEncodeError, or a protocol error
            # that reads like an unreachable server): a copy that took in a newline, a quote, a letter
            raise Unauthorized(
                "MFSREG_TOKEN holds characters no token has (spaces, control characters or letters "
                "beyond ASCII): copy it again from `mfsreg token create`"
            )
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        headers[protocol.HEADER] = str(protocol.CURRENT)  # a server of another version says which to upgrade
        self.http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            transport=httpx.HTTPTransport(retries=3, verify=tls_context()),  # retries failed connects, not requests
        )
        # only the client's own settings: the server's (MFSREG_MAX_BODY, MFSREG_PACK_SIZE, MFSREG_HOME...)
        # are no client's business, and a bad one in its environment refused every command
        self.chunk_size = chunk_size or check_chunk_size(size_from_env("MFSREG_CHUNK_SIZE", DEFAULT_CHUNK_SIZE))
        self.pool = ThreadPoolExecutor(
            max_workers=workers or max(1, os.cpu_count() or 1), thread_name_prefix="mfsreg-client"
        )
        self.upload_batch = size_from_env("MFSREG_UPLOAD_BATCH", UPLOAD_BATCH)
        self.bytes_received = 0  # network bytes of chunk payloads, over this client's life
        self.closed = False

    def close(self) -> None:
        self.closed = True
        self.http.close()
        self.pool.shutdown(wait=True)

    def __enter__(self) -> RemoteRegistry:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- HTTP plumbing ----------------------------------------------------------------------------

    def _request(self, method: str, path: str, **kw) -> httpx.Response:
        self.check_open()
        try:
            resp = self.http.request(method, path, **kw)
        except httpx.TransportError as exc:
            raise StorageError(
                f"cannot reach the registry at {self.url}: {exc.__class__.__name__}; check MFSREG_URL and that the server runs"
            ) from None
        _raise_for(resp)
        return resp

    def _json(self, method: str, path: str, **kw):
        return self._parsed(self._request(method, path, **kw), method, path)

    def _parsed(self, resp: httpx.Response, method: str, path: str):
        try:
            return resp.json()
        except ValueError:  # a proxy's or another server's page: every mfsreg answer is JSON
            raise InvalidRequest(
                f"{self.url} answered {method} {path} with {resp.status_code} and a body that is not "
                "JSON: check that MFSREG_URL points at an mfsreg server"
            ) from None

    def _doc(self, method: str, path: str, build, **kw):
        """``build`` of an answer's JSON. An answer of another shape (another server that answers
        JSON, a proxy's error, a damaged reply) is one line naming the request, not a KeyError."""
        return self._built(method, path, build, self._json(method, path, **kw))

    def _built(self, method: str, path: str, build, doc):
        try:
            return build(doc)
        except (KeyError, TypeError, ValueError, AttributeError, IndexError, InvalidRequest) as exc:
            detail = str(exc) if isinstance(exc, InvalidRequest) else f"{exc.__class__.__name__} {exc}"
            raise IntegrityError(
                f"{self.url} answered {method} {path} with a document of another shape ({detail[:200]}): "
                "check that MFSREG_URL points at an mfsreg server of this release"
            ) from None

    # -- push -------------------------------------------------------------------------------------

    def push(
        self,
        path: Path,
        family: str,
        version: str,
        parent: str | None = None,
        progress: Progress | None = None,
        mend_damaged: bool = False,
        meta: VersionMeta | None = None,
    ) -> PushResult:
        return pushing.drive(HttpPush(self, family, version, parent), path, progress, mend_damaged, meta)

    def _upload(
        self,
        family: str,
        job: HashJob,
        missing: set[str],
        progress: Progress,
        bases: dict[str, str],
    ) -> tuple[int, int]:
        """Send the missing chunks in batches; UPLOAD_INFLIGHT batches are in flight while the next is
        encoded (the server stores one while it verifies and delta-encodes another).
        Returns (payload bytes sent, stored bytes the server added)."""
        progress.start("send", missing_bytes(job, missing))
        sent = added = 0
        uploader = ThreadPoolExecutor(max_workers=UPLOAD_INFLIGHT, thread_name_prefix="mfsreg-upload")
        inflight: deque = deque()

        def post(batch: list[tuple[Entry, bytes]], raw: int) -> tuple[int, int]:
            added = self._doc(
                "POST",
                f"/v1/families/{family}/chunks",
                lambda r: _counted(_checked("UploadResponse", r)["new_bytes"]),
                content=build_batch(batch),
                headers={"Content-Type": "application/octet-stream"},
            )
            progress.advance("send", raw)
            return sum(len(p) for _, p in batch), added

        def collect(keep: int):
            nonlocal sent, added
            while len(inflight) > keep:
                s, a = inflight.popleft().result()
                sent, added = sent + s, added + a

        batch: list[tuple[Entry, bytes]] = []
        size = raw = 0

        def send():
            nonlocal batch, size, raw
            collect(UPLOAD_INFLIGHT - 1)
            inflight.append(uploader.submit(post, batch, raw))
            batch, size, raw = [], 0, 0

        try:
            for c, encoding, payload, _ in encoded_chunks(job, missing, self.pool):
                if batch and raw + c.size > RAW_PER_BODY * self.upload_batch:  # the server bounds decoded bytes too
                    send()
                batch.append((Entry(c.id, c.size, encoding, len(payload), bases.get(c.id), c.itemsize), payload))
                size, raw = size + len(payload), raw + c.size
                if size >= self.upload_batch or len(batch) >= MAX_UPLOAD_CHUNKS:
                    send()
            if batch:
                send()
            collect(0)
        finally:
            for fut in inflight:
                fut.cancel()
            uploader.shutdown(wait=True)
        return sent, added

    # -- pull -------------------------------------------------------------------------------------

    def version_doc(self, family: str, version: str) -> dict:
        doc, _ = self.version_doc_if(family, version)
        if doc is None:  # a 304, though no tag was sent: no mfsreg server answers so
            raise self._bad_document(InvalidRequest("304 Not Modified to a request that named no tag"))
        return doc

    def version_doc_if(self, family: str, version: str, tag: str | None = None) -> tuple[dict | None, str | None]:
        """The version's document and its tag; (None, tag) when ``tag`` is still current (a 304: the
        caller's copy is the document). A server older than tags sends no tag."""
        check_name("family", family)
        check_name("version", version)
        headers = {"If-None-Match": tag} if tag else None
        path = f"/v1/families/{family}/versions/{version}"
        resp = self._request("GET", path, headers=headers)
        if resp.status_code == 304:
            return None, resp.headers.get("etag", tag)
        return self._built("GET", path, _version_doc, self._parsed(resp, "GET", path)), resp.headers.get("etag")

    def manifest(self, family: str, version: str) -> tuple[VersionRow, Manifest]:
        doc = self.version_doc(family, version)
        return _version_row(doc), self.manifest_of(doc)

    def tier_doc(self, family: str, tier: str | None = None) -> dict:
        check_name("family", family)
        return self._doc("GET", f"/v1/families/{family}/chunks", _dict, params={"tier": tier} if tier else None)

    def fetch(self, family: str, chunks: list[Located]) -> Iterator[tuple[Located, bytes]]:
        """Payloads of ``chunks`` from the server, in batches of about DOWNLOAD_BATCH stored bytes."""
        batch: list[Located] = []
        size = 0
        for c in chunks:
            batch.append(c)
            size += c.stored_size
            if size >= DOWNLOAD_BATCH:
                yield from self._fetch_batch(family, batch)
                batch, size = [], 0
        if batch:
            yield from self._fetch_batch(family, batch)

    def _fetch_batch(self, family: str, chunks: list[Located]) -> Iterator[tuple[Located, bytes]]:
        by_id = {c.id: c for c in chunks}
        self.check_open()
        try:
            with self.http.stream("POST", f"/v1/families/{family}/chunks/download", json={"ids": list(by_id)}) as resp:
                if resp.status_code >= 400:
                    resp.read()
                    _raise_for(resp)
                for entry, payload in read_stream(resp.iter_bytes()):
                    known = by_id.get(entry.id)
                    if known is None:
                        raise IntegrityError(f"server sent chunk {entry.id}, which was not asked for")
                    self.bytes_received += len(payload)
                    yield (
                        Located(entry.id, entry.size, entry.encoding, entry.length, entry.basis_id),
                        payload,
                    )
        except httpx.TransportError as exc:
            raise StorageError(
                f"connection to {self.url} broke during a download ({exc.__class__.__name__}): try again"
            ) from None
        except StreamBrokeOff:
            raise StorageError(
                f"{self.url} broke off a download (its log says why, e.g. its blob store failed): try again"
            ) from None

    def pull(
        self, family: str, version: str, out: Path, progress: Progress | None = None, to_dir: bool = False, cache=None
    ) -> rebuild.PullResult:
        """Pull through the node cache (MFSREG_CACHE_DIR): only chunks it lacks cross the network."""
        from mfsreg.registry.client import node
        from mfsreg.registry.client.cache import NodeCache
        from mfsreg.registry.client.fetch import Fetcher

        check_name("family", family)
        check_name("version", version)
        own = cache is None
        cache = cache or NodeCache()
        try:
            return node.pull(Fetcher(self, cache), family, version, Path(out), progress, to_dir)
        finally:
            if own:
                cache.close()

    # -- listing and changes ----------------------------------------------------------------------

    def families(self) -> list[FamilyRow]:
        return self._doc("GET", "/v1/families", lambda d: [_family_row(f) for f in _list(d)])  # (rows checked there)

    def family(self, family: str) -> FamilyRow:
        check_name("family", family)
        return self._doc("GET", f"/v1/families/{family}", _family_row)

    def _cut_size(self, family: str) -> int:
        """The size this push cuts at: the family's, so that it dedups against the members already
        pushed; this client's own for a new family."""
        try:
            return self.family(family).chunk_size
        except NotFound as exc:
            if not isinstance(exc, NoRoute):
                return self.chunk_size  # a new family: this client's size starts it
            # A server older than family chunk sizes has no such route; its families were cut at
            # its clients' default then, 1 MiB.
            return LEGACY_CHUNK_SIZE

    def versions(self, family: str | None = None) -> list[VersionRow]:
        if family is None:
            return [v for f in self.families() for v in self.versions(f.name)]
        check_name("family", family)
        return self._doc(
            "GET",
            f"/v1/families/{family}/versions",
            lambda d: [_version_row(v) for v in _rows("VersionModel", d)],
        )

    def stats(self, family: str | None = None) -> dict:
        if family is not None:
            check_name("family", family)
        return self._doc("GET", "/v1/stats", _stats, params={"family": family} if family else None)

    def audit(self, limit: int = 100) -> list:
        """The newest ``limit`` audit entries this token may read (an admin token)."""
        from mfsreg.registry.db.auditlog import AuditRow

        def rows(d) -> list[AuditRow]:
            return [
                AuditRow(0, e["at"], e["actor"], e["action"], e.get("family"), e.get("detail", ""))
                for e in _rows("AuditEntryModel", d)
            ]

        return self._doc("GET", "/v1/audit", rows, params={"limit": limit})

    def tag_set(self, family: str, tag: str, version: str) -> TagMove:
        check_name("family", family)
        check_name("tag", tag)
        check_name("version", version)
        return self._doc("PUT", f"/v1/families/{family}/tags/{tag}", _tag_move, json={"version": version})

    def tag_rm(self, family: str, tag: str) -> TagMove:
        check_name("family", family)
        check_name("tag", tag)
        return self._doc("DELETE", f"/v1/families/{family}/tags/{tag}", _tag_move)

    def tags(self, family: str) -> list[TagRow]:
        check_name("family", family)

        def rows(d) -> list[TagRow]:
            return [
                TagRow(t["tag"], t["version"], t["set_by"], t["set_at"], bool(t["automatic"]))
                for t in _rows("TagModel", d)
            ]

        return self._doc("GET", f"/v1/families/{family}/tags", rows)

    def tag_history(self, family: str, tag: str | None = None, limit: int = 1000) -> list[TagEvent]:
        check_name("family", family)
        params: dict = {"limit": limit}
        if tag is not None:
            params["tag"] = check_name("tag", tag)

        def rows(d) -> list[TagEvent]:
            return [
                TagEvent(e["tag"], e.get("from_version"), e.get("to_version"), e["actor"], e["at"])
                for e in _rows("TagEventModel", d)
            ]

        return self._doc("GET", f"/v1/families/{family}/tag-history", rows, params=params)

    def delete(self, family: str, version: str) -> DeleteResult:
        check_name("family", family)
        check_name("version", version)
        return self._doc(
            "DELETE",
            f"/v1/families/{family}/versions/{version}",
            lambda d: _result(DeleteResult, "DeleteResultModel", d),
        )

    def prune(
        self, min_age: float, max_unused: float, dry_run: bool = False, progress: Progress | None = None
    ) -> PruneResult:
        """The server prunes its registry (admin token for every family); ``progress`` gets one task
        of unknown size ("server") until the answer comes, when the run ends, however long a repack
        takes: no read timeout."""
        params = {"min_age": min_age, "max_unused": max_unused, "dry_run": str(dry_run).lower()}
        (progress or NullProgress()).start("server", None)  # the server reports nothing until it is done
        return self._doc(
            "POST",
            "/v1/prune",
            lambda d: _result(PruneResult, "PruneResultModel", d),
            params=params,
            timeout=httpx.Timeout(None, connect=10.0),
        )

    def check(
        self, family: str | None = None, read_data: bool = False, progress: Progress | None = None
    ) -> CheckResult:
        """The server checks its blob store (an admin token: for ``family``, or for every family);
        ``progress`` gets one task of unknown size ("server") until the answer comes. No read
        timeout: --read-data reads every stored byte."""
        params = {"read_data": str(read_data).lower(), **({"family": family} if family is not None else {})}
        (progress or NullProgress()).start("server", None)  # a bar that pulses: the wait is not a hang
        return self._doc(
            "GET",
            "/v1/check",
            lambda d: CheckResult(**{k: v for k, v in _checked("CheckResultModel", d).items() if k != "ok"}),
            params=params,
            timeout=httpx.Timeout(None, connect=10.0),
        )

    def health(self) -> dict:
        return self._doc("GET", "/healthz", _dict)


class HttpPush:
    """A push's steps (pushing.PushSteps) sent to a server: POST negotiate, the chunk batches, POST
    commit (docs/design/protocol.md), which the server answers with the embedded push's own steps."""

    def __init__(self, remote: RemoteRegistry, family: str, version: str, parent: str | None) -> None:
        self.remote, self.family, self.version, self.parent = remote, family, version, parent
        self.base = f"/v1/families/{family}/versions/{version}"
        self.asked: dict = {}

    def check_names(self, meta: VersionMeta | None) -> VersionMeta | None:
        check_name("family", self.family)
        check_name("version", self.version)
        if self.parent is not None:
            check_name("version", self.parent)
        # checked here as the embedded push does, before the file is read (the server checks again)
        return check_meta(meta.description, meta.labels) if meta is not None else None

    def prepare(self) -> int:
        return self.remote._cut_size(self.family)

    def _negotiate(self, m: Manifest) -> dict:
        body = {"manifest": m.to_doc(), "parent": self.parent, **self.asked}
        return self.remote._doc("POST", f"{self.base}/negotiate", _negotiation, json=body)

    def negotiate(self, job: HashJob, mend_damaged: bool, progress: Progress) -> pushing.Offer:
        # mend_damaged is sent only when asked: without it the request is the one older servers know
        self.asked = {"mend_damaged": True} if mend_damaged else {}
        neg = _negotiate_draft(job, self._negotiate)
        done = _existing(neg, job.manifest(), self.family, self.version, time.perf_counter()) if neg["exists"] else None
        if mend_damaged and neg.get("mend_damaged") is not True:  # other content is refused first
            raise _mend_unheard(self.remote.url)
        if done is not None:
            # the chunks the server lists to mend (in a pack its blob store lost); an older server lists none
            mend = set(neg.get("mend", ())) & set(job.chunk_ids())
            return pushing.Offer(mend, mend, existing=done)
        return _offer(neg)

    def upload(self, job: HashJob, offer: pushing.Offer, progress: Progress) -> tuple[int, int]:
        return self.remote._upload(self.family, job, offer.missing, progress, offer.bases)

    def commit(self, manifest: Manifest, chunk_size: int, meta: VersionMeta | None) -> PushResult:
        body = {"parent": self.parent, "manifest": manifest.to_doc(), "chunk_size": chunk_size}
        if meta is not None and (meta.description or meta.labels):  # else the body older servers know
            body.update(meta.to_dict())
        return self.remote._doc("POST", f"{self.base}/commit", _committed, json=body)

    def renegotiate(self, manifest: Manifest) -> pushing.Offer:
        return _offer(self._negotiate(manifest))


def _checked(model: str, d) -> dict:
    """``d``, checked against the wire document ``model`` of registry/documents.py (what the
    server answers with; fields a newer server adds pass). pydantic is imported at the first
    check: a node that only loads tensors never imports it (version documents, its hot path, are
    checked by hand: _version_doc, chunk_table, manifest_of)."""
    from pydantic import ValidationError

    from mfsreg.registry import documents

    try:
        getattr(documents, model).model_validate(_dict(d))
    except ValidationError as exc:  # its text runs over several lines: the first fault, in one
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "the document"
        raise ValueError(f"{where}: {first['msg']} (as {model})") from None
    return d


def _rows(model: str, d) -> list[dict]:
    """A list answer, each of its rows checked as ``model``."""
    return [_checked(model, row) for row in _list(d)]


def _result(cls, model: str, d):
    """A result dataclass from a server's answer, checked as ``model``; fields a newer server adds
    are left out."""
    import dataclasses

    names = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in _checked(model, d).items() if k in names})


def _dict(d) -> dict:
    if not isinstance(d, dict):
        raise TypeError(f"expected an object, got {type(d).__name__}")
    return d


def _list(d) -> list:
    if not isinstance(d, list):
        raise TypeError(f"expected a list, got {type(d).__name__}")
    return d


def _counted(n) -> int:
    if not _count(n):
        raise TypeError(f"expected a count of bytes, got {n!r}"[:200])
    return n


def _negotiation(d) -> dict:
    """A negotiate answer: the version exists already (its digest and chunk count), or which chunks
    the server lacks and the bases it suggests for them (the ids checked as ids, which the model
    leaves to the server's code)."""
    _checked("NegotiateResponse", d)
    if d["exists"]:
        _counted(d["chunks"])
    else:
        [check_id(i) for i in _list(d["missing"])]
        [check_id(i) and check_id(b) for i, b in _dict(d.get("bases", {})).items()]
    [check_id(i) for i in _list(d.get("mend", []))]
    return d


def _committed(d) -> PushResult:
    """A commit's answer, checked; fields a newer server adds are left out."""
    result = _result(PushResult, "PushResultModel", d)
    _counted(result.chunks)
    return result


def _stats(d) -> dict:
    _dict(d)
    for key in ("logical_bytes", "stored_bytes", "versions_count"):
        _counted(d[key])
    _dict(d["tiers"]), _list(d["versions"])
    return d


def _version_doc(d) -> dict:
    """A version document's fields that a node reads as they come (the manifest and the chunk
    table get their own, closer checks: manifest_of, located)."""
    _dict(d)
    if not isinstance(d["digest"], str):
        raise TypeError("its digest is not a string")
    _counted(d["logical_bytes"])
    _dict(d["manifest"]), _dict(d["chunks"])
    _version_row(d)
    return d


def _version_row(d: dict) -> VersionRow:
    return VersionRow(
        0,
        d["family"],
        d["version"],
        d.get("parent"),
        d["digest"],
        d["logical_bytes"],
        d["files"],
        bool(d["single_file"]),
        d["created_at"],
        str(d.get("description") or ""),  # a server older than version metadata sends none
        {str(k): str(v) for k, v in _dict(d.get("labels") or {}).items()},
        str(d.get("pushed_by") or ""),
    )


def _tag_move(d) -> TagMove:
    _checked("TagMoveModel", d)
    return TagMove(d["family"], d["tag"], d.get("before"), d.get("after"))


def _offer(neg: dict) -> pushing.Offer:
    """A server's negotiate answer for a version it does not hold: what to send, mend and delta against."""
    missing = set(neg["missing"])
    return pushing.Offer(missing, set(neg.get("mend", ())) & missing, neg.get("bases", {}))


def _existing(neg: dict, manifest: Manifest, family: str, version: str, t0: float) -> PushResult:
    """The result of a push of a version the server holds already with this content (InvalidRequest
    where it holds other content under the name)."""
    return existing_result(
        neg["existing_digest"],
        manifest.logical_bytes,
        len(manifest.files),
        manifest.final_digest(),
        neg["chunks"],
        family,
        version,
        t0,
        neg.get("existing_layout"),
        manifest.layout,
    )


def _negotiate_draft(job: HashJob, negotiate) -> dict:
    """The server's answer to negotiating ``job``'s manifest. A draft goes first, so that the uploads run
    while the whole-file sha256s (the slowest hash, needed only by the commit) are still being
    computed; a server older than draft manifests gets the whole one, once the digests are in."""
    draft = job.draft()
    try:
        return negotiate(draft)
    except InvalidRequest as exc:
        if not draft.is_draft or "sha256" not in str(exc):
            raise
    return negotiate(job.manifest())


def _mend_unheard(url: str) -> InvalidRequest:
    """An older server ignores mend_damaged (one of the release before, for a new version): it read
    nothing, so "already stored" would read as "nothing was damaged", and a new version would commit
    over damaged chunks. Said before anything is uploaded."""
    return InvalidRequest(
        f"the server at {url} is older than push --mend-damaged: it did not read "
        "the stored chunks this version needs, so nothing damaged was mended; upgrade "
        "it, or push without --mend-damaged to mend only lost packs"
    )


def _check_url(url: str) -> None:
    """A registry URL httpx can use, refused in one line otherwise: httpx raises InvalidURL at the
    first request (an internal error to the user), and sends a URL's user name and password as Basic
    credentials in place of the token, which the server then calls a malformed header."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise InvalidRequest(
            f"registry URL {url!r} cannot be read ({exc}): fix MFSREG_URL, e.g. http://host:8700"
        ) from None
    if not parsed.host:
        raise InvalidRequest(f"registry URL {url!r} names no host: fix MFSREG_URL, e.g. http://host:8700")
    if parsed.port is not None and not 0 < parsed.port < 65536:
        raise InvalidRequest(f"registry URL {url!r} names port {parsed.port}, beyond 65535: fix MFSREG_URL")
    if parsed.userinfo:
        raise InvalidRequest(
            f"registry URL {url!r} carries a user name or password, which mfsreg does not send: "
            "remove it from MFSREG_URL and put the token in MFSREG_TOKEN"
        )


def _raise_for(resp: httpx.Response) -> None:
    if resp.status_code < 400:
        return
    try:
        body = resp.json()
        detail = body.get("detail") or resp.reason_phrase
    except (ValueError, AttributeError):
        # a proxy's or another server's page (every mfsreg answer is JSON): its HTML says nothing to
        # the user, and a 404 from it is no "not found" of a family or version
        kind: type[RegistryError] = StorageError if resp.status_code >= 500 else InvalidRequest
        raise kind(
            f"{resp.url.copy_with(query=None)} answered {resp.status_code} {resp.reason_phrase} with a body that "
            "is not JSON: check that MFSREG_URL points at an mfsreg server (and any proxy before it)"
        ) from None
    detail = " ".join(str(detail).split())[:500]  # one line, whatever the server put in it
    mfsreg_problem = isinstance(body, dict) and str(body.get("type", "")).startswith("urn:mfsreg:")
    # an mfsreg server answers a path it has no route for as urn:mfsreg:http_error (api/problems.py)
    if resp.status_code == 404 and (not mfsreg_problem or body.get("type") == "urn:mfsreg:http_error"):
        # not mfsreg's "no such family or version" (a problem with its type) but the server's
        # "no such route": MFSREG_URL names another server, or a path the API is not mounted at
        raise NoRoute(
            f"{resp.url.copy_with(query=None)} answered 404 {resp.reason_phrase}: no mfsreg API there; "
            "check that MFSREG_URL is the server's address (http://host:port, with a path only "
            "where a proxy mounts the API under one)"
        )
    kind = _STATUS.get(resp.status_code, RegistryError)
    if kind is not RegistryError and isinstance(body, dict):
        # A finer kind the caller acts on, named by the problem's type (api/problems.py); a server
        # older than that kind sends the plain one. On a 422 the type tells the two kinds apart.
        named = _CODES.get(str(body.get("type", "")).removeprefix("urn:mfsreg:"))
        if named is not None and (issubclass(named, kind) or resp.status_code == 422):
            kind = named
    raise kind(f"{detail}" if kind is not RegistryError else f"server answered {resp.status_code}: {detail}")


def _family_row(f: dict) -> FamilyRow:
    _checked("FamilyModel", f)
    return FamilyRow(0, f["family"], f["base_quorum"], f["versions"], f.get("chunk_size", LEGACY_CHUNK_SIZE))
