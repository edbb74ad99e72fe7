"""Schema changes only through Alembic: the migrations build exactly the tables the code declares."""

from __future__ import annotations

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
