"""The embedded registry as a node's source of documents and chunks: what RemoteRegistry answers
over HTTP, answered by the same service steps in this process (registry/store/service.py). With it,
load_tensors, ResidentModel and load_into work without a server (Node() without MFSREG_URL)."""

from __future__ import annotations

from collections.abc import Iterator

from mfsreg.registry.blobs.packs import ChunkForm
from mfsreg.registry.client.remote import Closable, DocumentReader
from mfsreg.registry.errors import InvalidRequest
from mfsreg.registry.format.wire import Located
from mfsreg.registry.registry import Registry
from mfsreg.registry.store import service


class EmbeddedSource(DocumentReader, Closable):
    """A Registry behind the interface the node's fetcher reads; ``own``: closed with this object."""

    def __init__(self, registry: Registry, own: bool = True):
        self.registry = registry
        self.own = own
        self.url = f"the embedded registry ({registry.settings.database_url.split('://')[0]})"
        self.pool = registry.pool
        self.bytes_received = 0  # payload bytes read from the blob store, as a remote's are received

    def version_doc_if(self, family: str, version: str, tag: str | None = None) -> tuple[dict | None, str | None]:
        return service.version_doc(self.registry, family, version, tag)

    def version_doc(self, family: str, version: str) -> dict:
        doc, _ = self.version_doc_if(family, version)
        if doc is None:
            raise InvalidRequest(f"no document for {family}/{version}")
        return doc

    def tier_doc(self, family: str, tier: str | None = None) -> dict:
        return service.tier_doc(self.registry, family, tier)

    def fetch(self, family: str, chunks: list[Located]) -> Iterator[tuple[ChunkForm, bytes]]:
        """Payloads of ``chunks`` (which must be the family's), read from the blob store."""
        self.check_open()
        located = service.plan_download(self.registry, family, [c.id for c in chunks])
        for chunk, payload in self.registry.read_payloads(located):
            self.bytes_received += len(payload)
            yield chunk, payload

    def close(self) -> None:
        self.closed = True
        if self.own:
            self.registry.close()
