"""The Hugging Face Hub's read protocol over the registry: what `huggingface_hub` and
`transformers` need to download a version by repo id ``FAMILY/VERSION`` (or ``FAMILY/TAG``).

A version is a repo with one commit: its id is the first 40 hex digits of the version's digest,
and revision ``main``, that commit id, or the whole digest name it. A single-file version shows
its file as ``model.safetensors``, the name transformers looks for; a directory keeps its paths.
A file is rebuilt from its chunks as it is sent, each chunk checked against its id (a whole-file
read is checked against the file's sha256 too, and broken off if it differs). Framework-free: the
routes are in api/routes/hub.py. See docs/hub.md.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime

from mfsreg.registry.context import Store
from mfsreg.registry.db import chunks as chunk_db
from mfsreg.registry.db import versions as version_db
from mfsreg.registry.db.engine import read_tx
from mfsreg.registry.errors import IntegrityError, InvalidRequest, NotFound, shown
from mfsreg.registry.format import filecheck
from mfsreg.registry.format.manifest import FileEntry, Manifest
from mfsreg.registry.format.rebuild import decode_batch
from mfsreg.registry.names import check_name
from mfsreg.registry.parallel import sized_batches
from mfsreg.registry.results import VersionRow

MAIN = "main"
COMMIT_HEX = 40  # a git commit id's length: huggingface_hub takes 40 hex digits as a pinned revision
_PINNED = re.compile(r"(?:sha256:)?([0-9a-f]{40}|[0-9a-f]{64})")
SINGLE_NAME = "model.safetensors"
BATCH_BYTES = 16 << 20  # raw bytes decoded per step while a file streams; the next step decodes meanwhile


class HubNotFound(NotFound):
    """A 404 a Hub client tells apart by its X-Error-Code header: RepoNotFound, RevisionNotFound or
    EntryNotFound."""

    def __init__(self, message: str, hub_code: str):
        super().__init__(message)
        # a header holds latin-1 only: a name the message quotes may not (a file called 模型.json)
        shown_message = message.encode("ascii", "backslashreplace").decode()
        self.http_headers = {"X-Error-Code": hub_code, "X-Error-Message": shown_message}


@dataclass(frozen=True)
class Repo:
    """One version seen as a Hub repo: its row, manifest, commit id and files by their Hub paths."""

    row: VersionRow
    manifest: Manifest
    commit: str
    files: dict[str, FileEntry]


def hub_time(value) -> str | None:
    """A row's time as the Hub writes one (2026-12-04T14:46:20.000000Z, UTC); SQLite's are naive UTC."""
    if not isinstance(value, datetime):
        return None
    if value.tzinfo is not None:
        value = value.astimezone(UTC).replace(tzinfo=None)
    return value.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def commit_of(digest: str) -> str:
    return digest.removeprefix("sha256:")[:COMMIT_HEX]


def open_repo(reg: Store, family: str, name: str, revision: str = MAIN) -> Repo:
    """The version repo ``family/name`` names at ``revision`` (main, its commit id or its digest)."""
    try:
        check_name("family", family)
        check_name("version", name)
    except InvalidRequest as exc:
        raise HubNotFound(f"repository {shown(f'{family}/{name}')} does not exist ({exc})", "RepoNotFound") from None
    with read_tx(reg.engine) as conn:
        row = version_db.find_version(conn, family, name, tags=True)
        if row is None:
            raise HubNotFound(f"repository {family}/{name} does not exist: see `mfsreg ls {family}`", "RepoNotFound")
        pinned = _PINNED.fullmatch(revision) if revision != MAIN else None
        if revision != MAIN and not (pinned and row.digest.removeprefix("sha256:").startswith(pinned[1])):
            # another version of the family (two of one content: the oldest)
            found = version_db.find_by_digest(conn, family, pinned[1]) if pinned else None
            if found is None:
                raise HubNotFound(
                    f"revision {shown(revision)} of {family}/{name} does not exist: use main, or the "
                    "commit id the repo's info gives",
                    "RevisionNotFound",
                )
            row = found
        manifest = Manifest.from_bytes(version_db.read_manifest(conn, row.id))
    paths = {SINGLE_NAME if manifest.single_file else f.path: f for f in manifest.files}
    return Repo(row, manifest, commit_of(row.digest), paths)


def entry_of(repo: Repo, path: str) -> FileEntry:
    entry = repo.files.get(path)
    if entry is None:
        raise HubNotFound(
            f"{repo.row.family}/{repo.row.name} has no file {shown(path)}: its files are listed by its info",
            "EntryNotFound",
        )
    return entry


def parse_range(header: str | None, size: int) -> tuple[int, int] | None:
    """A Range header's one byte range as (start, stop), stop exclusive; None for the whole file,
    which is also the answer to a header this does not read (another unit, several ranges, an end
    before its start), as RFC 9110 has it. A range that starts past the end raises
    RangeNotSatisfiable (416)."""
    if header is None:
        return None
    m = re.fullmatch(r"\s*bytes\s*=\s*(\d{0,19})\s*-\s*(\d{0,19})\s*", header)
    if m is None or (m[1] == "" and m[2] == "") or (m[1] and m[2] and int(m[2]) < int(m[1])):
        return None
    if m[1] == "":  # the last N bytes
        start, stop = max(0, size - int(m[2])), size
    else:
        start = int(m[1])
        stop = size if m[2] == "" else min(size, int(m[2]) + 1)
    if start >= size or stop <= start:
        raise RangeNotSatisfiable(f"Range {shown(header)} lies outside the file's {size} bytes", size)
    return start, stop


class RangeNotSatisfiable(InvalidRequest):
    def __init__(self, message: str, size: int):
        super().__init__(message)
        self.http_status = 416
        self.http_headers = {"Content-Range": f"bytes */{size}"}


def read_file(reg: Store, repo: Repo, entry: FileEntry, start: int = 0, stop: int | None = None) -> Iterator[bytes]:
    """Bytes [start, stop) of ``entry``, rebuilt from its chunks and checked as they go: each chunk
    against its id; the whole file, when all of it is read, against its sha256 before its last
    piece goes (a mismatch raises, which breaks the response off short of its Content-Length). The chunks' places are read before the first byte is sent, so
    a version deleted meanwhile is a 404, not a broken stream."""
    stop = entry.size if stop is None else stop
    chunks = [c for c in filecheck.check_tiling(entry) if c.offset < stop and c.offset + c.size > start]
    with read_tx(reg.engine) as conn:
        located = chunk_db.locate_closure(conn, {c.id for c in chunks})
    missing = [c.id for c in chunks if c.id not in located]
    if missing:
        raise NotFound(f"version {repo.row.family}/{repo.row.name} was deleted while it was being read")
    whole = start == 0 and stop == entry.size
    return _stream(reg, entry, chunks, located, start, stop, whole)


def _stream(reg: Store, entry: FileEntry, chunks, located, start: int, stop: int, whole: bool) -> Iterator[bytes]:
    digest = hashlib.sha256() if whole else None
    batches = list(sized_batches(chunks, lambda c: c.size, BATCH_BYTES))

    def decode(batch):
        return decode_batch(list(dict.fromkeys(c.id for c in batch)), located, reg.read_payloads, reg.pool)

    held = b""  # the last piece, sent once the whole file's sha256 is checked: a mismatch ends short
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfsreg-hub") as side:
        nxt = side.submit(decode, batches[0]) if batches else None
        for k, batch in enumerate(batches):
            raw = nxt.result()  # type: ignore[union-attr]
            if k + 1 < len(batches):
                nxt = side.submit(decode, batches[k + 1])
            for c in batch:
                piece = memoryview(raw[c.id])[max(0, start - c.offset) : min(c.size, stop - c.offset)]
                if digest is not None:
                    digest.update(piece)
                if held:
                    yield held
                held = bytes(piece)
    if digest is not None and entry.sha256 is not None and digest.hexdigest() != entry.sha256:
        raise IntegrityError(f"{entry.path} does not match its sha256 as rebuilt: the stored version is damaged")
    if held:
        yield held
