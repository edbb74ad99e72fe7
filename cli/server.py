"""`mfsreg serve` and `mfsreg token ...`: running the API and managing its tokens (admin side)."""

from __future__ import annotations

import typer

from mfsreg.cli.backend import embedded, local_only
from mfsreg.cli.output import emit_json, table

# the token commands read and write only the database (embedded(blobs=False)): an admin can list,
# create and revoke tokens while MFSREG_BLOB_URL is wrong or its S3 endpoint is down
token_app = typer.Typer(help="API tokens (runs against the database, not over HTTP).", no_args_is_help=True)


def serve(
    host: str = typer.Option("127.0.0.1", "--host", help="Address to bind."),
    port: int = typer.Option(8700, "--port", help="Port to bind."),
    workers: int = typer.Option(1, "--workers", help="Worker processes (the API keeps no state)."),
    log_level: str = typer.Option("info", "--log-level"),
    log_format: str = typer.Option(
        "text", "--log-format", help="text (uvicorn's lines) or json (one object per line, with request ids)."
    ),
) -> None:
    """Serve the registry over HTTP (MFSREG_DATABASE_URL and MFSREG_BLOB_URL, or the embedded default)."""
    import os
    import shutil
    import tempfile

    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    from mfsreg.registry.registry import Registry

    _check_serve_options(host, port, workers, log_level)
    if log_format not in ("text", "json"):
        from mfsreg.registry.errors import InvalidRequest

        raise InvalidRequest(f"--log-format {log_format!r}: use text or json")
    from mfsreg.api.logs import log_config as log_config_for

    with Registry() as reg:  # fail fast, with one line, if the database or blob store is unusable
        reg.ping()  # the blob store too: a missing bucket or an endpoint that is down (opening it connects to nothing)
    # The registry's own warnings (a stored chunk it could not read back, say) go out as uvicorn's
    # do, at the same level: otherwise Python prints them bare, and --log-level does not reach them.
    log_config = log_config_for(LOGGING_CONFIG, log_level, log_format)
    made = None
    if workers > 1 and not os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        # each worker writes its metrics there and /metrics adds them up (api/metrics.py)
        made = os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="mfsreg-metrics-")
    try:
        uvicorn.run(
            "mfsreg.api.app:create_app",
            factory=True,
            host=host,
            port=port,
            workers=workers,
            log_level=log_level,
            log_config=log_config,
        )
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")  # uvicorn's


def _check_serve_options(host: str, port: int, workers: int, log_level: str) -> None:
    """What uvicorn would refuse with a traceback or a screen of log lines (and exit 3, this CLI's
    code for auth failures), refused first in one line."""
    import socket

    from mfsreg.registry.errors import InvalidRequest

    if not host.strip():  # an unset $HOST in a script: uvicorn would listen on every interface
        raise InvalidRequest(
            f"--host {host!r} names no address: give one, e.g. 127.0.0.1 (or 0.0.0.0 for every interface)"
        )
    if not 1 <= port <= 65535:
        raise InvalidRequest(f"--port {port}: give a port from 1 to 65535")
    if workers < 1:
        raise InvalidRequest(f"--workers {workers}: give 1 or more worker processes")
    if log_level.lower() not in LOG_LEVELS:
        raise InvalidRequest(f"--log-level {log_level!r}: use one of {', '.join(LOG_LEVELS)}")
    try:  # uvicorn binds the same way (SO_REUSEADDR): a port it could take, this takes too
        socket.create_server((host, port)).close()
    except (OSError, UnicodeError, TypeError) as exc:  # TypeError: a name that does not encode (not UTF-8)
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else "not a name or address this machine has"
        raise InvalidRequest(
            f"cannot listen on {host}:{port}: {why}: pick another --port, or a --host this machine has"
        ) from None


@token_app.command("create")
def create(
    scope: str = typer.Option("read", "--scope", help="read, push or admin (each includes the ones before it)."),
    family: str = typer.Option("*", "--family", help="Family name or shell pattern, e.g. 'qwen*'."),
    description: str = typer.Option("", "--description", help="A note to tell tokens apart."),
    expires: str = typer.Option(
        None, "--expires", help="Valid for this long (e.g. 30d, 12h); without it, until revoked."
    ),
    json_: bool = typer.Option(False, "--json"),
) -> None:
    """Create a token; it is printed once and stored only as a hash."""
    from mfsreg.registry.auth import create_token
    from mfsreg.registry.config import parse_duration
    from mfsreg.registry.errors import InvalidRequest

    local_only("token create")
    seconds = None
    if expires is not None:
        try:
            seconds = parse_duration(expires)
        except ValueError:
            raise InvalidRequest(f"--expires {expires!r}: give a duration, e.g. 30d, 12h or 3600") from None
    with embedded(blobs=False) as reg:
        secret = create_token(reg.engine, scope, family, description, seconds)
    if json_:
        emit_json({"token": secret, "scope": scope, "family": family, "expires_in": seconds})
    else:
        typer.echo(secret)


@token_app.command("list")
def list_(json_: bool = typer.Option(False, "--json")) -> None:
    """Tokens that are not revoked (their prefixes, never the secrets)."""
    from mfsreg.registry.auth import list_tokens
    from mfsreg.registry.results import timestamp

    local_only("token list")
    with embedded(blobs=False) as reg:
        rows = [
            dict(
                prefix=t.prefix,
                scope=t.role,
                family=t.family_pattern,
                description=t.description,
                created_at=timestamp(t.created_at),
                expires_at=timestamp(t.expires_at) if t.expires_at is not None else None,
                last_used_at=timestamp(t.last_used_at) if t.last_used_at is not None else None,
            )
            for t in list_tokens(reg.engine)
        ]
    if json_:
        emit_json({"tokens": rows})
    else:
        table(
            None,
            ["prefix", "scope", "family", "expires", "last used", "description"],
            [
                [
                    r["prefix"],
                    r["scope"],
                    r["family"],
                    _minute(r["expires_at"]),
                    _minute(r["last_used_at"]),
                    r["description"],
                ]
                for r in rows
            ],
        )


def _minute(at: str | None) -> str:
    """An ISO time to the minute, for a table ("-" for none)."""
    return at[:16].replace("T", " ") if at else "-"


@token_app.command("revoke")
def revoke(prefix: str = typer.Argument(..., help="The token's prefix, as `mfsreg token list` shows it.")) -> None:
    """Revoke a token by its prefix."""
    from mfsreg.registry.auth import revoke_token
    from mfsreg.registry.errors import NotFound

    local_only("token revoke")
    with embedded(blobs=False) as reg:
        if revoke_token(reg.engine, prefix) == 0:
            raise NotFound(f"no active token with prefix {prefix!r}: see `mfsreg token list`")
    typer.echo(f"revoked {prefix}")
