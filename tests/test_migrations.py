"""Schema changes only through Alembic: the migrations build exactly the tables the code declares."""

from __future__ import annotations

from datetime import datetime

import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext

from mfsreg.registry.config import Settings
from mfsreg.registry.db.engine import create_db_engine
from mfsreg.registry.db.models import metadata
from mfsreg.registry.db.schema import current_revision, head_revision, known_revisions
from mfsreg.registry.errors import StorageError
from mfsreg.registry.registry import Registry, upgrade_database


def test_migrations_match_models(empty_db_url, tmp_path):
    settings = Settings.from_env({"MFSREG_HOME": str(tmp_path)}, database_url=empty_db_url)
    upgrade_database(settings)
    engine = create_db_engine(empty_db_url)
    try:
        assert current_revision(engine) == head_revision(engine)
        with engine.connect() as conn:
            diff = compare_metadata(MigrationContext.configure(conn), metadata)
        assert diff == []
    finally:
        engine.dispose()


def test_the_revisions_read_from_file_names_are_alembics_chain():
    """ensure_current compares a database with known_revisions() so that a current one is opened
    without importing Alembic: that list must be Alembic's own chain, oldest first."""
    from alembic.config import Config
    from alembic.script import ScriptDirectory

    from mfsreg.registry.db.schema import MIGRATIONS

    cfg = Config()
    cfg.set_main_option("script_location", str(MIGRATIONS))
    chain = [rev.revision for rev in ScriptDirectory.from_config(cfg).walk_revisions()][::-1]
    assert known_revisions() == chain and len(chain) >= 10


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


def test_chunk_rows_of_the_previous_release_and_this_one_live_side_by_side(empty_db_url):
    """Migration 0004 stops writing chunks.sha256 but keeps the column (nullable) for one release:
    during a rolling upgrade, processes of the previous release still insert rows with a digest and
    select the column, beside this release's rows without one. Both kinds must be readable by both,
    and a downgrade must leave a schema the previous release accepts (no NULL digests)."""
    from alembic import command
    from sqlalchemy import text

    from mfsreg.registry.blobs.packs import StoredChunk
    from mfsreg.registry.db import chunks as chunk_db
    from mfsreg.registry.db import reclaim as prune_db
    from mfsreg.registry.db.schema import _config

    engine = create_db_engine(empty_db_url)
    old_insert = text(
        'INSERT INTO chunks (id, size, sha256, encoding, stored_size, pack_id, "offset", depth) '
        "VALUES (:id, 4, :sha, 'raw', 4, 'p1', 0, 0)"
    )
    try:
        command.upgrade(_config(engine), "0003")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO packs (id, size) VALUES ('p1', 8)"))
            conn.execute(old_insert, {"id": "a" * 32, "sha": "1" * 64})  # written before the upgrade
        command.upgrade(_config(engine), "head")
        with engine.begin() as conn:
            conn.execute(old_insert, {"id": "b" * 32, "sha": "2" * 64})  # a previous-release process, after it
            prune_db.announce_pack(conn, "p2", 8)  # as a writer does before it writes the blob
            added = chunk_db.record_pack(conn, "p2", 8, [StoredChunk("c" * 32, 4, "raw", 4, "p2", 4)])
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


