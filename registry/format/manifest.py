"""Manifests: what rebuilds a version byte for byte.

A version is a list of files. Each file is a list of chunks in file order (their concatenation is the
file) plus, for safetensors files, the tensors and their byte ranges, so that a node can build
tensors straight from chunks. The first chunk of a safetensors file is its header, kept verbatim.
Stored as zstd-compressed JSON in the versions table; chunk lists are compact rows, not objects.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from dataclasses import dataclass

import zstandard

from mfsreg.registry.config import MAX_CHUNK_SIZE
from mfsreg.registry.format.chunking import ChunkRef, iter_cuts
from mfsreg.registry.format.safetensors import MAX_HEADER_BYTES, TensorSpan

# The largest chunk a manifest may name: a tensor piece, or a safetensors header kept whole. Bounded
# so that a small document cannot name a huge one (checking its cuts would plan them all).
MAX_CHUNK_BYTES = max(MAX_CHUNK_SIZE, MAX_HEADER_BYTES + 8)

_SHA256 = re.compile(r"[0-9a-f]{64}")
MAX_PATH_BYTES = 1024  # a file's path in a version, UTF-8; each of its names at most NAME_MAX
NAME_MAX = 255  # the longest file name Linux filesystems take

SAFETENSORS = "safetensors"
BLOB = "blob"
FORMAT = 1


@dataclass(frozen=True)
class FileEntry:
    path: str  # relative, '/'-separated
    kind: str  # SAFETENSORS or BLOB
    size: int
    sha256: str | None  # None only in a draft: the digest is still being computed (see HashJob.draft)
    chunks: tuple[ChunkRef, ...]
    tensors: tuple[TensorSpan, ...] = ()


@dataclass(frozen=True)
class Manifest:
    files: tuple[FileEntry, ...]
    single_file: bool  # pushed as one .safetensors file: pull writes a file, not a directory

    @property
    def logical_bytes(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def is_draft(self) -> bool:
        """A draft lacks some file digests: enough to negotiate which chunks to send, not to commit."""
        return any(f.sha256 is None for f in self.files)

    @property
    def digest(self) -> str | None:
        """sha256 over the sorted (path, size, sha256) of every file: the version's identity (None for a draft)."""
        if self.is_draft:
            return None
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
        return "sha256:" + h.hexdigest()

    def final_digest(self) -> str:
        """``digest`` of a manifest whose file digests are all in (what a commit takes, what
        HashJob.manifest returns); a draft is refused (InvalidRequest)."""
        digest = self.digest
        if digest is None:
            from mfsreg.registry.errors import InvalidRequest

            raise InvalidRequest("a draft manifest (some file digests still null) cannot be committed")
        return digest

    @property
    def layout(self) -> str:
        """sha256 over the sorted (path, size, chunks) of every file: the bytes a pull builds. The
        server checks each chunk against its id but cannot afford to hash whole files, so a file's
        sha256 (and with it ``digest``) is its pusher's word; two manifests of one digest are the
        same version only if this matches too. A draft has one."""
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.path):
            h.update(f"{f.path}\0{f.size}\0".encode())
            h.update(",".join(f"{c.id}:{c.offset}:{c.size}" for c in sorted(f.chunks, key=lambda c: c.offset)).encode())
            h.update(b"\n")
        return "sha256:" + h.hexdigest()

    def chunk_ids(self) -> list[str]:
        """Distinct chunk ids, in first-use order."""
        return list(dict.fromkeys(c.id for f in self.files for c in f.chunks))

    def chunk_sizes(self) -> dict[str, int]:
        return {c.id: c.size for f in self.files for c in f.chunks}

    def follows_chunk_size(self, chunk_size: int) -> bool:
        """Whether every file is cut exactly as plan_cuts cuts it at ``chunk_size``: only then does
        this version dedup against members of a family cut at that size."""
        for f in self.files:
            header = None
            if f.kind == SAFETENSORS:
                if not f.chunks:
                    return False
                # the header is one chunk, whatever its size; tensors in file order, as a header lists them
                header = _CutHeader(
                    min(f.chunks, key=lambda c: c.offset).size, tuple(sorted(f.tensors, key=lambda t: (t.start, t.end)))
                )
            have = sorted((c.offset, c.size) for c in f.chunks)
            # Compared a cut at a time, stopping at the first difference: a manifest may claim a file
            # of terabytes in a few kilobytes of JSON (few huge chunks), whose full plan at a small
            # chunk size would take the server's memory. At most len(have) + 1 cuts are planned.
            n = 0
            for c in iter_cuts(f.size, header, chunk_size):
                if n == len(have) or (c.offset, c.size) != have[n]:
                    return False
                n += 1
            if n != len(have):
                return False
        return True

    def cut_size(self) -> int | None:
        """The chunk size this manifest was cut at, read off its cuts (for a client that does not say):
        the largest whole step of a tensor (or blob) cut in several chunks; None if nothing was cut
        in two, when any size at least as large as its chunks cuts it alike."""
        steps = []  # chunks that end inside their tensor (or blob), so are a whole step long
        for f in self.files:
            if f.kind == SAFETENSORS:
                ends = {t.end for t in f.tensors}
                steps += [c.size for c in f.chunks if c.offset > 0 and c.offset + c.size not in ends]  # not the header
            else:
                steps += [c.size for c in f.chunks if c.offset + c.size < f.size]
        size = max(steps, default=None)
        return size if size is not None and self.follows_chunk_size(size) else None

    def to_doc(self) -> dict:
        """The manifest as plain JSON values (what is stored, compressed, and what the API carries)."""
        return {
            "format": FORMAT,
            "single_file": self.single_file,
            "files": [
                {
                    "path": f.path,
                    "kind": f.kind,
                    "size": f.size,
                    "sha256": f.sha256,
                    "chunks": [[c.id, c.offset, c.size, c.itemsize] for c in f.chunks],
                    "tensors": [[t.name, t.dtype, list(t.shape), t.start, t.end] for t in f.tensors],
                }
                for f in self.files
            ],
        }

    def to_bytes(self) -> bytes:
        return zstandard.ZstdCompressor(level=3).compress(json.dumps(self.to_doc(), separators=(",", ":")).encode())

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        return cls.from_doc(cls.doc_of(data))

    @staticmethod
    def doc_of(data: bytes) -> dict:
        """The document of stored manifest bytes, without building a Manifest (a server passes it on)."""
        return json.loads(zstandard.ZstdDecompressor().decompress(data))

    @classmethod
    def from_doc(cls, doc: dict) -> Manifest:
        files = tuple(
            FileEntry(
                path=f["path"],
                kind=f["kind"],
                size=f["size"],
                sha256=f["sha256"],
                chunks=tuple(ChunkRef(i, o, s, w) for i, o, s, w in f["chunks"]),
                tensors=tuple(TensorSpan(n, d, tuple(sh), s, e) for n, d, sh, s, e in f["tensors"]),
            )
            for f in doc["files"]
        )
        return cls(files=files, single_file=bool(doc["single_file"]))


