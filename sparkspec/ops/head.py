"""The LM head: logits = h · Wᵀ in fp32, for a bf16 (or fp32) head weight.

Legend: T rows (the batch's logits rows), H hidden, V vocabulary rows of this rank's head (V / world under a
vocab-parallel head).

The reference multiplies fp32 activations by the weight in fp32. A bf16 weight is exact in fp32, so the native
version keeps an fp32 copy of it (2.1 GB for V = 129,280, H = 4,096) and runs cuBLAS sgemm / gemv on it. The
accelerated version reads the bf16 weight itself (half the bytes, no copy): see `triton_kernels.head`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from sparkspec.ops.registry import accelerated, native


@native("lm_head")
def lm_head(
    h: torch.Tensor,  # [T, H] fp32 (normed final hidden states)
    weight: torch.Tensor,  # [V, H] the head weight as stored (bf16 or fp32)
    weight_fp32: Callable[[], torch.Tensor] | None = None,  # -> [V, H] fp32 copy of `weight` (cached by the caller)
) -> torch.Tensor:
    """-> logits [T, V] fp32 = h · weightᵀ with both operands in fp32. `weight_fp32`, when given, supplies the
    fp32 weight (a copy the caller keeps, so that it is not cast on every call); accelerated versions that read
    `weight` directly never call it."""
    w = weight_fp32() if weight_fp32 is not None else weight.float()
    return F.linear(h.float(), w)


@accelerated("lm_head", "cuda", "rocm", "xpu")
def lm_head_accelerated(
    h: torch.Tensor,  # [T, H] fp32
    weight: torch.Tensor,  # [V, H]
    weight_fp32: Callable[[], torch.Tensor] | None = None,
) -> torch.Tensor:
    """A bf16 weight: the Triton kernel on the bf16 weight (exact products, fp32 sums; no fp32 copy is made).
    Any other weight dtype: the native version."""
    needs_grad = torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad)  # the kernel has no backward
    if weight.dtype != torch.bfloat16 or h.dtype != torch.float32 or needs_grad:
        return lm_head(h, weight, weight_fp32)
    from sparkspec.ops.triton_kernels.head import lm_head_triton

    return lm_head_triton(h, weight)