def test_existing_families_get_the_chunk_size_they_were_cut_at(empty_db_url, tmp_path):
    """Migration 0005 gives each family a chunk size, read off its stored manifests: a family whose
    members were cut at 32 KiB keeps 32 KiB; one with no version, or none of whose tensors was cut
    in two, gets 1 MiB, the previous default; so do rows a previous-release process creates after
    the upgrade. A downgrade drops the column and keeps the families."""
    from alembic import command
    from sqlalchemy import text

    from mfsreg.registry.db.schema import _config
    from mfsreg.registry.format.hashing import hash_source
    from mfsreg.registry.format.source import open_source
    from mfsreg.registry.progress import NullProgress
    from tests import synth

    path = synth.write(tmp_path / "m.safetensors", synth.base_tensors())
    cut = {size: hash_source(open_source(path), size, NullProgress()) for size in (32 << 10, 64 << 20)}
    assert cut[32 << 10].cut_size() == 32 << 10 and cut[64 << 20].cut_size() is None
    engine = create_db_engine(empty_db_url)
    add_version = text(
        "INSERT INTO versions (family_id, name, digest, logical_bytes, file_count, single_file, manifest) "
        "VALUES ((SELECT id FROM families WHERE name = :f), 'v1', 'sha256:x', 1, 1, 1, :m)"
    )
    try:
        command.upgrade(_config(engine), "0004")
        with engine.begin() as conn:
            for name in ("cut-32k", "uncut", "empty"):
                conn.execute(text("INSERT INTO families (name) VALUES (:f)"), {"f": name})
            conn.execute(add_version, {"f": "cut-32k", "m": cut[32 << 10].to_bytes()})
            conn.execute(add_version, {"f": "uncut", "m": cut[64 << 20].to_bytes()})
        command.upgrade(_config(engine), "head")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO families (name) VALUES ('by-an-old-process')"))
            sizes = dict(conn.execute(text("SELECT name, chunk_size FROM families")).all())
        assert sizes == {"cut-32k": 32 << 10, "uncut": 1 << 20, "empty": 1 << 20, "by-an-old-process": 1 << 20}
        command.downgrade(_config(engine), "0004")
        with engine.connect() as conn:
            assert conn.execute(text("SELECT count(*) FROM families")).scalar() == 4
    finally:
        engine.dispose()


def test_a_database_newer_than_this_mfsreg_is_one_line(empty_db_url, tmp_path):
    """A database a later release upgraded holds a revision this code has never heard of: every
    command, `db upgrade` too, says so in one line (it was Alembic's "Can't locate revision", an
    internal error), and the database is left as it is."""
    from sqlalchemy import text

    from tests.cli_run import mfsreg

    settings = Settings.from_env({"MFSREG_HOME": str(tmp_path)}, database_url=empty_db_url)
    upgrade_database(settings)
    engine = create_db_engine(empty_db_url)
    try:
        with engine.begin() as conn:
            conn.execute(text("UPDATE alembic_version SET version_num = '0999'"))
        env = {"MFSREG_HOME": str(tmp_path / "home"), "MFSREG_DATABASE_URL": empty_db_url}
        for args in (["ls"], ["db", "upgrade"]):
            proc = mfsreg(*args, env=env, check=False)
            assert proc.returncode == 5 and proc.stderr.count("\n") == 1, (args, proc.stderr)
            assert "revision 0999, newer than this mfsreg knows" in proc.stderr and "upgrade mfsreg" in proc.stderr
        assert current_revision(engine) == "0999"
    finally:
        engine.dispose()


def test_processes_upgrading_one_database_at_once_take_turns(empty_db_url, tmp_path):
    """Two API processes starting on a fresh database, or `db upgrade` beside an embedded command:
    each upgrade waits for the one running (Postgres: an advisory lock; SQLite: a lock file), then
    finds the work done. At once, Postgres failed one of them on its catalog (duplicate key)."""
    import threading

    settings = Settings.from_env({"MFSREG_HOME": str(tmp_path)}, database_url=empty_db_url)
    start, results = threading.Barrier(4), []

    def run():
        start.wait()
        try:
            results.append(upgrade_database(settings))
        except Exception as exc:  # noqa: BLE001 (the test reports what each one raised)
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    engine = create_db_engine(empty_db_url)
    try:
        assert results == [head_revision(engine)] * 4, results
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), metadata) == []
    finally:
        engine.dispose()


def test_a_migration_that_fails_is_one_line_and_leaves_the_database_before_it(empty_db_url):
    """Migration 0005 reads every stored manifest to give its family a chunk size: a manifest it
    cannot read (damaged in the database) stops it. That is one line naming the revisions (it was
    zstd's error as an internal error). Each migration runs in a transaction of its own: begun at
    0003, the database keeps 0004 and stays there, whole."""
    from alembic import command
    from sqlalchemy import text

    from mfsreg.registry.db.schema import _config, upgrade

    engine = create_db_engine(empty_db_url)
    try:
        command.upgrade(_config(engine), "0003")
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO families (name) VALUES ('fam')"))
            conn.execute(
                text(
                    "INSERT INTO versions (family_id, name, digest, logical_bytes, file_count, single_file, "
                    "manifest) VALUES ((SELECT id FROM families WHERE name = 'fam'), 'v1', 'sha256:x', 1, 1, 1, "
                    ":m)"
                ),
                {"m": b"not a zstd frame"},
            )
        try:
            upgrade(engine)
        except StorageError as exc:
            msg = str(exc)
        else:
            raise AssertionError("an upgrade over a damaged manifest went through")
        assert "\n" not in msg and "schema migration 0005 failed" in msg and "stays at revision 0004" in msg, msg
        assert current_revision(engine) == "0004"
    finally:
        engine.dispose()


