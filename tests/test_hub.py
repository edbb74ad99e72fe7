"""The Hub's read protocol (api/routes/hub.py): the real huggingface_hub and transformers packages download
and load versions from a server in this process, by FAMILY/VERSION and FAMILY/TAG."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.server import Server, embedded_server_env, token

CLIENT = r"""
import hashlib, json, os, sys
from pathlib import Path
from huggingface_hub import hf_hub_download, snapshot_download
from transformers import AutoModelForCausalLM, AutoTokenizer

def files(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(folder).rglob("*")) if p.is_file()}

out = {}
out["snapshot_v1"] = files(snapshot_download("tiny/v1"))
out["snapshot_prod"] = files(snapshot_download("tiny/prod"))
pinned = sys.argv[1]
one = hf_hub_download("tiny/v1", "config.json", revision=pinned)
out["pinned_config"] = hashlib.sha256(Path(one).read_bytes()).hexdigest()
model = AutoModelForCausalLM.from_pretrained("tiny/prod")
out["prod_state"] = {k: hashlib.sha256(v.contiguous().numpy().tobytes()).hexdigest()
                     for k, v in model.state_dict().items()}
out["tokens"] = AutoTokenizer.from_pretrained("tiny/v1")("w1 w2 w3")["input_ids"]
print(json.dumps(out))
"""


def make_model(folder: Path, seed: int) -> dict[str, str]:
    """A tiny GPT-2 with a tokenizer, laid out as transformers' save_pretrained lays one out
    (config.json, three safetensors shards and their index, tokenizer files), written without
    importing transformers (about 14 s on this VM, per worker); returns the hashes of the state
    dict transformers builds from it (the head tied to the token embeddings)."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir(parents=True)
    gen = torch.Generator().manual_seed(seed)
    d, vocab_size, positions = 64, 128, 64
    shapes = {"transformer.wte.weight": (vocab_size, d), "transformer.wpe.weight": (positions, d)}
    for i in range(2):
        h = f"transformer.h.{i}."
        shapes |= {h + "ln_1.weight": (d,), h + "ln_1.bias": (d,), h + "attn.c_attn.weight": (d, 3 * d)}
        shapes |= {h + "attn.c_attn.bias": (3 * d,), h + "attn.c_proj.weight": (d, d), h + "attn.c_proj.bias": (d,)}
        shapes |= {h + "ln_2.weight": (d,), h + "ln_2.bias": (d,), h + "mlp.c_fc.weight": (d, 4 * d)}
        shapes |= {h + "mlp.c_fc.bias": (4 * d,), h + "mlp.c_proj.weight": (4 * d, d), h + "mlp.c_proj.bias": (d,)}
    shapes |= {"transformer.ln_f.weight": (d,), "transformer.ln_f.bias": (d,)}
    tensors = {k: torch.randn(shape, generator=gen) * 0.02 for k, shape in shapes.items()}
    names = sorted(tensors)
    shards = [names[i::3] for i in range(3)]
    weight_map = {}
    for n, part in enumerate(shards, 1):
        shard = f"model-{n:05d}-of-00003.safetensors"
        save_file({k: tensors[k] for k in part}, folder / shard, metadata={"format": "pt"})
        weight_map |= {k: shard for k in part}
    total = sum(t.numel() * 4 for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = dict(
        model_type="gpt2", architectures=["GPT2LMHeadModel"], n_layer=2, n_embd=d, n_head=2,
        vocab_size=vocab_size, n_positions=positions, bos_token_id=0, eos_token_id=0, tie_word_embeddings=True,
    )  # fmt: skip
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    vocab = {f"w{i}": i for i in range(126)} | {"[UNK]": 126, "[PAD]": 127}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    tok_config = {"tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "[UNK]", "pad_token": "[PAD]"}
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config))
    state = {k: hashlib.sha256(v.numpy().tobytes()).hexdigest() for k, v in tensors.items()}
    return state | {"lm_head.weight": state["transformer.wte.weight"]}


