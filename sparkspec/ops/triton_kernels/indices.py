"""Ragged index-list builders (Triton): one launch builds every query's [sliding-window | compressed] row
for a whole flattened batch, or every DSpark non-causal block row. Widths come from `ops.indices`.

Legend: T query tokens, R sequences, K top-k width, W row width. Rows are pool rows shifted by each
sequence's `pool_offsets[r]`; -1 is padding (negative top-k entries are passed through unchanged).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkspec.ops import indices as ref
from sparkspec.ops.registry import accelerated
from sparkspec.ops.triton_kernels.common import check, next_pow2, same_device

_BLOCK_W = 128  # row entries per program


@triton.jit
def _swa_compressed_kernel(
    pos_ptr,  # [T] int absolute positions
    cu_ptr,  # [R+1] int query offsets
    lo_ptr,  # [R] int absolute position of pool row 0
    num_raw_ptr,  # [R] int raw rows in the pool
    offset_ptr,  # [R] int first pool row in the concatenated pool
    topk_ptr,  # [T, K] int compressed entry ids (-1 pad); unused unless HAS_TOPK
    out_ptr,  # [T, W] int64
    num_seqs,
    width,
    num_topk,
    stride_topk,
    stride_out,
    WINDOW: tl.constexpr,
    RATIO: tl.constexpr,
    HAS_TOPK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    # sequence of token t = how many sequence ends lie at or before t
    seqs = tl.arange(0, BLOCK_R)
    ends = tl.load(cu_ptr + 1 + seqs, mask=seqs < num_seqs, other=0x7FFFFFFF).to(tl.int64)
    r = tl.sum((ends <= t).to(tl.int32), axis=0)
    lo = tl.load(lo_ptr + r).to(tl.int64)
    num_raw = tl.load(num_raw_ptr + r).to(tl.int64)
    offset = tl.load(offset_ptr + r).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)

    # [0, WINDOW): positions pos-WINDOW+1 .. pos, newest last
    p = pos - (WINDOW - 1) + cols
    swa = tl.where(p >= tl.maximum(lo, 0), p - lo + offset, -1)
    # [WINDOW, width): compressed entries
    c = cols - WINDOW
    if HAS_TOPK:
        tk = tl.load(topk_ptr + t * stride_topk + c, mask=(c >= 0) & (c < num_topk), other=-1).to(tl.int64)
        comp = tl.where(tk >= 0, tk + num_raw + offset, tk)
    else:  # heavily compressed: every entry j < (pos + 1) // RATIO
        comp = tl.where(c < (pos + 1) // RATIO, c + num_raw + offset, -1)
    row = tl.where(cols < WINDOW, swa, comp)
    tl.store(out_ptr + t * stride_out + cols, row, mask=cols < width)


@triton.jit
def _dspark_block_kernel(
    num_ctx_ptr,  # [R] int committed context rows per sequence
    offset_ptr,  # [R] int first pool row in the concatenated pool
    out_ptr,  # [R * NUM_BLOCK, W] int64
    width,
    stride_out,
    NUM_BLOCK: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    q = tl.program_id(0).to(tl.int64)  # one block query
    cols = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    r = q // NUM_BLOCK
    num_ctx = tl.load(num_ctx_ptr + r).to(tl.int64)
    offset = tl.load(offset_ptr + r).to(tl.int64)
    row = tl.maximum(num_ctx - WINDOW, 0) + cols  # last WINDOW context rows, then every block row
    row = tl.where(row < num_ctx + NUM_BLOCK, row + offset, -1)
    tl.store(out_ptr + q * stride_out + cols, row, mask=cols < width)


def _as_index(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    return t.to(device=device, dtype=torch.int64).contiguous()


@accelerated("ragged_swa_compressed_indices", "cuda", "rocm", "xpu")
def ragged_swa_compressed_indices(
    positions: torch.Tensor,  # [T]
    cu_seqlens_q: torch.Tensor,  # [R+1]
    lo: torch.Tensor,  # [R]
    num_raw: torch.Tensor,  # [R]
    pool_offsets: torch.Tensor,  # [R]
    window: int,
    ratio: int,
    topk: torch.Tensor | None,  # [T, K]
    num_compressed: int | None = None,
) -> torch.Tensor:
    """Triton twin of `ops.indices.ragged_swa_compressed_indices` -> [T, W] int64."""
    T = positions.shape[0]
    R = cu_seqlens_q.numel() - 1
    check(positions.dim() == 1, f"ragged_swa_compressed_indices: positions must be [T], got {tuple(positions.shape)}")
    check(R >= 0 and lo.numel() == R and num_raw.numel() == R and pool_offsets.numel() == R,
          f"ragged_swa_compressed_indices: want cu_seqlens_q [R+1] and lo/num_raw/pool_offsets [R]; got "
          f"{cu_seqlens_q.numel()}, {lo.numel()}, {num_raw.numel()}, {pool_offsets.numel()}")
    check(window >= 1, f"ragged_swa_compressed_indices: window must be >= 1, got {window}")
    if ratio <= 1:
        width, topk = ref.swa_index_width(window), None
    elif topk is not None:
        check(topk.dim() == 2 and topk.shape[0] == T,
              f"ragged_swa_compressed_indices: topk must be [T={T}, K], got {tuple(topk.shape)}")
        check(same_device(positions, topk), "ragged_swa_compressed_indices: positions and topk must share a device")
        width = ref.compressed_index_width(window, topk.shape[1])
    else:
        num = ref.hca_num_compressed(positions, ratio) if num_compressed is None else num_compressed
        width = ref.compressed_index_width(window, num)
    dev = positions.device
    out = torch.empty((T, width), dtype=torch.long, device=dev)
    if T == 0 or width == 0:
        return out
    cu, lo, num_raw, offs = (_as_index(x, dev) for x in (cu_seqlens_q, lo, num_raw, pool_offsets))
    tk = topk.contiguous() if topk is not None else out  # placeholder pointer when unused
    grid = (T, triton.cdiv(width, _BLOCK_W))
    _swa_compressed_kernel[grid](
        positions.contiguous(), cu, lo, num_raw, offs, tk, out,
        R, width, tk.shape[1] if topk is not None else 0, tk.stride(0), out.stride(0),
        WINDOW=window, RATIO=max(ratio, 1), HAS_TOPK=topk is not None, BLOCK_R=max(next_pow2(R), 2),
        BLOCK_W=_BLOCK_W, num_warps=4,
    )
    return out


@accelerated("swa_compressed_indices", "cuda", "rocm", "xpu")
def swa_compressed_indices(
    positions: torch.Tensor,  # [T]
    lo: int,
    num_raw: int,
    window: int,
    ratio: int,
    topk: torch.Tensor | None,  # [T, K]
) -> torch.Tensor:
    """One sequence: the ragged kernel with R = 1 and pool offset 0 -> [T, W] int64."""
    meta = torch.tensor([0, positions.shape[0], lo, num_raw, 0], dtype=torch.long).to(positions.device)
    return ragged_swa_compressed_indices(positions, meta[0:2], meta[2:3], meta[3:4], meta[4:5], window, ratio, topk)


@accelerated("ragged_dspark_block_indices", "cuda", "rocm", "xpu")
def ragged_dspark_block_indices(
    num_ctx: torch.Tensor,  # [R]
    pool_offsets: torch.Tensor,  # [R]
    num_block: int,
    window: int,
) -> torch.Tensor:
    """Triton twin of `ops.indices.ragged_dspark_block_indices` -> [R * num_block, window + num_block] int64."""
    check(num_ctx.dim() == 1 and pool_offsets.shape == num_ctx.shape,
          f"ragged_dspark_block_indices: want num_ctx [R] and pool_offsets [R]; got {tuple(num_ctx.shape)}, "
          f"{tuple(pool_offsets.shape)}")
    check(num_block >= 1 and window >= 0,
          f"ragged_dspark_block_indices: want num_block >= 1 and window >= 0; got {num_block}, {window}")
    width = ref.dspark_index_width(window, num_block)
    dev = num_ctx.device
    out = torch.empty((num_ctx.numel() * num_block, width), dtype=torch.long, device=dev)
    if out.numel() == 0:
        return out
    grid = (out.shape[0], triton.cdiv(width, _BLOCK_W))
    _dspark_block_kernel[grid](
        _as_index(num_ctx, dev), _as_index(pool_offsets, dev), out, width, out.stride(0),
        NUM_BLOCK=num_block, WINDOW=window, BLOCK_W=_BLOCK_W, num_warps=4,
    )
    return out
