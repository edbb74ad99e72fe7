"""The installed console script as a process: its entry point, its exit, and `serve` with workers.

Everything else runs the CLI in process (tests/cli_run.py); these are about the process itself."""

from __future__ import annotations

import filecmp
import json
import signal
import subprocess
import sys
import time

import httpx
import pytest

import mfsreg
from mfsreg.registry.auth import create_token
from mfsreg.registry.config import Settings
from mfsreg.registry.registry import Registry
from tests.cli_run import MFSREG, mfsreg_json
from tests.server import counter, free_port

pytestmark = pytest.mark.process


def run(*args, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([*args], env=env, capture_output=True, text=True, timeout=120)


def test_the_entry_point_and_python_m_print_the_version(home_env):
    for cmd in ([MFSREG, "--version"], [sys.executable, "-m", "mfsreg", "--version"]):
        proc = run(*cmd, env=home_env)
        assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"mfsreg {mfsreg.__version__}\n", ""), cmd


def test_the_quick_exit_keeps_the_exit_code_and_every_byte_of_output(home_env, fam):
    """The console script leaves through os._exit once the command is done: what it printed into a
    pipe must all arrive, and a failure keep its code and its one line."""
    settings = Settings.from_env(home_env)
    with Registry(settings) as reg:
        reg.push(fam["base"], "fam", "v0")
        for i in range(1, 100):  # the same bytes again: each push only records a version
            reg.push(fam["base"], "fam", f"v{i}", parent="v0")
    proc = run(MFSREG, "ls", "fam", "--json", env=home_env)
    assert proc.returncode == 0, proc.stderr
    assert len(proc.stdout) > 12 << 10  # more than Python's buffer of a pipe (8 KiB)
    assert [v["version"] for v in json.loads(proc.stdout)["versions"]] == [f"v{i}" for i in range(100)]
    proc = run(MFSREG, "show", "fam", "no-such-version", env=home_env)
    assert proc.returncode == 2 and proc.stdout == "" and proc.stderr.count("\n") == 1, proc.stderr
    assert "no-such-version" in proc.stderr


def test_serve_with_two_workers_takes_a_push_and_a_pull_and_stops_on_sigterm(home_env, fam, tmp_path):
    port = free_port()
    server = subprocess.Popen(
        [MFSREG, "serve", "--host", "127.0.0.1", "--port", str(port), "--workers", "2", "--log-format", "json"],
        env=home_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, server.stdout.read()
            try:
                if httpx.get(url + "/healthz", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "mfsreg serve --workers 2 did not answer within 60 s"
            time.sleep(0.1)
        with Registry(Settings.from_env(home_env, blobs=False)) as reg:
            tok = create_token(reg.engine, "push")
        client = dict(home_env, MFSREG_URL=url, MFSREG_TOKEN=tok, MFSREG_CACHE_DIR=str(tmp_path / "cache"))
        pushed = mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=client)
        # several requests in a row: each may land on either worker, both serve the same registry
        for i in range(4):
            got = mfsreg_json("pull", "fam", "base", "-o", tmp_path / f"base{i}.out", env=client)
            assert got["digest"] == pushed["digest"]
            assert filecmp.cmp(tmp_path / f"base{i}.out", fam["base"], shallow=False)
        # /metrics adds up both workers' samples: every read, on either worker, gives the same totals
        commit = "/v1/families/{family}/versions/{version}/commit"
        for _ in range(6):
            assert counter(url, "mfsreg_pushes", outcome="created") == 1
            assert counter(url, "mfsreg_chunks", outcome="stored") == pushed["new_chunks"]
            assert counter(url, "mfsreg_http_requests", route=commit, status="201") == 1
            assert counter(url, "mfsreg_http_request_duration_seconds", route=commit) == 1
            assert counter(url, "mfsreg_pulls", kind="version_document") >= 4
        seen = httpx.get(
            f"{url}/v1/families/fam/versions/base",
            headers={"Authorization": f"Bearer {tok}", "X-Request-ID": "trace-me-1"},
        )
        assert seen.headers["x-request-id"] == "trace-me-1"
    finally:
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=60)
    assert server.returncode == 0, out
    assert "Traceback" not in out, out
    # --log-format json: every line one object; the access line carries what the client saw
    lines = [json.loads(line) for line in out.splitlines() if line.strip()]
    (line,) = [x for x in lines if x.get("request_id") == "trace-me-1"]
    assert (line["status"], line["family"], line["route"]) == (200, "fam", "/v1/families/{family}/versions/{version}")
    assert tok.startswith(line["token"]) and line["duration_ms"] >= 0 and line["bytes_out"] > 0
