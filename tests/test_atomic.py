"""Nothing lost: a killed push leaves no version, a re-run sends only what is missing, and two
processes pushing members that share chunks at once both succeed."""

from __future__ import annotations

import contextlib
import filecmp
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests import synth
from tests.cli_run import MFSREG, mfsreg, mfsreg_json
from tests.server import token


def big_member(path: Path, seed: int, shared: dict | None = None, tensors: int = 12) -> Path:
    """``tensors`` x 4 MiB of fp32 weights (poorly compressible), optionally sharing ``shared``."""
    g = torch.Generator().manual_seed(seed)
    t = {f"layer.{i}.weight": torch.randn(1024, 1024, generator=g) for i in range(tensors)}
    if shared:
        t.update(shared)
    return synth.write(path, t)


@pytest.mark.process
def test_killed_push_leaves_nothing_visible_and_rerun_sends_only_the_rest(home_env, tmp_path):
    src = big_member(tmp_path / "big.safetensors", seed=7, tensors=40)  # 160 MiB: long enough to kill midway
    env = dict(home_env, MFSREG_PACK_SIZE=str(1 << 20), MFSREG_CHUNK_SIZE=str(256 << 10))
    mfsreg("db", "upgrade", env=env)
    packs = Path(env["MFSREG_HOME"]) / "blobs" / "packs"
    proc = subprocess.Popen(
        [MFSREG, "push", str(src), "--family", "fam", "--version", "big"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if packs.exists() and sum(1 for _ in packs.rglob("*.pack")) >= 3:
            break
        time.sleep(0.002)
    assert proc.poll() is None, "push finished before it could be killed; the file is too small for this machine"
    proc.send_signal(signal.SIGKILL)
    proc.wait()

    assert mfsreg_json("ls", env=env)["families"] == []  # no version, not even its family, is visible
    stats = mfsreg_json("stats", env=env)
    assert stats["versions_count"] == 0 and stats["unreferenced_bytes"] > 0
    sent_before = stats["unreferenced_bytes"]

    rerun = mfsreg_json("push", src, "--family", "fam", "--version", "big", env=env)
    full = mfsreg_json("stats", "--family", "fam", env=env)["stored_bytes"]
    # the re-run stored only what the killed push had not recorded
    assert rerun["new_bytes"] == full - sent_before
    assert 0 < rerun["new_bytes"] < full
    mfsreg("pull", "fam", "big", "-o", tmp_path / "out.safetensors", env=env)
    assert filecmp.cmp(tmp_path / "out.safetensors", src, shallow=False)


@pytest.mark.process
@pytest.mark.parametrize("backend", ["sqlite", "postgres"])
def test_concurrent_pushes_of_members_sharing_chunks(backend, home_env, tmp_path, request):
    env = dict(home_env, MFSREG_PACK_SIZE=str(1 << 20))
    if backend == "postgres":
        env["MFSREG_DATABASE_URL"] = request.getfixturevalue("pg_database")
        mfsreg("db", "upgrade", env=env)
    g = torch.Generator().manual_seed(3)
    shared = {f"shared.{i}.weight": torch.randn(512, 1024, generator=g) for i in range(8)}
    a = big_member(tmp_path / "a.safetensors", seed=1, shared=shared)
    b = big_member(tmp_path / "b.safetensors", seed=2, shared=shared)
    procs = [
        subprocess.Popen(
            [MFSREG, "push", str(p), "--family", "fam", "--version", v, "--json"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for p, v in ((a, "a"), (b, "b"))
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    results = [json.loads(out) for out, _ in outs]
    assert {r["version"] for r in results} == {"a", "b"}
    for path, v in ((a, "a"), (b, "b")):
        mfsreg("pull", "fam", v, "-o", tmp_path / f"{v}.out", env=env)
        assert filecmp.cmp(tmp_path / f"{v}.out", path, shallow=False)
    stats = mfsreg_json("stats", "--family", "fam", env=env)
    assert stats["versions_count"] == 2
    # each shared chunk counts once, in base; each member's own chunks are unique to it
    # 8 shared 2 MiB tensors in 64 KiB chunks, plus the header: both files have the same layout
    assert stats["tiers"]["base"]["chunks"] == 8 * (2 << 20) // (64 << 10) + 1
    assert stats["tiers"]["group"]["chunks"] == 0
    assert sum(t["bytes"] for t in stats["tiers"].values()) == stats["stored_bytes"]


def test_sync_dir_skips_only_filesystems_that_cannot_sync_a_directory(tmp_path, monkeypatch):
    """The last step of every atomic write (registry/format/durable.py): a directory the filesystem cannot
    sync (EINVAL, as on some network and FUSE filesystems) is passed over; any other failure, or a
    directory that is not there, is raised."""
    import errno
    import os

    from mfsreg.registry.format.durable import sync_dir

    sync_dir(tmp_path)
    with pytest.raises(FileNotFoundError):
        sync_dir(tmp_path / "gone")
    real = os.fsync
    for err, raised in ((errno.EINVAL, False), (errno.EIO, True)):

        def failing(fd, err=err):
            raise OSError(err, os.strerror(err))

        monkeypatch.setattr(os, "fsync", failing)
        if raised:
            with pytest.raises(OSError, match=os.strerror(err)):
                sync_dir(tmp_path)
        else:
            sync_dir(tmp_path)
    monkeypatch.setattr(os, "fsync", real)


@contextlib.contextmanager
def synced_inodes(monkeypatch):
    """The inodes of every file and folder fsynced inside the block (os.fsync recorded, then called)."""
    real = os.fsync
    synced: set[int] = set()

    def recording(fd):
        synced.add(os.fstat(fd).st_ino)
        return real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    try:
        yield synced
    finally:
        monkeypatch.setattr(os, "fsync", real)


def test_a_blob_put_makes_the_names_of_new_directories_durable(tmp_path, monkeypatch):
    """A pack written into directories made for it: the pack's name is synced in its directory, and
    each new directory's name in its parent (a crash could otherwise lose the directory, and the
    pack in it, after the commit that needs it)."""

    from mfsreg.registry.blobs.local import LocalBlobStore

    root = tmp_path / "store" / "blobs"
    with synced_inodes(monkeypatch) as synced:
        store = LocalBlobStore(root)
        store.put("packs/ab/abcdef", b"bytes of a pack")
    for d in (tmp_path, tmp_path / "store", root, root / "packs", root / "packs" / "ab"):
        assert d.stat().st_ino in synced, d
    assert store.get("packs/ab/abcdef") == b"bytes of a pack"


def test_a_pull_into_new_folders_makes_their_names_durable(reg, tmp_path, monkeypatch):
    """A directory version pulled into folders made for it: each file synced, each file's name in
    its folder, and each new folder's name in its parent (before, new folders were made without
    syncing their parents: a crash after the pull could lose the folder, and the files in it)."""
    (tmp_path / "src").mkdir()
    src = synth.sharded_dir(tmp_path / "src", synth.base_tensors())
    reg.push(src, "fam", "v1")
    out = tmp_path / "new" / "engine"
    with synced_inodes(monkeypatch) as synced:
        reg.pull("fam", "v1", out)
    files = sorted(out.iterdir())
    assert [f.name for f in files] == sorted(f.name for f in src.iterdir())
    for p in (tmp_path, tmp_path / "new", out, *files):
        assert p.stat().st_ino in synced, p


def test_a_rename_that_fails_partway_is_one_line_and_leaves_no_temp_file(reg, tmp_path, monkeypatch):
    """The renames come last, once every file is written and synced; a disk that fails between two
    of them: a StorageError saying how many files were renamed (the CLI's exit 5, where the raw
    OSError was an internal error), the temp files of the rest removed, and the folder of the one
    renamed synced."""
    from mfsreg.registry.errors import StorageError

    v1, v2 = synth.two_directory_versions(tmp_path / "src")
    reg.push(v1, "fam", "v1")
    reg.push(v2, "fam", "v2", parent="v1")
    out = tmp_path / "engine"
    reg.pull("fam", "v1", out)
    real_replace = os.replace
    calls = []

    def failing_second(src, dst):
        calls.append(dst)
        if len(calls) == 2:
            raise OSError(5, os.strerror(5))
        return real_replace(src, dst)

    with synced_inodes(monkeypatch) as synced:
        monkeypatch.setattr(os, "replace", failing_second)
        with pytest.raises(
            StorageError, match=rf"1 of the pull's {len(list(v2.iterdir()))} files were renamed into place"
        ):
            reg.pull("fam", "v2", out)
        monkeypatch.setattr(os, "replace", real_replace)
    assert out.stat().st_ino in synced
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in v1.iterdir())  # no temp file stayed
    first = Path(calls[0]).name
    assert (out / first).read_bytes() == (v2 / first).read_bytes()  # the one renamed is v2's, whole


def test_a_read_transaction_keeps_one_snapshot(reg, fam):
    """A version deleted while a read transaction runs (a node asking for it as an admin deletes it)
    is still whole to that transaction: its row and its manifest, not the row and then nothing."""
    from mfsreg.registry.db import versions as version_db
    from mfsreg.registry.db.engine import read_tx

    reg.push(fam["lora-chat"], "fam", "v1")
    with read_tx(reg.engine) as conn:
        row = version_db.find_version(conn, "fam", "v1")
        assert row is not None
        reg.delete("fam", "v1")  # its own transaction, committed meanwhile
        assert version_db.read_manifest(conn, row.id)
    assert reg.versions("fam") == []


class _RewriteAtSend:
    """A progress hook that rewrites a stretch of ``path`` in place as the push starts sending: a
    trainer still saving the checkpoint, or a copy into it, while it is pushed."""

    def __init__(self, path: Path, offset: int):
        self.path, self.offset = path, offset

    def start(self, task: str, total: int) -> None:
        if task == "send":
            with open(self.path, "r+b") as f:
                f.seek(self.offset)
                f.write(b"\x5a" * 1024)

    def advance(self, task: str, n: int) -> None:
        pass

    def done(self, task: str) -> None:
        pass


def _refused_then_intact(target, fam, tmp_path) -> None:
    from mfsreg.registry.errors import InvalidModel

    src = tmp_path / "member.safetensors"
    src.write_bytes(fam["full-med"].read_bytes())
    intact = src.read_bytes()
    with pytest.raises(InvalidModel) as info:
        target.push(src, "fam", "v1", progress=_RewriteAtSend(src, len(intact) // 2))
    msg = str(info.value)
    assert "\n" not in msg and str(src) in msg and "changed while it was being pushed" in msg, msg
    assert [(v.family, v.name) for v in target.versions()] == []  # nothing committed
    src.write_bytes(intact)
    target.push(src, "fam", "v1")
    target.pull("fam", "v1", tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == intact


def test_a_file_rewritten_while_it_is_pushed_is_refused_and_stores_nothing_false(reg, fam, tmp_path):
    """Chunks are hashed first and encoded after: a file rewritten in between must not store other
    bytes under the ids hashed (every version sharing such a chunk would fail its pull, and a push
    of the intact file would reuse it). The push stops with one line naming the file; pushed
    again, intact, it pulls back byte for byte."""
    _refused_then_intact(reg, fam, tmp_path)


def test_a_file_rewritten_while_it_is_pushed_to_a_server_is_refused_by_the_client(servers, server_env, fam, tmp_path):
    """The same through the API: the client checks what it encodes before it sends it."""
    from mfsreg.registry.client.remote import RemoteRegistry

    (srv,) = servers(1)
    with RemoteRegistry(srv.url, token=token(server_env, "push"), chunk_size=64 << 10) as remote:
        _refused_then_intact(remote, fam, tmp_path)


# A push, in a process of its own, whose file is cut to a tenth as the hash reaches its first chunk:
# a trainer reopening its checkpoint with O_TRUNC. Every later read of the map past the new end
# raises SIGBUS, which (unguarded) ends the process with no message.
_CUT_SHORT_PUSH = r"""
import os, sys
from pathlib import Path
from mfsreg.cli.backend import open_backend
from mfsreg.registry.errors import InvalidModel
from mfsreg.registry.progress import NullProgress

src = Path(sys.argv[1])

class CutShort(NullProgress):
    cut = False
    def advance(self, task, n):
        if task == "hash" and not self.cut:
            self.cut = True
            os.truncate(src, src.stat().st_size // 10)

with open_backend(os.environ.get("MFSREG_URL")) as backend:
    try:
        backend.push(src, "fam", "v1", progress=CutShort())
    except InvalidModel as exc:
        print(exc)
        sys.exit(2)
print("committed")
"""


def _cut_short_then_intact(env: dict, fam, tmp_path) -> None:
    import sys

    src = tmp_path / "member.safetensors"
    intact = fam["full-med"].read_bytes()
    src.write_bytes(intact)
    proc = subprocess.run(
        [sys.executable, "-c", _CUT_SHORT_PUSH, str(src)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)  # -7 (SIGBUS) unguarded
    msg = proc.stdout.strip()
    assert "\n" not in msg and str(src) in msg and "changed while it was being pushed" in msg, msg
    assert "cut short" in msg, msg
    listed = mfsreg("ls", "fam", "--json", env=env, check=False)  # nothing committed: no family, or no v1
    assert (listed.returncode == 2 and "does not exist" in listed.stderr) or (
        listed.returncode == 0 and "v1" not in listed.stdout
    ), listed
    src.write_bytes(intact)
    mfsreg("push", str(src), "--family", "fam", "--version", "v1", env=env)
    out = tmp_path / "out.safetensors"
    mfsreg("pull", "fam", "v1", "-o", str(out), env=env)
    assert out.read_bytes() == intact


def test_a_file_cut_short_while_it_is_pushed_is_refused_in_one_line(home_env, fam, tmp_path):
    """The reads past the new end are answered with zeros (registry/format/_busguard.c) instead of ending
    the process; the push then refuses to commit what it read, in one line, and stores no version.
    Pushed again, intact, it pulls back byte for byte."""
    _cut_short_then_intact(home_env, fam, tmp_path)


def test_a_file_cut_short_while_it_is_pushed_to_a_server_is_refused_by_the_client(servers, server_env, fam, tmp_path):
    from tests.server import client_env

    (srv,) = servers(1)
    _cut_short_then_intact(client_env(tmp_path, srv.url, token(server_env, "push")), fam, tmp_path)


_REAL_FAULT_AFTER_FAULTHANDLER = r"""
import faulthandler, mmap, os, sys, tempfile
from mfsreg.registry.format import _busguard

def mapped(n=1 << 16):
    fd, path = tempfile.mkstemp(dir=sys.argv[1])
    os.write(fd, b"x" * n)
    return path, mmap.mmap(fd, n, access=mmap.ACCESS_READ)

first, second = mapped()[1], mapped()[1]  # kept open: a span is dropped before its map is closed
_busguard.guard(first)   # a first push: the guard over the default action
faulthandler.enable()    # enabled later: it keeps the guard as the handler it restores
_busguard.guard(second)  # the next push: the guard over faulthandler
path, m = mapped()       # a map the guard does not know
os.truncate(path, 0)
m[40000]                       # a real fault: must end the process
"""


@pytest.mark.process
def test_a_fault_the_guard_does_not_know_still_ends_the_process(tmp_path):
    """A SIGBUS outside every guarded map is handed back and ends the process as without the
    guard, also where faulthandler was enabled between two pushes (the two handlers passed it back
    and forth for good, printing a traceback each time)."""
    import sys

    proc = subprocess.run(
        [sys.executable, "-c", _REAL_FAULT_AFTER_FAULTHANDLER, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=20,
        cwd=Path(__file__).resolve().parents[1],
    )
    assert proc.returncode == -signal.SIGBUS, (proc.returncode, proc.stderr[-500:])
    assert proc.stderr.count("Fatal Python error: Bus error") == 1, proc.stderr[-500:]


class _RewriteStoredAtSkip(_RewriteAtSend):
    """Rewrites a stretch in place once the push knows which chunks are stored: one of those, which
    it reuses without reading them again, so that no re-hash of an encoded chunk can notice."""

    def start(self, task: str, total: int) -> None:
        if task == "skip":
            super().start("send", total)


class _ReplaceAtSkip:
    """Saves the checkpoint the safe way as the push runs: a new file renamed over it (the push
    keeps reading the file it opened, whole), then a chmod and a hard link of the new one."""

    def __init__(self, path: Path, new: bytes):
        self.path, self.new = path, new

    def start(self, task: str, total: int) -> None:
        if task == "skip":
            tmp = self.path.with_name("saving.tmp")
            tmp.write_bytes(self.new)
            os.replace(tmp, self.path)
            os.chmod(self.path, 0o444)
            os.link(self.path, self.path.with_name("linked.safetensors"))

    def advance(self, task: str, n: int) -> None:
        pass

    def done(self, task: str) -> None:
        pass


def test_a_file_renamed_over_while_it_is_pushed_is_pushed_as_it_was_opened(reg, fam, tmp_path):
    """A rename over the pushed file changes the old file's ctime (its link count) and nothing it
    holds: the push goes on and stores the file it opened (it was refused as 'written to')."""
    src = tmp_path / "member.safetensors"
    intact = fam["full-med"].read_bytes()
    src.write_bytes(intact)
    reg.push(src, "fam", "v1", progress=_ReplaceAtSkip(src, fam["lora-chat"].read_bytes()))
    reg.pull("fam", "v1", tmp_path / "out.safetensors")
    assert (tmp_path / "out.safetensors").read_bytes() == intact


def test_a_stored_chunk_rewritten_while_it_is_pushed_is_refused(reg, fam, tmp_path):
    """A push that finds every chunk stored encodes nothing: a rewrite of the file meanwhile shows
    only in the file's own times, which the push checks before it commits."""
    from mfsreg.registry.errors import InvalidModel

    src = tmp_path / "member.safetensors"
    intact = fam["full-med"].read_bytes()
    src.write_bytes(intact)
    reg.push(src, "fam", "v1")
    with pytest.raises(InvalidModel) as info:
        reg.push(src, "fam", "v2", progress=_RewriteStoredAtSkip(src, len(intact) // 2))
    msg = str(info.value)
    assert "\n" not in msg and str(src) in msg and "changed while it was being pushed" in msg, msg
    assert [v.name for v in reg.versions("fam")] == ["v1"]
