"""Bad input gets one clear line on stderr, exit 2, and leaves the registry exactly as it was."""

from __future__ import annotations

import filecmp
import hashlib
import http.server
import json
import os
import signal
import sqlite3
import struct
import threading
from pathlib import Path

import pytest

from tests import synth
from tests.cli_run import mfsreg, mfsreg_json
from tests.server import free_port


def st_bytes(header: dict, data: bytes, claimed_len: int | None = None) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h) if claimed_len is None else claimed_len) + h + data


def good_file_bytes() -> bytes:
    header = {
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "BF16", "shape": [4], "data_offsets": [16, 24]},
    }
    return st_bytes(header, bytes(range(24)))


def snapshot(home: Path) -> tuple:
    """Every row of every table and every blob's bytes."""
    con = sqlite3.connect(home / "registry.db")
    try:
        rows = tuple(con.iterdump())
    finally:
        con.close()
    blobs = tuple(
        (p.relative_to(home).as_posix(), hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted((home / "blobs").rglob("*"))
        if p.is_file()
    )
    return rows, blobs


@pytest.fixture
def seeded(home_env, fam):
    """A registry that already holds a version, so 'as it was' is not trivially empty."""
    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=home_env)
    return home_env


def _truncated(tmp):
    return good_file_bytes()[:-5]


def _truncated_prefix(tmp):
    return b"\x10\x00\x00"


def _corrupted_header(tmp):
    raw = bytearray(good_file_bytes())
    raw[8:14] = b"\xff\xfe{{]]"
    return bytes(raw)


