"""Dense linears of 16-bit weights: y = x · Wᵀ (+ b).

Legend: M rows of x (tokens of the step), N output features, K input features.

The native version is `F.linear` (cuBLAS on a GPU). At decode sizes cuBLAS spends several microseconds on
GEMMs that move a few MB: on the H200, bench-1b's shapes (N, K of 128..2048) took 2.9-12.4 us at M = 1 under
CUDA graphs, where the batch-invariant Triton GEMM (`triton_kernels.batch_invariant`, one 16-row tile, the
whole K in one program) took 2.5-5.1 (`ops/triton_kernels/NOTES.md`). So on CUDA, up to SMALL_M_MAX rows of a
bf16 / fp16 linear go to that kernel; larger M (prefill) and other dtypes stay with cuBLAS. In batch-invariant
mode every GEMM is that kernel anyway (the aten override), with the same tile: the two paths give the same bits.
Only plain `nn.Linear` modules come here (`models.fused_linear.dense`); quantised layers run their own forward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparkspec.ops.registry import accelerated, native

SMALL_M_MAX = 64  # rows up to which the accelerated linear takes the Triton GEMM (measured up to 64 on the H200)
_HALF = (torch.bfloat16, torch.float16)


@native("linear")
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] · weight [N, K]ᵀ (+ bias [N]) -> [..., N] in x.dtype (`F.linear`)."""
    return F.linear(x, weight, bias)


@accelerated("linear", "cuda")
def linear_small_m(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`linear` with the Triton GEMM for a few rows of a 16-bit linear (module docstring), else `F.linear`."""
    K = weight.shape[-1]
    rows = x.numel() // K if K else 0
    if (x.dtype not in _HALF or weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype)
            or not 0 < rows <= SMALL_M_MAX or x.shape[-1] != K
            or (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad))):
        return F.linear(x, weight, bias)
    from sparkspec.ops.triton_kernels.batch_invariant import matmul_invariant

    y = matmul_invariant(x.reshape(rows, K), weight.t(), bias)
    return y.view(*x.shape[:-1], weight.shape[0])