def parse_doc(doc: object, draft: bool = False) -> Manifest:
    """A manifest sent by a client, checked for shape and self-consistency (InvalidRequest if not).
    With ``draft``, file digests may be null (a push negotiates while its client still hashes).

    Checked here: the fields and their JSON types (_check_shape), safe unique paths, chunks that
    tile each file from 0 to its size, tensors of known dtypes that lie on chunk boundaries. The
    header chunk's bytes are checked against the tensors on commit, once the chunk is stored
    (registry/store/service.py).
    """
    # (over 60 lines: one check per rule the docstring lists, in that order, each with its
    # one-line refusal; split, the rules would no longer read as one list)
    from mfsreg.registry.errors import InvalidRequest, shown
    from mfsreg.registry.format.safetensors import DTYPE_SIZES
    from mfsreg.registry.format.wire import check_id

    _check_shape(doc)
    m = Manifest.from_doc(doc)  # type: ignore[arg-type]
    if not m.files or (m.single_file and len(m.files) != 1):
        raise InvalidRequest("malformed manifest: no files, or several files in a single-file version")
    _check_no_file_above_another(m)
    seen = set()
    for f in m.files:
        if f.path in seen or unsafe_path(f.path):
            raise InvalidRequest(f"malformed manifest: unsafe or repeated path {shown(f.path, 200)}")
        seen.add(f.path)
        path = shown(f.path, 200)
        bad_file = f"malformed manifest: {path}: bad kind or sha256"
        # a node names files in its cache by this digest: 64 lowercase hex digits and nothing else
        digest_ok = (isinstance(f.sha256, str) and _SHA256.fullmatch(f.sha256) is not None) or (
            draft and f.sha256 is None
        )
        if f.kind not in (SAFETENSORS, BLOB):
            raise InvalidRequest(f"{bad_file}: kind {shown(f.kind, 40)} is not {SAFETENSORS!r} or {BLOB!r}")
        if not digest_ok and f.sha256 is None:
            raise InvalidRequest(
                f"{bad_file}: sha256 is null: a commit needs each file's digest (only a negotiation takes a draft)"
            )
        if not digest_ok:
            raise InvalidRequest(f"{bad_file}: sha256 {shown(f.sha256, 80)} is not 64 lowercase hex digits")
        pos = 0
        for k, c in enumerate(f.chunks):
            check_id(c.id)
            if c.offset != pos:
                raise InvalidRequest(
                    f"malformed manifest: {path}: chunks do not tile the file at offset {pos} "
                    f"(chunk {k} starts at {c.offset}): list them in file order, each where the last ends"
                )
            if c.size <= 0:
                raise InvalidRequest(
                    f"malformed manifest: {path}: chunk {k} at offset {pos} has size {c.size}: "
                    "a chunk holds at least one byte"
                )
            if c.itemsize not in (1, 2, 4, 8):
                raise InvalidRequest(
                    f"malformed manifest: {path}: chunk {k} at offset {pos} has itemsize "
                    f"{c.itemsize}: use 1, 2, 4 or 8 (its tensor's element size; 1 outside tensors)"
                )
            if c.size > MAX_CHUNK_BYTES:
                raise InvalidRequest(
                    f"malformed manifest: {path}: a chunk of {c.size} bytes at offset {pos}, "
                    f"over the {MAX_CHUNK_BYTES} byte limit"
                )
            pos += c.size
        if pos != f.size:
            raise InvalidRequest(f"malformed manifest: {path}: chunks cover {pos} of {f.size} bytes")
        starts = {c.offset for c in f.chunks} | {f.size}
        if f.kind == BLOB and f.tensors:
            raise InvalidRequest(f"malformed manifest: {path}: a side file cannot hold tensors")
        for t in f.tensors:
            if t.dtype not in DTYPE_SIZES:
                raise InvalidRequest(
                    f"malformed manifest: {path}: tensor {shown(t.name, 80)} has unknown dtype "
                    f"{shown(t.dtype, 20)}: use one of {', '.join(DTYPE_SIZES)}"
                )
            if t.start not in starts or t.end not in starts or t.start > t.end:
                raise InvalidRequest(
                    f"malformed manifest: {path}: tensor {shown(t.name, 80)} is not on chunk "
                    f"boundaries (bytes {t.start} to {t.end}): it must start and end where chunks do"
                )
        if f.kind == SAFETENSORS and not f.chunks:
            raise InvalidRequest(f"malformed manifest: {path}: a safetensors file without a header chunk")
    return m


