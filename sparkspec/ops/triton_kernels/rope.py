"""Row-wise RMS norm and rotary embedding (Triton): one launch for norm, norm + RoPE, or RoPE alone.

Legend: N rows of width F (x viewed as [N, F]), T tokens (each owns N / T consecutive rows: heads), R rotary
dims (the last R of F, interleaved pairs). One program owns BLOCK_R whole rows: it loads a row once in fp32,
normalises it, and rotates each rotary feature with its pair partner, which it loads a second time (pairs are
adjacent: the reload hits in cache) rather than shuffling registers. One rounding, at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkspec.ops.batch_invariant import pinned
from sparkspec.ops.registry import accelerated
from sparkspec.ops.triton_kernels.common import check, next_pow2, same_device

_MAX_TILE = 4096  # elements a program holds: BLOCK_R rows of BLOCK_F features


@triton.jit
def _norm_rope_kernel(
    x_ptr,  # [T, N / T, F]: a token's rows contiguous, tokens stride_xt apart; any float dtype
    w_ptr,  # [F] norm weight (read only when HAS_WEIGHT)
    rot_ptr,  # [T, R/2, 2] fp32 (cos, sin) of each token's rotation (read only when ROPE)
    out_ptr,  # [N, F] the output dtype (SCATTER: a pool [S, F], row out_rows[r] for row r)
    out_rows_ptr,  # [N] int rows of out (read only with SCATTER)
    num_rows,
    width,  # F
    rows_per_token,  # N / T
    rope_start,  # F - R
    eps,
    stride_xt,
    BLOCK_R: tl.constexpr,
    BLOCK_F: tl.constexpr,
    NORM: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    ROPE: tl.constexpr,
    INVERSE: tl.constexpr,  # rotate by the conjugate
    SCATTER: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_F)
    col_ok = cols < width
    mask = (rows < num_rows)[:, None] & col_ok[None, :]
    row_base = rows.to(tl.int64)[:, None] * width
    x_tok = (rows // rows_per_token).to(tl.int64)
    x_base = (x_tok * stride_xt + (rows - x_tok * rows_per_token) * width)[:, None]
    x = tl.load(x_ptr + x_base + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_F]
    if NORM:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / width + eps)  # [BLOCK_R]
        x = x * rstd[:, None]
        if HAS_WEIGHT:
            x = x * tl.load(w_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        in_rope = cols >= rope_start
        k = tl.where(in_rope, cols - rope_start, 0)  # [BLOCK_F] index within the rotary dims
        partner = tl.where(in_rope, cols + 1 - 2 * (k % 2), cols)  # the other half of the pair
        xp = tl.load(x_ptr + x_base + partner[None, :], mask=mask, other=0.0).to(tl.float32)
        if NORM:
            xp = xp * rstd[:, None]
            if HAS_WEIGHT:
                xp = xp * tl.load(w_ptr + partner, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        tok = (rows // rows_per_token).to(tl.int64)
        rot_mask = mask & in_rope[None, :]
        rot_off = tok[:, None] * (width - rope_start) + (k - k % 2)[None, :]  # (cos, sin) of pair k // 2
        cos = tl.load(rot_ptr + rot_off, mask=rot_mask, other=1.0)  # nope features: cos 1, sin 0
        sin = tl.load(rot_ptr + rot_off + 1, mask=rot_mask, other=0.0)
        if INVERSE:
            sin = -sin
        sign = tl.where(k % 2 == 0, -1.0, 1.0)  # (a + ib)(c + is): even a·c - b·s, odd b·c + a·s
        x = x * cos + sign[None, :] * xp * sin
    if SCATTER:
        dest = tl.load(out_rows_ptr + rows, mask=rows < num_rows, other=0).to(tl.int64)
        row_base = dest[:, None] * width
    tl.store(out_ptr + row_base + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=mask)


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float | None, rot: torch.Tensor | None,
            inverse: bool, out_dtype: torch.dtype | None, out: torch.Tensor | None = None,
            out_rows: torch.Tensor | None = None) -> torch.Tensor:
    F = x.shape[-1]
    # tokens need not be adjacent: a column slice of a wider matrix (one GEMM's output for several projections)
    # is read in place
    x = x if x.is_contiguous() or (x.dim() >= 2 and x[0].is_contiguous()) else x.contiguous()
    scatter = out is not None
    if scatter:
        check(x.dim() == 2 and out.dim() == 2 and out.shape[1] == F and out.is_contiguous(),
              f"rope: out must be a contiguous [S, {F}] pool for rows [T, {F}], got {tuple(out.shape)} for "
              f"{tuple(x.shape)}")
        check(out_rows is not None and out_rows.shape == (x.shape[0],) and same_device(x, out, out_rows),
              f"rope: out_rows must be [{x.shape[0]}] on {x.device}")
    else:
        out = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    N = x.numel() // max(F, 1)
    if N == 0:
        return out
    rows_per_token = N // x.shape[0] if x.dim() >= 2 else 1
    stride_xt = x.stride(0) if x.dim() >= 2 else F
    rope_start, rot_real = F, x  # rot_real: any pointer when there is no rotation
    if rot is not None:
        check(rot.is_complex() and rot.dim() == 2 and rot.shape[0] == x.shape[0],
              f"rope: rot must be complex [T={x.shape[0]}, R/2], got {rot.dtype} {tuple(rot.shape)}")
        check(2 * rot.shape[1] <= F, f"rope: {2 * rot.shape[1]} rotary dims exceed the row width {F}")
        check(same_device(x, rot), "rope: x and rot must share a device")
        rot_real = torch.view_as_real(rot.resolve_conj())
        rot_real = rot_real if rot_real.is_contiguous() else rot_real.contiguous()
        rope_start = F - 2 * rot.shape[1]
    if weight is not None:
        check(weight.numel() == F, f"rms_norm: weight has {weight.numel()} entries, rows have {F}")
        check(same_device(x, weight), "rms_norm: x and weight must share a device")
        weight = weight if weight.is_contiguous() else weight.contiguous()
    block_f = next_pow2(F)
    # rows per program from the row count, except in batch-invariant mode: the tile's shape decides how tl.sum
    # splits a row's reduction over threads, so it must not depend on the batch
    block_r = max(1, _MAX_TILE // block_f if pinned() else min(next_pow2(N), _MAX_TILE // block_f))
    _norm_rope_kernel[(triton.cdiv(N, block_r),)](
        x, weight if weight is not None else x, rot_real, out, out_rows if scatter else x, N, F, rows_per_token,
        rope_start,
        float(eps or 0.0), stride_xt, BLOCK_R=block_r, BLOCK_F=block_f, NORM=eps is not None,
        HAS_WEIGHT=weight is not None,
        ROPE=rot is not None, INVERSE=bool(inverse), SCATTER=scatter, num_warps=4,
    )
    return out


@accelerated("rms_norm", "cuda", "rocm", "xpu")
def rms_norm(
    x: torch.Tensor,  # [..., F]
    weight: torch.Tensor | None,  # [F]
    eps: float,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """Triton twin of `ops.rope.rms_norm` -> [..., F] out_dtype (default x.dtype)."""
    check(x.dim() >= 1, "rms_norm: x must have a feature dim")
    return _launch(x, weight, eps, None, False, out_dtype)


@accelerated("rope", "cuda", "rocm", "xpu")
def rope(
    x: torch.Tensor,  # [T, ..., F]
    rot: torch.Tensor,  # [T, R/2] complex64
    inverse: bool = False,
    norm_weight: torch.Tensor | None = None,  # [F]
    norm_eps: float | None = None,
    out_dtype: torch.dtype | None = None,
    out: torch.Tensor | None = None,  # [S, F] a pool: rows go to out[out_rows] (the cache write in this launch)
    out_rows: torch.Tensor | None = None,  # [T]
) -> torch.Tensor:
    """Triton twin of `ops.rope.rope` -> [T, ..., F] out_dtype (default x.dtype), or `out` with its rows written."""
    check(x.dim() >= 2, f"rope: x must be [T, ..., F], got {tuple(x.shape)}")
    check(norm_weight is None or norm_eps is not None, "rope: norm_weight without norm_eps")
    return _launch(x, norm_weight, norm_eps, rot, inverse, out_dtype, out, out_rows)
