"""The one interface the CLI talks to: the embedded Registry (registry/registry.py) and a server's
client (registry/client/remote.py) both implement it, and mypy checks that they do
(cli/backend.py assigns each to it). A command written against it runs on either."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # annotations only: importing this module costs the CLI nothing
    from mfsreg.registry.format.manifest import Manifest
    from mfsreg.registry.format.rebuild import PullResult
    from mfsreg.registry.meta import VersionMeta
    from mfsreg.registry.progress import Progress
    from mfsreg.registry.results import DeleteResult, FamilyRow, PruneResult, PushResult, VersionRow
    from mfsreg.registry.store.check import CheckResult


class RegistryClient(Protocol):
    """push, pull, ls, show, stats, tags, delete, prune, check and the audit log, on one registry."""

    def push(
        self,
        path: Path,
        family: str,
        version: str,
        parent: str | None = None,
        progress: Progress | None = None,
        mend_damaged: bool = False,
        meta: VersionMeta | None = None,
    ) -> PushResult: ...

    def pull(
        self, family: str, version: str, out: Path, progress: Progress | None = None, to_dir: bool = False
    ) -> PullResult: ...

    def families(self) -> list[FamilyRow]: ...

    def versions(self, family: str | None = None) -> list[VersionRow]: ...

    def manifest(self, family: str, version: str) -> tuple[VersionRow, Manifest]: ...

    def stats(self, family: str | None = None) -> dict: ...

    def tags(self, family: str) -> list: ...

    def tag_set(self, family: str, tag: str, version: str): ...

    def tag_rm(self, family: str, tag: str): ...

    def tag_history(self, family: str, tag: str | None = None, limit: int = 1000) -> list: ...

    def delete(self, family: str, version: str) -> DeleteResult: ...

    def prune(
        self, min_age: float, max_unused: float, dry_run: bool = False, progress: Progress | None = None
    ) -> PruneResult: ...

    def check(
        self, family: str | None = None, read_data: bool = False, progress: Progress | None = None
    ) -> CheckResult: ...

    def audit(self, *, limit: int = 100) -> list: ...

    def close(self) -> None: ...
