"""Faults on the links an API server depends on: a proxy of the tests' own (tests/faults.py) stands
between the server and moto's S3 server, and between the server and Postgres, and delays, cuts or
resets their connections while pushes, pulls and prunes run. A client then fails in one line (exit 5,
the storage's code) or the server retries; afterwards every committed version pulls byte for byte,
`check --read-data` finds every byte, and a push that failed completes when run again."""

from __future__ import annotations

import threading
from urllib.parse import urlsplit

import pytest

from mfsreg.registry.client.remote import RemoteRegistry
from mfsreg.registry.errors import RegistryError
from tests.cli_run import mfsreg, mfsreg_json
from tests.faults import FaultProxy, assert_whole
from tests.hooks import OnSend
from tests.server import Servers, client_env, make_server_env, token


@pytest.fixture
def faulty(migrated_pg, s3_blob_url, tmp_path):
    """A server whose database and blob store are reached through fault proxies, holding "base":
    (server, admin client environment, Postgres proxy, S3 proxy)."""
    blob_url, endpoint = s3_blob_url
    s3 = urlsplit(endpoint)
    s3_proxy = FaultProxy((s3.hostname, s3.port))
    pg = urlsplit(migrated_pg)
    pg_proxy = FaultProxy((pg.hostname, pg.port))
    db_url = migrated_pg.replace(f"@{pg.hostname}:{pg.port}/", f"@127.0.0.1:{pg_proxy.port}/")
    env = make_server_env(db_url, (blob_url, s3_proxy.url), tmp_path)
    started = Servers(env, tmp_path)
    try:
        (srv,) = started(1)
        admin = client_env(tmp_path, srv.url, token(env, "admin"))
        yield srv, admin, pg_proxy, s3_proxy
    finally:
        pg_proxy.heal()
        s3_proxy.heal()
        started.stop()
        pg_proxy.close()
        s3_proxy.close()


def failed_in_one_line(ran) -> bool:
    return ran.returncode == 5 and ran.stderr.count("\n") == 1 and "Traceback" not in ran.stderr


def test_s3_cut_during_a_push_fails_in_one_line_and_a_rerun_completes(faulty, fam, tmp_path):
    srv, env, _, s3 = faulty
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    s3.arm(64 << 10, requests=True)  # the first pack the server writes is cut a quarter in
    ran = mfsreg(
        "push", fam["full-med"], "--family", "fam", "--version", "full-med", "--parent", "base", env=env, check=False
    )
    assert failed_in_one_line(ran), ran.stderr
    assert "full-med" not in [v["version"] for v in mfsreg_json("ls", "fam", env=env)["versions"]]
    s3.heal()
    mfsreg("push", fam["full-med"], "--family", "fam", "--version", "full-med", "--parent", "base", env=env)
    assert_whole(env, fam, {"base": "base", "full-med": "full-med"}, tmp_path)


def test_a_slow_s3_link_slows_a_push_and_a_pull_but_fails_neither(faulty, fam, tmp_path):
    srv, env, _, s3 = faulty
    s3.delay(0.02)
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    mfsreg("push", fam["lora-chat"], "--family", "fam", "--version", "lora-chat", "--parent", "base", env=env)
    assert_whole(env, fam, {"base": "base", "lora-chat": "lora-chat"}, tmp_path)


def test_s3_cut_during_a_pull_fails_in_one_line_and_writes_nothing(faulty, fam, tmp_path):
    srv, env, _, s3 = faulty
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    s3.arm(128 << 10)  # part of a pack's bytes on their way to the server, then the endpoint is gone
    out = tmp_path / "base.out"
    ran = mfsreg("pull", "fam", "base", "-o", out, env=dict(env, MFSREG_CACHE_DIR=str(tmp_path / "c1")), check=False)
    assert failed_in_one_line(ran), ran.stderr
    assert not out.exists()
    s3.heal()
    assert_whole(env, fam, {"base": "base"}, tmp_path)


