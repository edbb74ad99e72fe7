"""Loading a version's tensors into an existing torch module (a transformers model built from its
config, a model an engine already holds): load_into."""

from __future__ import annotations

import torch

from mfsreg.registry.client.torch_loader import Node, load_tensors
from mfsreg.registry.errors import InvalidRequest


def load_into(
    module: torch.nn.Module,
    family: str,
    version: str,
    node: Node | None = None,
    strict: bool = True,
    verify: bool = True,
):
    """Load ``family/version`` (a version's name or a tag) into ``module``'s parameters and buffers,
    on the device they are on, every chunk checked as load_tensors checks it; returns torch's
    ``(missing_keys, unexpected_keys)``. Weights the module ties to others (a language model's head
    to its embeddings, which save_pretrained leaves out of the file) are tied again afterwards and
    do not count as missing. With ``strict``, any other missing or unexpected name, or a shape
    that differs, is refused in one line and the module is left as it was."""
    own = dict(module.state_dict())
    device = next(iter(own.values())).device if own else torch.device("cpu")
    tensors = load_tensors(family, version, device=device, node=node, verify=verify)
    tied = _tied(module)
    missing = sorted(k for k in own if k not in tensors and k not in tied)
    unexpected = sorted(k for k in tensors if k not in own)
    wrong = sorted(k for k in tensors if k in own and tensors[k].shape != own[k].shape)
    if strict and (missing or unexpected or wrong):
        what = [
            f"{len(missing)} missing (first: {missing[0]})" if missing else "",
            f"{len(unexpected)} not in the module (first: {unexpected[0]})" if unexpected else "",
            f"{len(wrong)} of another shape (first: {wrong[0]}: {tuple(tensors[wrong[0]].shape)} against "
            f"{tuple(own[wrong[0]].shape)})"
            if wrong
            else "",
        ]
        raise InvalidRequest(
            f"{family}/{version} does not fit this module: tensors "
            + "; ".join(w for w in what if w)
            + ": load it into the model it was saved from, or pass strict=False"
        )
    result = module.load_state_dict({k: v for k, v in tensors.items() if k not in wrong}, strict=False)
    tie = getattr(module, "tie_weights", None)
    if tied and callable(tie):  # transformers' models tie their head to their embeddings again
        tie()
    return result._replace(missing_keys=[k for k in result.missing_keys if k not in tied])


def _tied(module: torch.nn.Module) -> set[str]:
    """Names of the module's weights that share storage with another of its weights (tied)."""
    seen: dict[int, str] = {}
    tied: set[str] = set()
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = tensor.data_ptr()
        if key in seen and tensor.numel():
            tied.add(name)
        else:
            seen[key] = name
    return tied
