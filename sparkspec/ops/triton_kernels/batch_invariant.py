"""A batch-invariant (batched) GEMM: c[b] = a[b] · bm[b] (+ bias), one fixed tile for every row count.

Legend: B batch of matrices (1 for mm / linear), M rows (tokens), N output columns, K the reduced dim.

Why: cuBLAS picks its algorithm, tile and split-K by the shapes, M included, so the order in which one row's K
products are summed (and thus its rounding) changes with how many rows the step has: a request's greedy tokens
then depend on the batch it ran in. Here every launch uses the same tile (`invariant_tile`: BLOCK_M, BLOCK_K and
the warp count fixed; BLOCK_N a function of N only, which is the weight's, not the batch's), no split-K, and one
program owns an output tile for the whole K loop: row m's sum is Σ over K tiles in increasing k0, each tile's
partial product by the same `tl.dot` instruction sequence whatever M is and wherever m sits in its block (rows
of a dot never mix). So c[m] depends on a[m] and the weight only. fp32 accumulation; 16-bit operands go to
tensor-core dots (exact products), fp32 operands to exact (`ieee`) fp32 dots; the output is rounded once to
the inputs' dtype. In the interpreter (CPU tests), whose 16-bit dots are wrong, operands are upcast to fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkspec.ops.triton_kernels.common import check, on_interpreter, same_device

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def _bi_matmul_kernel(
    a_ptr,  # [B, M, K] any strides
    b_ptr,  # [B, K, N] any strides (a linear's weight [N, K] passed transposed)
    bias_ptr,  # [N] (unused without HAS_BIAS)
    c_ptr,  # [B, M, N] contiguous
    M,
    N,
    K,
    stride_ab, stride_am, stride_ak,
    stride_bb, stride_bk, stride_bn,
    HAS_BIAS: tl.constexpr,
    HALF_DOT: tl.constexpr,  # 16-bit operands straight into tl.dot; else fp32 operands, exact products
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # M fastest: the row blocks of one weight tile run together and share it through L2
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    batch = tl.program_id(2).to(tl.int64)
    row_ok, col_ok = rows < M, cols < N
    a_rows = a_ptr + batch * stride_ab + rows.to(tl.int64) * stride_am  # [BLOCK_M]
    b_cols = b_ptr + batch * stride_bb + cols * stride_bn  # [BLOCK_N]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # the one K order of every row
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(a_rows[:, None] + ks[None, :].to(tl.int64) * stride_ak, mask=row_ok[:, None] & k_ok[None, :],
                    other=0.0)  # [BLOCK_M, BLOCK_K]
        b = tl.load(b_cols[None, :] + ks[:, None].to(tl.int64) * stride_bk, mask=k_ok[:, None] & col_ok[None, :],
                    other=0.0)  # [BLOCK_K, BLOCK_N]
        if HALF_DOT:
            acc = tl.dot(a, b, acc)
        else:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    c = c_ptr + batch * M * N + rows[:, None].to(tl.int64) * N + cols[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def invariant_tile(N: int, interpreter: bool) -> tuple[int, int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages): never a function of M (that is the point). BLOCK_N
    shrinks for narrow weights so that a batch-1 step still has programs to spread over the SMs (N is fixed by
    the layer). Untuned first choices: the GPU script measures their cost against cuBLAS."""
    if interpreter:
        return 16, 32, 32, 4, 1
    return 64, (32 if N <= 2048 else 64), 64, 4, 3


def matmul_invariant(
    a: torch.Tensor,  # [M, K] or [B, M, K]
    b: torch.Tensor,  # [K, N] or [B, K, N] (for a linear: weight.t())
    bias: torch.Tensor | None = None,  # [N]
) -> torch.Tensor:
    """-> a · b (+ bias) [M, N] / [B, M, N] in a.dtype, with fp32 accumulation and a reduction order per row that
    does not depend on M (module docstring)."""
    check(a.dim() == b.dim() and a.dim() in (2, 3), f"matmul_invariant: want a [M, K] and b [K, N] (or batched "
          f"[B, M, K], [B, K, N]), got {tuple(a.shape)} and {tuple(b.shape)}")
    check(a.shape[-1] == b.shape[-2] and (a.dim() == 2 or a.shape[0] == b.shape[0]),
          f"matmul_invariant: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
    check(a.dtype == b.dtype and a.dtype in SUPPORTED_DTYPES,
          f"matmul_invariant: a and b must share a dtype in {SUPPORTED_DTYPES}, got {a.dtype} and {b.dtype}")
    check(same_device(a, b) and (bias is None or same_device(a, bias)), "matmul_invariant: one device for all")
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a.unsqueeze(0), b.unsqueeze(0))
    (B, M, K), N = a3.shape, b3.shape[2]
    check(bias is None or (bias.dim() == 1 and bias.shape[0] == N),
          f"matmul_invariant: bias must be [{N}], got {None if bias is None else tuple(bias.shape)}")
    c = torch.empty(B, M, N, dtype=a.dtype, device=a.device)
    if c.numel() == 0 or K == 0:
        c = c.zero_() if K == 0 else c
        if K == 0 and bias is not None:
            c += bias.to(c.dtype)
        return c if batched else c[0]
    interp = on_interpreter(a)
    bm, bn, bk, warps, stages = invariant_tile(N, interp)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn), B)
    _bi_matmul_kernel[grid](
        a3, b3, bias if bias is not None else c, c, M, N, K,
        a3.stride(0), a3.stride(1), a3.stride(2), b3.stride(0), b3.stride(1), b3.stride(2),
        HAS_BIAS=bias is not None, HALF_DOT=a.dtype != torch.float32 and not interp,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps, num_stages=stages,
    )
    return c if batched else c[0]
