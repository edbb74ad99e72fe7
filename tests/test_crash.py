"""The crash matrix: a push, a prune and a pull killed with SIGKILL at each of their steps, in a
process of their own; then every committed version pulls byte for byte, `check --read-data` finds
every byte, the interrupted operation completes when run again, and one prune leaves no
unreferenced pack, chunk row or temp file.

Embedded, the kill lands at a step the operation reports (its progress, or its first call of a blob
store method). Through a server, the server process is killed while a push uploads, a prune repacks
and a pull downloads, and started again."""

from __future__ import annotations

import filecmp
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.cli_run import mfsreg, mfsreg_json
from tests.faults import assert_whole
from tests.server import Server, client_env, token

pytestmark = pytest.mark.process
REPO = Path(__file__).resolve().parent.parent

# Runs one operation on the embedded registry of MFSREG_HOME and kills itself at the step named:
# "TASK:SHARE" once TASK has advanced SHARE of its total (0: as it starts), "blob:METHOD" just
# before the first call of that blob store method. Prints FINISHED if the step never came.
CHILD = r"""
import os, signal, sys
from pathlib import Path
from mfsreg.registry.config import Settings
from mfsreg.registry.progress import NullProgress
from mfsreg.registry.registry import Registry
from tests.hooks import OnFirst

op, step, *args = sys.argv[1:]


def die():
    os.kill(os.getpid(), signal.SIGKILL)


class KillAt(NullProgress):
    def __init__(self, task, share):
        self.task, self.share, self.total, self.done = task, share, 0, 0

    def start(self, task, total):
        if task == self.task:
            self.total = total or 0
            if self.share == 0:
                die()

    def advance(self, task, n):
        if task == self.task:
            self.done += n
            if self.done >= self.share * self.total:
                die()


reg = Registry(Settings.from_env())
progress = NullProgress()
if step.startswith("blob:"):
    reg.blobs = OnFirst(reg.open_blobs(), step[5:], die)
else:
    task, share = step.split(":")
    progress = KillAt(task, float(share))
if op == "push":
    reg.push(Path(args[0]), args[1], args[2], parent=args[3] or None, progress=progress)
elif op == "prune":
    reg.prune(0, 0.1, False, progress)
elif op == "pull":
    reg.pull(args[0], args[1], Path(args[2]), progress=progress)
print("FINISHED")
"""


def killed_at(step: str, op: str, *args, env: dict) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, op, step, *map(str, args)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, (step, proc.returncode, proc.stdout, proc.stderr[-2000:])


def assert_pruned_clean(env: dict, home: Path) -> None:
    """One prune leaves nothing unreferenced: no chunk row, no unlisted or unrecorded pack, no temp file."""
    mfsreg("prune", "--min-age", "0", env=env)
    stats = mfsreg_json("stats", env=env)
    assert stats["unreferenced_bytes"] == 0 and stats["unlisted_pack_bytes"] == 0, stats
    assert stats["leftover_bytes"] == 0, stats
    on_disk = [p for p in (home / "blobs").rglob("*") if p.is_file()]
    assert not [p for p in on_disk if p.name.endswith(".tmp")], on_disk
    assert sum(p.stat().st_size for p in on_disk) == stats["pack_bytes"], (on_disk, stats)


@pytest.fixture
def crash_env(home_env) -> dict:
    """An embedded registry of small packs (several per push), holding fam/base."""
    env = dict(home_env, MFSREG_PACK_SIZE=str(256 << 10))
    return env


PUSH_STEPS = ["hash:0.5", "send:0", "blob:put", "send:0.5", "send:1"]


@pytest.mark.parametrize("step", PUSH_STEPS)
def test_a_push_killed_at_each_step(step, crash_env, fam, tmp_path):
    env, home = crash_env, Path(crash_env["MFSREG_HOME"])
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    killed_at(step, "push", fam["full-med"], "fam", "med", "base", env=env)
    assert [v["version"] for v in mfsreg_json("ls", "fam", env=env)["versions"]] == ["base"]
    assert_whole(env, fam, {"base": "base"}, tmp_path)
    mfsreg("push", fam["full-med"], "--family", "fam", "--version", "med", "--parent", "base", env=env)
    assert_whole(env, fam, {"base": "base", "med": "full-med"}, tmp_path)
    assert_pruned_clean(env, home)
    assert_whole(env, fam, {"base": "base", "med": "full-med"}, tmp_path)


