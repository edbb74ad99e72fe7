"""Settings from MFSREG_* environment variables, with the embedded defaults under MFSREG_HOME.

Embedded default: SQLite (WAL) at $MFSREG_HOME/registry.db and packs under $MFSREG_HOME/blobs.
Server mode: MFSREG_DATABASE_URL (any SQLAlchemy URL; Postgres through psycopg 3) and
MFSREG_BLOB_URL (file:///path or s3://bucket/prefix, with MFSREG_S3_ENDPOINT_URL for MinIO).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from mfsreg.registry.blobs.urls import check_endpoint_url, configured_endpoint, parse_blob_url
from mfsreg.registry.errors import InvalidRequest

# 2 MiB, the size of a PMD-mapped page: a chunk file of it, mapped into a tensor on a 2 MiB boundary,
# takes one page-table entry and one fault (benchmarks/page_mapping.py: 8 ms to map and touch 1.16
# GB, against 56 for 1 MiB chunk files and 67 for load_file's one file). It also stores no more than
# 1 MiB (bench_chunk_size: 1.148 against 1.150 GB) with half the chunk rows. Families pushed
# before keep theirs (migration 0005).
DEFAULT_CHUNK_SIZE = 2 << 20
DEFAULT_PACK_SIZE = 64 << 20  # packs of tens of MiB keep object counts low and range reads cheap
MIN_CHUNK_SIZE = 4 << 10
MAX_CHUNK_SIZE = 256 << 20
# Room for an upload batch that holds one chunk of the largest size, uncompressible, with its index
# (registry/format/wire.py caps an index at 16 MiB): at 256 MiB a family cut at 256 MiB could not push.
DEFAULT_MAX_BODY = 320 << 20
# S3 requests: an endpoint that stops answering fails a request within about a minute (3 attempts
# of 20 s without a byte), not botocore's 60 s x 5 (over 6 minutes of silence). The read timeout is
# the longest wait for the next bytes, not for a whole pack, so a slow link still reads 64 MiB.
DEFAULT_S3_CONNECT_TIMEOUT = 5.0
DEFAULT_S3_READ_TIMEOUT = 20.0
DEFAULT_S3_MAX_ATTEMPTS = 3
MAX_S3_ATTEMPTS = 20
# prune's defaults (registry/store/prune.py): a grace period, in seconds, longer than any push between its
# first upload and its commit; and the share of unused bytes past which a pack is repacked
PRUNE_MIN_AGE = 3600.0
PRUNE_MAX_UNUSED = 0.1


def check_chunk_size(size: int, what: str = "MFSREG_CHUNK_SIZE") -> int:
    if not MIN_CHUNK_SIZE <= size <= MAX_CHUNK_SIZE:
        raise InvalidRequest(f"{what}={size} is out of range: use {MIN_CHUNK_SIZE} to {MAX_CHUNK_SIZE} bytes")
    return size


_Default = TypeVar("_Default")


def _size(env: dict, name: str, default: _Default) -> int | _Default:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = parse_size(raw)
    except (ValueError, OverflowError):
        raise InvalidRequest(f"{name}={raw!r} is not a size: {SIZE_HINT}") from None
    return value


SIZE_HINT = "give 1 byte or more, as bytes or with a suffix K, M, G or T (binary: 1K = 1024), e.g. 20G"


def parse_size(text: str) -> int:
    """Parse '1048576', '1M', '64KiB', '2G', '1T' into bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    mult = 1
    for suffix, m in (("K", 1 << 10), ("M", 1 << 20), ("G", 1 << 30), ("T", 1 << 40)):
        if t.endswith(suffix):
            t, mult = t[:-1], m
            break
    value = float(t) * mult
    if not 1 <= value < 1 << 62:  # also refuses inf and nan, and sizes under a byte (0.5 was taken for 0)
        raise ValueError(text)
    return int(value)


_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_duration(text: str) -> float:
    """Parse '90', '90s', '30m', '1h', '2d' into seconds (zero or more)."""
    t = text.strip().lower()
    mult = _SECONDS.get(t[-1:], None)
    try:
        value = float(t[:-1] if mult else t) * (mult or 1)
    except ValueError:
        raise ValueError(text) from None
    if not 0 <= value < float("inf"):  # also refuses nan
        raise ValueError(text)
    return value


