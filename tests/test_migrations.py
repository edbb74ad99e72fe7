"""Schema changes only through Alembic: the migrations build exactly the tables the code declares."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from registry.config import Settings
from registry.db.engine import create_db_engine
from registry.db.models import metadata
from registry.db.schema import current_revision, head_revision
from registry.errors import StorageError
from registry.registry import Registry, upgrade_database


def test_migrations_match_models(db_url, tmp_path):
    settings = Settings.from_env({"MFSREG_HOME": str(tmp_path)}, database_url=db_url)
    upgrade_database(settings)
    engine = create_db_engine(db_url)
    try:
        assert current_revision(engine) == head_revision(engine)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_server_database_is_not_upgraded_behind_the_operators_back(pg_database, tmp_path):
    settings = Settings.from_env({"MFSREG_HOME": str(tmp_path)}, database_url=pg_database)
    try:
        Registry(settings)
    except StorageError as exc:
        assert "mfsreg db upgrade" in str(exc)
    else:
        raise AssertionError("an un-migrated Postgres database was used without `mfsreg db upgrade`")
    upgrade_database(settings)
    with Registry(settings) as reg:
        assert reg.families() == []


def test_embedded_default_upgrades_itself(tmp_path):
    settings = Settings.from_env({"MFSREG_HOME": str(tmp_path / "home")})
    with Registry(settings) as reg:
        assert reg.families() == []
    assert (tmp_path / "home" / "registry.db").exists()


def test_chunk_rows_of_the_previous_release_and_this_one_live_side_by_side(db_url):
    """Migration 0004 stops writing chunks.sha256 but keeps the column (nullable) for one release:
    during a rolling upgrade, processes of the previous release still insert rows with a digest and
    select the column, beside this release's rows without one. Both kinds must be readable by both,
    and a downgrade must leave a schema the previous release accepts (no NULL digests)."""
    from alembic import command
    from sqlalchemy import text

    from registry.blobs.packs import StoredChunk
    from registry.db import chunks as chunk_db
    from registry.db.schema import _config

    engine = create_db_engine(db_url)
    old_insert = text("INSERT INTO chunks (id, size, sha256, encoding, stored_size, pack_id, \"offset\", depth) "
                      "VALUES (:id, 4, :sha, 'raw', 4, 'p1', 0, 0)")
    try:
        command.upgrade(_config(engine), "0003")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO packs (id, size) VALUES ('p1', 8)"))
            conn.execute(old_insert, {"id": "a" * 32, "sha": "1" * 64})  # written before the upgrade
        command.upgrade(_config(engine), "head")
        with engine.begin() as conn:
            conn.execute(old_insert, {"id": "b" * 32, "sha": "2" * 64})  # a previous-release process, after it
            added = chunk_db.record_pack(conn, "p1", 8, [StoredChunk("c" * 32, 4, "raw", 4, "p1", 4)])
        assert added == 4
        with engine.connect() as conn:
            found = chunk_db.locate(conn, ["a" * 32, "b" * 32, "c" * 32])
            digests = dict(conn.execute(text("SELECT id, sha256 FROM chunks ORDER BY id")).all())
        assert set(found) == {"a" * 32, "b" * 32, "c" * 32} and found["c" * 32].offset == 4
        assert digests == {"a" * 32: "1" * 64, "b" * 32: "2" * 64, "c" * 32: None}
        command.downgrade(_config(engine), "0003")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT sha256 FROM chunks WHERE id = :id"), {"id": "c" * 32}).scalar() == ""
    finally:
        engine.dispose()


@pytest.mark.parametrize("env_size, recorded", [(None, 1 << 20), ("256K", 256 << 10)])
def test_existing_families_get_the_chunk_size_they_were_cut_at(db_url, monkeypatch, env_size, recorded):
    """Migration 0005 gives each family a chunk size. Existing ones were cut at the previous default,
    1 MiB, or at MFSREG_CHUNK_SIZE where the operator set it (the upgrade runs in the server's
    environment); rows a previous-release process creates afterwards get 1 MiB too."""
    from alembic import command
    from sqlalchemy import text

    from registry.db.schema import _config

    if env_size is None:
        monkeypatch.delenv("MFSREG_CHUNK_SIZE", raising=False)
    else:
        monkeypatch.setenv("MFSREG_CHUNK_SIZE", env_size)
    engine = create_db_engine(db_url)
    try:
        command.upgrade(_config(engine), "0004")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO families (name) VALUES ('old')"))
        command.upgrade(_config(engine), "head")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO families (name) VALUES ('by-an-old-process')"))
            sizes = dict(conn.execute(text("SELECT name, chunk_size FROM families")).all())
        assert sizes == {"old": recorded, "by-an-old-process": 1 << 20}
        command.downgrade(_config(engine), "0004")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM families")).scalar() == 2
    finally:
        engine.dispose()