_FIELDS = ("format", "single_file", "files")
_FILE_FIELDS = ("path", "kind", "size", "sha256", "chunks", "tensors")
_CHUNK_ROW = ("id", "offset", "size", "itemsize")
_TENSOR_ROW = ("name", "dtype", "shape", "start", "end")


def _check_shape(doc: object) -> None:
    """A client's document holds format 1's fields in its JSON types, so that from_doc (which reads
    stored documents, written by this code) takes it whole. Each refusal names the field, as a path
    into the document (files[0].chunks[3]), quotes the value and says what it must be: a client's
    bug is named, not reported as the Python error that reading it would raise."""
    # (over 60 lines: one check per field of the document, in the document's order)
    from mfsreg.registry.errors import InvalidRequest, shown

    def bad(what: str) -> InvalidRequest:
        return InvalidRequest(f"malformed manifest: {what}")

    def count(value: object, where: str) -> None:
        if type(value) is not int or value < 0:  # not bool (true is an int to Python), nor 4096.0
            raise bad(f"{where} must be a non-negative integer, not {shown(value, 40)}")

    def text(value: object, where: str) -> None:
        if not isinstance(value, str):
            raise bad(f"{where} must be a string, not {shown(value, 40)}")

    def rows(value: object, where: str, row: tuple[str, ...]) -> list:
        shape = f"[{', '.join(row)}]"
        if not isinstance(value, list):
            raise bad(f"{where} must be a list of {shape} rows, not {shown(value, 40)}")
        for k, r in enumerate(value):
            if not isinstance(r, list) or len(r) != len(row):
                raise bad(f"{where}[{k}] must be a list {shape}, not {shown(r, 40)}")
        return value

    if not isinstance(doc, dict):
        raise bad(f"the manifest must be a JSON object with {', '.join(_FIELDS)}, not {shown(doc, 40)}")
    # the format first: another format's document may be shaped otherwise
    if "format" not in doc:
        raise bad(f"no 'format': a manifest says \"format\": {FORMAT}, the format this server reads")
    if doc["format"] != FORMAT or isinstance(doc["format"], bool):
        raise bad(
            f"format {str(doc['format'])[:20]!r}: this server reads format {FORMAT}; upgrade the server, "
            "or push with a client of its release"
        )
    # from_doc would take "single_file": "false" for true
    if not isinstance(doc.get("single_file"), bool):
        raise bad("single_file must be true or false")
    if "files" not in doc:
        raise bad(f"no 'files': a manifest lists its files, each an object with {', '.join(_FILE_FIELDS)}")
    files = doc["files"]
    if not isinstance(files, list):
        raise bad(f"files must be a list of file objects ({', '.join(_FILE_FIELDS)}), not {shown(files, 40)}")
    for i, f in enumerate(files):
        at = f"files[{i}]"
        if not isinstance(f, dict):
            raise bad(f"{at} must be an object with {', '.join(_FILE_FIELDS)}, not {shown(f, 40)}")
        for key in _FILE_FIELDS:
            if key not in f:
                raise bad(f"{at} has no {key!r}: a file has {', '.join(_FILE_FIELDS)}")
        text(f["path"], f"{at}.path")
        text(f["kind"], f"{at}.kind")
        count(f["size"], f"{at}.size")
        for k, (_id, offset, size, itemsize) in enumerate(rows(f["chunks"], f"{at}.chunks", _CHUNK_ROW)):
            for name, value in zip(_CHUNK_ROW[1:], (offset, size, itemsize)):
                count(value, f"{at}.chunks[{k}] {name}")
        for k, (name, dtype, shape, start, end) in enumerate(rows(f["tensors"], f"{at}.tensors", _TENSOR_ROW)):
            where = f"{at}.tensors[{k}]"
            text(name, f"{where} name")
            text(dtype, f"{where} dtype")
            if not isinstance(shape, list) or any(type(d) is not int or d < 0 for d in shape):
                raise bad(f"{where} shape must be a list of non-negative integers, not {shown(shape, 40)}")
            count(start, f"{where} start")
            count(end, f"{where} end")


