"""A model family made by training: a small Llama-shaped model pre-trained, then fine-tuned as teams do.

benchmarks/family.py draws its fine-tunes as noise of a chosen size, which says nothing of how far
real training moves the weights. Here every member is trained with AdamW, on the CPU, in minutes:
the size of each element's move comes from the optimiser (Adam moves each weight by about the
learning rate per step, whatever the model's size, and Llama-style weights start at std 0.02
whatever the width), not from a figure picked for the benchmark. What stays small is the model
(2.5 M parameters, 5 MB in bf16), the data (synthetic token streams) and the length of the runs
(hundreds of steps, where real fine-tunes run thousands): see the README's bench_trained section
for what that leaves open.

Model: Llama-shaped and named as Hugging Face names it (embed_tokens, per layer q/k/v/o with
grouped-query k/v, SwiGLU gate/up/down, RMSNorm weights, norm, lm_head), causal attention without
position encoding. Data: each "domain" is a random Markov chain over the vocabulary (every token
has a few likely successors, drawn per domain); the base is pre-trained on a mix of four domains,
each fine-tune on domains of its own. Training keeps fp32 weights and saves bf16, the way mixed
precision fine-tunes are released; a fine-tune starts from its parent's bf16 file, so the weights
it does not move stay bit-identical.

Members (parent first), each trained for its own steps and learning rate:

- ``base``        pre-training from N(0, 0.02): AdamW lr 1e-3, 300 steps, weight decay 0.1.
- ``chat``        full fine-tune of base: lr 2e-5, 200 steps, a new domain.
- ``code``        full fine-tune of base at a high rate: lr 1e-4, 200 steps, another domain.
- ``med-lora``    LoRA (rank 8, alpha 16) on q_proj and v_proj: lr 1e-3, 200 steps, merged into base.
- ``chat-v2``     full fine-tune of chat: lr 2e-5, 100 steps, chat's domain and one more.
- ``chat-v3``     full fine-tune of chat-v2: lr 2e-5, 100 steps.

Files are cached under ``out_dir/trained-v1/`` (written to a temp name and renamed); ``family.json``
beside them records each member's recipe, its last training loss and how far it moved from its
parent. A run with the same torch and thread count trains the same bytes; across machines, floating
point sums in another order may change the last bits.

    python -m benchmarks.trained_family [OUT_DIR]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

GENERATOR_VERSION = 1  # bump when a recipe changes: cached files live under a versioned folder
DEFAULT_DIR = Path(__file__).resolve().parent.parent / "bench-data"
VOCAB, HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 2048, 256, 704, 2, 4, 2
SEQ, BATCH = 64, 8
SUCCESSORS = 4  # likely next tokens per token in a domain's Markov chain
INIT_STD = 0.02


@dataclass(frozen=True)
class Recipe:
    parent: str | None
    lr: float
    steps: int
    domains: tuple[int, ...]
    lora_rank: int = 0  # 0: every weight trains
    weight_decay: float = 0.0
    seed: int = 0


MEMBERS: dict[str, Recipe] = {
    "base": Recipe(None, 1e-3, 300, (0, 1, 2, 3), weight_decay=0.1, seed=1),
    "chat": Recipe("base", 2e-5, 200, (4,), seed=2),
    "code": Recipe("base", 1e-4, 200, (5,), seed=3),
    "med-lora": Recipe("base", 1e-3, 200, (6,), lora_rank=8, seed=4),
    "chat-v2": Recipe("chat", 2e-5, 100, (4, 7), seed=5),
    "chat-v3": Recipe("chat-v2", 2e-5, 100, (4, 7), seed=6),
}
LORA_TARGETS = ("self_attn.q_proj.weight", "self_attn.v_proj.weight")


def tensor_shapes() -> dict[str, tuple[int, ...]]:
    h, i, kv = HIDDEN, INTERMEDIATE, HIDDEN * KV_HEADS // HEADS
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (VOCAB, h)}
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        out |= {
            p + "self_attn.q_proj.weight": (h, h),
            p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h),
            p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (VOCAB, h)
    return out


def _rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w


def forward(w: dict[str, torch.Tensor], tokens: torch.Tensor) -> torch.Tensor:
    """Logits for ``tokens`` (batch, seq) under weights ``w`` (HF Llama names)."""
    b, s = tokens.shape
    hd = HIDDEN // HEADS
    x = w["model.embed_tokens.weight"][tokens]
    for n in range(LAYERS):
        p = f"model.layers.{n}."
        h = _rms_norm(x, w[p + "input_layernorm.weight"])
        q = (h @ w[p + "self_attn.q_proj.weight"].T).view(b, s, HEADS, hd).transpose(1, 2)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).view(b, s, KV_HEADS, hd).transpose(1, 2)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).view(b, s, KV_HEADS, hd).transpose(1, 2)
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, HIDDEN)
        x = x + a @ w[p + "self_attn.o_proj.weight"].T
        h = _rms_norm(x, w[p + "post_attention_layernorm.weight"])
        x = (
            x
            + (F.silu(h @ w[p + "mlp.gate_proj.weight"].T) * (h @ w[p + "mlp.up_proj.weight"].T))
            @ w[p + "mlp.down_proj.weight"].T
        )
    return _rms_norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


class Domains:
    """Token streams from per-domain Markov chains: each token has SUCCESSORS likely next tokens."""

    def __init__(self, seed: int = 7, count: int = 8):
        g = torch.Generator().manual_seed(seed)
        self.succ = torch.randint(0, VOCAB, (count, VOCAB, SUCCESSORS), generator=g)

    def batch(self, domains: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
        out = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        d = torch.tensor(domains)[torch.randint(0, len(domains), (BATCH,), generator=g)]
        out[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for t in range(SEQ):
            pick = torch.randint(0, SUCCESSORS, (BATCH,), generator=g)
            out[:, t + 1] = self.succ[d, out[:, t], pick]
        return out


def _init() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    return {
        name: (torch.ones(s) if name.endswith("norm.weight") else torch.randn(s, generator=g) * INIT_STD)
        for name, s in tensor_shapes().items()
    }


def train(start: dict[str, torch.Tensor], r: Recipe, data: Domains) -> tuple[dict[str, torch.Tensor], float]:
    """``start`` (fp32) trained by ``r``; the trained weights (fp32) and the mean loss of the last 20 steps."""
    g = torch.Generator().manual_seed(r.seed)
    torch.manual_seed(r.seed)
    w = {k: v.clone() for k, v in start.items()}
    if r.lora_rank:
        # LoRA as PEFT sets it up: A ~ Kaiming-uniform, B = 0, W' = W + B @ A * alpha / r
        lora = {}
        for name in w:
            if name.endswith(LORA_TARGETS):
                out_f, in_f = w[name].shape
                bound = 1 / math.sqrt(in_f)
                lora[name] = (
                    torch.empty(r.lora_rank, in_f).uniform_(-bound, bound, generator=g).requires_grad_(),
                    torch.zeros(out_f, r.lora_rank, requires_grad=True),
                )
        params = [t for ab in lora.values() for t in ab]
        scale = 2.0  # alpha 16 / rank 8

        def weights():
            return {k: (v + (lora[k][1] @ lora[k][0]) * scale if k in lora else v) for k, v in w.items()}
    else:
        for v in w.values():
            v.requires_grad_()
        params = list(w.values())

        def weights():
            return w

    opt = torch.optim.AdamW(params, lr=r.lr, weight_decay=r.weight_decay)
    losses = []
    for _ in range(r.steps):
        seq = data.batch(r.domains, g)
        logits = forward(weights(), seq[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), seq[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    with torch.no_grad():
        final = {k: v.detach().clone() for k, v in weights().items()}
    return final, sum(losses[-20:]) / len(losses[-20:])


def _moved(parent: dict[str, torch.Tensor], child: dict[str, torch.Tensor]) -> dict:
    """How far a member's bf16 weights are from its parent's: elements changed, and the norm of the
    change over the norm of the weights (over every tensor)."""
    changed = total = 0
    dn = wn = 0.0
    for k, c in child.items():
        p = parent[k]
        changed += int((c.view(torch.int16) != p.view(torch.int16)).sum())
        total += c.numel()
        dn += float((c.float() - p.float()).pow(2).sum())
        wn += float(p.float().pow(2).sum())
    return {"elements_changed": changed / total, "relative_change": math.sqrt(dn / wn)}


def family_dir(out_dir: Path) -> Path:
    return Path(out_dir) / f"trained-v{GENERATOR_VERSION}"


def generate(out_dir: Path | str = DEFAULT_DIR, verbose: bool = False) -> dict[str, Path]:
    """Train (or find cached) every member; returns member name -> .safetensors path, parents first."""
    root = family_dir(Path(out_dir))
    root.mkdir(parents=True, exist_ok=True)
    paths = {m: root / f"{m}.safetensors" for m in MEMBERS}
    info_path = root / "family.json"
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    info.update(
        generator_version=GENERATOR_VERSION,
        params=sum(math.prod(s) for s in tensor_shapes().values()),
        shape=dict(
            vocab=VOCAB, hidden=HIDDEN, intermediate=INTERMEDIATE, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS
        ),
        data=dict(seq=SEQ, batch=BATCH, successors=SUCCESSORS),
        torch=torch.__version__,
        threads=torch.get_num_threads(),
    )
    info.setdefault("members", {})
    data = Domains()
    for member, r in MEMBERS.items():
        dest = paths[member]
        if dest.exists():
            continue
        t0 = time.perf_counter()
        parent = load_file(str(paths[r.parent])) if r.parent else None
        start = {k: v.float() for k, v in parent.items()} if parent else _init()
        trained, loss = train(start, r, data)
        out = {k: v.to(torch.bfloat16).contiguous() for k, v in trained.items()}
        tmp = dest.with_name(dest.name + ".tmp")
        save_file(out, str(tmp))
        os.replace(tmp, dest)
        entry = {**asdict(r), "final_loss": loss, "bytes": dest.stat().st_size, "seconds": time.perf_counter() - t0}
        if parent is not None:
            entry["vs_parent"] = _moved(parent, out)
        info["members"][member] = entry
        info_path.write_text(json.dumps(info, indent=2) + "\n")
        if verbose:
            moved = entry.get("vs_parent")
            print(
                f"  trained {member}: loss {loss:.3f}"
                + (
                    f", {moved['elements_changed']:.1%} of elements changed, "
                    f"change {moved['relative_change']:.2e} of the weights' norm"
                    if moved
                    else ""
                )
                + f" ({entry['seconds']:.0f} s)",
                flush=True,
            )
    info_path.write_text(json.dumps(info, indent=2) + "\n")
    return paths


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="train (or find cached) the trained benchmark family")
    ap.add_argument("out_dir", nargs="?", type=Path, default=DEFAULT_DIR)
    args = ap.parse_args(argv)
    for member, path in generate(args.out_dir, verbose=True).items():
        print(f"{member}: {path}")


if __name__ == "__main__":
    main()
