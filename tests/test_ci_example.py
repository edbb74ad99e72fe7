"""examples/ci/: the publishing script both CI examples call, run against a server on loopback."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.cli_run import MFSREG, mfsreg_json
from tests.server import Server, embedded_server_env, token

CI = Path(__file__).resolve().parent.parent / "examples" / "ci"


def test_both_ci_examples_call_the_script_with_the_token_from_secrets():
    github = yaml.safe_load((CI / "github-actions.yml").read_text())
    steps = github["jobs"]["publish"]["steps"]
    run = next(s for s in steps if "publish.sh" in s.get("run", ""))
    assert run["env"]["MFSREG_TOKEN"] == "${{ secrets.MFSREG_TOKEN }}"
    gitlab = yaml.safe_load((CI / "gitlab-ci.yml").read_text())
    assert any("examples/ci/publish.sh" in line for line in gitlab["publish-fine-tune"]["script"])


@pytest.mark.process
def test_the_publish_script_pushes_tags_and_reports(tmp_path, fam):
    env = embedded_server_env(tmp_path / "server")
    srv = Server(env, tmp_path / "server.log")
    try:
        ci = {k: v for k, v in os.environ.items() if not k.startswith("MFSREG_")}
        ci.update(MFSREG_URL=srv.url, MFSREG_TOKEN=token(env, "push", "qwen*"), MFSREG_HOME=str(tmp_path / "ci"))
        ci["PATH"] = f"{Path(MFSREG).parent}:{ci['PATH']}"

        def publish(model, version, **extra) -> subprocess.CompletedProcess:
            return subprocess.run(
                ["bash", str(CI / "publish.sh"), str(model), "qwen7b", version],
                env={**ci, **extra},
                capture_output=True,
                text=True,
                timeout=120,
            )

        first = publish(fam["base"], "base", COMMIT_SHA="c0ffee")
        assert first.returncode == 0, first.stderr
        second = publish(fam["lora-chat"], "chat-v1", PARENT="base", TAG="staging", DESCRIPTION="chat tune")
        assert second.returncode == 0, second.stderr
        assert "pushed qwen7b/chat-v1" in second.stdout and "qwen7b/staging -> chat-v1" in second.stdout
        assert "shar" in second.stdout.lower()  # the stats table
        shown = mfsreg_json("show", "qwen7b", "staging", env=ci)
        assert (shown["version"], shown["parent"], shown["description"]) == ("chat-v1", "base", "chat tune")
        assert mfsreg_json("show", "qwen7b", "base", env=ci)["labels"] == {"commit": "c0ffee"}
        again = publish(fam["lora-chat"], "chat-v1", PARENT="base", TAG="staging")
        assert again.returncode == 0 and "already stored" in again.stdout
        refused = publish(fam["base"], "x", MFSREG_TOKEN=token(env, "read", "qwen*"))
        assert refused.returncode == 3 and "needs 'push'" in refused.stderr
        usage = subprocess.run(["bash", str(CI / "publish.sh")], env=ci, capture_output=True, text=True)
        assert usage.returncode == 2 and "usage:" in usage.stderr
    finally:
        srv.stop()
