"""/metrics (api/metrics.py) on a server in this process: what a push and a pull count, and the
token that guards the route. Counters are process-wide here: each check reads a difference."""

from __future__ import annotations

import httpx

from tests.cli_run import mfsreg_json
from tests.server import Server, client_env, counter, embedded_server_env, token


def test_a_push_and_a_pull_are_counted(fam, tmp_path):
    env = embedded_server_env(tmp_path / "server")
    srv = Server(env, tmp_path / "server.log")
    try:
        url, commit = srv.url, "/v1/families/{family}/versions/{version}/commit"
        upload = "/v1/families/{family}/chunks"
        seen = {
            "created": counter(url, "mfsreg_pushes", outcome="created"),
            "stored": counter(url, "mfsreg_chunks", outcome="stored"),
            "reused": counter(url, "mfsreg_chunks", outcome="reused"),
            "commits": counter(url, "mfsreg_http_requests", route=commit, method="POST", status="201"),
            "uploaded": counter(url, "mfsreg_http_received_bytes", route=upload),
            "sent": counter(url, "mfsreg_http_sent_bytes", route="/v1/families/{family}/chunks/download"),
            "docs": counter(url, "mfsreg_pulls", kind="version_document"),
            "unmatched": counter(url, "mfsreg_http_requests", route="unmatched", status="404"),
        }
        client = client_env(tmp_path, url, token(env, "push"))
        base = mfsreg_json("push", fam["base"], "-f", "m", "-v", "base", env=client)
        chat = mfsreg_json("push", fam["lora-chat"], "-f", "m", "-v", "chat", "--parent", "base", env=client)
        pulled = mfsreg_json("pull", "m", "chat", "-o", tmp_path / "chat.out", env=client)
        httpx.get(f"{url}/no/such/route/at/all")

        def grew(key: str, name: str, **labels) -> float:
            return counter(url, name, **labels) - seen[key]

        assert grew("created", "mfsreg_pushes", outcome="created") == 2
        assert grew("commits", "mfsreg_http_requests", route=commit, method="POST", status="201") == 2
        assert grew("stored", "mfsreg_chunks", outcome="stored") == base["new_chunks"] + chat["new_chunks"]
        assert grew("reused", "mfsreg_chunks", outcome="reused") == chat["reused_chunks"] > 0
        assert (
            grew("uploaded", "mfsreg_http_received_bytes", route=upload) >= base["sent_bytes"] + chat["sent_bytes"] > 0
        )
        assert (
            grew("sent", "mfsreg_http_sent_bytes", route="/v1/families/{family}/chunks/download")
            >= pulled["fetched_bytes"]
            > 0
        )
        assert grew("docs", "mfsreg_pulls", kind="version_document") >= 1
        assert grew("unmatched", "mfsreg_http_requests", route="unmatched", status="404") == 1
    finally:
        srv.stop()


def test_the_metrics_token_guards_the_route(tmp_path):
    env = embedded_server_env(tmp_path / "server", MFSREG_METRICS_TOKEN="scrape-me")
    srv = Server(env, tmp_path / "server.log")
    try:
        refused = httpx.get(f"{srv.url}/metrics")
        assert refused.status_code == 401 and "mfsreg_" not in refused.text
        assert httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer wrong"}).status_code == 401
        ok = httpx.get(f"{srv.url}/metrics", headers={"Authorization": "Bearer scrape-me"})
        assert ok.status_code == 200 and "mfsreg_http_requests_total" in ok.text
    finally:
        srv.stop()


def test_each_request_gets_an_access_line_with_its_id(tmp_path):
    import io
    import json
    import logging

    from mfsreg.api.logs import JsonFormatter

    env = embedded_server_env(tmp_path / "server")
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JsonFormatter())
    access = logging.getLogger("mfsreg.access")
    access.addHandler(handler)
    old = access.level
    access.setLevel(logging.INFO)
    srv = Server(env, tmp_path / "server.log")
    try:
        tok = token(env, "read", "fam*")
        got = httpx.get(
            f"{srv.url}/v1/families/fam", headers={"Authorization": f"Bearer {tok}", "X-Request-ID": "r-42"}
        )
        assert got.status_code == 404
        hub = httpx.get(f"{srv.url}/fam/v1/resolve/main/config.json", headers={"Authorization": f"Bearer {tok}"})
        assert hub.status_code == 404
    finally:
        srv.stop()
        access.removeHandler(handler)
        access.setLevel(old)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    (line,) = [x for x in lines if x["request_id"] == "r-42"]
    assert (line["status"], line["family"], line["route"], line["method"]) == (
        404,
        "fam",
        "/v1/families/{family}",
        "GET",
    )
    assert tok.startswith(line["token"]) and line["level"] == "info" and line["time"].endswith("Z")
    (hub_line,) = [x for x in lines if x["request_id"] == hub.headers["x-request-id"]]
    assert tok.startswith(hub_line["token"]) and hub_line["family"] == "fam"  # a Hub route names its token too
