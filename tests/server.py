"""Real `mfsreg serve` processes (uvicorn) on loopback, over Postgres and moto's S3 server."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import httpx
import pytest

from tests.cli_run import MFSREG, mfsreg, mfsreg_json


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, env: dict, log_path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = open(log_path, "wb")
        self.proc = subprocess.Popen([MFSREG, "serve", "--host", "127.0.0.1", "--port", str(self.port), "--log-level", "warning"],
                                     env=env, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mfsreg serve exited {self.proc.returncode}; see {log_path}")
            try:
                if httpx.get(self.url + "/healthz", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.1)
        raise RuntimeError("mfsreg serve did not become healthy within 60 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


@pytest.fixture
def server_env(pg_database, s3_blob_url, tmp_path) -> dict:
    """Environment of a server deployment: Postgres metadata, S3 packs; migrated, no state elsewhere."""
    blob_url, endpoint = s3_blob_url
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(MFSREG_DATABASE_URL=pg_database, MFSREG_BLOB_URL=blob_url, MFSREG_S3_ENDPOINT_URL=endpoint,
               MFSREG_HOME=str(tmp_path / "server-home"), MFSREG_PACK_SIZE=str(1 << 20))
    mfsreg("db", "upgrade", env=env)
    return env


@pytest.fixture
def servers(server_env, tmp_path):
    """Start API processes on demand: ``servers(n)`` returns n running servers on one database and bucket."""
    started: list[Server] = []

    def start(n: int = 1) -> list[Server]:
        new = [Server(server_env, tmp_path / f"server{len(started) + i}.log") for i in range(n)]
        started.extend(new)
        return new

    yield start
    for s in started:
        s.stop()


def token(server_env: dict, scope: str, family: str = "*") -> str:
    return mfsreg_json("token", "create", "--scope", scope, "--family", family, env=server_env)["token"]


def client_env(tmp_path, url: str, tok: str | None, **extra) -> dict:
    """A node or CI runner: only MFSREG_URL and MFSREG_TOKEN, and a home that must stay untouched."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(MFSREG_URL=url, MFSREG_HOME=str(tmp_path / "client-home"), MFSREG_CHUNK_SIZE=str(64 << 10),
               MFSREG_CACHE_DIR=str(tmp_path / "node-cache"), **extra)
    if tok:
        env["MFSREG_TOKEN"] = tok
    return env


