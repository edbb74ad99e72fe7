"""The `mfsreg` command as scripts and CI use it: --json output of every command."""

from __future__ import annotations

import filecmp

import pytest

from tests.cli_run import mfsreg, mfsreg_json


def test_json_contract(home_env, fam, tmp_path):
    push = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=home_env)
    assert {"family", "version", "digest", "logical_bytes", "new_bytes"} <= set(push)
    assert push["logical_bytes"] == fam["base"].stat().st_size and push["new_bytes"] > 0
    assert push["digest"].startswith("sha256:")
    child = mfsreg_json(
        "push", fam["lora-chat"], "--family", "fam", "--version", "chat", "--parent", "base", env=home_env
    )
    assert 0 < child["new_bytes"] < push["new_bytes"]

    pulled = mfsreg_json("pull", "fam", "chat", "-o", tmp_path / "chat.safetensors", env=home_env)
    assert pulled["digest"] == child["digest"]
    assert filecmp.cmp(tmp_path / "chat.safetensors", fam["lora-chat"], shallow=False)

    ls = mfsreg_json("ls", env=home_env)
    assert ls["families"] == [{"family": "fam", "versions": 2, "base_quorum": 1.0, "chunk_size": 64 << 10}]
    versions = mfsreg_json("ls", "fam", env=home_env)["versions"]
    assert [(v["version"], v["parent"]) for v in versions] == [("base", None), ("chat", "base")]

    show = mfsreg_json("show", "fam", "chat", env=home_env)
    assert show["parent"] == "base" and show["files"][0]["tensors"] > 0 and show["digest"] == child["digest"]

    stats = mfsreg_json("stats", env=home_env)
    assert {"logical_bytes", "stored_bytes", "sharing_ratio", "tiers", "versions"} <= set(stats)
    assert set(stats["tiers"]) == {"base", "group", "unique"}
    assert all(set(t) >= {"chunks", "bytes"} for t in stats["tiers"].values())
    assert {"family", "version", "logical_bytes", "unique_bytes"} <= set(stats["versions"][0])
    assert stats["logical_bytes"] == push["logical_bytes"] + child["logical_bytes"]
    assert stats["stored_bytes"] == push["new_bytes"] + child["new_bytes"]
    assert stats["sharing_ratio"] > 1.0
    fam_stats = mfsreg_json("stats", "--family", "fam", env=home_env)
    assert fam_stats["stored_bytes"] == stats["stored_bytes"]

    quorum = mfsreg_json("family", "quorum", "fam", "0.5", env=home_env)
    assert quorum["tier_changes"] > 0
    assert mfsreg_json("stats", env=home_env)["tiers"]["group"]["chunks"] == 0

    deleted = mfsreg_json("delete", "fam", "chat", env=home_env)
    assert deleted["version"] == "chat"
    assert [v["version"] for v in mfsreg_json("ls", "fam", env=home_env)["versions"]] == ["base"]


def test_human_output_and_db_upgrade(home_env, fam, tmp_path):
    up = mfsreg("db", "upgrade", env=home_env)
    assert "revision" in up.stdout
    out = mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", env=home_env).stdout
    assert "pushed fam/v1" in out
    again = mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", env=home_env).stdout
    assert "already stored" in again
    assert "sharing ratio" in mfsreg("stats", env=home_env).stdout
    assert "v1" in mfsreg("ls", "fam", env=home_env).stdout


def test_pushing_a_version_whose_pack_was_lost_again_says_what_it_mended(home_env, fam, tmp_path):
    """A pack deleted from MFSREG_HOME's blob store by hand: the version's pull exits 5; pushing its
    file again under its own name (what `mfsreg check` says to do) exits 0, says how many chunks it
    stored again, the version pulls byte for byte and check finds all whole; a re-push with nothing
    lost mends nothing."""
    from pathlib import Path

    mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", env=home_env)
    for pack in (Path(home_env["MFSREG_HOME"]) / "blobs" / "packs").rglob("*.pack"):
        pack.unlink()
    assert mfsreg("pull", "fam", "v1", "-o", tmp_path / "broken", env=home_env, check=False).returncode == 5
    told = mfsreg("check", env=home_env, check=False)
    assert told.returncode == 4 and "push each listed version's file again" in told.stdout, told.stdout
    out = mfsreg("push", fam["base"], "--family", "fam", "--version", "v1", env=home_env).stdout
    assert out.startswith("already stored fam/v1") and "; mended " in out and "stored)" in out, out
    mfsreg("pull", "fam", "v1", "-o", tmp_path / "v1.out", env=home_env)
    assert mfsreg("check", env=home_env).returncode == 0  # what check said to do, done
    assert filecmp.cmp(tmp_path / "v1.out", fam["base"], shallow=False)
    again = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "v1", env=home_env)
    assert again["existed"] and again["mended_chunks"] == 0 and again["new_bytes"] == 0, again


