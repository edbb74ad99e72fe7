"""Small synthetic model families for tests: real safetensors files whose members differ the way
fine-tunes do (merged LoRA, retrained last layers, dense updates, appended vocabulary rows)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

VOCAB, HIDDEN, LAYERS = 500, 128, 3  # 500 rows: a vocab tensor ends in a partial chunk


def base_tensors(dtype=torch.bfloat16, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    t = {"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.02}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[p + f"self_attn.{name}.weight"] = torch.randn(HIDDEN, HIDDEN, generator=g) * 0.02
        t[p + "mlp.up_proj.weight"] = torch.randn(2 * HIDDEN, HIDDEN, generator=g) * 0.02
        t[p + "mlp.down_proj.weight"] = torch.randn(HIDDEN, 2 * HIDDEN, generator=g) * 0.02
        t[p + "input_layernorm.weight"] = torch.ones(HIDDEN)
    t["model.norm.weight"] = torch.ones(HIDDEN)
    t["lm_head.weight"] = torch.randn(VOCAB, HIDDEN, generator=g) * 0.02
    return {k: v.to(dtype).contiguous() for k, v in t.items()}


def lora(base: dict, targets=("q_proj", "v_proj"), seed: int = 1, rank: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = dict(base)
    for k, v in base.items():
        if any(f"{t}.weight" in k for t in targets):
            a = torch.randn(rank, v.shape[1], generator=g) * 0.01
            b = torch.randn(v.shape[0], rank, generator=g) * 0.01
            out[k] = (v.float() + b @ a).to(v.dtype)
    return out


def retrain_last(base: dict, seed: int = 2) -> dict:
    g = torch.Generator().manual_seed(seed)
    last = f"model.layers.{LAYERS - 1}."
    return {
        k: ((v.float() + torch.randn(v.shape, generator=g) * 0.01).to(v.dtype) if k.startswith(last) else v)
        for k, v in base.items()
    }


def dense_update(base: dict, seed: int = 3) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {k: (v.float() * (1 + torch.randn(v.shape, generator=g) * 1e-2)).to(v.dtype) for k, v in base.items()}


def extend_vocab(base: dict, rows: int = 8, seed: int = 4) -> dict:
    g = torch.Generator().manual_seed(seed)
    out = dict(base)
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        v = base[k]
        extra = (torch.randn(rows, v.shape[1], generator=g) * 0.02).to(v.dtype)
        out[k] = torch.cat([v, extra]).contiguous()
    return out


def write(path: Path, tensors: dict, metadata: dict | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path), metadata=metadata)
    return path


def family(dirpath: Path, dtype=torch.bfloat16) -> dict[str, Path]:
    """A base and four genuinely different members, one file each."""
    base = base_tensors(dtype)
    members = {
        "base": base,
        "lora-chat": lora(base),
        "last-code": retrain_last(base),
        "full-med": dense_update(base),
        "vocab-ext": extend_vocab(base),
    }
    return {name: write(dirpath / f"{name}.safetensors", t, {"member": name}) for name, t in members.items()}


def sharded_dir(dirpath: Path, tensors: dict, shards: int = 2, side_files: bool = True) -> Path:
    """A Hugging Face style checkpoint directory: shards, an index, config and tokenizer files."""
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(dirpath / fname))
        weight_map.update({n: fname for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dirpath / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
    )
    if side_files:
        (dirpath / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "vocab_size": VOCAB}))
        (dirpath / "tokenizer.json").write_text(json.dumps({"vocab": {f"t{i}": i for i in range(2000)}}))
    return dirpath


def two_directory_versions(dirpath: Path) -> tuple[Path, Path]:
    """v1 and v2 of a sharded checkpoint whose every file differs (every weight moved, a new config):
    a pull of v2 over v1 that fails partway shows whether it replaced any file before failing."""
    base = base_tensors()
    for name in ("v1", "v2"):
        (dirpath / name).mkdir(parents=True)
    v1 = sharded_dir(dirpath / "v1", base)
    v2 = sharded_dir(dirpath / "v2", dense_update(base))
    (v2 / "config.json").write_text(json.dumps({"hidden_size": HIDDEN, "vocab_size": VOCAB, "tuned": True}))
    return v1, v2


def last_file_victim(old, new) -> tuple[str, str]:
    """(path, chunk id): a chunk of the last file of manifest ``new`` that uses one no other file of
    ``new`` or ``old`` uses, where a file ``new`` writes before it differs from ``old``'s: the chunk
    to lose so that a pull of ``new`` over ``old`` fails after it wrote a file that shows it."""
    old_files = {f.path: f.sha256 for f in old.files}
    for k in range(len(new.files) - 1, 0, -1):
        before, last = new.files[:k], new.files[k]
        elsewhere = {c.id for f in (*old.files, *before, *new.files[k + 1 :]) for c in f.chunks}
        own = [c.id for c in last.chunks if c.id not in elsewhere]
        if own and any(old_files.get(f.path) != f.sha256 for f in before):
            return last.path, own[0]
    raise AssertionError("no file of the new version fails late enough to show a replacement")