@pytest.mark.parametrize("step", ["repack:0", "repack:0.5", "blob:delete"])
def test_a_prune_killed_at_each_step(step, crash_env, fam, tmp_path):
    """A prune with work of every kind: chunks to delete, packs to repack (a deleted version's packs
    hold chunks a kept one uses) and blobs to delete."""
    from safetensors.torch import load_file, save_file

    env, home = crash_env, Path(crash_env["MFSREG_HOME"])
    med, base = load_file(str(fam["full-med"])), load_file(str(fam["base"]))
    # full-med's tensors but the last layer's, which are base's: keeps part of each of med's packs
    mixed = {k: (base[k] if k.startswith("model.layers.2.") else v) for k, v in med.items()}
    save_file(mixed, str(tmp_path / "mixed.safetensors"))
    fam = {**fam, "mixed": tmp_path / "mixed.safetensors"}
    for name, member in (("base", "base"), ("med", "full-med"), ("mixed", "mixed")):
        parent = ["--parent", "base"] if name != "base" else []
        mfsreg("push", fam[member], "--family", "fam", "--version", name, *parent, env=env)
    mfsreg("delete", "fam", "med", env=env)
    killed_at(step, "prune", env=env)
    assert_whole(env, fam, {"base": "base", "mixed": "mixed"}, tmp_path)
    assert_pruned_clean(env, home)
    assert_whole(env, fam, {"base": "base", "mixed": "mixed"}, tmp_path)


@pytest.mark.parametrize("step", ["write:0.25", "write:0.75"])
def test_a_pull_killed_at_each_step(step, crash_env, fam, tmp_path):
    """A pull killed while it writes leaves the target as it was, and its temp file goes with the
    next pull of that target (it stayed for good before)."""
    env = crash_env
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
    target = tmp_path / "out" / "model.safetensors"
    target.parent.mkdir()
    target.write_bytes(b"what was there")
    killed_at(step, "pull", "fam", "base", target, env=env)
    assert target.read_bytes() == b"what was there"
    left = [p for p in target.parent.iterdir() if p.name.endswith(".tmp")]
    assert left, "the kill left no temp file: the step came after the file was written"
    mfsreg("pull", "fam", "base", "-o", target, env=env)
    assert filecmp.cmp(target, fam["base"], shallow=False)
    assert sorted(p.name for p in target.parent.iterdir()) == ["model.safetensors"]