def test_tables_show_whole_names_and_one_familys_stats_leave_out_the_family_column(home_env, fam):
    """(`stats --verbose`'s versions table.) On an 80-column terminal the registry-wide versions table cut 'lastlayers-code' to
    'lastlayers-…'; a name is folded instead, and stats --family drops the column every row repeats."""
    env = dict(home_env, COLUMNS="80")
    long_name = "lastlayers-code"
    mfsreg("push", fam["base"], "--family", "demo-llm", "--version", "base", env=env)
    mfsreg("push", fam["lora-chat"], "--family", "demo-llm", "--version", long_name, env=env)

    def rows(out: str) -> list[list[str]]:
        """The versions table's rows, a folded row's lines joined again (a line whose first cell is
        empty continues the row above)."""
        joined = []
        for line in out.split("versions")[-1].splitlines():
            if line.startswith("│"):
                cells = [c.strip() for c in line.split("│")[1:-1]]
                if cells[0] or not joined:
                    joined.append(cells)
                else:
                    joined[-1] = [a + b for a, b in zip(joined[-1], cells)]
        return joined

    everything = mfsreg("stats", "--verbose", env=env).stdout
    assert [r[:2] for r in rows(everything)] == [["demo-llm", "base"], ["demo-llm", long_name]], everything
    assert "…" not in everything, everything
    one = mfsreg("stats", "--family", "demo-llm", "--verbose", env=env).stdout
    assert "family" not in one.split("versions")[-1] and "…" not in one, one
    assert [r[0] for r in rows(one)] == ["base", long_name], one
    narrow = mfsreg("stats", "--family", "demo-llm", env=dict(env, COLUMNS="40")).stdout
    assert "…" not in narrow and "-code" in narrow, narrow  # every cell folded, none cut


