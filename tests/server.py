"""mfsreg API servers on loopback over Postgres and moto's S3 server: uvicorn in a thread of this
process by default, or a real `mfsreg serve` process where the test is about that process (its
log, its workers, its start-up checks)."""

from __future__ import annotations

import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import pytest

from tests.cli_run import ALWAYS_PROCESS, MFSREG


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One API server for ``env`` (a server deployment's MFSREG_* settings). In a thread, its log
    goes to Python's logging; as a process (``process=True``), to ``log_path``."""

    def __init__(self, env: dict, log_path, process: bool = False):
        self.log_path = log_path
        if process or ALWAYS_PROCESS:
            self._start_process(env)
        else:
            self._start_thread(env)

    def _start_thread(self, env: dict) -> None:
        import uvicorn

        from mfsreg.api.app import create_app
        from mfsreg.registry.config import Settings
        from mfsreg.registry.registry import Registry

        self.proc = None
        self.log = None
        settings = Settings.from_env(env)
        self.registry = Registry(settings)
        self.registry.ping()  # as `mfsreg serve` does before it listens
        # named apart from a command's own pool: tests/cli_run.py keeps the server's records off its stderr
        self.registry.pool.shutdown()
        self.registry.pool = ThreadPoolExecutor(settings.workers, thread_name_prefix="mfsreg-server")
        sock = socket.create_server(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(settings, registry=self.registry),
            log_config=None,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=5,
        )
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(
            target=self.server.run, kwargs={"sockets": [sock]}, name="mfsreg-server-loop", daemon=True
        )
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the API server in a thread did not start")
            time.sleep(0.005)
        self._sock = sock

    def _start_process(self, env: dict) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [MFSREG, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
            env=env,
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mfsreg serve exited {self.proc.returncode}; see {self.log_path}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("mfsreg serve did not become healthy within 60 s")

    def stop(self) -> None:
        if self.proc is None:
            self.server.should_exit = True
            self.thread.join(timeout=15)
            self._sock.close()
            self.registry.close()
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@contextmanager
def module_server(s3_server: str, where) -> Iterator[tuple[Server, dict]]:
    """A server of its own database and bucket, for the tests of a module to share: (server, its
    deployment's environment)."""
    from tests.conftest import scratch_pg_database
    from tests.s3server import scratch_bucket

    with scratch_pg_database() as db, scratch_bucket(s3_server) as bucket:
        started = Servers(make_server_env(db, (f"s3://{bucket}/blobs", s3_server), where), where)
        try:
            (srv,) = started(1)
            yield srv, started.env
        finally:
            started.stop()


def migrate(env: dict) -> None:
    """`mfsreg db upgrade` for ``env``'s database, through the library."""
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import upgrade_database

    upgrade_database(Settings.from_env(env, blobs=False))


def embedded_server_env(home, **extra) -> dict:
    """Environment of a server on the embedded default (SQLite and packs under ``home``), migrated:
    for tests whose point is not the database's dialect or S3."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(MFSREG_HOME=str(home), MFSREG_CHUNK_SIZE=str(64 << 10), **extra)
    migrate(env)
    return env


@pytest.fixture
def server_env(migrated_pg, s3_blob_url, tmp_path) -> dict:
    """Environment of a server deployment: Postgres metadata, S3 packs; migrated, no state elsewhere."""
    return make_server_env(migrated_pg, s3_blob_url, tmp_path)


def make_server_env(database_url: str, s3_blob_url: tuple[str, str], where) -> dict:
    blob_url, endpoint = s3_blob_url
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(
        MFSREG_DATABASE_URL=database_url,
        MFSREG_BLOB_URL=blob_url,
        MFSREG_S3_ENDPOINT_URL=endpoint,
        MFSREG_HOME=str(where / "server-home"),
        MFSREG_PACK_SIZE=str(1 << 20),
    )
    migrate(env)
    return env


class Servers:
    """Starts servers on demand: ``servers(n)`` returns n running servers on one database and bucket."""

    def __init__(self, env: dict, where):
        self.env, self.where, self.started = env, where, []

    def __call__(self, n: int = 1, process: bool = False) -> list[Server]:
        new = [Server(self.env, self.where / f"server{len(self.started) + i}.log", process) for i in range(n)]
        self.started.extend(new)
        return new

    def stop(self) -> None:
        for s in self.started:
            s.stop()


@pytest.fixture
def servers(server_env, tmp_path):
    started = Servers(server_env, tmp_path)
    yield started
    started.stop()


def token(server_env: dict, scope: str | None, family: str = "*") -> str:
    """A new API token of ``scope`` for ``family``, made as `mfsreg token create` makes it."""
    from mfsreg.registry.auth import create_token
    from mfsreg.registry.config import Settings
    from mfsreg.registry.db.engine import create_db_engine

    engine = create_db_engine(Settings.from_env(server_env, blobs=False).database_url)
    try:
        return create_token(engine, scope, family)
    finally:
        engine.dispose()


def client_env(tmp_path, url: str, tok: str | None, **extra) -> dict:
    """A node or CI runner: only MFSREG_URL and MFSREG_TOKEN, and a home that must stay untouched."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(
        MFSREG_URL=url,
        MFSREG_HOME=str(tmp_path / "client-home"),
        MFSREG_CHUNK_SIZE=str(64 << 10),
        MFSREG_CACHE_DIR=str(tmp_path / "node-cache"),
        **extra,
    )
    if tok:
        env["MFSREG_TOKEN"] = tok
    return env


def counter(url: str, name: str, headers: dict | None = None, **labels) -> float:
    """The sum of ``name``'s samples (a counter's _total, a histogram's _count) whose labels include
    ``labels``, as the server's /metrics gives them now."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{url}/metrics", headers=headers, timeout=30).text
    total = 0.0
    for family in text_string_to_metric_families(text):
        if family.name == name:
            for sample in family.samples:
                if sample.name in (f"{name}_total", f"{name}_count") and labels.items() <= sample.labels.items():
                    total += sample.value
    return total
