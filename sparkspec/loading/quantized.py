"""Layers that keep FP8 / FP4 checkpoint weights quantised in memory, and the module surgery that puts them in
a model built on the meta device (`load_checkpoint(..., quantization="keep")`, `quantize_layers_` for random
weights).

* `Fp8Linear`: `weight` [out, in] float8_e4m3fn + `scale` [ceil(out/128), ceil(in/128)] fp32 (the checkpoint's
  names); forward = `ops.fp8_block_linear`. 1 byte a weight instead of 2 (bf16).
* `Fp4Linear`: `weight` [out, in/2] uint8 (two e2m1 codes a byte, low nibble first) + `scale` [out, in/32]
  uint8 (e8m0 exponents); half a byte a weight plus 1/32 of a byte. Routed experts only: the MoE stacks the
  packed experts (`ops.moe.expert_weights`) and its grouped GEMM dequantises tiles in registers; a forward of
  its own (dequantise, then `F.linear`) exists for completeness.

Only layers the model calls as modules are replaced (`FP8_LAYERS`, `FP4_LAYERS`): the attention projections
`wq_a`, `wq_b`, `wkv`, `wo_b`, the indexer's `wq_b`, the shared experts' `w1/w2/w3` (FP8) and the routed
experts (FP4). Weights the model reads through `.weight` stay dequantised: `wo_a` (viewed per output group,
as the official inference also dequantises it), the compressors' `wkv` / `wgate` (one fp32 GEMM), the router
gate, the LM head and embedding (BF16 in the checkpoint anyway), and every drafter (`mtp.*`) tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from sparkspec.loading import CheckpointError
from sparkspec.loading.plan import TensorSource, keep_problem
from sparkspec.ops import ops
from sparkspec.ops.formats import (
    FP4_BLOCK,
    FP8_BLOCK,
    dequant_fp4,
    dequant_fp8_block,
    fp4_scale_shape,
    fp8_scale_shape,
)

# what happens to FP8 / FP4 checkpoint weights: "keep" them quantised in the layers that can compute on them
# (`Fp8Linear`, `Fp4Linear`), "dequantize" them to the load dtype, or "auto": keep on accelerators, dequantise on CPU
Quantization = Literal["auto", "keep", "dequantize"]
QUANTIZATIONS = ("auto", "keep", "dequantize")
FP8_LAYERS = re.compile(r"^layers\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123])$")
FP4_LAYERS = re.compile(r"^layers\.\d+\.ffn\.experts\.\d+\.w[123]$")


class _KeepsFormat(nn.Module):
    """Parameters keep their storage dtype through `.to(dtype)` / `.half()`: only device moves apply (a cast
    would turn codes into plain numbers without their scales)."""

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True):
        for name, p in self._parameters.items():
            moved = fn(torch.empty(0, dtype=p.dtype, device=p.device))
            if moved.device != p.device:
                self._parameters[name] = nn.Parameter(p.data.to(moved.device), requires_grad=False)
        return self


class Fp8Linear(_KeepsFormat):
    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=torch.float8_e4m3fn, device=device),
                                   requires_grad=False)
        self.scale = nn.Parameter(torch.empty(fp8_scale_shape((out_features, in_features)), device=device),
                                  requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out] (x.dtype)
        return ops.fp8_block_linear(x, self.weight, self.scale)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp8 e4m3 128x128 blocks"


class Fp4Linear(_KeepsFormat):
    def __init__(self, in_features: int, out_features: int, device: torch.device | str | None = None):
        super().__init__()
        if in_features % 2:
            raise ValueError(f"in_features = {in_features}: FP4 packs two values a byte, expected an even width")
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features // 2, dtype=torch.uint8, device=device),
                                   requires_grad=False)
        self.scale = nn.Parameter(torch.empty(fp4_scale_shape((out_features, in_features)), dtype=torch.uint8,
                                              device=device), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, dequant_fp4(self.weight, self.scale, dtype=x.dtype))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, fp4 e2m1 1x{FP4_BLOCK} blocks"


def keep_quantized_(model: nn.Module, plan: dict[str, TensorSource], strict: bool) -> list[str]:
    """Replace, on a meta model, the `nn.Linear` layers of `FP8_LAYERS` / `FP4_LAYERS` whose checkpoint weight
    (`plan[name + '.weight']`, a tensor-parallel rank's cut included) is FP8 / FP4 with `Fp8Linear` /
    `Fp4Linear` of the same shape; the loader then fills `weight` and `scale` as stored. A layer that cannot be
    kept (a cut off the scale blocks) is an error when `strict`, else stays dequantised. Routed experts go all
    or none per MoE layer (they are stacked). -> names of the replaced layers."""
    chosen: dict[str, type[nn.Module]] = {}
    moe_experts: dict[str, list[str]] = {}  # MoE layer -> its routed expert linears
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        src = plan.get(name + ".weight")
        quant = src.quant if src is not None else None
        if FP4_LAYERS.match(name):
            moe_experts.setdefault(name.split(".experts.")[0], []).append(name)
        if quant == "fp8" and FP8_LAYERS.match(name):
            cls = Fp8Linear
        elif quant == "fp4" and FP4_LAYERS.match(name):
            cls = Fp4Linear
        else:
            continue
        problem = keep_problem(src)
        if problem is not None:
            if strict:
                raise CheckpointError(f"tensor '{name}.weight' cannot stay quantised: {problem}")
            continue
        chosen[name] = cls
    return swap_layers_(model, chosen, moe_experts)


def quantize_layers_(model: nn.Module, cuts: dict) -> list[str]:
    """On a meta target (sharded or not), replace the `nn.Linear` layers an official checkpoint stores quantised
    and the model calls as modules (`FP8_LAYERS` -> `Fp8Linear`, `FP4_LAYERS` -> `Fp4Linear`) with
    empty quantised layers of the same (rank's) shape, as `keep_quantized_` does from a checkpoint's dtypes.
    A layer whose rank cut (`cuts`, from `shard_`) is not on its scale blocks stays plain (a tiny config's
    slices; the real models' cuts all are); routed experts go all or none per MoE layer (they are stacked).
    -> names of the replaced layers."""
    chosen: dict[str, type[nn.Module]] = {}
    moe_experts: dict[str, list[str]] = {}  # MoE layer -> its routed expert linears
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if FP4_LAYERS.match(name):
            moe_experts.setdefault(name.split(".experts.")[0], []).append(name)
            cls, blocks, fits = Fp4Linear, (1, FP4_BLOCK), module.in_features % FP4_BLOCK == 0
        elif FP8_LAYERS.match(name):
            cls, blocks, fits = Fp8Linear, (FP8_BLOCK, FP8_BLOCK), True
        else:
            continue
        cut = cuts.get(name + ".weight")
        if cut is not None and cut.dim is not None:
            fits = fits and cut.start % blocks[cut.dim] == 0 and cut.stop % blocks[cut.dim] == 0
        if fits:
            chosen[name] = cls
    return swap_layers_(model, chosen, moe_experts)


def swap_layers_(model: nn.Module, chosen: dict[str, type[nn.Module]], moe_experts: dict[str, list[str]]
                 ) -> list[str]:
    """Replace each chosen `nn.Linear` of a meta model with an empty `Fp8Linear` / `Fp4Linear` of its (rank's)
    shape; an MoE layer's routed experts (`moe_experts`: layer -> expert linears) go all or none, since they are
    stacked. Stacked expert weights made before are dropped (`ops.moe.stack_experts_` makes new ones).
    -> names of the replaced layers."""
    for experts in moe_experts.values():
        if not all(n in chosen for n in experts):
            for n in experts:
                chosen.pop(n, None)
    for name, cls in chosen.items():
        owner, _, attr = name.rpartition(".")
        out_features, in_features = model.get_submodule(name).weight.shape  # a rank's slice when sharded
        setattr(model.get_submodule(owner), attr, cls(in_features, out_features, device="meta"))
    for module in model.modules():
        if hasattr(module, "_stacked_experts"):
            del module._stacked_experts
    return sorted(chosen)


def dequantize_layers_(model: nn.Module, dtype: torch.dtype) -> list[str]:
    """The inverse of keeping a layer quantised: every `Fp8Linear` / `Fp4Linear` of `model` becomes a bias-free
    `nn.Linear` on the same device whose weight is its exact dequantised value in `dtype` (the fp32 product of
    code and scale, rounded once). Each layer's codes are freed as it goes; stacked expert weights made before are
    dropped (made again from the new layers on the next forward). -> names of the replaced layers. For comparing
    the quantised kernels with the same weights in `dtype` (`bench.quant_greedy`)."""
    names = [name for name, m in model.named_modules() if isinstance(m, (Fp8Linear, Fp4Linear))]
    for name in names:
        q = model.get_submodule(name)
        dequant = dequant_fp8_block if isinstance(q, Fp8Linear) else dequant_fp4
        with torch.no_grad():
            weight = dequant(q.weight.data, q.scale.data, name, dtype)
        linear = nn.Linear(q.in_features, q.out_features, bias=False, device="meta", dtype=dtype)
        linear.weight = nn.Parameter(weight, requires_grad=False)
        owner, _, attr = name.rpartition(".")
        setattr(model.get_submodule(owner) if owner else model, attr, linear)
    for module in model.modules():
        if hasattr(module, "_stacked_experts"):
            del module._stacked_experts
    return names
