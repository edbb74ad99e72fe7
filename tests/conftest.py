"""Shared fixtures: real registries on SQLite and on the Postgres server, synthetic families."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

import psycopg
import pytest

from mfsreg.registry.config import Settings
from mfsreg.registry.registry import Registry

from tests import synth
from tests.s3server import s3_blob_url, s3_bucket, s3_server  # noqa: F401

PG_ADMIN = os.environ.get("MFSREG_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{dbname}"


@pytest.fixture
def pg_database():
    """A scratch database on the real Postgres server, dropped afterwards."""
    name = f"mfsreg_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _pg_url(name)
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'meta' / 'registry.db'}"
    return request.getfixturevalue("pg_database")


@pytest.fixture
def settings(tmp_path, db_url) -> Settings:
    """Settings for a fresh registry: the given database, packs in a temp directory, small chunks."""
    return Settings.from_env(
        {"MFSREG_HOME": str(tmp_path / "home")},
        database_url=db_url,
        chunk_size=64 << 10,
        pack_size=1 << 20,
    )


@pytest.fixture
def reg(settings):
    with Registry(settings, migrate=True) as r:
        yield r


@pytest.fixture(scope="session")
def fam(tmp_path_factory) -> dict[str, Path]:
    return synth.family(tmp_path_factory.mktemp("family"))


@pytest.fixture
def home_env(tmp_path) -> dict:
    """Environment for running the CLI against an embedded registry in a temp MFSREG_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env["MFSREG_HOME"] = str(tmp_path / "clihome")
    env["MFSREG_CHUNK_SIZE"] = str(64 << 10)
    return env
