"""Linears that read one input, run as one GEMM: their weights are stacked once along the output dim and the
modules' parameters re-pointed to row blocks of the stack (no copy is kept), so a layer launches one GEMM where
it had two or three (attention's wq_a / wkv / the indexer's weights_proj on the layer input, the shared expert's
w1 / w3). Parameter names, values and `state_dict()` are unchanged; in-place loads land in the stack. Anything
that replaces a parameter's storage later (`.to(device / dtype)`, a reload by assignment) breaks the sharing,
which the next call notices (data pointers) and stacks again.

Only plain bias-free `nn.Linear`s of one dtype and device are stacked: quantised layers (`Fp8Linear`, whose
forward dequantises per block) and autograd (training wants each parameter's own gradient) run one GEMM per
module, as before.
"""

from __future__ import annotations

import torch
from torch import nn

from sparkspec.ops.registry import ops


def _stackable(linears: tuple[nn.Module, ...]) -> bool:
    w0 = linears[0].weight
    return all(type(m) is nn.Linear and m.bias is None and m.weight.dtype == w0.dtype and m.weight.device == w0.device
               and m.weight.shape[1] == w0.shape[1] for m in linears)


def _shares(stack: torch.Tensor, linears: tuple[nn.Module, ...]) -> bool:
    row, step = stack.data_ptr(), stack.stride(0) * stack.element_size()
    for m in linears:
        w = m.weight
        if w.data_ptr() != row or w.dtype != stack.dtype or w.device != stack.device or not w.is_contiguous():
            return False
        row += w.shape[0] * step
    return row == stack.data_ptr() + stack.shape[0] * step


def stacked_weight(linears: tuple[nn.Module, ...]) -> torch.Tensor | None:
    """[Σ out, in] weight of `linears` (kept on the first module), or None where they cannot share one."""
    if len(linears) == 1 or not _stackable(linears) or (torch.is_grad_enabled() and any(
            m.weight.requires_grad for m in linears)):
        return None
    key = tuple(id(m) for m in linears)
    cached = getattr(linears[0], "_stacked_weight", None)
    if cached is not None and cached[0] == key and _shares(cached[1], linears):
        return cached[1]
    with torch.inference_mode(False), torch.no_grad():  # normal tensors even when first called from inference
        stack = torch.cat([m.weight.detach() for m in linears])
        row = 0
        for m in linears:
            n = m.weight.shape[0]
            m.weight.data = stack[row : row + n]
            row += n
    linears[0]._stacked_weight = (key, stack)  # a plain attribute: not in state_dict, not moved by .to()
    return stack


def stacked_linear(x: torch.Tensor, *linears: nn.Module) -> torch.Tensor | None:
    """x [T, in] -> [T, Σ out]: the outputs of `linears` side by side from one GEMM, or None where they cannot
    share a stacked weight (the caller then runs them one by one)."""
    stack = stacked_weight(linears)
    return None if stack is None else ops.linear(x, stack)


def fused_linear(x: torch.Tensor, *linears: nn.Module) -> tuple[torch.Tensor, ...]:
    """(m(x) for m in linears), through one GEMM where they can share a stacked weight: then column slices of
    its output (views with the stack's row stride: a kernel that reads strides takes them as they are)."""
    y = stacked_linear(x, *linears)
    if y is None:
        return tuple(dense(m, x) for m in linears)
    return y.split([m.weight.shape[0] for m in linears], dim=-1)


def dense(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """module(x), with a plain `nn.Linear` through `ops.linear` (a Triton GEMM for decode-sized steps on CUDA);
    quantised layers (`Fp8Linear`, ...) and subclasses run their own forward."""
    if type(module) is nn.Linear:
        return ops.linear(x, module.weight, module.bias)
    return module(x)
