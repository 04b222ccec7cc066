"""Index-list builders: the ONE place that decides which KV rows each query reads and how wide the lists are.

Pools are laid out per sequence as [raw KV rows lo .. end-1 | compressed entries 0 .. C-1].
A ragged batch concatenates the pools of R sequences; `pool_offsets[r]` is sequence r's first row there.
The public builders dispatch through the op table (a Triton kernel on accelerators); the `_..._native`
functions below are the PyTorch references and the test oracle.
"""

from __future__ import annotations

import torch

from sparkspec.ops.registry import native, ops


def swa_index_width(window: int) -> int:
    """Width of a causal sliding-window row (the window includes the current token)."""
    return window


def dspark_index_width(window: int, num_block_rows: int) -> int:
    """Width of a DSpark non-causal row: the last `window` context positions plus every block row.

    Buffers sized by the window alone overflow here (the failure the vLLM ports hit)."""
    return window + num_block_rows


def compressed_index_width(window: int, num_compressed: int) -> int:
    """Width of a [sliding-window rows | compressed rows] list (num_compressed = top-k for CSA, all visible for HCA)."""
    return swa_index_width(window) + num_compressed


def hca_num_compressed(positions: torch.Tensor, ratio: int) -> int:
    """Compressed entries visible to the newest query of a heavily compressed layer (host sync)."""
    return int((positions.max().item() + 1) // ratio) if positions.numel() else 0


def swa_compressed_indices(
    positions: torch.Tensor,  # [T] absolute positions of the queries
    lo: int,  # absolute position of pool row 0
    num_raw: int,  # raw KV rows in the pool (positions lo .. lo+num_raw-1)
    window: int,
    ratio: int,  # 1 = sliding only
    topk: torch.Tensor | None,  # [T, K] chosen compressed entries (-1 pad) for CSA; None = all visible (HCA)
) -> torch.Tensor:
    """Causal sliding window + compressed entries visible at each position -> [T, W] pool rows, -1 padded."""
    return ops.swa_compressed_indices(positions, lo, num_raw, window, ratio, topk)


def ragged_swa_compressed_indices(
    positions: torch.Tensor,  # [T] absolute positions; sequence r owns positions[cu_seqlens_q[r]:cu_seqlens_q[r+1]]
    cu_seqlens_q: torch.Tensor,  # [R+1] int query offsets
    lo: torch.Tensor,  # [R] int absolute position of each sequence's pool row 0
    num_raw: torch.Tensor,  # [R] int raw KV rows in each sequence's pool
    pool_offsets: torch.Tensor,  # [R] int first row of each sequence's pool in the concatenated pool
    window: int,
    ratio: int,
    topk: torch.Tensor | None,  # [T, K] per-sequence compressed entry ids (-1 pad); None = all visible (HCA)
    num_compressed: int | None = None,  # HCA width of the compressed part; None = from positions (host sync)
) -> torch.Tensor:
    """`swa_compressed_indices` for a whole ragged batch in one call, rows shifted into the concatenated pool
    -> [T, compressed_index_width(window, ·)] int64, -1 padded."""
    return ops.ragged_swa_compressed_indices(positions, cu_seqlens_q, lo, num_raw, pool_offsets, window, ratio, topk,
                                             num_compressed)


def ragged_dspark_block_indices(
    num_ctx: torch.Tensor,  # [R] int committed context rows of each sequence (its pool rows 0..num_ctx-1)
    pool_offsets: torch.Tensor,  # [R] int first row of each sequence's pool in the concatenated pool
    num_block: int,
    window: int,
) -> torch.Tensor:
    """`dspark_block_indices` for R sequences at once -> [R * num_block, dspark_index_width(window, num_block)]."""
    return ops.ragged_dspark_block_indices(num_ctx, pool_offsets, num_block, window)


def _shift(idx: torch.Tensor, offset: int) -> torch.Tensor:
    return torch.where(idx >= 0, idx + offset, idx)


@native("swa_compressed_indices")
def _swa_compressed_indices_native(
    positions: torch.Tensor,  # [T] absolute positions of the queries
    lo: int,  # absolute position of pool row 0
    num_raw: int,  # raw KV rows in the pool (positions lo .. lo+num_raw-1)
    window: int,
    ratio: int,  # 1 = sliding only
    topk: torch.Tensor | None,  # [T, K] chosen compressed entries (-1 pad) for CSA; None = all visible (HCA)
) -> torch.Tensor:
    """Causal sliding window + compressed entries visible at each position -> [T, W] pool rows, -1 padded."""
    dev = positions.device
    offs = torch.arange(window - 1, -1, -1, device=dev)  # newest last
    pos = positions.unsqueeze(1) - offs  # [T, window]
    swa = torch.where(pos >= max(lo, 0), pos - lo, torch.full_like(pos, -1))
    swa = torch.where(pos >= 0, swa, torch.full_like(pos, -1))
    if ratio <= 1:
        return swa
    if topk is None:  # heavily compressed: every entry j < (t+1)//ratio
        num_comp_max = hca_num_compressed(positions, ratio)
        j = torch.arange(num_comp_max, device=dev).unsqueeze(0)
        visible = j < ((positions + 1) // ratio).unsqueeze(1)
        comp = torch.where(visible, j + num_raw, torch.full_like(j, -1))
    else:
        comp = torch.where(topk >= 0, topk + num_raw, topk)
    return combine_topk_swa(comp, swa)


def combine_topk_swa(comp: torch.Tensor, swa: torch.Tensor) -> torch.Tensor:
    """Merge compressed-entry rows [T, K] with sliding-window rows [T, W] into one list [T, K + W]."""
    return torch.cat([swa, comp], dim=1)


def dspark_block_indices(
    num_ctx: int,  # committed context rows available in the pool (ctx rows are pool rows 0..num_ctx-1, oldest first)
    num_block: int,  # block rows, pool rows num_ctx .. num_ctx+num_block-1
    window: int,
    device: torch.device,
) -> torch.Tensor:
    """Non-causal block rows: every block query reads the last `window` context rows and all block rows.
    -> [num_block, dspark_index_width(window, num_block)] pool rows, -1 padded."""
    width = dspark_index_width(window, num_block)
    ctx_lo = max(num_ctx - window, 0)
    row = torch.cat([torch.arange(ctx_lo, num_ctx + num_block, device=device)])
    row = torch.nn.functional.pad(row, (0, width - row.numel()), value=-1)
    return row.unsqueeze(0).expand(num_block, -1).contiguous()


@native("ragged_swa_compressed_indices")
def _ragged_swa_compressed_indices_native(positions, cu_seqlens_q, lo, num_raw, pool_offsets, window, ratio, topk,
                                          num_compressed=None):
    if ratio <= 1:
        width = swa_index_width(window)
    elif topk is not None:
        width = compressed_index_width(window, topk.shape[1])
    else:
        width = compressed_index_width(window, hca_num_compressed(positions, ratio) if num_compressed is None
                                       else num_compressed)
    cu = cu_seqlens_q.tolist()
    out = torch.full((positions.shape[0], width), -1, dtype=torch.long, device=positions.device)
    for r, (s, e) in enumerate(zip(cu[:-1], cu[1:])):
        if e == s:
            continue
        idx = _swa_compressed_indices_native(positions[s:e], int(lo[r]), int(num_raw[r]), window, ratio,
                                             None if topk is None else topk[s:e])
        out[s:e, : idx.shape[1]] = _shift(idx, int(pool_offsets[r]))
    return out


@native("ragged_dspark_block_indices")
def _ragged_dspark_block_indices_native(num_ctx, pool_offsets, num_block, window):
    rows = [_shift(dspark_block_indices(int(c), num_block, window, num_ctx.device), int(o))
            for c, o in zip(num_ctx.tolist(), pool_offsets.tolist())]
    if not rows:
        return torch.empty((0, dspark_index_width(window, num_block)), dtype=torch.long, device=num_ctx.device)
    return torch.cat(rows, dim=0)