def _check_no_file_above_another(m: Manifest) -> None:
    """No file's path may be a folder another file lies in ('a' and 'a/b'): such a version could be
    stored but never pulled (the second file needs a folder where the first file is)."""
    from mfsreg.registry.errors import InvalidRequest

    paths = {f.path for f in m.files if isinstance(f.path, str)}
    for p in paths:
        parts = p.split("/")
        for k in range(1, len(parts)):
            above = "/".join(parts[:k])
            if above in paths:
                raise InvalidRequest(
                    f"malformed manifest: {above[:200]!r} is a file, but {p[:200]!r} needs it as a folder"
                )


def unsafe_path(path: str) -> bool:
    """Whether a file path of a manifest could not be written under a pull's output directory as it
    is: absolute, empty, climbing out (``..``), hidden, too long, or holding a control character
    (NUL, newline: they would also make two manifests hash alike, see Manifest.digest) or a lone
    surrogate (no UTF-8 for it)."""
    parts = path.split("/")
    if not path or path.startswith("/") or any(x in ("", ".", "..") or x.startswith(".") for x in parts):
        return True
    if any(unicodedata.category(ch) in ("Cc", "Cs") for ch in path):
        return True
    return len(path.encode()) > MAX_PATH_BYTES or any(len(x.encode()) > NAME_MAX for x in parts)


@dataclass(frozen=True)
class _CutHeader:
    """What plan_cuts reads of a safetensors header, rebuilt from a manifest."""

    header_size: int
    tensors: tuple[TensorSpan, ...]