def files(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """A server (SQLite, packs on disk) holding tiny/v1 and tiny/v2 (tagged prod), with read tokens
    for tiny* and for other families."""
    from mfsreg.registry.config import Settings
    from mfsreg.registry.meta import VersionMeta
    from mfsreg.registry.registry import Registry

    where = tmp_path_factory.mktemp("hub")
    env = embedded_server_env(where / "home")
    states = {}
    with Registry(Settings.from_env(env)) as reg:
        for v, seed in (("v1", 0), ("v2", 1)):
            states[v] = make_model(where / v, seed)
            meta = VersionMeta(f"tiny {v}", {"stage": "rc"})
            reg.push(where / v, "tiny", v, parent="v1" if v == "v2" else None, meta=meta)
        reg.tag_set("tiny", "prod", "v2")
    srv = Server(env, where / "server.log")
    try:
        yield dict(
            srv=srv,
            env=env,
            where=where,
            states=states,
            read=token(env, "read", "tiny*"),
            other=token(env, "read", "other*"),
        )
    finally:
        srv.stop()


@pytest.mark.process
def test_huggingface_hub_and_transformers_download_by_version_and_tag(hub, tmp_path):
    commit = hub_get(hub, "/api/models/tiny/v1").json()["sha"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "MFSREG_"))}
    env.update(HF_ENDPOINT=hub["srv"].url, HF_TOKEN=hub["read"], HF_HOME=str(tmp_path / "hf"))
    env.update(HF_HUB_DISABLE_TELEMETRY="1", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1")
    ran = subprocess.run([sys.executable, "-c", CLIENT, commit], env=env, capture_output=True, text=True, timeout=240)
    assert ran.returncode == 0, ran.stderr[-3000:]
    got = json.loads(ran.stdout.strip().splitlines()[-1])
    assert got["snapshot_v1"] == files(hub["where"] / "v1")  # every file, byte-identical
    assert got["snapshot_prod"] == files(hub["where"] / "v2")
    assert len([f for f in got["snapshot_v1"] if f.endswith(".safetensors")]) > 1  # sharded
    assert got["pinned_config"] == files(hub["where"] / "v1")["config.json"]
    assert got["prod_state"] == hub["states"]["v2"]
    assert got["tokens"] == [1, 2, 3]

    # the cache huggingface_hub made pushes as its snapshot: the model's files, not the cache's own
    from mfsreg.registry.config import Settings
    from mfsreg.registry.registry import Registry

    with Registry(Settings.from_env({"MFSREG_HOME": str(tmp_path / "again")})) as reg:
        reg.push(tmp_path / "hf" / "hub" / "models--tiny--v1", "copy", "v1")
        reg.pull("copy", "v1", tmp_path / "out", to_dir=True)
    assert files(tmp_path / "out") == files(hub["where"] / "v1")


def hub_get(hub, path: str, tok: str | None = "read", method: str = "GET", **headers) -> httpx.Response:
    if tok is not None:
        headers["Authorization"] = f"Bearer {hub[tok]}"
    return httpx.request(method, hub["srv"].url + path, headers=headers, timeout=30)


ROUTES = [
    ("GET", "/api/models/tiny/v1"),
    ("GET", "/api/models/tiny/prod/revision/main"),
    ("GET", "/api/models/tiny/v1/tree/main"),
    ("GET", "/tiny/prod/resolve/main/config.json"),
    ("HEAD", "/tiny/prod/resolve/main/config.json"),
]


@pytest.mark.parametrize("method, path", ROUTES)
def test_every_hub_route_holds_to_the_token_scope(hub, method, path):
    assert hub_get(hub, path, "other", method).status_code == 403
    assert hub_get(hub, path, None, method).status_code == 401
    if method == "GET":
        assert "set HF_TOKEN" in hub_get(hub, path, None, method).json()["detail"]
    assert hub_get(hub, path, "read", method).status_code == 200
    assert hub_get(hub, path.replace("tiny", "nope", 1), "other", method).status_code == 403  # nothing told


def test_file_answers_carry_what_clients_read_and_take_ranges(hub):
    src = (hub["where"] / "v1" / "model.safetensors.index.json").read_bytes()
    info = hub_get(hub, "/api/models/tiny/v1").json()
    card = info["cardData"]
    assert (card["version"], card["parent"], card["description"], card["labels"]) == (
        "v1",
        None,
        "tiny v1",
        {"stage": "rc"},
    )
    assert hub_get(hub, "/api/models/tiny/prod").json()["cardData"]["version"] == "v2"
    assert sorted(s["rfilename"] for s in info["siblings"]) == sorted(files(hub["where"] / "v1"))
    head = hub_get(hub, "/tiny/v1/resolve/main/model.safetensors.index.json", method="HEAD")
    assert head.headers["x-repo-commit"] == info["sha"] and len(info["sha"]) == 40
    assert head.headers["etag"] == f'"{hashlib.sha256(src).hexdigest()}"'
    assert int(head.headers["content-length"]) == len(src) and head.content == b""
    path = "/tiny/v1/resolve/main/model-00001-of-00003.safetensors"
    whole = (hub["where"] / "v1" / "model-00001-of-00003.safetensors").read_bytes()
    for rng, want in (
        ("bytes=0-9", whole[:10]),
        ("bytes=100000-", whole[100000:]),
        ("bytes=-7", whole[-7:]),
        (f"bytes=70000-{len(whole) + 50}", whole[70000:]),
    ):
        got = hub_get(hub, path, Range=rng)
        assert got.status_code == 206 and got.content == want, rng
        assert got.headers["content-range"].endswith(f"/{len(whole)}")
    assert hub_get(hub, path).content == whole
    bad = hub_get(hub, path, Range=f"bytes={len(whole)}-")
    assert bad.status_code == 416 and bad.headers["content-range"] == f"bytes */{len(whole)}"
    for ignored in ("bytes=a-b", "items=0-9", "bytes=0-1,5-9", "bytes=9-3", "bytes=-" + "9" * 5000):
        got = hub_get(hub, path, Range=ignored)  # RFC 9110: a Range not read is ignored
        assert got.status_code == 200 and got.content == whole, ignored
    head = hub_get(hub, path, method="HEAD", Range="bytes=5-14")
    assert head.status_code == 206 and head.headers["content-range"] == f"bytes 5-14/{len(whole)}"
    assert head.headers["content-length"] == "10" and head.content == b""
    pinned = hub_get(hub, f"/tiny/prod/resolve/{info['sha']}/config.json")  # prod is v2; the commit names v1
    assert pinned.content == (hub["where"] / "v1" / "config.json").read_bytes()
    by_digest = hub_get(hub, f"/api/models/tiny/v2/revision/{hub_get(hub, '/api/models/tiny/v2').json()['_id']}")
    assert by_digest.status_code == 200


@pytest.mark.parametrize(
    "path, code",
    [
        ("/api/models/tiny/nope", "RepoNotFound"),
        ("/api/models/tinyx/v1", "RepoNotFound"),
        ("/api/models/tiny/..%2Fx", None),  # no such route: the path has one segment more
        ("/api/models/tiny/-x", "RepoNotFound"),
        ("/api/models/tiny/v1/revision/dev", "RevisionNotFound"),
        ("/api/models/tiny/v1/revision/" + "0" * 40, "RevisionNotFound"),
        ("/tiny/v1/resolve/main/nope.json", "EntryNotFound"),
        ("/tiny/v1/resolve/main/模型.json", "EntryNotFound"),
    ],
)
def test_what_does_not_exist_is_a_404_a_hub_client_tells_apart(hub, path, code):
    got = hub_get(hub, path)
    assert got.status_code == 404
    if code is not None:
        assert got.headers["x-error-code"] == code
        assert "Traceback" not in got.text and "detail" in got.json()


def test_anonymous_reads_where_the_server_opens_them(hub):
    srv = Server({**hub["env"], "MFSREG_ANONYMOUS_READ": "1"}, hub["where"] / "anon.log")
    try:
        got = httpx.get(f"{srv.url}/tiny/prod/resolve/main/config.json")
        assert got.status_code == 200 and got.content == (hub["where"] / "v2" / "config.json").read_bytes()
    finally:
        srv.stop()


def test_a_path_that_climbs_out_is_no_file_of_the_version(hub):
    """Sent as it is (httpx would fold the dots away): the server looks the path up among the
    version's files, where it is not."""
    import http.client

    host, port = hub["srv"].url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request(
            "GET", "/tiny/v1/resolve/main/../../../etc/passwd", headers={"Authorization": f"Bearer {hub['read']}"}
        )
        got = conn.getresponse()
        assert got.status == 404 and got.getheader("x-error-code") == "EntryNotFound"
        assert b"root:" not in got.read()
    finally:
        conn.close()


def test_a_file_that_does_not_match_its_sha256_is_broken_off_short(hub, tmp_path):
    """A manifest whose file digest lies (a pusher's word): the whole-file check fails before the
    last piece is sent, so the client gets fewer bytes than Content-Length says, never a whole file."""
    from dataclasses import replace

    from sqlalchemy import update

    from mfsreg.registry.config import Settings
    from mfsreg.registry.db.engine import write_tx
    from mfsreg.registry.db.models import versions
    from mfsreg.registry.meta import VersionMeta
    from mfsreg.registry.registry import Registry

    with Registry(Settings.from_env(hub["env"])) as reg:
        reg.push(hub["where"] / "v1", "tiny", "liar", meta=VersionMeta("tampered below"))
        row, manifest = reg.manifest("tiny", "liar")
        files = tuple(replace(f, sha256="0" * 64) if f.path == "config.json" else f for f in manifest.files)
        with write_tx(reg.engine) as conn:
            conn.execute(
                update(versions)
                .where(versions.c.id == row.id)
                .values(manifest=replace(manifest, files=files).to_bytes())
            )
    size = (hub["where"] / "v1" / "config.json").stat().st_size
    with pytest.raises(httpx.HTTPError):
        got = hub_get(hub, "/tiny/liar/resolve/main/config.json")
        assert len(got.content) < size  # (httpx raises first on a body short of its length)
    assert hub_get(hub, "/tiny/liar/resolve/main/config.json", Range="bytes=0-9").status_code == 206
