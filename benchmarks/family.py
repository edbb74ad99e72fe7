"""A synthetic, LLM-shaped model family in bf16, written as .safetensors files.

The base is Llama-shaped (vocab 32000, hidden 2048, intermediate 5632, grouped-query attention with
k/v of hidden/4, 10 layers: 582 M parameters, 1.16 GB at scale 1). The layer count sets the size
(TinyLlama's 22 layers at these widths would be 2.2 GB); the widths, and so the tensor and chunk
shapes, are those of a real 1B-class model. ``scale`` multiplies the parameter count by scaling
vocab, hidden and intermediate by sqrt(scale) (rounded to multiples of 256 / 64), so quick runs keep
every member and every tensor name.

Weights are N(0, 1) * 0.02 drawn in float32 from a per-tensor seed and rounded to bf16; norm weights
are 1 + N(0, 1) * 0.02. The members differ from their parents the way real fine-tunes do:

- ``lora-chat``       LoRA (rank 16, alpha 32) merged into q_proj and v_proj of every layer. The
                      update's std is 5% of the weights': nearly every element of those tensors
                      changes, every other tensor is bit-identical.
- ``lastlayers-code`` the last 4 layers retrained: base + N(0, 0.01) on every tensor of those layers.
- ``full-medical``    a full fine-tune: every tensor gets dense noise of 1e-3 of its RMS. After bf16
                      rounding a large minority of the elements change, by one or two ulps: sign and
                      exponent bits almost all equal. No chunk is bit-identical to the base's.
- ``vocab-ext``       256 new token rows appended to embed_tokens and lm_head; the rest identical
                      (but every later tensor sits at a new offset in the file).
- ``lora-chat-v2``    a fine-tune of a fine-tune: lora-chat plus a LoRA merged into every o_proj.

Files are cached under ``out_dir/family-v1-s<scale>/`` and never rewritten once there (written to a
temp name and renamed, so an interrupted run leaves no half file). ``family.json`` beside them holds
the shape and, per member, how many tensors and bf16 elements differ from its parent.

    python -m benchmarks.family OUT_DIR [--scale S]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

GENERATOR_VERSION = 1  # bump when the recipe changes: cached files live under a versioned folder
SEED = 1234
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "bench-data"

BASE = "base"
# member -> parent, in push order (a parent always comes before its children)
MEMBERS: dict[str, str | None] = {
    BASE: None,
    "lora-chat": BASE,
    "lastlayers-code": BASE,
    "full-medical": BASE,
    "vocab-ext": BASE,
    "lora-chat-v2": "lora-chat",
}

LORA_RANK = 16
LORA_ALPHA = 32
LORA_REL_STD = 0.05  # std of the merged update relative to the weights' std
RETRAIN_LAYERS = 4
RETRAIN_STD = 0.01
FULL_FT_REL = 1e-3
VOCAB_EXTRA = 256
INIT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    vocab: int
    hidden: int
    intermediate: int
    layers: int

    @property
    def kv(self) -> int:
        return self.hidden // 4  # grouped-query attention: 4 query heads per k/v head

    @classmethod
    def for_scale(cls, scale: float) -> Shape:
        if not 0 < scale <= 4:
            raise ValueError(f"scale {scale} must be in (0, 4]")
        f = math.sqrt(scale)

        def rnd(x: float, m: int) -> int:
            return max(m, int(round(x * f / m)) * m)

        return cls(vocab=rnd(32000, 64), hidden=rnd(2048, 256), intermediate=rnd(5632, 64), layers=10)

    def tensor_shapes(self) -> dict[str, tuple[int, ...]]:
        h, i, kv = self.hidden, self.intermediate, self.kv
        out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (self.vocab, h)}
        for n in range(self.layers):
            p = f"model.layers.{n}."
            out[p + "self_attn.q_proj.weight"] = (h, h)
            out[p + "self_attn.k_proj.weight"] = (kv, h)
            out[p + "self_attn.v_proj.weight"] = (kv, h)
            out[p + "self_attn.o_proj.weight"] = (h, h)
            out[p + "mlp.gate_proj.weight"] = (i, h)
            out[p + "mlp.up_proj.weight"] = (i, h)
            out[p + "mlp.down_proj.weight"] = (h, i)
            out[p + "input_layernorm.weight"] = (h,)
            out[p + "post_attention_layernorm.weight"] = (h,)
        out["model.norm.weight"] = (h,)
        out["lm_head.weight"] = (self.vocab, h)
        return out

    def params(self) -> int:
        return sum(math.prod(s) for s in self.tensor_shapes().values())


def _gen(key: str) -> torch.Generator:
    return torch.Generator().manual_seed(SEED * 1_000_003 + zlib.crc32(key.encode()))


def _randn(shape, key: str) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(key), dtype=torch.float32)


def _is_norm(name: str) -> bool:
    return name.endswith("norm.weight")


def _base(shape: Shape) -> dict[str, torch.Tensor]:
    out = {}
    for name, s in shape.tensor_shapes().items():
        w = _randn(s, "base/" + name).mul_(INIT_STD)
        if _is_norm(name):
            w.add_(1.0)
        out[name] = w.to(torch.bfloat16)
    return out


def _merge_lora(t: dict[str, torch.Tensor], suffixes: tuple[str, ...], key: str) -> None:
    """W += B @ A * alpha / r, with the update's std at LORA_REL_STD of the weights'."""
    scale = LORA_ALPHA / LORA_RANK
    ab_std = math.sqrt(LORA_REL_STD * INIT_STD / (scale * math.sqrt(LORA_RANK)))
    for name in list(t):
        if not name.endswith(suffixes):
            continue
        out_f, in_f = t[name].shape
        a = _randn((LORA_RANK, in_f), f"{key}/A/{name}").mul_(ab_std)
        b = _randn((out_f, LORA_RANK), f"{key}/B/{name}").mul_(ab_std)
        t[name] = (t[name].float() + (b @ a) * scale).to(torch.bfloat16)


def _lora_chat(t):
    _merge_lora(t, ("self_attn.q_proj.weight", "self_attn.v_proj.weight"), "lora-chat")


def _lora_chat_v2(t):
    _merge_lora(t, ("self_attn.o_proj.weight",), "lora-chat-v2")


def _lastlayers(t):
    n_layers = 1 + max(int(n.split(".")[2]) for n in t if n.startswith("model.layers."))
    keep = tuple(f"model.layers.{n}." for n in range(n_layers - RETRAIN_LAYERS, n_layers))
    for name in list(t):
        if name.startswith(keep):
            noise = _randn(t[name].shape, "lastlayers/" + name).mul_(RETRAIN_STD)
            t[name] = (t[name].float() + noise).to(torch.bfloat16)


def _full_ft(t):
    for name in list(t):
        w = t[name].float()
        rms = float(w.square().mean().sqrt())
        w.add_(_randn(w.shape, "full-medical/" + name).mul_(FULL_FT_REL * rms))
        t[name] = w.to(torch.bfloat16)


def _vocab_ext(t):
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        w = t[name]
        rows = _randn((VOCAB_EXTRA, w.shape[1]), "vocab-ext/" + name).mul_(INIT_STD).to(torch.bfloat16)
        t[name] = torch.cat([w, rows], dim=0)


RECIPES = {
    "lora-chat": _lora_chat,
    "lastlayers-code": _lastlayers,
    "full-medical": _full_ft,
    "vocab-ext": _vocab_ext,
    "lora-chat-v2": _lora_chat_v2,
}


def family_dir(out_dir: Path, scale: float) -> Path:
    return Path(out_dir) / f"family-v{GENERATOR_VERSION}-s{scale:g}"


def _diff(parent: dict[str, torch.Tensor], child: dict[str, torch.Tensor]) -> dict:
    """How far a member is from its parent: tensors and bf16 elements that differ."""
    tensors_changed = elems_changed = elems = 0
    for name, c in child.items():
        p = parent.get(name)
        elems += c.numel()
        if p is None or p.shape != c.shape:
            tensors_changed += 1
            n = c.numel() if p is None else c.numel() - p.numel()  # appended rows count as changed
            elems_changed += n
            if p is not None:
                elems_changed += int((c[: p.shape[0]].view(torch.int16) != p.view(torch.int16)).sum())
            continue
        d = int((c.view(torch.int16) != p.view(torch.int16)).sum())
        if d:
            tensors_changed += 1
            elems_changed += d
    return {
        "tensors": len(child),
        "tensors_changed": tensors_changed,
        "elements": elems,
        "elements_changed": elems_changed,
        "fraction_changed": round(elems_changed / elems, 4),
    }


def _save(tensors: dict[str, torch.Tensor], dest: Path) -> None:
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def generate(out_dir: Path | str = DEFAULT_DIR, scale: float = 1.0, verbose: bool = False) -> dict[str, Path]:
    """Write (or find cached) every member; returns member name -> .safetensors path, in push order."""
    shape = Shape.for_scale(scale)
    root = family_dir(Path(out_dir), scale)
    root.mkdir(parents=True, exist_ok=True)
    paths = {m: root / f"{m}.safetensors" for m in MEMBERS}
    info_path = root / "family.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info.update(shape=asdict(shape), params=shape.params(), scale=scale, generator_version=GENERATOR_VERSION)
    info.setdefault("members", {})
    loaded: dict[str, dict[str, torch.Tensor]] = {}

    def tensors(member: str) -> dict[str, torch.Tensor]:
        if member not in loaded:
            loaded[member] = load_file(str(paths[member]))
        return loaded[member]

    for member, parent in MEMBERS.items():
        dest = paths[member]
        if dest.exists():
            continue
        t0 = time.perf_counter()
        if parent is None:
            t = _base(shape)
        else:
            t = dict(tensors(parent))
            RECIPES[member](t)
        _save(t, dest)
        loaded[member] = t
        entry = {"parent": parent, "bytes": dest.stat().st_size}
        if parent is not None:
            entry["vs_parent"] = _diff(tensors(parent), t)
        info["members"][member] = entry
        info_path.write_text(json.dumps(info, indent=2) + "\n")
        if verbose:
            print(
                f"  wrote {dest} ({dest.stat().st_size / 1e9:.3f} GB) in {time.perf_counter() - t0:.1f} s", flush=True
            )
        if member not in MEMBERS.values():  # nobody derives from it: free it now
            loaded.pop(member, None)
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out_dir", nargs="?", default=str(DEFAULT_DIR), type=Path)
    ap.add_argument("--scale", type=float, default=1.0, help="parameter count relative to the 1.16 GB base")
    args = ap.parse_args(argv)
    shape = Shape.for_scale(args.scale)
    print(f"family at scale {args.scale:g}: {shape} = {shape.params() / 1e6:.1f} M params per base")
    paths = generate(args.out_dir, args.scale, verbose=True)
    for name, p in paths.items():
        print(f"{name:16s} {p.stat().st_size:>14,d}  {p}")


if __name__ == "__main__":
    main()
