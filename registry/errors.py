"""The one error tree of mfsreg.

Every failure a user can cause is a RegistryError subclass with a one-line message that says what is
wrong and what to do. The CLI maps the tree to exit codes, the API to HTTP statuses, each in one table
(cli/exits.py, api/problems.py); nothing here knows about either.
"""

from __future__ import annotations


def shown(value: object, limit: int = 80) -> str:
    """``value`` as an error message quotes it (its repr), cut to about ``limit`` characters: a
    message is one line, and a caller's value may be a megabyte (a name, an id, a path in a body)."""
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


class RegistryError(Exception):
    """Base of every error mfsreg reports to a user."""

    code = "registry_error"

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class InvalidName(RegistryError):
    """A family or version name outside the allowed alphabet."""

    code = "invalid_name"


class InvalidModel(RegistryError):
    """A model file or directory that is malformed or not a safetensors checkpoint."""

    code = "invalid_model"


class InvalidRequest(RegistryError):
    """Arguments that do not fit together (bad option values, wrong paths)."""

    code = "invalid_request"


class NotFound(RegistryError):
    """A family, version, chunk or blob that does not exist."""

    code = "not_found"
    pack_id: str | None = None  # a basis read's failed pack, set by registry/store/deltas.py


class NoRoute(NotFound):
    """A 404 that is not mfsreg's: no such route on that server (another server, a wrong path in
    MFSREG_URL, or a server of an older release without this route). Raised by the remote client."""


class MissingChunks(NotFound):
    """A commit names chunks that are not stored: never uploaded, or deleted by a prune after the
    push found them stored. A push uploads them and commits again, once."""

    code = "missing_chunks"


class Conflict(RegistryError):
    """An operation that contradicts stored state, e.g. a version name reused for other bytes."""

    code = "conflict"


class Pruned(Conflict):
    """A prune deleted something this operation relied on while it ran (a delta's basis, or a pack
    it took for abandoned): nothing was recorded. A push stores such chunks again once (plain where
    the basis is gone); only if that is refused too does the user see this, and a re-run works."""

    code = "pruned"


class IntegrityError(RegistryError):
    """Stored or received bytes that do not match their recorded digest."""

    code = "integrity_error"
    chunk_id: str | None = None  # a delta chain's damaged chunk, set by registry/store/deltas.py


class Unauthorized(RegistryError):
    """No credentials, or credentials that are not valid."""

    code = "unauthorized"


class Forbidden(RegistryError):
    """Valid credentials without the scope for this operation."""

    code = "forbidden"


class StorageError(RegistryError):
    """The metadata database or blob store cannot be reached or refused an operation.

    The message is for the registry's operator and may name the database, the bucket, a key or a
    path. ``public`` says what happened to someone who is not the operator, without those: the
    API sends it (or, where there is none, a general line) and logs the message beside the
    request's id. >>> StorageError("S3 put of packs/ab.pack in s3://b failed", public="the blob store failed")"""

    code = "storage_error"

    def __init__(self, message: str, public: str | None = None):
        super().__init__(message)
        self.public = public


class TooLarge(RegistryError):
    """A request or input over a configured size limit."""

    code = "too_large"
