"""The API fuzzed from its own OpenAPI document (schemathesis): every operation, with requests drawn
from the document and from outside it, with an admin token and without one. No answer is a server
error, and every answer is one the document names, in the form it gives.

Bounded per operation (EXAMPLES), on one server for the module: Postgres and moto's S3 server, uvicorn
in a thread. The registry holds a small family, so that reads of it find something."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings

from mfsreg.api.app import create_app
from mfsreg.registry.config import Settings
from tests.cli_run import mfsreg_json
from tests.server import client_env, module_server, token

EXAMPLES = 25
schema = schemathesis.openapi.from_dict(create_app(Settings.from_env({"MFSREG_HOME": "/nonexistent"})).openapi())


@pytest.fixture(scope="module")
def api(s3_server, fam, tmp_path_factory):
    """(server, admin token) of a registry holding family "fam": base and lora-chat."""
    with module_server(s3_server, tmp_path_factory.mktemp("fuzzed")) as (srv, server_env):
        tok = token(server_env, "admin")
        env = client_env(tmp_path_factory.mktemp("client"), srv.url, tok)
        mfsreg_json("push", fam["base"], "--family", "fam", "--version", "base", env=env)
        mfsreg_json("push", fam["lora-chat"], "--family", "fam", "--version", "lora-chat", "--parent", "base", env=env)
        yield srv, tok


# A request the document allows may still be refused: a manifest must also be consistent (its chunks
# tiling its files), an upload's bytes must match their ids. So the check that every schema-valid
# request is accepted is left out; a refusal must still be a 4xx the document names, as a problem.
NOT_CHECKED = [schemathesis.checks.positive_data_acceptance]


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_answer_is_a_server_error_or_one_the_document_does_not_name(case, api):
    srv, tok = api
    # The token goes with every case but those schemathesis drew to lack it (negative cases of the
    # bearer scheme): sent to those too, such a request was valid, accepted, and reported as
    # "schema-violating request accepted".
    negated = case.operation.schema.is_security_param_negated(case)
    headers = None if negated else {"Authorization": f"Bearer {tok}"}
    response = case.call_and_validate(base_url=srv.url, headers=headers, excluded_checks=NOT_CHECKED)
    assert not negated or response.status_code == 401, response.status_code


@schema.parametrize()
@settings(max_examples=5, deadline=None, suppress_health_check=list(HealthCheck))
def test_without_a_token_every_operation_is_refused_as_the_document_says(case, api):
    srv, _ = api
    response = case.call_and_validate(base_url=srv.url, excluded_checks=NOT_CHECKED)
    # 405: a method no route takes; 200: the health checks alone
    assert response.status_code in (200, 400, 401, 404, 405, 413, 422), response.status_code
    assert response.status_code != 200 or case.path in ("/healthz", "/readyz")


def test_docs_work_offline_with_an_authorize_button(tmp_path):
    """/docs loads Swagger UI from the server itself (nothing from another host), and the document
    declares the bearer scheme on every /v1/ operation, the health checks excepted."""
    import re

    from fastapi.testclient import TestClient

    app = create_app(Settings.from_env({"MFSREG_HOME": str(tmp_path / "home")}))
    doc = app.openapi()
    assert doc["components"]["securitySchemes"]["bearer"]["scheme"] == "bearer"
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert (op.get("security") == [{"bearer": []}]) == path.startswith("/v1/"), path
    with TestClient(app) as client:
        page = client.get("/docs")
        assert page.status_code == 200
        assets = re.findall(r"""(?:src|href)=["']([^"']+)["']""", page.text) + re.findall(
            r"""url: ?['"]([^'"]+)['"]""", page.text
        )
        assert assets and all(a.startswith("/") and not a.startswith("//") for a in assets), assets
        for asset in assets:
            assert client.get(asset).status_code == 200, asset
        assert client.get("/redoc").status_code == 404
