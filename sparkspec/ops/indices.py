"""Index-list builders: the ONE place that decides which KV rows each query reads and how wide the lists are.

Pools are laid out per sequence as [raw KV rows lo .. end-1 | compressed entries 0 .. C-1].
"""

from __future__ import annotations

import torch


def swa_index_width(window: int) -> int:
    """Width of a causal sliding-window row (the window includes the current token)."""
    return window


def dspark_index_width(window: int, num_block_rows: int) -> int:
    """Width of a DSpark non-causal row: the last `window` context positions plus every block row.

    Buffers sized by the window alone overflow here (the failure the vLLM ports hit)."""
    return window + num_block_rows


def swa_compressed_indices(
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
        num_comp_max = int((positions.max().item() + 1) // ratio) if positions.numel() else 0
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
