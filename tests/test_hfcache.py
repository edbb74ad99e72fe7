"""Pushing a Hugging Face cache folder (models--org--name/): the snapshot refs/main names, never the
cache's blobs/, refs/ and snapshots/ themselves; a broken one is refused in one line."""

from __future__ import annotations

import filecmp
import hashlib
import os
from pathlib import Path

import pytest

from tests import synth
from tests.cli_run import mfsreg, mfsreg_json


def cache_repo(root: Path, model: Path, commit: str = "a" * 40, ref: str | None = "main") -> Path:
    """``model``'s files laid out as huggingface_hub caches a download: blobs named by content,
    snapshots/COMMIT/ of relative links to them, refs/REF holding the commit."""
    repo = root / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snap = repo / "snapshots" / commit
    for f in sorted(p for p in model.rglob("*") if p.is_file()):
        data = f.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snap / f.relative_to(model)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    if ref is not None:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return repo


@pytest.fixture
def model(tmp_path) -> Path:
    (tmp_path / "model").mkdir()
    return synth.sharded_dir(tmp_path / "model", synth.base_tensors(seed=7))


def test_a_cache_folder_pushes_its_main_snapshot_only(home_env, model, tmp_path):
    repo = cache_repo(tmp_path / "hub", model)
    cache_repo(
        tmp_path / "hub", synth.write(tmp_path / "other.safetensors", synth.base_tensors(seed=9)).parent, "b" * 40, None
    )
    mfsreg("push", repo, "-f", "hf", "-v", "v1", env=home_env)
    shown = mfsreg_json("show", "hf", "v1", env=home_env)
    assert sorted(f["path"] for f in shown["files"]) == sorted(
        str(p.relative_to(model)) for p in model.rglob("*") if p.is_file()
    )
    mfsreg("pull", "hf", "v1", "--to-dir", tmp_path / "out", env=home_env)
    assert not filecmp.dircmp(model, tmp_path / "out").diff_files
    assert shown["logical_bytes"] == sum(p.stat().st_size for p in model.rglob("*") if p.is_file())


def test_revision_picks_a_ref_or_a_commit(home_env, model, tmp_path):
    repo = cache_repo(tmp_path / "hub", model, "c" * 40, ref="v2.0")
    other = synth.write(tmp_path / "x" / "model.safetensors", synth.base_tensors(seed=11))
    cache_repo(tmp_path / "hub", other.parent, "d" * 40, ref="main")
    mfsreg("push", repo, "-f", "hf", "-v", "by-ref", "--revision", "v2.0", env=home_env)
    mfsreg("push", repo, "-f", "hf", "-v", "by-commit", "--revision", "c" * 40, env=home_env)
    mfsreg("push", repo, "-f", "hf", "-v", "main", env=home_env)
    digests = {v["version"]: v["digest"] for v in mfsreg_json("ls", "hf", env=home_env)["versions"]}
    assert digests["by-ref"] == digests["by-commit"] != digests["main"]


@pytest.mark.parametrize(
    "breakage, says",
    [
        ("no-ref", "without refs/main: give --revision"),
        ("ref-to-nothing", "which snapshots/ lacks"),
        ("dangling-blob", "which does not exist"),
        ("bad-revision", "give a ref name"),
        ("unknown-revision", "without refs/nope"),
        ("not-a-cache", "is not one"),
    ],
)
def test_a_broken_cache_folder_is_refused_in_one_line(home_env, model, tmp_path, breakage, says):
    repo = cache_repo(tmp_path / "hub", model, ref=None if breakage == "no-ref" else "main")
    args = ["push", repo, "-f", "hf", "-v", "v1"]
    if breakage == "ref-to-nothing":
        (repo / "refs" / "main").write_text("f" * 40)
    elif breakage == "dangling-blob":
        next((repo / "blobs").iterdir()).unlink()
    elif breakage == "bad-revision":
        args += ["--revision", "../main"]
    elif breakage == "unknown-revision":
        args += ["--revision", "nope"]
    elif breakage == "not-a-cache":
        args = ["push", model, "-f", "hf", "-v", "v1", "--revision", "main"]
    ran = mfsreg(*args, env=home_env, check=False)
    assert ran.returncode != 0 and says in ran.stderr, ran.stderr
    assert len(ran.stderr.strip().splitlines()) == 1
    assert mfsreg("ls", env=home_env, check=False).stdout.count("hf") == 0  # nothing stored
