"""Every MFSREG_* environment variable mfsreg reads, in one table.

docs/configuration.md is generated from ``VARIABLES`` (docs/hooks.py), and tests/test_docs.py checks
that the code reads no variable the table lacks and that the table names none the code does not
read, so the page cannot drift from the code. The values are parsed where they are used
(registry/config.py for the registry's settings, the node client for its own).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Variable:
    """One setting: its name, its default in words, who reads it, and what it does."""

    name: str
    default: str
    used_by: str  # "registry" (embedded and server), "server", "client" (CLI or Python against a server), "node", "CLI"
    help: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "MFSREG_HOME",
        "~/.mfsreg",
        "registry",
        "Directory of the embedded registry: its SQLite database (registry.db) and packs (blobs/). An absolute path.",
    ),
    Variable(
        "MFSREG_DATABASE_URL",
        "sqlite:///$MFSREG_HOME/registry.db",
        "registry",
        "Metadata database: `sqlite:////absolute/path` or `postgresql://user@host/db` (psycopg 3). A server's "
        "database is upgraded only by `mfsreg db upgrade`; the embedded one upgrades itself.",
    ),
    Variable(
        "MFSREG_BLOB_URL",
        "file://$MFSREG_HOME/blobs",
        "registry",
        "Where packs are stored: `file:///dir` or `s3://bucket/prefix`.",
    ),
    Variable(
        "MFSREG_S3_ENDPOINT_URL",
        "AWS's, or AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL",
        "registry",
        "S3 endpoint for MinIO or another S3 server, e.g. `http://minio:9000`. Credentials come the usual AWS "
        "way (AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, a profile, an instance role).",
    ),
    Variable("MFSREG_S3_CONNECT_TIMEOUT", "5", "registry", "Seconds to open a connection to the S3 endpoint."),
    Variable(
        "MFSREG_S3_READ_TIMEOUT",
        "20",
        "registry",
        "Seconds to wait for the endpoint's next bytes (not for a whole pack).",
    ),
    Variable("MFSREG_S3_MAX_ATTEMPTS", "3", "registry", "Tries of one S3 request, the first included (1 to 20)."),
    Variable(
        "MFSREG_CHUNK_SIZE",
        "2M",
        "registry",
        "Largest chunk a new family is cut into (4K to 256M); a family keeps the size it was first pushed with.",
    ),
    Variable("MFSREG_PACK_SIZE", "64M", "registry", "Target size of a pack object."),
    Variable(
        "MFSREG_DELTA",
        "1",
        "registry",
        "Store near-duplicate chunks as lossless deltas against a basis chunk (0: exact dedup only).",
    ),
    Variable("MFSREG_ANONYMOUS_READ", "0", "server", "Let requests without a token read every family."),
    Variable("MFSREG_MAX_BODY", "320M", "server", "Largest request body the API accepts."),
    Variable(
        "MFSREG_METRICS_TOKEN",
        "unset (open)",
        "server",
        "Bearer token that `/metrics` asks for; unset, anyone who reaches the server reads the metrics.",
    ),
    Variable(
        "MFSREG_URL",
        "unset (the embedded registry)",
        "client",
        "URL of an mfsreg server, e.g. `http://registry:8700`; the CLI and the Python client then talk to it.",
    ),
    Variable("MFSREG_TOKEN", "unset (no token)", "client", "API token sent to the server (`mfsreg token create`)."),
    Variable("MFSREG_UPLOAD_BATCH", "32M", "client", "Payload bytes per upload request of a push to a server."),
    Variable(
        "MFSREG_CACHE_DIR",
        "$XDG_CACHE_HOME/mfsreg, or ~/.cache/mfsreg",
        "node",
        "The node cache: chunks, rebuilt files and their index. Processes on one node may share it.",
    ),
    Variable(
        "MFSREG_CACHE_MAX",
        "unset (no limit)",
        "node",
        "Size limit of the node cache; the least recently used chunks are evicted, the base tier last.",
    ),
    Variable(
        "MFSREG_VERSION_MAX_AGE",
        "30",
        "node",
        "Seconds a node's loads and switches trust a version document the registry confirmed, before "
        "asking again (`0`: ask every time). A version deleted meanwhile can still be loaded from the "
        "cache for that long.",
    ),
    Variable(
        "MFSREG_PULL_DIRECT",
        "0",
        "node",
        "Write big pulled files around the page cache (O_DIRECT) where the filesystem takes it.",
    ),
    Variable("MFSREG_DEBUG", "unset", "CLI", "Print a traceback for an unexpected error instead of one line."),
)

NAMES = frozenset(v.name for v in VARIABLES)
