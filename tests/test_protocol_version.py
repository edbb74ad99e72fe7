"""The protocol version every /v1/ request and answer carries (registry/protocol.py, api/versioning.py):
this server answers its own and the one before; another is refused in one line that says which side
to upgrade, before the token is looked at or anything is read or stored."""

from __future__ import annotations

import httpx
import pytest

from mfsreg.registry import protocol
from tests import synth
from tests.server import Server, embedded_server_env, token


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    where = tmp_path_factory.mktemp("protocol")
    env = embedded_server_env(where / "home")
    srv = Server(env, where / "server.log")
    try:
        yield dict(srv=srv, env=env, where=where, push=token(env, "push", "*"))
    finally:
        srv.stop()


def _get(site, path: str, version: str | list[str] | None, tok: str | None = "push") -> httpx.Response:
    headers = [("Authorization", f"Bearer {site[tok]}")] if tok else []
    for v in [version] if isinstance(version, str) else version or []:
        headers.append((protocol.HEADER, v))
    return httpx.get(site["srv"].url + path, headers=headers, timeout=30)


def test_the_client_speaks_the_current_version_and_the_server_says_its_own(site):
    from mfsreg.registry.client.remote import RemoteRegistry

    path = synth.write(site["where"] / "m.safetensors", synth.base_tensors())
    with RemoteRegistry(site["srv"].url, token=site["push"]) as reg:
        assert reg.http.headers[protocol.HEADER] == str(protocol.CURRENT)
        reg.push(path, "fam", "v1")
        assert [v.name for v in reg.versions("fam")] == ["v1"]
    answer = _get(site, "/v1/families", str(protocol.CURRENT))
    assert answer.status_code == 200 and answer.headers[protocol.HEADER] == str(protocol.CURRENT)


def test_a_request_without_the_header_is_the_previous_version_and_answered(site):
    assert protocol.OLDEST == protocol.CURRENT - 1 == 1
    answer = _get(site, "/v1/families", None)
    assert answer.status_code == 200 and answer.headers[protocol.HEADER] == str(protocol.CURRENT)
    assert _get(site, "/v1/families", str(protocol.OLDEST)).status_code == 200


@pytest.mark.parametrize(
    ("sent", "said"),
    [
        (str(protocol.CURRENT + 1), f"upgrade the server to a release that speaks {protocol.CURRENT + 1}"),
        ("0", f"upgrade the client to release {protocol.RELEASE[protocol.OLDEST]} or later"),
        ("two", "is not a protocol version"),
        ("", "is not a protocol version"),
        ("99999", "is not a protocol version"),
        ([str(protocol.CURRENT)] * 2, "send one"),
    ],
)
def test_another_version_is_refused_in_one_line_before_the_token(site, sent, said):
    for tok in ("push", None):  # no token: still the version's refusal, not a 401
        answer = _get(site, "/v1/families", sent, tok)
        assert answer.status_code == 400, answer.text
        detail = answer.json()["detail"]
        assert said in detail and "\n" not in detail
        assert answer.headers[protocol.HEADER] == str(protocol.CURRENT)


def test_a_refused_push_stores_nothing(site):
    """A client of a newer protocol pushing a whole model: refused at its first request, and no
    family, version, chunk or pack appears."""
    from mfsreg.registry.client.remote import RemoteRegistry
    from mfsreg.registry.errors import InvalidRequest

    packs = site["where"] / "home" / "blobs"
    path = synth.write(site["where"] / "new.safetensors", synth.base_tensors(seed=5))
    with RemoteRegistry(site["srv"].url, token=site["push"]) as reg:
        reg.push(synth.write(site["where"] / "ok.safetensors", synth.base_tensors(seed=6)), "okfam", "v1")
    before = sorted(p.name for p in packs.rglob("*") if p.is_file())
    assert before  # the listing sees the packs a push writes
    with RemoteRegistry(site["srv"].url, token=site["push"]) as reg:
        reg.http.headers[protocol.HEADER] = str(protocol.CURRENT + 1)
        with pytest.raises(InvalidRequest, match="upgrade the server"):
            reg.push(path, "newfam", "v1")
    with RemoteRegistry(site["srv"].url, token=site["push"]) as reg:
        assert "newfam" not in [f.name for f in reg.families()]
    assert sorted(p.name for p in packs.rglob("*") if p.is_file()) == before


def test_routes_outside_v1_take_no_version(site):
    for path in ("/healthz", "/ui/login"):
        answer = _get(site, path, "bogus", None)
        assert answer.status_code == 200 and protocol.HEADER not in answer.headers
