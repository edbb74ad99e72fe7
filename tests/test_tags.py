"""Tags and version metadata: embedded (SQLite, the CLI in process) and over HTTP (Postgres, S3)."""

from __future__ import annotations

import filecmp

import httpx
import pytest

from tests import synth
from tests.cli_run import mfsreg, mfsreg_json
from tests.server import client_env, token


def state(env: dict, family: str) -> tuple:
    """What a refused command must leave as it was: the versions, the tags and their history."""
    return (
        mfsreg_json("ls", family, env=env),
        mfsreg_json("tag", "ls", family, env=env),
        mfsreg_json("tag", "ls", family, "--history", env=env),
    )


def refused(env: dict, *args) -> str:
    ran = mfsreg(*args, env=env, check=False)
    assert ran.returncode != 0, ran.stdout
    lines = ran.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in ran.stderr, ran.stderr
    return lines[0]


@pytest.fixture
def tagged(home_env, fam):
    """An embedded registry holding base and lora (lora's parent given as the tag latest)."""
    mfsreg("push", fam["base"], "-f", "q", "-v", "base", "-d", "the base model", "-l", "stage=base", env=home_env)
    mfsreg(
        "push",
        fam["lora-chat"],
        "-f",
        "q",
        "-v",
        "lora",
        "--parent",
        "latest",
        "-l",
        "stage=rc",
        "-l",
        "team=nlp",
        env=home_env,
    )
    return home_env


def test_tags_name_versions_everywhere(tagged, fam, tmp_path):
    env = tagged
    tags = mfsreg_json("tag", "ls", "q", env=env)["tags"]
    assert [(t["tag"], t["version"], t["automatic"]) for t in tags] == [("latest", "lora", True)]
    assert mfsreg_json("show", "q", "lora", env=env)["parent"] == "base"  # --parent latest was base then

    assert mfsreg_json("tag", "set", "q", "prod", "base", env=env) == {
        "family": "q",
        "tag": "prod",
        "before": None,
        "after": "base",
    }
    mfsreg("pull", "q", "prod", "-o", tmp_path / "prod.st", env=env)
    assert filecmp.cmp(tmp_path / "prod.st", fam["base"], shallow=False)
    shown = mfsreg_json("show", "q", "prod", env=env)
    assert (shown["version"], shown["tag"]) == ("base", "prod")

    assert mfsreg_json("tag", "set", "q", "prod", "lora", env=env)["before"] == "base"
    mfsreg("pull", "q", "prod", "-o", tmp_path / "prod2.st", env=env)
    assert filecmp.cmp(tmp_path / "prod2.st", fam["lora-chat"], shallow=False)

    # latest set by hand stays put through a push, and follows pushes again once removed
    mfsreg("tag", "set", "q", "latest", "base", env=env)
    mfsreg("push", fam["last-code"], "-f", "q", "-v", "retrain", env=env)
    assert mfsreg_json("show", "q", "latest", env=env)["version"] == "base"
    assert mfsreg_json("tag", "rm", "q", "latest", env=env)["before"] == "base"
    assert mfsreg_json("show", "q", "latest", env=env)["version"] == "retrain"

    history = mfsreg_json("tag", "ls", "q", "--history", env=env)["history"]
    assert [(e["tag"], e["from_version"], e["to_version"]) for e in history] == [
        ("latest", "base", None),
        ("latest", None, "base"),
        ("prod", "base", "lora"),
        ("prod", None, "base"),
    ]
    assert all(e["actor"].startswith("local") and e["at"] for e in history)
    only = mfsreg_json("tag", "ls", "q", "--history", "--tag", "prod", env=env)["history"]
    assert [e["to_version"] for e in only] == ["lora", "base"]
    listed = {v["version"]: v["tags"] for v in mfsreg_json("ls", "q", env=env)["versions"]}
    assert listed == {"base": [], "lora": ["prod"], "retrain": ["latest"]}


