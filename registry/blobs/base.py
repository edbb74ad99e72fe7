"""The BlobStore contract: the few operations the registry needs from object storage.

Every backend keeps these rules (tests/test_blobstore_contract.py checks each):
- ``put`` is atomic, idempotent, and returns once the bytes are durable;
- ``get(key, start, end)`` returns exactly bytes [start, end) (default: all), else raises NotFound
  (a missing key, a range past the end);
- ``size`` and ``exists`` download nothing; deleting a missing key succeeds;
- keys are relative paths of letters, digits and ``._/-``, without '..';
- ``leftovers`` lists what writers killed mid-put left (never a blob ``list`` shows), and
  ``remove_leftover`` removes one; a put still running may show one, younger than it.
"""

from __future__ import annotations

import abc
import builtins
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from mfsreg.registry.errors import InvalidRequest

_KEY = re.compile(r"^[A-Za-z0-9_-][A-Za-z0-9._/-]*$")


def check_key(key: str) -> str:
    if not _KEY.fullmatch(key) or ".." in key.split("/") or "//" in key:
        raise InvalidRequest(f"invalid blob key {key!r}")
    return key


@dataclass(frozen=True)
class Leftover:
    """Part of a put that never finished: a local store's temp file, an S3 multipart upload."""

    name: str  # the store's own name for it: a temp file's path under the root, "key upload-id" on S3
    size: int  # bytes it holds
    age: float  # seconds since it was last written (a local file's mtime, an upload's last part)


class BlobStore(abc.ABC):
    """Object storage for packs. Implementations: local.LocalBlobStore, s3.S3BlobStore."""

    url: str

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview) -> None: ...

    @abc.abstractmethod
    def get(self, key: str, start: int = 0, end: int | None = None) -> bytes: ...

    @abc.abstractmethod
    def size(self, key: str) -> int: ...

    @abc.abstractmethod
    def delete(self, key: str) -> None: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> Iterator[str]: ...

    def check(self) -> None:  # noqa: B027 (a store that is always reachable keeps this no-op)
        """Raise StorageError unless the store can be reached and used: a readiness probe, which
        reads nothing. A local directory a first push has yet to make passes."""

    def exists(self, key: str) -> bool:
        from mfsreg.registry.errors import NotFound

        try:
            self.size(key)
        except NotFound:
            return False
        return True

    def leftovers(self) -> Iterator[Leftover]:
        """What killed writers left (see the module docstring); a store whose puts leave nothing
        keeps this empty."""
        return iter(())

    def remove_leftover(self, leftover: Leftover) -> None:  # noqa: B027 (nothing to remove where none are left)
        """Remove one of ``leftovers``; one gone already is removed all the same."""

    def get_ranges(self, key: str, ranges: Sequence[tuple[int, int | None]]) -> builtins.list[bytes]:
        """Bytes of several [start, end) ranges of one object; backends may coalesce requests."""
        return [self.get(key, s, e) for s, e in ranges]
