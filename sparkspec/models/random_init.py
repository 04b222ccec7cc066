"""Random tensors for any sparkspec module, named as its state dict names them (official checkpoint names).

Used by `init_dspark_tensors` / `init_mtp_tensors` (what `sparkspec init --drafter` writes) and by tests
that build tiny random models. The scales keep activations O(1) through mHC, attention and MoE.
"""

from __future__ import annotations

import torch
from torch import nn


def random_tensors(module: nn.Module, generator: torch.Generator, prefix: str = "") -> dict[str, torch.Tensor]:
    """name -> fp32 tensor (int64 for `tid2eid`) for every parameter and persistent buffer of `module`."""
    out: dict[str, torch.Tensor] = {}
    named = list(module.named_parameters()) + [(n, b) for n, b in module.named_buffers() if n.endswith("tid2eid")]
    for name, p in named:
        leaf = name.split(".")[-1]
        shape = tuple(p.shape)
        if leaf == "tid2eid":  # hash routing table [V, A]: A distinct experts per token id
            num_experts = module.get_parameter(name.rsplit(".", 1)[0] + ".weight").shape[0]
            t = torch.stack([torch.randperm(num_experts, generator=generator)[: shape[1]] for _ in range(shape[0])])
        elif leaf.startswith("hc_") and leaf.endswith("_fn"):  # [M, n·H]: mixes of unit-RMS streams ~ N(0, 1)
            t = torch.randn(shape, generator=generator) / shape[1] ** 0.5
        elif leaf.endswith("_scale"):
            t = torch.ones(shape)
        elif leaf.endswith("_base") or leaf in ("attn_sink", "ape", "bias"):
            t = torch.zeros(shape)
        elif name.endswith("norm.weight"):
            t = torch.ones(shape)
        elif leaf == "weight" and len(shape) == 2:
            is_table = name.endswith(("embed.weight", "markov_w1.weight"))
            std = 1.0 if is_table else shape[1] ** -0.5  # lookup tables: unit rows; linears: fan-in scaling
            t = torch.randn(shape, generator=generator) * std
        else:
            t = torch.randn(shape, generator=generator) * 0.02
        out[prefix + name] = t
    return out