def test_bad_option_values_are_one_line(home_env, fam):
    for value in ("2.0", "-0.1", "-1e-3"):  # a negative one was read as an unknown option: 'No such option: -0'
        proc = mfsreg("family", "quorum", "nofam", value, env=home_env, check=False)
        assert proc.returncode == 2 and f"base_quorum {float(value)} is out of range" in proc.stderr, proc.stderr
    proc = mfsreg("family", "quorum", "nofam", "--", "-0.5", env=home_env, check=False)  # after '--' too
    assert proc.returncode == 2 and "base_quorum -0.5 is out of range" in proc.stderr, proc.stderr
    # and an unknown option, wherever it stands, is named as one (it read "Invalid value for 'value'")
    # alone, or with an argument missing, it is named too (it read "Missing argument 'VALUE'")
    for args, says in (
        (["--bogus"], "No such option: --bogus"),
        (["nofam", "-x"], "No such option: -x"),
        (["--bogus", "nofam", "0.5"], "No such option: --bogus"),
        (["nofam", "--bogus", "0.5"], "No such option: --bogus"),
        (["nofam", "0.5", "7"], "unexpected extra argument(s) (7)"),
        (["nofam", "half"], "'half' is not a number: give a fraction in (0, 1]"),
        (["nofam", "--bogus=3", "0.5"], "No such option: --bogus (see"),
    ):
        proc = mfsreg("family", "quorum", *args, env=home_env, check=False)
        assert proc.returncode == 2 and says in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    env = dict(home_env, MFSREG_CHUNK_SIZE="lots")
    proc = mfsreg("push", fam["base"], "--family", "f", "--version", "v", env=env, check=False)
    assert proc.returncode == 2 and "MFSREG_CHUNK_SIZE" in proc.stderr and "Traceback" not in proc.stderr
    env = dict(home_env, MFSREG_DATABASE_URL="postgresql+psycopg://nobody@127.0.0.1:1/none")
    proc = mfsreg("ls", env=env, check=False)
    assert proc.returncode == 5 and "database" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_database_commands_refuse_to_run_while_mfsreg_url_names_a_server(home_env, fam):
    """`family quorum`, `token ...` and `db upgrade` act on a database, never through a server: with
    MFSREG_URL set they changed (or created) a local registry the user did not mean to touch."""
    from pathlib import Path

    mfsreg("push", fam["base"], "--family", "fam", "--version", "base", env=home_env)
    home = Path(home_env["MFSREG_HOME"])
    before = (home / "registry.db").read_bytes()
    env = dict(home_env, MFSREG_URL="http://127.0.0.1:9")  # never reached
    for args in (
        ["family", "quorum", "fam", "0.5"],
        ["token", "create", "--scope", "read"],
        ["token", "list"],
        ["token", "revoke", "abc"],
        ["db", "upgrade"],
    ):
        proc = mfsreg(*args, env=env, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert f"`mfsreg {' '.join(args[:2])}` acts on the registry's database directly" in proc.stderr, proc.stderr
        assert "MFSREG_URL" in proc.stderr
    assert (home / "registry.db").read_bytes() == before
    assert mfsreg_json("family", "quorum", "fam", "0.5", env=home_env)["base_quorum"] == 0.5  # without it, as before


def test_serve_options_are_checked_before_it_starts(home_env):
    """A port out of range, no workers, an unknown log level, a port in use: one line, exit 2, where
    uvicorn printed a traceback or a screen of log lines and exited 3 (this CLI's code for auth)."""
    import socket

    taken = socket.create_server(("127.0.0.1", 0))
    try:
        port = taken.getsockname()[1]
        for args, says in (
            (["--port", "-1"], "give a port from 1 to 65535"),
            (["--port", "99999"], "from 1 to 65535"),
            (["--workers", "0"], "1 or more worker"),
            (["--log-level", "bogus"], "use one of"),
            (["--port", str(port)], "cannot listen on 127.0.0.1"),
            (["--host", "no such host.invalid"], "cannot listen on no such host.invalid"),
            (["--host", ""], "--host '' names no address"),
            (["--host", " "], "--host ' ' names no address"),
        ):
            proc = mfsreg("serve", *args, env=home_env, check=False, timeout=60)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
            assert says in proc.stderr, (args, proc.stderr)
    finally:
        taken.close()


def test_usage_errors_are_one_line_and_bare_groups_print_their_help(home_env):
    """A missing argument, a value of the wrong type, an unknown command or option: one line naming
    the help to read, exit 2 (they were a five-line box). `mfsreg` and `mfsreg cache` alone print
    their help, as before."""
    for args, says in (
        (["push"], "Missing argument 'path'. (see `mfsreg push --help`)"),
        (["prune", "--max-unused", "abc"], "Invalid value for '--max-unused'"),
        (["bogus"], "No such command 'bogus'."),
        (["ls", "--no-such-option"], "No such option: --no-such-option"),
        (["cache", "warm"], "Missing argument 'family'. (see `mfsreg cache warm --help`)"),
    ):
        proc = mfsreg(*args, env=home_env, check=False)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, (args, proc.stderr)
        assert proc.stderr.startswith("mfsreg: error: ") and says in proc.stderr, (args, proc.stderr)
    for args in ([], ["cache"]):
        proc = mfsreg(*args, env=home_env, check=False)
        assert proc.returncode == 2 and "Usage: mfsreg" in proc.stdout and proc.stderr == "", (args, proc.stderr)
    assert "Usage: mfsreg push" in mfsreg("push", "--help", env=home_env).stdout


def test_each_command_is_listed_in_one_line(home_env):
    """In every group's list of commands, each command's summary is one line on a wide terminal:
    the list showed a docstring's first paragraph with its source line breaks (prune's, cache
    prune's and cache verify's ran over three lines, cut mid-sentence)."""
    env = dict(home_env, COLUMNS="200")
    for group in ([], ["cache"], ["token"], ["db"], ["family"]):
        out = mfsreg(*group, "--help", env=env).stdout
        box = out[out.index("─ Commands") :].splitlines()[1:]
        rows = [line for line in box[: next(i for i, line in enumerate(box) if line.startswith("╰"))]]
        assert rows and all(line[2] != " " for line in rows), (group, rows)  # no continuation lines


def test_a_token_or_endpoint_no_request_can_carry_is_one_line(home_env, fam):
    """MFSREG_TOKEN with a letter beyond ASCII or a newline (a bad copy) and an S3 endpoint that is
    not a URL: one line saying which, where they were an internal UnicodeEncodeError, an
    'unreachable server' or an internal ValueError."""
    for bad in ("mfs_ä", "mfs_abc\nmore", "mfs_abc def"):
        proc = mfsreg("ls", env=dict(home_env, MFSREG_URL="http://127.0.0.1:9", MFSREG_TOKEN=bad), check=False)
        assert proc.returncode == 3 and proc.stderr.count("\n") == 1, (bad, proc.stderr)
        assert "MFSREG_TOKEN holds characters no token has" in proc.stderr, proc.stderr
    env = dict(home_env, MFSREG_BLOB_URL="s3://bucket/prefix", MFSREG_S3_ENDPOINT_URL="not a url")
    proc = mfsreg("check", env=env, check=False)  # ls would not open the blob store
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert "MFSREG_S3_ENDPOINT_URL='not a url'" in proc.stderr and "internal error" not in proc.stderr, proc.stderr


def test_embedded_pull_to_dir_writes_the_files_and_makes_nothing_when_it_fails(home_env, fam, tmp_path):
    """Embedded `pull --to-dir` made the directory (and its parents) before it looked the version
    up, and left them behind when it failed; it had no test of its own."""
    mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=home_env)
    res = mfsreg_json("pull", "fam", "base", "--to-dir", tmp_path / "engine" / "a", env=home_env)
    [written] = list((tmp_path / "engine" / "a").iterdir())
    assert res["path"] == str(written) and written.name == fam["base"].name  # as through a server (test_node)
    assert filecmp.cmp(written, fam["base"], shallow=False)
    for missing in (["nofam", "base"], ["fam", "nover"]):
        proc = mfsreg("pull", *missing, "--to-dir", tmp_path / "new" / "a" / "b", env=home_env, check=False)
        assert proc.returncode == 2 and "does not exist" in proc.stderr, proc.stderr
        assert not (tmp_path / "new").exists()