def expand_user(name: str, value: str) -> Path:
    """``value`` with a leading ~ or ~user expanded; pathlib raises RuntimeError for a user this
    machine does not have, which would reach a user as an internal error."""
    try:
        return Path(value).expanduser()
    except RuntimeError:
        raise InvalidRequest(
            f"{name}={value!r} starts with a user name this machine does not have: give an absolute path"
        ) from None


@dataclass(frozen=True)
class Settings:
    home: Path
    database_url: str
    blob_url: str
    s3_endpoint_url: str | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    pack_size: int = DEFAULT_PACK_SIZE
    workers: int = field(default_factory=lambda: max(1, os.cpu_count() or 1))
    delta: bool = True  # store near-duplicate chunks as deltas against a basis (MFSREG_DELTA=0: exact dedup only)
    anonymous_read: bool = False  # server: let requests without a token read
    max_body: int = DEFAULT_MAX_BODY  # server: largest request body accepted (uploads are batched below it)
    metrics_token: str | None = None  # server: the bearer token /metrics asks for (None: open)
    s3_connect_timeout: float = DEFAULT_S3_CONNECT_TIMEOUT  # seconds to open a connection to the S3 endpoint
    s3_read_timeout: float = DEFAULT_S3_READ_TIMEOUT  # seconds to wait for the endpoint's next bytes
    s3_max_attempts: int = DEFAULT_S3_MAX_ATTEMPTS  # tries of one S3 request, the first included
    # The one-line refusal of a malformed MFSREG_S3_* value (a timeout or attempts field then holds
    # its default; s3_endpoint_url keeps what was given), or of a malformed endpoint set the AWS way,
    # raised where an S3 store is opened (blob_store_options), not by every command: ls, stats and
    # the token commands never open the store, and a local directory store reads none of them.
    s3_error: str | None = None

    @property
    def embedded(self) -> bool:
        return self.database_url.startswith("sqlite")

    def blob_store_options(self) -> dict:
        """What open_blob_store takes besides the URL and endpoint: the S3 timeouts and attempts for
        an s3 store, nothing for a local directory. InvalidRequest for a malformed URL, or for a
        malformed S3 setting or endpoint (s3_error) when the store is on S3."""
        if parse_blob_url(self.blob_url)[0] != "s3":
            return {}
        if self.s3_error:
            raise InvalidRequest(self.s3_error)
        return dict(
            connect_timeout=self.s3_connect_timeout,
            read_timeout=self.s3_read_timeout,
            max_attempts=self.s3_max_attempts,
        )

    @classmethod
    def from_env(cls, env: dict | None = None, *, blobs: bool = True, **overrides) -> Settings:
        """``blobs=False`` for a command that never opens the blob store (``db upgrade``, ``ls``,
        ``stats``, the token commands: cli/backend.py's embedded): its URL and S3 settings are then
        not checked here, and Registry.open_blobs checks them wherever the store is opened. With
        ``blobs``, a malformed one is refused here, before the database is opened."""
        env = dict(os.environ if env is None else env)
        home = expand_user("MFSREG_HOME", env.get("MFSREG_HOME") or str(Path.home() / ".mfsreg"))
        if not home.is_absolute():  # a relative one (or ' ') made a registry in each directory a command ran from
            raise InvalidRequest(
                f"MFSREG_HOME={env['MFSREG_HOME']!r} is not an absolute path: give one, e.g. "
                "/var/lib/mfsreg (or unset it for ~/.mfsreg)"
            )
        chunk_size = check_chunk_size(_size(env, "MFSREG_CHUNK_SIZE", DEFAULT_CHUNK_SIZE))
        values: dict[str, Any] = dict(
            home=home,
            database_url=env.get("MFSREG_DATABASE_URL") or f"sqlite:///{home / 'registry.db'}",
            blob_url=env.get("MFSREG_BLOB_URL") or (home / "blobs").as_uri(),
            s3_endpoint_url=env.get("MFSREG_S3_ENDPOINT_URL") or None,
            chunk_size=chunk_size,
            pack_size=_size(env, "MFSREG_PACK_SIZE", DEFAULT_PACK_SIZE),
            delta=_flag(env, "MFSREG_DELTA", True),
            anonymous_read=_flag(env, "MFSREG_ANONYMOUS_READ", False),
            max_body=_size(env, "MFSREG_MAX_BODY", DEFAULT_MAX_BODY),
            metrics_token=env.get("MFSREG_METRICS_TOKEN") or None,
        )
        s3, s3_errors = _s3_settings(env, overrides.get("s3_endpoint_url", values["s3_endpoint_url"]))
        values.update(s3)
        values.update(overrides)
        # the first malformed S3 setting that no override replaced, kept for when an S3 store opens
        values.setdefault("s3_error", next((msg for f, msg in s3_errors.items() if f not in overrides), None))
        settings = cls(**values)
        if blobs:  # a bad URL, or a bad S3 setting for an s3 one, is refused (exit 2) before anything connects
            settings.blob_store_options()
        return settings