def test_deleting_a_version_removes_its_tags_on_the_record(tagged):
    env = tagged
    mfsreg("tag", "set", "q", "prod", "lora", env=env)
    assert "q/prod is a tag of version lora: delete a version by its own name" in refused(env, "delete", "q", "prod")
    assert mfsreg_json("show", "q", "prod", env=env)["version"] == "lora"
    mfsreg("delete", "q", "lora", env=env)
    assert [t["tag"] for t in mfsreg_json("tag", "ls", "q", env=env)["tags"]] == ["latest"]
    assert mfsreg_json("tag", "ls", "q", "--history", env=env)["history"][0] | {"at": 0, "actor": 0} == {
        "tag": "prod",
        "from_version": "lora",
        "to_version": None,
        "at": 0,
        "actor": 0,
    }


@pytest.mark.parametrize(
    "args, says",
    [
        (("tag", "set", "q", "base", "lora"), "is a version: a tag may not take a version's name"),
        (("tag", "set", "q", "prod", "nope"), "version q/nope does not exist"),
        (("tag", "set", "nofam", "prod", "base"), "family 'nofam' does not exist"),
        (("tag", "set", "q", "../prod", "base"), "invalid tag name"),
        (("tag", "set", "q", "--", "-prod", "base"), "may not start with '-'"),
        (("tag", "rm", "q", "prod"), "tag q/prod does not exist"),
        (("tag", "rm", "q", "latest"), "latest is not set by hand"),
        (("delete", "q", "stable"), "q/stable is a tag of version base"),
        (("push", "FAM_RETRAIN", "-f", "q", "-v", "stable"), "is a tag (of version base)"),
        (("push", "FAM_RETRAIN", "-f", "q", "-v", "latest"), "'latest' is kept for the tag"),
        (("push", "FAM_RETRAIN", "-f", "q", "-v", "r", "-l", "novalue"), "write it as KEY=VALUE"),
        (("push", "FAM_RETRAIN", "-f", "q", "-v", "r", "-l", "a=1", "-l", "a=2"), "--label a is given twice"),
        (("push", "FAM_RETRAIN", "-f", "q", "-v", "r", "-l", "/a=1"), "invalid label key"),
        (("push", "FAM_RETRAIN", "-f", "q", "-v", "r", "-d", "x" * 1025), "at most 1024 characters"),
        (("ls", "--label", "a=1"), "give the family"),
    ],
)
def test_bad_tags_and_metadata_are_refused_and_change_nothing(tagged, fam, args, says):
    env = tagged
    mfsreg("tag", "set", "q", "stable", "base", env=env)
    before = state(env, "q")
    args = [str(fam["last-code"]) if a == "FAM_RETRAIN" else a for a in args]
    assert says in refused(env, *args)
    assert state(env, "q") == before


def test_version_metadata_is_kept_shown_and_filtered(tagged):
    env = tagged
    base = mfsreg_json("show", "q", "base", env=env)
    assert (base["description"], base["labels"]) == ("the base model", {"stage": "base"})
    assert base["pushed_by"].startswith("local") and base["created_at"]
    rc = mfsreg_json("ls", "q", "--label", "stage=rc", env=env)["versions"]
    assert [(v["version"], v["labels"]) for v in rc] == [("lora", {"stage": "rc", "team": "nlp"})]
    assert mfsreg_json("ls", "q", "-l", "stage=rc", "-l", "team=cv", env=env)["versions"] == []
    text = mfsreg("show", "q", "base", env=env).stdout
    assert "description: the base model" in text and "labels: stage=base" in text
    table = mfsreg("ls", "q", env={**env, "COLUMNS": "200"}).stdout
    assert "stage=rc,team=nlp" in table and "the base model" in table


