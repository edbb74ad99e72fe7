"""The Python API without a server: docs/python.md's examples marked "# runs in CI" run as written,
and load_into's refusals."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
import torch

from tests.cli_run import mfsreg

DOCS = Path(__file__).resolve().parent.parent / "docs" / "python.md"


def examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", DOCS.read_text(), flags=re.S)
    return [b for b in blocks if b.startswith("# runs in CI")]


def test_the_docs_have_examples_to_run():
    assert len(examples()) >= 2


@pytest.mark.parametrize("index", [0, 1])
def test_python_examples_in_the_docs_run_on_the_embedded_registry(index, tmp_path, monkeypatch, capsys):
    """Run in this process, as written, in a fresh folder and registry (no interpreter to start)."""
    for key in [k for k in os.environ if k.startswith(("MFSREG_", "HF_"))]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("MFSREG_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("MFSREG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)
    exec(compile(examples()[index], f"docs/python.md example {index}", "exec"), {"__name__": "__example__"})
    out = capsys.readouterr().out
    if index == 0:
        assert "switched to prod" in out and "bytes copied" in out
    else:
        assert "loaded; missing [], unexpected []" in out


def test_load_into_refuses_a_module_it_does_not_fit_and_leaves_it(home_env, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    import mfsreg as api

    save_file({"weight": torch.ones(8, 4), "bias": torch.ones(8)}, tmp_path / "lin.safetensors")
    mfsreg("push", tmp_path / "lin.safetensors", "-f", "lin", "-v", "v1", env=home_env)
    for key, value in home_env.items():
        if key.startswith("MFSREG_"):
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("MFSREG_URL", raising=False)
    monkeypatch.setenv("MFSREG_CACHE_DIR", str(tmp_path / "cache"))
    fits = torch.nn.Linear(4, 8)
    assert api.load_into(fits, "lin", "latest") == ([], [])
    assert torch.equal(fits.weight, torch.ones(8, 4))
    wrong = torch.nn.Linear(4, 6)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(api.RegistryError, match=r"of another shape \(first: bias: \(8,\) against \(6,\)\)"):
        api.load_into(wrong, "lin", "v1")
    assert all(torch.equal(before[k], v) for k, v in wrong.state_dict().items())
    extra = torch.nn.Sequential(torch.nn.Linear(4, 8))
    with pytest.raises(api.RegistryError, match="missing"):
        api.load_into(extra, "lin", "v1")
    missing, unexpected = api.load_into(extra, "lin", "v1", strict=False)
    assert sorted(missing) == ["0.bias", "0.weight"] and sorted(unexpected) == ["bias", "weight"]


def test_a_node_follows_a_moved_tag_at_once(home_env, tmp_path, monkeypatch):
    """A version's own name is kept MFSREG_VERSION_MAX_AGE; a tag is asked for again every load."""
    from safetensors.torch import save_file

    import mfsreg as api

    for key, value in home_env.items():
        if key.startswith("MFSREG_"):
            monkeypatch.setenv(key, value)
    monkeypatch.delenv("MFSREG_URL", raising=False)
    monkeypatch.setenv("MFSREG_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("MFSREG_VERSION_MAX_AGE", "3600")
    for v in (1, 2):
        save_file({"w": torch.full((64, 64), float(v))}, tmp_path / f"v{v}.safetensors")
        mfsreg("push", tmp_path / f"v{v}.safetensors", "-f", "t", "-v", f"v{v}", env=home_env)
    mfsreg("tag", "set", "t", "prod", "v1", env=home_env)
    node = api.Node()
    try:
        assert api.load_tensors("t", "prod", node=node)["w"][0, 0] == 1
        mfsreg("tag", "set", "t", "prod", "v2", env=home_env)
        assert api.load_tensors("t", "prod", node=node)["w"][0, 0] == 2
        model = api.ResidentModel("t", "v1", node=node)
        model.switch("prod")
        assert model.tensors["w"][0, 0] == 2
        model.close()
    finally:
        node.close()


def test_a_node_given_a_registry_loads_from_it_whatever_mfsreg_url_says(home_env, tmp_path, monkeypatch):
    from safetensors.torch import save_file

    import mfsreg as api
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    save_file({"w": torch.full((8, 8), 3.0)}, tmp_path / "m.safetensors")
    mfsreg("push", tmp_path / "m.safetensors", "-f", "n", "-v", "v1", env=home_env)
    monkeypatch.setenv("MFSREG_URL", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setenv("MFSREG_CACHE_DIR", str(tmp_path / "cache"))
    with Registry(Settings.from_env(home_env)) as reg:
        with pytest.raises(api.RegistryError, match="give url= or registry=, not both"):
            api.Node(url="http://127.0.0.1:9", registry=reg)
        node = api.Node(registry=reg)
        try:
            assert api.load_tensors("n", "latest", node=node)["w"][0, 0] == 3
        finally:
            node.close()
        assert reg.versions("n")  # left open: the node did not close it