def _s3_settings(env: dict, endpoint_url: str | None) -> tuple[dict, dict]:
    """The MFSREG_S3_* timeouts and attempts by field, and by field the one-line refusal of each
    malformed one (left at its default) and of a malformed endpoint (MFSREG_S3_ENDPOINT_URL, else
    AWS_ENDPOINT_URL_S3 or AWS_ENDPOINT_URL, which S3BlobStore would take): the caller decides when to
    raise it (Settings.s3_error). botocore refused a bad endpoint only once the database was open."""
    values, errors = {}, {}
    endpoint, setting = configured_endpoint(endpoint_url, env)
    if endpoint:
        try:
            check_endpoint_url(endpoint, setting)
        except InvalidRequest as exc:
            errors["s3_endpoint"] = exc.message  # of the endpoint in use, an override's included
    # (field, parser, variable, default): each parser takes a default of its own field's type
    fields: tuple[tuple[str, Callable[[dict, str, Any], float], str, float], ...] = (
        ("s3_connect_timeout", _seconds, "MFSREG_S3_CONNECT_TIMEOUT", DEFAULT_S3_CONNECT_TIMEOUT),
        ("s3_read_timeout", _seconds, "MFSREG_S3_READ_TIMEOUT", DEFAULT_S3_READ_TIMEOUT),
        ("s3_max_attempts", _attempts, "MFSREG_S3_MAX_ATTEMPTS", DEFAULT_S3_MAX_ATTEMPTS),
    )
    for field_name, parse, name, default in fields:
        try:
            values[field_name] = parse(env, name, default)
        except InvalidRequest as exc:
            values[field_name], errors[field_name] = default, exc.message
    return values, errors


def _seconds(env: Mapping[str, str], name: str, default: float, zero: bool = False) -> float:
    """A duration: seconds, or with a suffix s/m/h ('20', '20s', '2m'), at most a day; more than
    zero (a timeout), or with ``zero`` zero too (a freshness window: 0 trusts nothing)."""
    raw = env.get(name, "").strip()
    if not raw:
        return default
    try:
        value = parse_duration(raw)
    except ValueError:
        value = -1.0
    if not (0 <= value if zero else 0 < value) or value > 86400:
        if zero:
            raise InvalidRequest(
                f"{name}={env[name]!r} is not a number of seconds: give 0 to 86400, e.g. {default:g} or 0"
            )
        raise InvalidRequest(
            f"{name}={env[name]!r} is not a timeout: give seconds over zero (at most a day), "
            f"e.g. {default:g} or {default:g}s"
        )
    return value


def _attempts(env: dict, name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or not 1 <= int(raw) <= MAX_S3_ATTEMPTS:
        raise InvalidRequest(
            f"{name}={env[name]!r} is not a number of attempts: give 1 to {MAX_S3_ATTEMPTS} (1: no retries), e.g. 3"
        )
    return int(raw)


_YES, _NO = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _flag(env: dict, name: str, default: bool) -> bool:
    """A yes/no setting; unset or empty: ``default``. Another value is refused rather than read
    as one of the two (MFSREG_DELTA=maybe turned deltas on, MFSREG_ANONYMOUS_READ=maybe off)."""
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw in _YES or raw in _NO:
        return raw in _YES
    raise InvalidRequest(f"{name}={env[name]!r} is not a yes/no setting: use 1 or 0 (true/false, yes/no, on/off)")


def age_from_env(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """A freshness window from the environment: seconds, or with a suffix s/m/h; zero allowed."""
    return _seconds(os.environ if env is None else env, name, default, zero=True)


def size_from_env(name: str, default: _Default, env: dict | None = None) -> int | _Default:
    """A size setting (bytes or K/M/G) from the environment; InvalidRequest if malformed."""
    return _size(dict(os.environ if env is None else env), name, default)