def test_tags_and_metadata_over_http(servers, server_env, fam, tmp_path):
    (srv,) = servers(1)
    push = token(server_env, "push", "q*")
    env = client_env(tmp_path, srv.url, push)
    mfsreg("push", fam["base"], "-f", "q", "-v", "base", "-d", "from CI", "-l", "commit=abc123", env=env)
    mfsreg("push", fam["lora-chat"], "-f", "q", "-v", "lora", "--parent", "base", env=env)
    mfsreg("tag", "set", "q", "prod", "base", env=env)
    before = state(env, "q")

    # a read token, and a push token for other families, may not move a tag: one line, nothing changed
    for tok, says in (
        (token(server_env, "read", "q*"), "needs 'push'"),
        (token(server_env, "push", "z*"), "limited to"),
    ):
        other = client_env(tmp_path, srv.url, tok)
        assert says in refused(other, "tag", "set", "q", "prod", "lora")
        assert says in refused(other, "tag", "rm", "q", "prod")
        assert state(env, "q") == before
    assert httpx.put(f"{srv.url}/v1/families/q/tags/prod", json={"version": "lora"}).status_code == 401
    assert state(env, "q") == before

    from mfsreg.registry.auth import list_tokens  # the prefix `token list` shows, which history names
    from mfsreg.registry.config import Settings
    from mfsreg.registry.db.engine import create_db_engine

    engine = create_db_engine(Settings.from_env(server_env, blobs=False).database_url)
    try:
        prefix = next(t.prefix for t in list_tokens(engine) if push.startswith(t.prefix))
    finally:
        engine.dispose()
    assert mfsreg_json("tag", "set", "q", "prod", "lora", env=env)["before"] == "base"
    history = mfsreg_json("tag", "ls", "q", "--history", env=env)["history"]
    assert [(e["from_version"], e["to_version"], e["actor"]) for e in history] == [
        ("base", "lora", prefix),
        (None, "base", prefix),
    ]
    mfsreg("pull", "q", "prod", "-o", tmp_path / "prod.st", env=env)
    assert filecmp.cmp(tmp_path / "prod.st", fam["lora-chat"], shallow=False)
    base = mfsreg_json("show", "q", "base", env=env)
    assert (base["description"], base["labels"], base["pushed_by"]) == ("from CI", {"commit": "abc123"}, prefix)
    assert [v["version"] for v in mfsreg_json("ls", "q", "--label", "commit=abc123", env=env)["versions"]] == ["base"]
    assert "is a tag" in refused(env, "push", fam["last-code"], "-f", "q", "-v", "prod")
    bad = httpx.put(
        f"{srv.url}/v1/families/q/tags/prod", json={"version": "../x"}, headers={"Authorization": f"Bearer {push}"}
    )
    assert bad.status_code == 400 and "invalid version name" in bad.json()["detail"]


def test_a_sharded_directory_keeps_its_metadata(home_env, tmp_path):
    (tmp_path / "m").mkdir()
    d = synth.sharded_dir(tmp_path / "m", synth.base_tensors(seed=5))
    mfsreg("push", d, "-f", "s", "-v", "v1", "-l", "kind=sharded", env=home_env)
    assert mfsreg_json("show", "s", "latest", env=home_env)["labels"] == {"kind": "sharded"}


def test_the_library_checks_metadata_as_the_cli_does(home_env, fam):
    from mfsreg.registry.config import Settings
    from mfsreg.registry.errors import InvalidRequest
    from mfsreg.registry.meta import VersionMeta
    from mfsreg.registry.registry import Registry

    with Registry(Settings.from_env(home_env)) as reg:
        for meta in (VersionMeta("x" * 1025), VersionMeta("", {"k": 1}), VersionMeta("", {"bad key": "v"})):
            with pytest.raises(InvalidRequest):
                reg.push(fam["base"], "m", "v1", meta=meta)
        assert reg.families() == []


def test_the_remote_client_checks_metadata_before_it_sends_anything(servers, server_env, fam):
    """As the embedded push does (above): refused before the file is read, so no chunk is uploaded."""
    from sqlalchemy import func, select

    from mfsreg.registry.client.remote import RemoteRegistry
    from mfsreg.registry.config import Settings
    from mfsreg.registry.db.engine import create_db_engine
    from mfsreg.registry.db.models import chunks
    from mfsreg.registry.errors import InvalidRequest
    from mfsreg.registry.meta import VersionMeta

    (srv,) = servers(1)
    engine = create_db_engine(Settings.from_env(server_env, blobs=False).database_url)
    try:
        with RemoteRegistry(srv.url, token=token(server_env, "push", "m*")) as remote:
            for meta, says in (
                (VersionMeta("x" * 1025), "at most 1024 characters"),
                (VersionMeta("", {"bad key": "v"}), "invalid label key"),
            ):
                with pytest.raises(InvalidRequest, match=says):
                    remote.push(fam["base"], "m", "v1", meta=meta)
            assert remote.families() == []
        with engine.connect() as conn:
            assert conn.execute(select(func.count()).select_from(chunks)).scalar_one() == 0
    finally:
        engine.dispose()
