"""Shared fixtures: real registries on SQLite and on the Postgres server, synthetic families."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest

from mfsreg.registry.config import Settings
from mfsreg.registry.db import schema
from mfsreg.registry.db.engine import create_db_engine
from mfsreg.registry.db.models import metadata
from mfsreg.registry.registry import Registry
from tests import synth

# fixtures of the S3 server and of API servers, for every test module
pytest_plugins = ["tests.s3server", "tests.server"]

PG_ADMIN = os.environ.get("MFSREG_TEST_PG", "postgresql://postgres@127.0.0.1:5432/postgres")


def _pg_url(dbname: str) -> str:
    base = PG_ADMIN.rsplit("/", 1)[0].replace("postgresql://", "postgresql+psycopg://", 1)
    return f"{base}/{dbname}"


@contextmanager
def scratch_pg_database() -> Iterator[str]:
    """A new database on the real Postgres server (its SQLAlchemy URL), dropped afterwards."""
    name = f"mfsreg_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    try:
        yield _pg_url(name)
    finally:
        with psycopg.connect(PG_ADMIN, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture
def pg_database():
    """A scratch database on the real Postgres server, dropped afterwards."""
    with scratch_pg_database() as url:
        yield url


@pytest.fixture(scope="session")
def _reused_pg() -> Iterator[list[str]]:
    """This test process's migrated Postgres database, which migrated_pg empties for each test:
    making and migrating a database costs 0.65 s, emptying one 0.05 s."""
    with scratch_pg_database() as url:
        engine = create_db_engine(url)
        try:
            schema.upgrade(engine)
        finally:
            engine.dispose()
        yield [url]


@pytest.fixture
def migrated_pg(_reused_pg) -> str:
    """A migrated Postgres database whose tables are empty, as a new one's are after `db upgrade`
    (its tables truncated, their id sequences restarted)."""
    url = _reused_pg[0]
    tables = ", ".join(f'"{t.name}"' for t in metadata.sorted_tables)
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://", 1), autocommit=True) as conn:
        conn.execute("SET lock_timeout = '20s'")  # a connection a test leaked in a transaction: fail, not hang
        conn.execute(f"TRUNCATE {tables} RESTART IDENTITY CASCADE")
    return url


@pytest.fixture(params=["sqlite", "postgres"])
def db_url(request, tmp_path):
    """A registry database on SQLite, and one on the Postgres server, migrated."""
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'meta' / 'registry.db'}"
    return request.getfixturevalue("migrated_pg")


@pytest.fixture(params=["sqlite", "postgres"])
def empty_db_url(request, tmp_path):
    """A database no migration has run on yet, on SQLite and on the Postgres server."""
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


# A test needs the Postgres server or the S3 server when one of these fixtures is in its closure, or
# when it is the postgres case of db_url (which asks for pg_database only as it runs): marked
# `services`, so that `make test-fast` can leave it out.
SERVICE_FIXTURES = {
    "pg_database",
    "migrated_pg",
    "s3_server",
    "s3_bucket",
    "s3_blob_url",
    "server_env",
    "family_server",
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if (
            SERVICE_FIXTURES & set(getattr(item, "fixturenames", ()))
            or "postgres" in params.values()
            or params.get("store") == "s3"
        ):
            item.add_marker(pytest.mark.services)