def test_a_put_killed_while_it_writes_a_pack_leaves_a_temp_file_that_prune_removes(crash_env, tmp_path):
    """Repro 3: a push killed while it wrote a pack left `.<pack>.<uuid>.tmp` in the local blob store,
    which prune never removed and stats did not count. Stats counts it; prune removes it."""
    import numpy as np
    from safetensors.numpy import save_file

    env, home = dict(crash_env, MFSREG_PACK_SIZE=str(256 << 20)), Path(crash_env["MFSREG_HOME"])
    big = tmp_path / "big.safetensors"
    rng = np.random.default_rng(7)
    save_file({f"w{i}": rng.integers(0, 2**32, size=(4 << 20), dtype=np.uint32) for i in range(12)}, str(big))
    child = subprocess.Popen(
        [sys.executable, "-m", "mfsreg", "push", str(big), "--family", "big", "--version", "v1"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        # a temp file with bytes in it: a kill between its creation and its first write leaves an
        # empty one, which is not what this test is about
        while not any(p.stat().st_size for p in (home / "blobs").rglob(".*.tmp")):
            assert child.poll() is None and time.monotonic() < deadline, "the push wrote no temp file"
            time.sleep(0.002)
    finally:
        child.kill()
        child.wait()
    left = list((home / "blobs").rglob(".*.tmp"))
    assert left
    stats = mfsreg_json("stats", env=env)
    assert stats["leftover_bytes"] == sum(p.stat().st_size for p in left) > 0, stats
    assert "killed writers left" in mfsreg("stats", env=env).stdout
    dry = mfsreg_json("prune", "--min-age", "0", "--dry-run", env=env)
    assert dry["deleted_packs"] >= len(left) and list((home / "blobs").rglob(".*.tmp")) == left
    assert_pruned_clean(env, home)


# -- through a server: the server process killed ---------------------------------------------------


def restart(srv: Server, env: dict, tmp_path: Path) -> Server:
    srv.proc.kill()
    srv.proc.wait()
    srv.log.close()
    return Server(env, tmp_path / f"server-{time.monotonic_ns()}.log", process=True)


def test_a_server_killed_while_it_takes_a_push_loses_nothing(server_env, fam, tmp_path):
    srv = Server(server_env, tmp_path / "server.log", process=True)
    try:
        admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
        env = dict(admin, MFSREG_UPLOAD_BATCH=str(64 << 10))
        mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=env)
        push = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "mfsreg",
                "push",
                str(fam["full-med"]),
                "--family",
                "fam",
                "--version",
                "med",
                "--parent",
                "base",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 60
        while mfsreg_json("stats", env=admin)["unreferenced_bytes"] == 0:  # some batches stored, no commit yet
            assert push.poll() is None and time.monotonic() < deadline, "the push ended before the kill"
            time.sleep(0.01)
        srv = restart(srv, server_env, tmp_path)
        push.wait(timeout=120)
        assert push.returncode == 5, push.stderr.read()
        admin, env = (dict(e, MFSREG_URL=srv.url) for e in (admin, env))
        assert_whole(admin, fam, {"base": "base"}, tmp_path)
        mfsreg("push", fam["full-med"], "--family", "fam", "--version", "med", "--parent", "base", env=env)
        assert_whole(admin, fam, {"base": "base", "med": "full-med"}, tmp_path)
        pruned = mfsreg_json("prune", "--min-age", "0", env=admin)
        assert pruned["waiting_packs"] == 0, pruned
        stats = mfsreg_json("stats", env=admin)
        assert stats["unreferenced_bytes"] == 0 and stats["unlisted_pack_bytes"] == 0, stats
    finally:
        srv.stop()


def test_a_server_killed_while_it_streams_a_pull_loses_nothing(server_env, fam, tmp_path):
    srv = Server(server_env, tmp_path / "server.log", process=True)
    try:
        admin = client_env(tmp_path, srv.url, token(server_env, "admin"))
        mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=admin)
        doc = httpx.get(
            f"{srv.url}/v1/families/fam/versions/base", headers={"Authorization": f"Bearer {admin['MFSREG_TOKEN']}"}
        ).json()
        with httpx.stream(
            "POST",
            f"{srv.url}/v1/families/fam/chunks/download",
            json={"ids": list(doc["chunks"])},
            headers={"Authorization": f"Bearer {admin['MFSREG_TOKEN']}"},
        ) as resp:
            stream = resp.iter_raw(4096)
            first = next(stream)  # the stream has begun
            srv = restart(srv, server_env, tmp_path)
            try:
                for _ in stream:
                    pass
            except httpx.HTTPError:
                pass  # the kill broke the answer off (the usual case)
            # else the whole answer was in the socket's buffers before the kill landed (a slow hour):
            # httpx read it to its last chunk, complete; either way what follows must hold
        assert first
        admin = dict(admin, MFSREG_URL=srv.url)
        assert_whole(admin, fam, {"base": "base"}, tmp_path)
    finally:
        srv.stop()


def test_a_server_killed_while_it_prunes_loses_nothing(migrated_pg, s3_blob_url, fam, tmp_path):
    """The server process killed mid-prune: its database link slowed (a proxy of the tests' own, see
    tests/faults.py) so that the prune is still running when the kill lands, whatever step it is at."""
    from urllib.parse import urlsplit

    from tests.faults import FaultProxy
    from tests.server import make_server_env

    pg = urlsplit(migrated_pg)
    proxy = FaultProxy((pg.hostname, pg.port))
    env = make_server_env(
        migrated_pg.replace(f"@{pg.hostname}:{pg.port}/", f"@127.0.0.1:{proxy.port}/"), s3_blob_url, tmp_path
    )
    srv = Server(env, tmp_path / "server.log", process=True)
    try:
        admin = client_env(tmp_path, srv.url, token(env, "admin"))
        for name, member in (("base", "base"), ("chat", "lora-chat"), ("med", "full-med")):
            parent = ["--parent", "base"] if name != "base" else []
            mfsreg("push", fam[member], "--family", "fam", "--version", name, *parent, env=admin)
        mfsreg("delete", "fam", "med", env=admin)
        proxy.delay(0.02)
        prune = subprocess.Popen(
            [sys.executable, "-m", "mfsreg", "prune", "--min-age", "0"],
            env=admin,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        time.sleep(1.0)
        assert prune.poll() is None, "the prune ended before the kill"
        srv = restart(srv, env, tmp_path)
        prune.wait(timeout=120)
        assert prune.returncode == 5, prune.stderr.read()
        proxy.heal()
        admin = dict(admin, MFSREG_URL=srv.url)
        assert_whole(admin, fam, {"base": "base", "chat": "lora-chat"}, tmp_path)
        mfsreg("prune", "--min-age", "0", env=admin)
        stats = mfsreg_json("stats", env=admin)
        assert stats["unreferenced_bytes"] == 0 and stats["unlisted_pack_bytes"] == 0, stats
        assert_whole(admin, fam, {"base": "base", "chat": "lora-chat"}, tmp_path)
    finally:
        srv.stop()
        proxy.close()
