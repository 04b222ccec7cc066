"""The LM head (Triton): fp32 activations times a bf16 weight, read once, with exact products.

Legend: M rows of h, N vocabulary rows of the weight, K hidden.

Each fp32 activation is split into three bf16 pieces, h = h1 + h2 + h3 exactly (8 significant bits each). A bf16
piece times a bf16 weight is exact in fp32, so three bf16 tensor-core dots per weight tile with fp32 accumulation
give h · w with exact products: only the order (and, on tensor cores, the rounding) of the fp32 sums differs from
an fp32 GEMM on the fp32-cast weight. Tensor-core dots need >= 16 rows, so a batch of 1 pads h to 16 rows: the
extra MMAs are free next to streaming the weight (V x H bf16 = 1.06 GB for DeepSeek-V4-Flash, ~0.25 ms at
4.3 TB/s), which is the floor from batch 1 to 64. Programs walk M fastest, so the M blocks of one weight tile run
together and share it through L2.

In the interpreter (CPU tests), whose bf16 dots are wrong, the same pieces go through ieee fp32 dots.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkspec.ops.triton_kernels.common import check, on_interpreter, same_device
from sparkspec.ops.triton_kernels.compressor import _split3_bf16


@triton.jit
def _lm_head_kernel(
    h_ptr,  # [M, K] fp32
    w_ptr,  # [N, K] bf16
    out_ptr,  # [M, N] fp32
    M,
    N,
    K,
    stride_hm,
    stride_wn,
    stride_om,
    BF16_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)  # int64: M·N passes 2^31 at M > 16k
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        h = tl.load(h_ptr + rows[:, None] * stride_hm + ks[None, :], mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        w = tl.load(w_ptr + cols[:, None] * stride_wn + ks[None, :], mask=col_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_N, BLOCK_K] bf16
        h1, h2, h3 = _split3_bf16(h)
        if BF16_DOT:
            wt = tl.trans(w)
            acc = tl.dot(h3, wt, acc)  # the small pieces first
            acc = tl.dot(h2, wt, acc)
            acc = tl.dot(h1, wt, acc)
        else:
            wt = tl.trans(w.to(tl.float32))
            acc = tl.dot(h3.to(tl.float32), wt, acc, input_precision="ieee")
            acc = tl.dot(h2.to(tl.float32), wt, acc, input_precision="ieee")
            acc = tl.dot(h1.to(tl.float32), wt, acc, input_precision="ieee")
    tl.store(out_ptr + rows[:, None] * stride_om + cols[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


HEAD_DECODE = (16, 128, 64, 4, 3)  # up to 16 rows (also batch-invariant mode's tile at every M)
HEAD_WIDE = (64, 256, 64, 4, 4)  # from 17 rows


def head_config(M: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) for M rows, from a sweep on the H200 (CUDA graphs;
    `ops/triton_kernels/NOTES.md`): V = 129,280, H = 4,096 took 271 us at M = 1 with the 16-row tile (0.43 ms
    with the earlier 64-column, 128-deep one; the weight streams in ~0.22 ms) and 445 us at M = 64 with 64 rows
    by 256 columns (the 16-row tile re-reads the weight per 16 rows: 925 us)."""
    return HEAD_DECODE if M <= 16 else HEAD_WIDE


def lm_head_triton(
    h: torch.Tensor,  # [M, K] fp32
    weight: torch.Tensor,  # [N, K] bf16
    config: tuple[int, int, int, int, int] | None = None,  # head_config's fields, for sweeps
) -> torch.Tensor:
    """-> [M, N] fp32 = h · weightᵀ (exact products, fp32 sums): `ops.head.lm_head` on a bf16 weight."""
    check(h.dim() == 2 and weight.dim() == 2 and h.shape[1] == weight.shape[1],
          f"lm_head: want h [M, K] and weight [N, K], got {tuple(h.shape)} and {tuple(weight.shape)}")
    check(h.dtype == torch.float32, f"lm_head: h must be fp32, got {h.dtype}")
    check(weight.dtype == torch.bfloat16, f"lm_head: the Triton head reads a bf16 weight, got {weight.dtype}")
    check(same_device(h, weight), "lm_head: one device for all")
    (M, K), N = h.shape, weight.shape[0]
    out = torch.empty(M, N, dtype=torch.float32, device=h.device)
    if M == 0 or N == 0:
        return out
    h = h if h.stride(-1) == 1 else h.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    block_m, block_n, block_k, warps, stages = config or head_config(M)
    grid = (triton.cdiv(M, block_m), triton.cdiv(N, block_n))
    _lm_head_kernel[grid](
        h, weight, out, M, N, K, h.stride(0), weight.stride(0), out.stride(0), BF16_DOT=not on_interpreter(h),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=warps, num_stages=stages,
    )
    return out