def test_a_pull_from_an_s3_endpoint_gone_silent_fails_in_one_line_within_its_timeouts(
    home_env, fam, s3_blob_url, tmp_path
):
    """Packs in S3, then the endpoint stops answering (it takes connections and says nothing): the
    pull stops after MFSREG_S3_MAX_ATTEMPTS x MFSREG_S3_READ_TIMEOUT with one line (exit 5) naming
    the endpoint, and writes nothing; it sat silent for about six minutes."""
    import time

    from tests.test_blobstore_contract import silent_endpoint

    blob_url, endpoint = s3_blob_url
    env = dict(home_env, MFSREG_BLOB_URL=blob_url, MFSREG_S3_ENDPOINT_URL=endpoint)
    mfsreg_json("push", fam["lora-chat"], "--family", "fam", "--version", "chat", env=env)
    sock, silent = silent_endpoint()
    try:
        t0 = time.monotonic()
        proc = mfsreg(
            "pull",
            "fam",
            "chat",
            "-o",
            tmp_path / "out",
            check=False,
            timeout=120,
            env=dict(env, MFSREG_S3_ENDPOINT_URL=silent, MFSREG_S3_READ_TIMEOUT="1", MFSREG_S3_MAX_ATTEMPTS="2"),
        )
        took = time.monotonic() - t0
    finally:
        sock.close()
    assert proc.returncode == 5 and proc.stderr.count("\n") == 1, proc.stderr
    assert silent in proc.stderr and "did not answer" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert took < 30 and not (tmp_path / "out").exists()


def test_an_error_a_signal_leaves_while_the_command_unwinds_is_reported_as_the_signal(capsys):
    """SIGHUP raised KeyboardInterrupt inside a Condition.wait of a pull, which left its lock
    released, and the `with` around it failed with "RuntimeError: release unlocked lock": the
    command said "internal error" and exited 1. A command a signal stopped says so, 128 + signal."""
    import os
    import signal
    import time

    from mfsreg.cli import exits as errors

    def command():
        try:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(5)  # the handler's KeyboardInterrupt arrives here
        except KeyboardInterrupt:
            raise RuntimeError("release unlocked lock") from None
        raise AssertionError("the signal did not arrive")

    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        with pytest.raises(SystemExit) as stopped:
            errors.run_guarded(command)
    finally:
        for s, handler in saved.items():
            signal.signal(s, handler)
        errors._signalled.clear()
    err = capsys.readouterr().err
    assert stopped.value.code == 128 + signal.SIGHUP, err
    assert err.count("\n") == 1 and "stopped by SIGHUP; nothing partial was committed" in err, err