def test_postgres_connections_reset_between_a_pushs_negotiation_and_its_upload(faulty, fam, tmp_path):
    """The server's pooled connections die under it (a failover, a restarted database): the push
    goes on over new ones, or fails in one line and completes when run again."""
    srv, env, pg, _ = faulty
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    with RemoteRegistry(env["MFSREG_URL"], token=env["MFSREG_TOKEN"]) as remote:
        hook = OnSend(pg.reset)
        try:
            remote.push(fam["lora-chat"], "fam", "lora-chat", parent="base", progress=hook)
        except RegistryError as exc:
            assert "\n" not in str(exc)
            remote.push(fam["lora-chat"], "fam", "lora-chat", parent="base")
        assert hook.results, "the reset did not happen during the push"
    assert_whole(env, fam, {"base": "base", "lora-chat": "lora-chat"}, tmp_path)


def test_postgres_cut_during_a_pull_fails_in_one_line_and_the_server_recovers(faulty, fam, tmp_path):
    srv, env, pg, _ = faulty
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    pg.cut()
    ran = mfsreg(
        "pull", "fam", "base", "-o", tmp_path / "o", env=dict(env, MFSREG_CACHE_DIR=str(tmp_path / "c")), check=False
    )
    assert failed_in_one_line(ran), ran.stderr
    assert "5432" not in ran.stderr and str(pg.port) not in ran.stderr  # no internal address reaches a client
    pg.heal()
    assert_whole(env, fam, {"base": "base"}, tmp_path)


def test_postgres_reset_while_a_prune_runs_loses_nothing(faulty, fam, tmp_path):
    srv, env, pg, _ = faulty
    for name in ("base", "lora-chat", "full-med"):
        mfsreg(
            "push",
            fam[name],
            "--family",
            "fam",
            "--version",
            name,
            *(["--parent", "base"] if name != "base" else []),
            env=env,
        )
    mfsreg("delete", "fam", "full-med", env=env)
    pg.delay(0.01)  # the prune's queries take long enough for the reset to land among them
    resetter = threading.Timer(0.3, pg.reset)
    resetter.start()
    ran = mfsreg("prune", "--min-age", "0", env=env, check=False)
    resetter.join()
    pg.heal()
    assert ran.returncode == 0 or failed_in_one_line(ran), ran.stderr
    assert_whole(env, fam, {"base": "base", "lora-chat": "lora-chat"}, tmp_path)
    again = mfsreg_json("prune", "--min-age", "0", env=env)
    assert again["deleted_chunks"] == 0 or ran.returncode != 0, again
    assert_whole(env, fam, {"base": "base", "lora-chat": "lora-chat"}, tmp_path)


@pytest.mark.parametrize("when", ["refused", "reset"])
def test_a_prune_lock_whose_postgres_is_gone_is_one_storage_line(when, migrated_pg):
    """The prune's session lock (db/locks.session_lock) opens a connection of its own and asks for
    the lock outside any transaction helper: a Postgres that refuses the connection, or resets it
    as the lock is asked for, raised SQLAlchemy's own error, which the server answered with a 500
    (seen once in CI: a reset during `mfsreg prune`). Now it is the one StorageError line every
    query gives, naming no address."""
    from sqlalchemy import event

    from mfsreg.registry.db.engine import create_db_engine
    from mfsreg.registry.db.reclaim import one_prune_at_a_time
    from mfsreg.registry.errors import StorageError

    pg = urlsplit(migrated_pg)
    proxy = FaultProxy((pg.hostname, pg.port))
    engine = create_db_engine(migrated_pg.replace(f"@{pg.hostname}:{pg.port}/", f"@127.0.0.1:{proxy.port}/"))
    try:
        if when == "refused":
            proxy.cut()
        else:  # reset just as the lock is asked for (SQLAlchemy's own hook, before the query goes out)

            @event.listens_for(engine, "before_cursor_execute")
            def reset_at_the_lock(conn, cursor, statement, *args):
                if "advisory_lock" in statement:
                    proxy.reset()

        with pytest.raises(StorageError, match="^database .*: .*; check MFSREG_DATABASE_URL"):
            with one_prune_at_a_time(engine):
                pass
    finally:
        engine.dispose()
        proxy.close()