@pytest.mark.parametrize("history", ["retired_packs", "unlisted_without_claims"])
def test_databases_built_by_pre_release_migrations_are_repaired(empty_db_url, tmp_path, history):
    """Migrations 0004 and 0006 changed after they were first committed: a database that the first
    texts upgraded is at revision 0009 with no chunks.sha256 and a retired_packs table (58d9a58) or
    an unlisted_packs table without claimed_at (d5c4a01), and every push or prune failed on it.
    Migration 0010 brings it to the schema the code declares and keeps the retired packs as
    unlisted ones, each unlisted since it was retired: a prune deletes the blob of one retired
    longer ago than its grace period and keeps that of one retired just now. A push, delete and
    prune then work."""
    from alembic import command
    from sqlalchemy import text

    from mfsreg.registry.blobs.packs import pack_key
    from mfsreg.registry.db.schema import _config
    from tests import synth

    engine = create_db_engine(empty_db_url)
    retired = {"old": "2020-01-01 00:00:00+00:00", "new": None}  # None: retired now (the column's default)
    try:
        command.upgrade(_config(engine), "0009")
        with engine.begin() as conn:
            conn.execute(text("ALTER TABLE chunks DROP COLUMN sha256"))  # 0004 as first committed
            if history == "retired_packs":  # 0006 as first committed
                conn.execute(text("DROP TABLE unlisted_packs"))
                conn.execute(
                    text(
                        "CREATE TABLE retired_packs (id VARCHAR(32) NOT NULL PRIMARY KEY, size BIGINT NOT NULL, "
                        "retired_at TIMESTAMP WITH TIME ZONE NOT NULL DEFAULT CURRENT_TIMESTAMP)"
                    )
                )
                conn.execute(
                    text("INSERT INTO retired_packs (id, size, retired_at) VALUES ('old', 5, :t)"),
                    {"t": datetime.fromisoformat(retired["old"])},
                )
                conn.execute(text("INSERT INTO retired_packs (id, size) VALUES ('new', 5)"))
            else:  # 0006 as committed in between
                conn.execute(text("ALTER TABLE unlisted_packs DROP COLUMN claimed_at"))
        assert current_revision(engine) == "0009"
        settings = Settings.from_env(
            {"MFSREG_HOME": str(tmp_path / "home")}, database_url=empty_db_url, chunk_size=64 << 10, pack_size=1 << 20
        )
        upgrade_database(settings)
        with engine.connect() as conn:
            assert compare_metadata(MigrationContext.configure(conn), metadata) == []
            moved = {i: (s, c) for i, s, c in conn.execute(text("SELECT id, size, claimed_at FROM unlisted_packs"))}
        assert moved == ({"old": (5, None), "new": (5, None)} if history == "retired_packs" else {})

        with Registry(settings) as reg:
            if history == "retired_packs":
                for pack_id in retired:
                    reg.blobs.put(pack_key(pack_id), b"12345")
                report = reg.prune(min_age=3600)
                assert (report.deleted_packs, report.waiting_packs) == (1, 1), report
                assert not reg.blobs.exists(pack_key("old")) and reg.blobs.exists(pack_key("new"))
            base = synth.write(tmp_path / "base.safetensors", synth.base_tensors())
            reg.push(base, "fam", "v1")
            reg.delete("fam", "v1")
            report = reg.prune(min_age=0)
            after = reg.stats()
        assert report.deleted_chunks > 0
        assert after["stored_bytes"] == 0 and after["pack_bytes"] == 0 and after["unlisted_pack_bytes"] == 0, after
    finally:
        engine.dispose()