def _offset_past_end(tmp):
    return st_bytes({"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4000]}}, b"\0" * 4)


def _overlapping(tmp):
    header = {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }
    return st_bytes(header, b"\0" * 24)


def _unknown_dtype(tmp):
    return st_bytes({"a": {"dtype": "F12", "shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4)


def _claims_100mb(tmp):
    raw = good_file_bytes()
    return struct.pack("<Q", 100 * 1024 * 1024) + raw[8:]


def _shape_mismatch(tmp):
    return st_bytes({"a": {"dtype": "F32", "shape": [3], "data_offsets": [0, 16]}}, b"\0" * 16)


def _header_nested_too_deep(tmp):
    header = b"[" * 100_000  # json.loads gives up with a RecursionError
    return struct.pack("<Q", len(header)) + header


def _header_with_a_huge_integer(tmp):
    header = b'{"a": {"dtype": "U8", "shape": [' + b"9" * 5000 + b'], "data_offsets": [0, 4]}}'
    return struct.pack("<Q", len(header)) + header + b"\0" * 4  # over Python's digit limit: a ValueError


def _dtype_not_a_string(tmp):
    return st_bytes({"a": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)


def _shape_of_huge_dimensions(tmp):
    # the product has about 6,000 digits: too long to print, and no file holds that many bytes
    return st_bytes({"a": {"dtype": "F32", "shape": [10**15] * 400, "data_offsets": [0, 4]}}, b"\0" * 4)


CASES = {
    "truncated": (_truncated, "truncated"),
    "truncated-prefix": (_truncated_prefix, "truncated"),
    "corrupted-header": (_corrupted_header, "corrupted header"),
    "offset-past-end": (_offset_past_end, "past the end"),
    "overlapping": (_overlapping, "overlap"),
    "unknown-dtype": (_unknown_dtype, "unknown dtype"),
    "header-claims-100mb": (_claims_100mb, "over the"),
    "shape-mismatch": (_shape_mismatch, "shape"),
    "header-nested-too-deep": (_header_nested_too_deep, "corrupted header"),
    "header-with-a-huge-integer": (_header_with_a_huge_integer, "corrupted header"),
    "dtype-not-a-string": (_dtype_not_a_string, "unknown dtype"),
    "shape-of-huge-dimensions": (_shape_of_huge_dimensions, "more than the data's 4 bytes"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_malformed_file_is_refused_and_nothing_changes(case, seeded, tmp_path):
    make, words = CASES[case]
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(make(tmp_path))
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    proc = mfsreg("push", bad, "--family", "fam", "--version", "bad", env=seeded, check=False)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert words in lines[0] and "bad.safetensors" in lines[0], lines[0]
    assert snapshot(home) == before
    assert "bad" not in mfsreg("ls", "fam", "--json", env=seeded).stdout


@pytest.mark.parametrize(
    "family,version",
    [("../../x", "v1"), ("fam", "../../x"), (".hidden", "v1"), ("fam", "a/b"), ("--json", "v1"), ("fam", "-v")],
)
def test_bad_names_are_refused(family, version, seeded, fam):
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    proc = mfsreg("push", fam["lora-chat"], "--family", family, "--version", version, env=seeded, check=False)
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and "invalid" in proc.stderr and "name" in proc.stderr
    assert snapshot(home) == before
    assert not (home.parent / "x").exists()


def test_not_a_model_and_missing_path(seeded, tmp_path):
    txt = tmp_path / "notes.txt"
    txt.write_text("hello")
    loop = tmp_path / "loop.safetensors"
    loop.symlink_to(loop.name)
    broken = tmp_path / "broken.safetensors"
    broken.symlink_to("gone.safetensors")
    for path, words in (
        (txt, "not a .safetensors file"),
        (tmp_path / "missing.safetensors", "no such file"),
        (loop, "leads back to itself"),
        (broken, "'gone.safetensors', which does not exist"),
    ):
        proc = mfsreg("push", path, "--family", "fam", "--version", "x", env=seeded, check=False)
        assert proc.returncode == 2 and words in proc.stderr and "Traceback" not in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_directory_without_weights_and_broken_index(seeded, tmp_path):
    d = tmp_path / "empty"
    d.mkdir()
    (d / "config.json").write_text("{}")
    proc = mfsreg("push", d, "--family", "fam", "--version", "x", env=seeded, check=False)
    assert proc.returncode == 2 and "no .safetensors file" in proc.stderr
    (d / "model.safetensors").write_bytes(good_file_bytes())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "model-2.safetensors"}}))
    proc = mfsreg("push", d, "--family", "fam", "--version", "x", env=seeded, check=False)
    assert proc.returncode == 2 and "missing" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.parametrize("name", [b"notes\nx.txt", b"tab\tname.json", b"latin1-\xe9.txt"])
def test_a_file_name_a_version_cannot_hold_is_refused(name, seeded, tmp_path):
    """Control characters and bytes that are not UTF-8 in a model directory's file names: refused
    at push (a server refuses such a manifest, and a node such a document), nothing stored."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "model.safetensors").write_bytes(good_file_bytes())
    with open(os.path.join(os.fsencode(d), name), "wb") as f:
        f.write(b"{}")
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    proc = mfsreg("push", d, "--family", "fam", "--version", "x", env=seeded, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot hold this file name" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(home) == before


def test_unknown_version_and_family(seeded, tmp_path):
    for args, words in (
        (("pull", "fam", "nope", "-o", tmp_path / "o"), "does not exist"),
        (("show", "nofam", "v1"), "does not exist"),
        (("stats", "--family", "nofam"), "does not exist"),
        (("ls", "nofam"), "does not exist"),
    ):
        proc = mfsreg(*args, env=seeded, check=False)
        assert proc.returncode == 2 and words in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


class _Impostor(http.server.BaseHTTPRequestHandler):
    """Not an mfsreg server: every request gets self.server.answer = (status, content type, body)."""

    def _answer(self):
        length = int(self.headers.get("Content-Length") or 0)
        if length:
            self.rfile.read(length)
        status, ctype, body = self.server.answer
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = do_DELETE = do_PUT = _answer

    def log_message(self, *args):
        pass


HTML_404 = (
    404,
    "text/html",
    b"<!DOCTYPE HTML>\n<html><body>\n<h1>Error response</h1>\n<p>Error code: 404</p>\n</body></html>\n",
)
ANSWERS = {
    "an HTML 404": (HTML_404, "not JSON"),
    "an HTML 502": ((502, "text/html", HTML_404[2]), "not JSON"),
    "200 with {}": ((200, "application/json", b"{}"), "another shape"),
    "200 with []": ((200, "application/json", b"[]"), "another shape"),
    "200 with null": ((200, "application/json", b"null"), "another shape"),
    # fields of the wrong types: the shared documents' check (registry/documents.py) says so in one line
    "200 with wrong types": (
        (200, "application/json", b'{"family": 1, "versions": "x", "exists": []}'),
        "another shape",
    ),
    "a 400 whose detail has newlines": ((400, "application/json", b'{"detail": "one\\ntwo\\nthree"}'), "one two three"),
    # a route the server lacks (FastAPI's own 404, or a wrong path in MFSREG_URL): not a missing version
    "a JSON 404 that is not mfsreg's": ((404, "application/json", b'{"detail": "Not Found"}'), "no mfsreg API there"),
}


@pytest.mark.parametrize("answer", sorted(ANSWERS))
def test_a_server_that_is_not_mfsreg_gets_one_line_for_every_command(answer, fam, tmp_path):
    """MFSREG_URL pointing at another server, a proxy's error page, or an mfsreg of another shape:
    every command says so in one line and fails (an empty listing exited 0; a KeyError or the
    page's HTML reached the user)."""
    (status, ctype, body), says = ANSWERS[answer]
    impostor = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Impostor)
    impostor.answer = (status, ctype, body)
    threading.Thread(target=impostor.serve_forever, daemon=True).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(
        MFSREG_URL=f"http://127.0.0.1:{impostor.server_address[1]}",
        MFSREG_TOKEN="t",
        MFSREG_HOME=str(tmp_path / "home"),
        MFSREG_CACHE_DIR=str(tmp_path / "cache"),
    )
    commands = [
        ["ls"],
        ["ls", "fam"],
        ["show", "fam", "v1"],
        ["stats"],
        ["delete", "fam", "v1"],
        ["prune", "--min-age", "0"],
        ["push", fam["base"], "--family", "fam", "--version", "v1"],
        ["pull", "fam", "v1", "-o", tmp_path / "out.safetensors"],
        ["cache", "warm", "fam"],
    ]
    try:
        for args in commands:
            if body == b"[]" and args[0] == "ls":  # a registry without families, or a family without versions
                listed = json.loads(mfsreg(*args, "--json", env=env).stdout)
                assert listed.get("families", listed.get("versions")) == [], (args, listed)
                continue
            proc = mfsreg(*args, env=env, check=False)
            lines = proc.stderr.strip().splitlines()
            assert proc.returncode != 0 and len(lines) == 1, (args, proc.returncode, proc.stderr)
            assert "internal error" not in lines[0] and "<" not in lines[0], (args, lines[0])
            assert says in lines[0] or says == "another shape" and "fails its checks" in lines[0], (args, lines[0])
            if says != "one two three":
                assert "MFSREG_URL" in lines[0], (args, lines[0])
            if answer == "200 with wrong types" and args[0] == "push":  # the family's document, by its model
                assert "family: Input should be a valid string (as FamilyModel)" in lines[0], lines[0]
        assert not (tmp_path / "out.safetensors").exists() and not (tmp_path / "home").exists()
    finally:
        impostor.shutdown()
        impostor.server_close()


@pytest.mark.parametrize("name", ["model.safetensors", "model.safetensors.index.json"])
def test_a_named_pipe_is_refused_not_read_forever(name, seeded, tmp_path):
    """A pipe (or socket, or device) given as the model: refused at once, where reading its header
    waited for a writer that never came."""
    pipe = tmp_path / name
    os.mkfifo(pipe)
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    proc = mfsreg("push", pipe, "--family", "fam", "--version", "piped", env=seeded, check=False, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "not a regular file" in proc.stderr and str(pipe) in proc.stderr
    assert snapshot(home) == before


def _pg(query: str = "") -> str:
    from tests.conftest import _pg_url

    return _pg_url("test") + query


@pytest.mark.parametrize(
    "url,code,says",
    [
        ("sqlite:///{tmp}/not-a-db", 5, "file is not a database"),
        ("sqlite:///{tmp}", 5, "unable to open database file"),  # a directory
        ("postgresql+psycopg://u@127.0.0.1:notaport/db", 2, "is not a database URL"),
        ("postgresql+psycopg2://u@127.0.0.1/db", 2, "names driver 'postgresql+psycopg2', which mfsreg does not use"),
        ("mysql://a@b/c", 2, "names driver 'mysql'"),
        ("{pg}?connect_timeout=abc", 5, "bad value for connect_timeout"),
        ("{pg}?bogus_option=1", 5, 'invalid connection option "bogus_option"'),
    ],
)
def test_a_database_url_that_cannot_work_is_one_line(url, code, says, tmp_path):
    """A file that is not a database, a port that is not a number, a driver mfsreg does not use, an
    option the driver refuses: one line naming it (each was 'internal error: ...', some on two lines)."""
    (tmp_path / "not-a-db").write_bytes(b"plain text, not SQLite\n" * 100)
    before = (tmp_path / "not-a-db").read_bytes()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(MFSREG_HOME=str(tmp_path / "home"), MFSREG_DATABASE_URL=url.format(tmp=tmp_path, pg=_pg()))
    proc = mfsreg("ls", env=env, check=False)
    assert proc.returncode == code and proc.stderr.count("\n") == 1, proc.stderr
    assert says in proc.stderr and "internal error" not in proc.stderr and "MFSREG_DATABASE_URL" in proc.stderr, (
        proc.stderr
    )
    if url.startswith("sqlite"):
        assert "server" not in proc.stderr, proc.stderr  # a file has no server to run
    assert (tmp_path / "not-a-db").read_bytes() == before


def test_a_file_blob_url_with_a_host_is_refused(fam, tmp_path):
    """file://relative/x reads 'relative' as a host and /x as the path: packs went to /x."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(MFSREG_HOME=str(tmp_path / "home"), MFSREG_BLOB_URL="file://mfsreg-test-relative/mfsreg-test-x")
    proc = mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "names host 'mfsreg-test-relative'" in proc.stderr and "file:///" in proc.stderr
    assert not Path("/mfsreg-test-x").exists()
    # no path, or a relative one: an internal error (ValueError from Path.as_uri) once
    for url in ("file://", "file:mfsreg-test-blobs"):
        env["MFSREG_BLOB_URL"] = url
        for args in (["check"], ["push", fam["base"], "--family", "fam", "--version", "v1"]):
            proc = mfsreg(*args, env=env, check=False)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
            assert "has no absolute path" in proc.stderr and "file:///" in proc.stderr, proc.stderr
    assert not Path("mfsreg-test-blobs").exists()


def test_a_home_with_a_space_keeps_its_packs_inside_it(fam, tmp_path):
    """The default blob URL is MFSREG_HOME/blobs as a file URL, where a space is %20: read literally,
    the packs went to a sibling directory named with '%20', outside MFSREG_HOME."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    home = tmp_path / "my home"
    env.update(MFSREG_HOME=str(home))
    mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", env=env)
    assert any((home / "blobs").rglob("*.pack")) and not (tmp_path / "my%20home").exists()
    # a given URL's escapes are read too
    given = dict(env, MFSREG_BLOB_URL=(tmp_path / "other packs").as_uri())
    mfsreg(
        "push", fam["base"], "--family", "fam2", "--version", "v1", env=dict(given, MFSREG_HOME=str(tmp_path / "h2"))
    )
    assert any((tmp_path / "other packs").rglob("*.pack"))
    out = tmp_path / "out.safetensors"
    mfsreg("pull", "fam", "v1", "-o", str(out), env=env)
    assert filecmp.cmp(out, fam["base"], shallow=False)


def test_a_store_left_at_its_escaped_path_is_named_with_the_move_that_fixes_it(fam, tmp_path):
    """An earlier mfsreg kept a home-with-a-space's packs at the literal '%20' path: opening the
    decoded path alone would find none of them, so every command that opens the blob store says
    where they are (ls, which reads only the database, lists the versions as ever)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    home = tmp_path / "my home"
    env.update(MFSREG_HOME=str(home))
    mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", env=env)
    left = tmp_path / "my%20home" / "blobs"
    left.parent.mkdir()
    (home / "blobs").rename(left)  # where the earlier release put them

    def state():
        return snapshot(home)[0], sorted((p.name, p.read_bytes()) for p in left.rglob("*") if p.is_file())

    before = state()
    assert before[1]
    assert [v["version"] for v in mfsreg_json("ls", "fam", env=env)["versions"]] == ["v1"]
    for args in (
        ["check"],
        ["pull", "fam", "v1", "-o", str(tmp_path / "out")],
        ["push", fam["lora-chat"], "--family", "fam", "--version", "chat"],
    ):
        proc = mfsreg(*args, env=env, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"packs are in {left}" in proc.stderr and "mv " in proc.stderr, proc.stderr
    assert state() == before and not (home / "blobs").exists() and not (tmp_path / "out").exists()
    left.rename(home / "blobs")  # the move the message gives
    mfsreg("pull", "fam", "v1", "-o", str(tmp_path / "out"), env=env)
    assert filecmp.cmp(tmp_path / "out", fam["base"], shallow=False)


def _pull_under_a_file_size_limit(env: dict, out: Path, kib: int = 64):
    """`mfsreg pull fam base -o OUT` with files capped at ``kib`` KiB (ulimit -f): the writes fail
    with EFBIG, as on a full disk (ENOSPC), without filling one."""
    import subprocess

    from tests.cli_run import MFSREG

    return subprocess.run(
        ["bash", "-c", f'ulimit -f {kib}; exec "$0" pull fam base -o "$1"', MFSREG, str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_pull_that_cannot_write_its_file_names_it_in_one_line(seeded, tmp_path):
    """A full disk, a quota or a file size limit during a pull: one line naming the file and what to
    do, exit 5, and no temp file left (it said 'File too large: ' and nothing else, exit 1)."""
    out = tmp_path / "out" / "base.safetensors"
    proc = _pull_under_a_file_size_limit(seeded, out)
    assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"cannot write {out}: File too large: make room there" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()  # no temp file, nor the folder the pull made for it


@pytest.mark.process
def test_a_push_whose_pack_cannot_be_written_leaves_nothing_waiting_for_prune(seeded, tmp_path):
    """A pack blob the store could not write (here a file size limit, as a full disk would): the
    push fails in one line, and its announcement of the pack goes too; stats counted it as unlisted
    bytes, waiting for a prune, though no blob was ever there."""
    import subprocess

    import torch

    from tests.cli_run import MFSREG

    model = tmp_path / "big.safetensors"
    synth.write(model, {"w": torch.randn(512, 1024, generator=torch.Generator().manual_seed(7))})  # 2 MiB, new
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    proc = subprocess.run(
        ["bash", "-c", 'ulimit -f 1024; exec "$0" push "$1" --family fam --version big', MFSREG, str(model)],
        env={**seeded, "MFSREG_PACK_SIZE": "8MiB"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
    assert "File too large" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(home) == before
    assert mfsreg_json("stats", env=seeded)["unlisted_pack_bytes"] == 0


@pytest.mark.process
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_pull_stopped_by_a_signal_leaves_no_temp_file(home_env, tmp_path, signum):
    """`timeout`, `kill` or a closed terminal killed a pull on the spot, leaving its temp file (as
    large as the output) beside it; it now unwinds as Ctrl-C does: one line, exit 128 + signal."""
    import subprocess
    import time

    import torch

    from tests.cli_run import MFSREG

    model = tmp_path / "big.safetensors"
    gen = torch.Generator().manual_seed(3)
    synth.write(model, {f"w{i}": torch.randn(1024, 1024, generator=gen) for i in range(64)})  # 256 MiB
    mfsreg("push", model, "--family", "fam", "--version", "big", env=home_env)
    out = tmp_path / "out"
    out.mkdir()
    for _ in range(5):  # until the signal lands while the file is being written
        proc = subprocess.Popen(
            [MFSREG, "pull", "fam", "big", "-o", str(out / "big.safetensors")],
            env=home_env,
            stderr=subprocess.PIPE,
            text=True,
        )
        while proc.poll() is None and not any(p.name.endswith(".tmp") for p in out.iterdir()):
            time.sleep(0.001)
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=60)
        if proc.returncode != 0:
            break
        (out / "big.safetensors").unlink()
    assert proc.returncode == 128 + signum, err
    assert err.count("\n") == 1 and f"stopped by {signal.Signals(signum).name}; nothing partial" in err, err
    assert list(out.iterdir()) == []


@pytest.mark.process
@pytest.mark.parametrize(
    "args,extra_env,says",
    [
        (
            [b"token", b"create", b"--scope", b"push", b"--family", b"fam", b"--description", b"a\xffb"],
            {},
            "'a\\xffb' is not UTF-8 text",
        ),
        ([b"token", b"revoke", b"\xff"], {}, "'\\xff' is not UTF-8 text"),
        ([b"serve", b"--host", b"\xff", b"--port", b"1"], {}, "cannot listen on"),
        ([b"ls"], {b"MFSREG_URL": b"http://127.0.0.1:9/\xff"}, "is not UTF-8 text"),
        (
            [b"push", b"no\nsuch\x1b[31m", b"--family", b"fam", b"--version", b"x"],
            {},
            "no\\nsuch\\x1b[31m: no such file",
        ),
        ([b"ls"], {b"MFSREG_HOME": b"/dev/null/a\nb"}, "/dev/null/a\\nb: Not a directory"),
    ],
)
def test_values_that_are_not_utf8_or_hold_control_characters_get_one_line(seeded, args, extra_env, says):
    """Bytes that are not UTF-8 in an argument or setting ended in 'internal error: UnicodeEncodeError',
    exit 1; a path with a newline or an escape sequence printed two lines, or recoloured the
    terminal. Each is one printable line now, exit 2."""
    import subprocess

    from tests.cli_run import MFSREG

    env = {os.fsencode(k): os.fsencode(v) for k, v in seeded.items()} | extra_env
    proc = subprocess.run([os.fsencode(MFSREG), *args], env=env, capture_output=True, timeout=120)
    err = proc.stderr.decode()
    assert proc.returncode == 2 and err.count("\n") == 1 and err.isascii(), err
    assert says in err and "internal error" not in err and "\x1b" not in err, err


def test_a_pull_to_a_path_ending_in_a_slash_wants_that_directory(seeded, fam, tmp_path):
    """`-o newdir/` wrote a file named newdir where no such directory was."""
    proc = mfsreg("pull", "fam", "base", "-o", f"{tmp_path / 'newdir'}/", env=seeded, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "no such directory: make it first, or drop the trailing '/'" in proc.stderr, proc.stderr
    assert not (tmp_path / "newdir").exists()
    (tmp_path / "newdir").mkdir()
    res = mfsreg_json("pull", "fam", "base", "-o", f"{tmp_path / 'newdir'}/", env=seeded)
    assert res["path"] == str(tmp_path / "newdir" / fam["base"].name)


def test_a_pull_to_dir_over_another_versions_weights_is_refused(seeded, fam, tmp_path):
    """--to-dir over a directory holding another version's shards and index left them beside the new
    version's file, exit 0: an engine loading the directory read both."""
    src = tmp_path / "sharded"
    src.mkdir()
    synth.sharded_dir(src, synth.base_tensors(seed=9))
    mfsreg("push", src, "--family", "fam", "--version", "sharded", env=seeded)
    engine = tmp_path / "engine"
    mfsreg("pull", "fam", "sharded", "--to-dir", engine, env=seeded)
    before = sorted((p.name, p.read_bytes()) for p in engine.iterdir())
    proc = mfsreg("pull", "fam", "base", "--to-dir", engine, env=seeded, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "holds model-00001-of-00002.safetensors, which this version does not" in proc.stderr, proc.stderr
    assert sorted((p.name, p.read_bytes()) for p in engine.iterdir()) == before
    mfsreg("pull", "fam", "sharded", "--to-dir", engine, env=seeded)  # the same version again: fine
    (engine / "config.json").unlink()  # side files do not count; the weights do
    for p in engine.glob("model*"):
        p.unlink()
    res = mfsreg_json("pull", "fam", "base", "--to-dir", engine, env=seeded)
    assert filecmp.cmp(res["path"], fam["base"], shallow=False)


def test_a_pull_onto_the_registrys_own_files_is_refused(seeded, tmp_path):
    """`-o $MFSREG_HOME/registry.db` replaced the database and said "verified"; the next command
    found no database. Its side files, the blob store and links to them are refused alike."""
    home = Path(seeded["MFSREG_HOME"])
    pack = next(p for p in (home / "blobs").rglob("*") if p.is_file())
    (tmp_path / "link.db").symlink_to(home / "registry.db")
    before = snapshot(home)
    for args, says in (
        (["-o", home / "registry.db"], "that is the registry's database"),
        (["-o", home / "registry.db-wal"], "that is the registry's database"),
        (["-o", pack], "that lies in the registry's blob store"),
        (["--to-dir", home / "blobs" / "engine"], "that lies in the registry's blob store"),
        (["-o", tmp_path / "link.db"], f"that is the registry's database ({home / 'registry.db'})"),
    ):
        proc = mfsreg("pull", "fam", "base", *args, env=seeded, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert says in proc.stderr and "pull elsewhere" in proc.stderr, proc.stderr
    assert snapshot(home) == before
    assert (tmp_path / "link.db").is_symlink()
    mfsreg("pull", "fam", "base", "-o", home, env=seeded)  # beside them is fine: a file of its own name
    assert mfsreg_json("ls", "fam", env=seeded)["versions"]


@pytest.mark.process
def test_a_blob_store_this_user_may_not_write_says_so_and_keeps_the_registry(seeded, tmp_path):
    """It said "cannot write blob packs/84/<id>.pack: Permission denied": a path inside the store,
    and nothing to do. Root is given up for the push (setpriv), as the file modes stop no one else."""
    import shutil
    import subprocess

    import torch

    from tests.cli_run import MFSREG

    model = tmp_path / "new.safetensors"
    synth.write(model, {"w": torch.randn(300, 300, generator=torch.Generator().manual_seed(11))})
    home = Path(seeded["MFSREG_HOME"])
    folders = [home / "blobs" / "packs", *(p for p in (home / "blobs" / "packs").rglob("*") if p.is_dir())]
    before = snapshot(home)
    cmd = [MFSREG, "push", str(model), "--family", "fam", "--version", "new"]
    if os.geteuid() == 0:
        cmd = [shutil.which("setpriv"), "--bounding-set=-all", "--inh-caps=-all", *cmd]
    for d in folders:
        d.chmod(0o555)
    try:
        proc = subprocess.run(cmd, env=seeded, capture_output=True, text=True, timeout=120)
    finally:
        for d in folders:
            d.chmod(0o755)
    assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"cannot write blob {home / 'blobs' / 'packs'}/" in proc.stderr, proc.stderr
    assert "Permission denied: this user may not write there; give it write access" in proc.stderr, proc.stderr
    assert snapshot(home) == before


def test_a_pull_into_a_folder_it_may_not_write_names_the_folder_not_a_temp_file(seeded):
    """sysfs refuses new files, to root too: the error named the temp file beside the output
    ("/sys/.x.<hex>.tmp: Permission denied"), a path the user never gave."""
    proc = mfsreg("pull", "fam", "base", "-o", "/sys/mfsreg-out.safetensors", env=seeded, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "/sys: Permission denied (making mfsreg-out.safetensors there)" in proc.stderr, proc.stderr
    assert ".tmp" not in proc.stderr


@pytest.mark.process
def test_a_relative_home_is_refused_and_a_client_ignores_server_settings(tmp_path):
    """A relative MFSREG_HOME (or ' ') made a registry in each directory a command ran from. A
    remote client refused every command on a bad server-only setting (MFSREG_MAX_BODY=bogus) in
    its environment, while ignoring others."""
    import subprocess

    from tests.cli_run import MFSREG

    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    for rel in ("relhome", " "):
        proc = subprocess.run(
            [MFSREG, "ls"], env=dict(env, MFSREG_HOME=rel), cwd=tmp_path, capture_output=True, text=True, timeout=60
        )
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert f"MFSREG_HOME={rel!r} is not an absolute path" in proc.stderr, proc.stderr
    assert list(tmp_path.iterdir()) == []
    remote = dict(
        env,
        MFSREG_URL="http://127.0.0.1:9",
        MFSREG_MAX_BODY="bogus",
        MFSREG_PACK_SIZE="bogus",
        MFSREG_DELTA="maybe",
        MFSREG_HOME="relhome",
    )
    proc = subprocess.run([MFSREG, "ls"], env=remote, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 5 and "cannot reach" in proc.stderr.lower(), proc.stderr  # on to the server
    proc = subprocess.run(
        [MFSREG, "ls"], env=dict(remote, MFSREG_CHUNK_SIZE="bogus"), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 2 and "MFSREG_CHUNK_SIZE" in proc.stderr, proc.stderr  # the client's own: checked


def test_a_home_or_cache_that_is_a_file_says_what_to_do(tmp_path):
    """MFSREG_HOME, or a folder the node cache needs, that is a file: one line naming it and what to
    do, exit 2 (it said only 'File exists')."""
    (tmp_path / "home").write_text("not a directory")
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "chunks").write_text("not a directory")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    for extra, args, path in (
        ({"MFSREG_HOME": str(tmp_path / "home")}, ["ls"], tmp_path / "home"),
        ({"MFSREG_CACHE_DIR": str(tmp_path / "cache")}, ["cache", "stats"], tmp_path / "cache" / "chunks"),
    ):
        proc = mfsreg(*args, env={**env, **extra}, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert str(path) in proc.stderr and "a file is where a directory is needed; move it away" in proc.stderr, (
            proc.stderr
        )


def _model_with(tmp_path, odd: str) -> Path:
    """A model directory with one entry a push cannot store as a file."""
    d = tmp_path / f"model-{odd}"
    d.mkdir()
    (d / "model-a.safetensors").write_bytes(good_file_bytes())
    if odd == "broken-link":
        (d / "model-b.safetensors").symlink_to(tmp_path / "nonexistent")
    elif odd == "link-to-folder":
        (tmp_path / "elsewhere").mkdir()
        (tmp_path / "elsewhere" / "config.json").write_text("{}")
        (d / "extra").symlink_to(tmp_path / "elsewhere")
    elif odd == "pipe":
        os.mkfifo(d / "tokenizer.json")
    return d


@pytest.mark.parametrize(
    "odd,says",
    [("broken-link", "which does not exist"), ("link-to-folder", "a link to a folder"), ("pipe", "not a regular file")],
)
def test_a_model_directory_entry_that_is_no_file_is_refused_not_left_out(odd, says, seeded, tmp_path):
    """A broken link, a link to a folder or a pipe in a model directory: refused, naming it. The
    push passed over them and stored a version without them, exit 0. A link to a file (as in a
    Hugging Face snapshot) is followed, as before."""
    d = _model_with(tmp_path, odd)
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    proc = mfsreg("push", d, "--family", "fam", "--version", "odd", env=seeded, check=False, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert says in proc.stderr and str(d) in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert snapshot(home) == before
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "model.safetensors").symlink_to(d / "model-a.safetensors")
    mfsreg("push", linked, "--family", "fam", "--version", "linked", env=seeded)
    files = [f["path"] for f in json.loads(mfsreg("show", "fam", "linked", "--json", env=seeded).stdout)["files"]]
    assert files == ["model.safetensors"]


@pytest.mark.process
def test_a_model_folder_the_push_may_not_list_is_refused_not_left_out(seeded, tmp_path):
    """A subfolder without read access: refused, naming it (it was left out of the version).
    As root, permissions do not stop reads: the push runs without the capabilities that let root
    past them."""
    d = _model_with(tmp_path, "locked")
    (d / "sub").mkdir()
    (d / "sub" / "config.json").write_text("{}")
    os.chmod(d / "sub", 0)
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    args = ["push", d, "--family", "fam", "--version", "locked"]
    try:
        if os.geteuid() == 0:
            caps = "-dac_override,-dac_read_search,-fowner"
            import subprocess

            from tests.cli_run import MFSREG

            proc = subprocess.run(
                ["setpriv", f"--bounding-set={caps}", f"--inh-caps={caps}", "--", MFSREG, *map(str, args)],
                env=seeded,
                capture_output=True,
                text=True,
                timeout=120,
            )
        else:
            proc = mfsreg(*args, env=seeded, check=False)
    finally:
        os.chmod(d / "sub", 0o755)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "cannot list this folder" in proc.stderr and str(d / "sub") in proc.stderr, proc.stderr
    assert snapshot(home) == before


def test_a_pull_onto_a_pipe_refuses_instead_of_replacing_it(seeded, tmp_path):
    """A pull builds its file under a temp name and renames it into place: over a pipe or a device
    (as root, /dev/full) that put a regular file where it was, exit 0."""
    pipe = tmp_path / "out"
    os.mkfifo(pipe)
    proc = mfsreg("pull", "fam", "base", "-o", pipe, env=seeded, check=False, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "pipe, socket or device" in proc.stderr and str(pipe) in proc.stderr, proc.stderr
    assert pipe.is_fifo()


@pytest.mark.process
@pytest.mark.parametrize(
    "args",
    [
        ["pull", "fam", "base", "-o", ""],
        ["pull", "fam", "base", "--to-dir", " "],
        ["push", "", "--family", "fam", "--version", "cwd"],
    ],
)
def test_an_empty_path_is_refused_not_taken_for_the_current_directory(args, seeded, tmp_path):
    """An empty path (an unset variable in a script) was the current directory: a pull wrote the
    version there, over a file of the same name; a push stored whatever the directory held."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "base.safetensors").write_bytes(b"mine")
    (cwd / "model.safetensors").write_bytes(good_file_bytes())
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    import subprocess

    from tests.cli_run import MFSREG

    proc = subprocess.run([MFSREG, *args], env=seeded, cwd=cwd, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "is empty: give a path" in proc.stderr, proc.stderr
    assert sorted(p.name for p in cwd.iterdir()) == ["base.safetensors", "model.safetensors"]
    assert (cwd / "base.safetensors").read_bytes() == b"mine" and snapshot(home) == before


@pytest.mark.parametrize(
    "url,says",
    [
        ("http://[::1", "cannot be read"),
        ("http://256.1.1.1:80", "cannot be read"),
        ("http://", "names no host"),
        ("http://127.0.0.1:99999", "beyond 65535"),
        ("http://user:secret@127.0.0.1:1", "carries a user name or password"),
    ],
)
def test_a_registry_url_that_cannot_work_is_one_line(url, says, tmp_path):
    """MFSREG_URL that httpx cannot parse was an internal error (exit 1); one with a user name and
    password sent them as Basic credentials, which the server called a malformed token."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(
        MFSREG_URL=url, MFSREG_TOKEN="t", MFSREG_HOME=str(tmp_path / "home"), MFSREG_CACHE_DIR=str(tmp_path / "c")
    )
    for args in (["ls"], ["pull", "fam", "v1", "-o", tmp_path / "o"]):
        proc = mfsreg(*args, env=env, check=False, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert says in proc.stderr and "MFSREG_URL" in proc.stderr and "internal error" not in proc.stderr, proc.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("pattern", ["bad name", "[abc", "fam/x", "x]"])
def test_a_token_family_pattern_that_matches_no_family_is_refused(pattern, seeded):
    """A pattern with characters no family name holds (a space, an unclosed '[') made a token that
    could never be used; it was created and printed, exit 0."""
    listed = mfsreg("token", "list", "--json", env=seeded).stdout
    proc = mfsreg("token", "create", "--scope", "push", "--family", pattern, env=seeded, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "invalid family pattern" in proc.stderr, proc.stderr
    assert mfsreg("token", "list", "--json", env=seeded).stdout == listed
    for good in ("qwen*", "[ab]x?"):
        mfsreg("token", "create", "--family", good, env=seeded)


@pytest.mark.parametrize("description", ["d" * 257, "two\nlines", "bell\x07"])
def test_a_token_description_too_long_or_on_several_lines_is_refused(description, seeded):
    """One of 100,000 characters was cut at 256 quietly, and a newline broke `token list`'s table."""
    listed = mfsreg("token", "list", "--json", env=seeded).stdout
    proc = mfsreg("token", "create", "--description", description, env=seeded, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "give at most 256, on one line, without control characters" in proc.stderr, proc.stderr
    assert mfsreg("token", "list", "--json", env=seeded).stdout == listed
    made = mfsreg_json("token", "create", "--description", "d" * 256, env=seeded)
    assert any(t["description"] == "d" * 256 for t in mfsreg_json("token", "list", "--json", env=seeded)["tokens"]), (
        made
    )


@pytest.mark.parametrize("name", ["MFSREG_DELTA", "MFSREG_ANONYMOUS_READ"])
def test_a_yes_no_setting_of_another_value_is_refused(name, seeded, fam):
    """MFSREG_DELTA=maybe was read as on, MFSREG_ANONYMOUS_READ=maybe as off, without a word."""
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    proc = mfsreg(
        "push", fam["lora-chat"], "--family", "fam", "--version", "chat", env={**seeded, name: "maybe"}, check=False
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert f"{name}='maybe' is not a yes/no setting" in proc.stderr, proc.stderr
    assert snapshot(home) == before


def test_a_command_that_only_reads_leaves_a_missing_blob_directory_missing(seeded, tmp_path):
    """MFSREG_BLOB_URL naming a directory that is not there (mistyped): ls, stats and pull make
    nothing there (each made an empty store, where the next push would quietly start a second
    one); the pull says what is missing and names MFSREG_BLOB_URL. A push makes it."""
    missing = tmp_path / "no-such" / "blobs"
    env = dict(seeded, MFSREG_BLOB_URL=missing.as_uri())
    mfsreg("ls", env=env)
    mfsreg("stats", env=env)
    proc = mfsreg("pull", "fam", "base", "-o", tmp_path / "out", env=env, check=False)
    assert proc.returncode == 5 and "MFSREG_BLOB_URL" in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "no-such").exists() and not (tmp_path / "out").exists()
    mfsreg(
        "push",
        synth.write(tmp_path / "m.safetensors", synth.base_tensors(seed=9)),
        "--family",
        "other",
        "--version",
        "v1",
        env=env,
    )
    assert any(missing.rglob("*.pack"))


def test_a_blob_url_naming_a_file_is_refused(seeded, fam, tmp_path):
    (tmp_path / "a-file").write_text("not a directory\n")
    env = dict(seeded, MFSREG_BLOB_URL=(tmp_path / "a-file").as_uri())
    proc = mfsreg("push", fam["lora-chat"], "--family", "fam", "--version", "chat", env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "which is a file: give a directory" in proc.stderr and "MFSREG_BLOB_URL" in proc.stderr, proc.stderr
    assert (tmp_path / "a-file").read_text() == "not a directory\n"
    assert [v["version"] for v in mfsreg_json("ls", "fam", env=seeded)["versions"]] == ["base"]


@pytest.mark.process
@pytest.mark.parametrize(
    "url, says",
    [
        ("sqlite:///rel/registry.db", "'rel/registry.db', a path relative to the current directory"),
        ("sqlite://", "names no database file"),
        ("sqlite:///:memory:", "names no database file"),
        # options: dropped with a SQLAlchemy warning on stderr, and a "read-only" database made
        (
            "sqlite:////tmp/mfsreg-test-options.db?mode=ro",
            "carries options (mode), which mfsreg does not pass to SQLite",
        ),
    ],
)
def test_a_sqlite_url_without_an_absolute_path_is_refused(url, says, fam, tmp_path):
    """With three slashes SQLAlchemy reads the path as relative to the current directory: each
    directory a command ran from got a registry of its own, quietly; an in-memory database kept
    nothing past the command (a push 'succeeded' and its packs were never listed)."""
    import subprocess

    from tests.cli_run import MFSREG

    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(MFSREG_HOME=str(tmp_path / "home"), MFSREG_DATABASE_URL=url)
    (tmp_path / "cwd").mkdir()
    proc = subprocess.run(
        [MFSREG, "push", str(fam["base"]), "--family", "fam", "--version", "v1"],
        env=env,
        cwd=tmp_path / "cwd",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert says in proc.stderr and "sqlite:////" in proc.stderr and "MFSREG_DATABASE_URL" in proc.stderr, proc.stderr
    assert list((tmp_path / "cwd").iterdir()) == [] and not Path("/tmp/mfsreg-test-options.db").exists()
    assert not (tmp_path / "home" / "blobs").exists() or not any((tmp_path / "home" / "blobs").rglob("*.pack"))


@pytest.mark.parametrize("device", ["mps", "meta", "cpu:1", "gpu", "CPU", "", "cpu ", None, -1, "cuda:99"])
def test_a_device_the_loader_cannot_use_is_refused_before_anything_is_asked(device, tmp_path, monkeypatch):
    """load_tensors and ResidentModel put tensors on the CPU or a CUDA device: "mps" or "meta" got
    CPU tensors, quietly; a name torch does not know, or a CUDA device that is not there, raised
    torch's own error from inside the load. Refused first, with no registry to ask (MFSREG_URL
    names a port nothing listens on)."""
    from mfsreg.registry.client import ResidentModel, load_tensors
    from mfsreg.registry.errors import InvalidRequest

    monkeypatch.setenv("MFSREG_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("MFSREG_CACHE_DIR", str(tmp_path / "cache"))
    for make in (load_tensors, ResidentModel):
        with pytest.raises(InvalidRequest, match=r"^device .*(cpu|cuda|CUDA|CPU)"):
            make("fam", "v1", device=device)
    assert not (tmp_path / "cache").exists()


@pytest.mark.process
def test_ctrl_c_is_one_line_and_exit_130(tmp_path, fam):
    """Ctrl-C exited 130 with nothing on stderr: Typer turns the KeyboardInterrupt into its exit
    code, and the CLI's line for it never ran. Here the command waits on a server that accepts the
    connection and never answers, as a slow one would."""
    import signal
    import socket
    import subprocess
    import time

    from tests.cli_run import MFSREG

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    silent.settimeout(120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    env.update(
        MFSREG_URL=f"http://127.0.0.1:{silent.getsockname()[1]}",
        MFSREG_TOKEN="mfs_x",
        MFSREG_CACHE_DIR=str(tmp_path / "cache"),
        MFSREG_HOME=str(tmp_path / "home"),
    )
    try:
        for args in (["ls"], ["push", fam["base"], "--family", "fam", "--version", "v1"]):
            proc = subprocess.Popen(
                [MFSREG, *map(str, args)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            waiting, _ = silent.accept()  # the command is running, and waits on the server
            time.sleep(0.2)
            proc.send_signal(signal.SIGINT)
            _, err = proc.communicate(timeout=30)
            waiting.close()
            assert proc.returncode == 130 and err.startswith("mfsreg: error: interrupted;") and err.count("\n") == 1, (
                args,
                err,
            )
    finally:
        silent.close()


def test_a_home_or_cache_under_an_unknown_user_is_one_line(tmp_path):
    """~nosuchuser/...: pathlib's RuntimeError reached the user as an internal error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
    for extra, args, name in (
        ({"MFSREG_HOME": "~mfsreg-no-such-user/h"}, ["ls"], "MFSREG_HOME"),
        (
            {
                "MFSREG_CACHE_DIR": "~mfsreg-no-such-user/c",
                "MFSREG_URL": "http://127.0.0.1:9",
                "MFSREG_HOME": str(tmp_path / "home"),
            },
            ["pull", "fam", "v1", "-o", tmp_path / "o"],
            "MFSREG_CACHE_DIR",
        ),
    ):
        proc = mfsreg(*args, env={**env, **extra}, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert (
            f"{name}='~mfsreg-no-such-user/" in proc.stderr and "user name this machine does not have" in proc.stderr
        ), proc.stderr


@pytest.mark.process
def test_a_node_cache_without_room_is_named_not_the_pull_output(tmp_path):
    """A pull writes the node cache and its output: a cache on a full disk read "cannot write
    OUT: ... make room there". Files capped at 1 KiB (ulimit -f) stand in for the full disk."""
    import subprocess
    import sys

    code = (
        "import os, resource, signal, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "from mfsreg.registry.client.cache import NodeCache\n"
        "from mfsreg.registry.format.chunking import chunk_id\n"
        "from mfsreg.registry.errors import StorageError\n"
        "cache = NodeCache(sys.argv[1])\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1024, resource.RLIM_INFINITY))\n"
        "data = os.urandom(5000)\n"
        "try:\n"
        "    cache.put(chunk_id(data), data)\n"
        "except StorageError as exc:\n"
        "    print(exc)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True, text=True, timeout=60)
    said = proc.stdout.strip()
    assert said.startswith(f"the node cache cannot take {tmp_path / 'c' / 'chunks'}") and "File too large" in said, proc
    assert "make room there" in said and "MFSREG_CACHE_MAX" in said, said
    assert not [p for p in (tmp_path / "c" / "chunks").rglob("*") if p.is_file()]  # no temp file left


def test_a_read_only_destination_is_not_told_to_make_room(capsys):
    """EROFS read "make room there" like a full disk."""
    import errno

    from mfsreg.registry.errors import StorageError
    from mfsreg.registry.format.durable import writing

    with pytest.raises(StorageError) as caught:
        with writing(Path("/mnt/ro/out.safetensors")):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
    said = str(caught.value)
    assert "cannot write /mnt/ro/out.safetensors: Read-only file system: that filesystem is mounted read-only" in said
    assert "make room" not in said, said
    # one the CLI meets outside such a write (a folder made on a read-only mount): exit 2, not 1
    import errno as errnos

    from mfsreg.cli.exits import run_guarded

    def make_on_read_only():
        raise OSError(errnos.EROFS, os.strerror(errnos.EROFS), "/mnt/ro/engine")

    with pytest.raises(SystemExit) as exited:
        run_guarded(make_on_read_only)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(
        "mfsreg: error: /mnt/ro/engine: Read-only file system: that filesystem is mounted read-only"
    ), err


SECRET = "s3cr3t-Value-mfsreg"


@pytest.mark.parametrize(
    "url, says",
    [
        (f"s3://AKIAMFSREG:{SECRET}@bucket/p", "AWS_ACCESS_KEY_ID"),
        ("s3://bucket:9000/p", "MFSREG_S3_ENDPOINT_URL"),
        ("s3://../", "not a bucket name"),
        ("s3://", "names no bucket"),
        ("s3:////x", "names no bucket"),
        ("s3://Bad_Bucket/p", "not a bucket name"),
        ("s3://ab/p", "not a bucket name"),
        ("s3://mfsreg-packs/a/../b", "prefix"),
        (f"s3://mfsreg-packs/p?token={SECRET}", "'?' or '#'"),
        (f"s3://mfsreg-packs/p#{SECRET}", "'?' or '#'"),
        (f"https://user:{SECRET}@example.com/p", "s3://bucket/prefix"),
        ("file:///srv/blobs?x=1", "'?' or '#'"),
    ],
)
def test_a_bad_blob_url_is_refused_in_one_line_without_its_secret(url, says, seeded, fam, tmp_path):
    """MFSREG_BLOB_URL that cannot name a store: refused before anything connects, exit 2, one
    line that says what to give instead and never quotes a credential (these exited 5 with
    botocore's words, some with the secret in them, or dropped a query silently)."""
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    env = dict(seeded, MFSREG_BLOB_URL=url, MFSREG_S3_ENDPOINT_URL="http://127.0.0.1:9")
    for args in (
        ["check"],
        ["push", fam["lora-chat"], "--family", "fam", "--version", "chat"],
        ["pull", "fam", "base", "-o", tmp_path / "out"],
        ["serve", "--port", free_port()],
    ):
        proc = mfsreg(*args, env=env, check=False, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert says in proc.stderr and "MFSREG_BLOB_URL" in proc.stderr, (args, proc.stderr)
        assert SECRET not in proc.stderr + proc.stdout and "botocore" not in proc.stderr.lower(), proc.stderr
    assert snapshot(home) == before and not (tmp_path / "out").exists()


@pytest.mark.parametrize("url", ["s3://Bad_Bucket/p", f"s3://AKIAMFSREG:{SECRET}@bucket/p", "file://"])
def test_db_upgrade_runs_whatever_the_blob_url(url, home_env):
    """`mfsreg db upgrade` never opens the blob store: a malformed MFSREG_BLOB_URL (as a migrate job
    may carry, sharing the api's environment) refused it with exit 2; it now upgrades, and a command
    that opens the store still refuses in one line."""
    env = dict(home_env, MFSREG_BLOB_URL=url)
    assert mfsreg_json("db", "upgrade", env=env)["revision"]
    proc = mfsreg("check", env=env, check=False)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "MFSREG_BLOB_URL" in proc.stderr, proc.stderr
    assert SECRET not in proc.stderr


# what reads or changes only the database; the blob store is never opened for them
DATABASE_ONLY = (
    ["ls"],
    ["ls", "fam"],
    ["show", "fam", "base"],
    ["stats"],
    ["stats", "--family", "fam"],
    ["token", "list"],
    ["family", "quorum", "fam", "1"],
    ["db", "upgrade"],
)


def _needs_blobs(fam, out: Path) -> tuple:
    return (
        ["push", fam["lora-chat"], "--family", "fam", "--version", "chat"],
        ["pull", "fam", "base", "-o", out],
        ["check"],
        ["prune", "--min-age", "0"],
    )


@pytest.mark.parametrize(
    "setting, says",
    [
        ({"MFSREG_BLOB_URL": "bogus://x"}, "MFSREG_BLOB_URL is neither a file:///path nor an s3://bucket/prefix URL"),
        ({"MFSREG_BLOB_URL": f"s3://AKIAMFSREG:{SECRET}@bucket/p"}, "MFSREG_BLOB_URL holds credentials"),
        (
            {"MFSREG_BLOB_URL": "s3://mfsreg-packs/p", "MFSREG_S3_ENDPOINT_URL": "not a url"},
            "MFSREG_S3_ENDPOINT_URL='not a url'",
        ),
        (
            {"MFSREG_BLOB_URL": "s3://mfsreg-packs/p", "MFSREG_S3_ENDPOINT_URL": "http://host:notaport"},
            "MFSREG_S3_ENDPOINT_URL='http://host:notaport': has a port that is not a number",
        ),
        (
            {"MFSREG_BLOB_URL": "s3://mfsreg-packs/p", "MFSREG_S3_READ_TIMEOUT": "soon"},
            "MFSREG_S3_READ_TIMEOUT='soon' is not a timeout",
        ),
        (
            {"MFSREG_BLOB_URL": "s3://mfsreg-packs/p", "MFSREG_S3_CONNECT_TIMEOUT": "-1"},
            "MFSREG_S3_CONNECT_TIMEOUT='-1' is not a timeout",
        ),
        (
            {"MFSREG_BLOB_URL": "s3://mfsreg-packs/p", "MFSREG_S3_MAX_ATTEMPTS": "0"},
            "MFSREG_S3_MAX_ATTEMPTS='0' is not a number of attempts",
        ),
    ],
)
def test_database_only_commands_run_whatever_the_blob_store_settings(setting, says, seeded, fam, tmp_path):
    """ls, show, stats, tokens, family quorum and delete never open the blob store: a malformed
    MFSREG_BLOB_URL (or S3 endpoint, or S3 timeout) refused them all with exit 2, so an admin could
    not so much as list tokens. The commands that do need the store still refuse in one line, exit 2, and change
    nothing."""
    home = Path(seeded["MFSREG_HOME"])
    env = dict(seeded, **setting)
    for args in DATABASE_ONLY:
        mfsreg(*args, env=env)
    secret = mfsreg_json("token", "create", "--scope", "admin", env=env)["token"]
    before = snapshot(home)
    for args in _needs_blobs(fam, tmp_path / "out"):
        proc = mfsreg(*args, env=env, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert says in proc.stderr and SECRET not in proc.stderr, (args, proc.stderr)
    assert snapshot(home) == before and not (tmp_path / "out").exists()
    assert mfsreg("token", "revoke", secret[:10], env=env).stdout.startswith("revoked")
    assert mfsreg_json("token", "list", env=env)["tokens"] == []
    assert mfsreg_json("delete", "fam", "base", env=env)["version"] == "base"
    assert mfsreg_json("ls", "fam", env=env)["versions"] == []


def test_a_malformed_s3_timeout_stops_serve_at_start_up_and_a_local_store_ignores_it(seeded, fam, tmp_path):
    """`mfsreg serve` over an S3 store refuses a malformed S3 timeout before it listens (one line,
    exit 2), not on its first request. A local directory store reads no S3 setting (as it reads
    no MFSREG_S3_ENDPOINT_URL), so the embedded default pushes and pulls whatever they hold."""
    home = Path(seeded["MFSREG_HOME"])
    before = snapshot(home)
    proc = mfsreg(
        "serve",
        "--port",
        free_port(),
        check=False,
        timeout=60,
        env=dict(seeded, MFSREG_BLOB_URL="s3://mfsreg-packs/p", MFSREG_S3_READ_TIMEOUT="1 minute"),
    )
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "MFSREG_S3_READ_TIMEOUT='1 minute' is not a timeout" in proc.stderr, proc.stderr
    assert snapshot(home) == before
    env = dict(seeded, MFSREG_S3_READ_TIMEOUT="soon", MFSREG_S3_CONNECT_TIMEOUT="0", MFSREG_S3_MAX_ATTEMPTS="99")
    assert mfsreg_json("push", fam["lora-chat"], "--family", "fam", "--version", "chat", env=env)["new_bytes"] > 0
    mfsreg_json("pull", "fam", "chat", "-o", tmp_path / "out", env=env)
    assert filecmp.cmp(tmp_path / "out", fam["lora-chat"], shallow=False)


def test_database_only_commands_never_contact_an_s3_endpoint(seeded, fam, tmp_path):
    """An S3 endpoint that is down (it takes connections and never answers): the commands that
    read or change only the database run, and not one connection reaches the endpoint; a push,
    which needs it, connects, fails in one line within its timeouts (exit 5) and changes nothing."""
    from tests.test_blobstore_contract import silent_endpoint

    home = Path(seeded["MFSREG_HOME"])
    sock, endpoint = silent_endpoint()
    try:
        sock.settimeout(0)
        env = dict(
            seeded,
            MFSREG_BLOB_URL="s3://mfsreg-packs/p",
            MFSREG_S3_ENDPOINT_URL=endpoint,
            MFSREG_S3_READ_TIMEOUT="1",
            MFSREG_S3_MAX_ATTEMPTS="1",
            AWS_ACCESS_KEY_ID="testing",
            AWS_SECRET_ACCESS_KEY="testing",
            AWS_EC2_METADATA_DISABLED="true",
        )
        for args in (*DATABASE_ONLY, ["token", "create"]):
            mfsreg(*args, env=env, timeout=60)
        with pytest.raises(BlockingIOError):  # nobody knocked
            sock.accept()
        before = snapshot(home)
        proc = mfsreg(
            "push", fam["lora-chat"], "--family", "fam", "--version", "chat", env=env, check=False, timeout=60
        )
        assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
        assert endpoint in proc.stderr and "did not answer" in proc.stderr, proc.stderr
        sock.accept()[0].close()  # the push did: the check above can fail
        assert snapshot(home) == before
    finally:
        sock.close()


def test_a_good_s3_blob_url_with_a_trailing_slash_is_taken(s3_blob_url, tmp_path):
    from mfsreg.registry.blobs.stores import open_blob_store

    blob_url, endpoint = s3_blob_url
    store = open_blob_store(blob_url + "/", endpoint)
    store.put("k", b"x")
    assert open_blob_store(blob_url, endpoint).get("k") == b"x"


@pytest.mark.parametrize(
    "variable, endpoint, says",
    [
        ("MFSREG_S3_ENDPOINT_URL", "not a url", "is not an http:// or https:// URL"),
        ("MFSREG_S3_ENDPOINT_URL", "localhost:9000", "is not an http:// or https:// URL"),
        ("MFSREG_S3_ENDPOINT_URL", "ftp://x", "is not an http:// or https:// URL"),
        ("MFSREG_S3_ENDPOINT_URL", "http://", "names no host"),
        ("MFSREG_S3_ENDPOINT_URL", "http://my host:9000", "holds a space"),
        ("MFSREG_S3_ENDPOINT_URL", "http://-minio-:9000", "not a host name or address"),
        ("MFSREG_S3_ENDPOINT_URL", "http://host:notaport", "port"),
        ("MFSREG_S3_ENDPOINT_URL", "http://127.0.0.1:99999", "port"),
        ("MFSREG_S3_ENDPOINT_URL", f"http://minio:{SECRET}@127.0.0.1:9000", "credentials"),
        ("MFSREG_S3_ENDPOINT_URL", f"http://127.0.0.1:9000/?token={SECRET}", "'?' or '#'"),
        ("AWS_ENDPOINT_URL_S3", "ftp://x", "is not an http:// or https:// URL"),
    ],
)
def test_a_malformed_s3_endpoint_is_refused_before_a_new_home_is_made(
    variable, endpoint, says, home_env, fam, tmp_path
):
    """A malformed S3 endpoint was refused (by botocore) only once the database was open, so on a
    new MFSREG_HOME push, pull, check, prune and serve made an empty registry.db before they failed;
    some (ftp://x, http://host:notaport) were not refused at all, and each S3 request then failed
    with exit 5. Each now refuses in one line (exit 2), naming the variable and the URL to give,
    before anything is made; a local directory store still reads no endpoint."""
    home = Path(home_env["MFSREG_HOME"])
    env = dict(
        home_env,
        MFSREG_BLOB_URL="s3://mfsreg-packs/p",
        AWS_ACCESS_KEY_ID="testing",
        AWS_SECRET_ACCESS_KEY="testing",
        AWS_EC2_METADATA_DISABLED="true",
        **{variable: endpoint},
    )
    for args in (*_needs_blobs(fam, tmp_path / "out"), ["serve", "--port", free_port()]):
        proc = mfsreg(*args, env=env, check=False, timeout=60)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert proc.stderr.startswith(f"mfsreg: error: {variable}") and says in proc.stderr, (args, proc.stderr)
        assert "e.g. http://127.0.0.1:9000" in proc.stderr and "Traceback" not in proc.stderr, (args, proc.stderr)
        assert SECRET not in proc.stderr + proc.stdout and "botocore" not in proc.stderr.lower(), proc.stderr
        assert not home.exists(), (args, sorted(p.name for p in home.iterdir()))
    assert not (tmp_path / "out").exists()
    local = {k: v for k, v in env.items() if k != "MFSREG_BLOB_URL"}  # the embedded default: a local directory
    assert mfsreg_json("push", fam["lora-chat"], "--family", "fam", "--version", "chat", env=local)["new_bytes"] > 0
