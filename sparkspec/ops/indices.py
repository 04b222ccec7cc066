"""Index lists: the ONE place that decides which pool rows each query reads and how wide the lists are.

Legend: T queries, R requests, W window, K chosen compressed entries (CSA top-k), C visible compressed entries
(HCA), k DSpark block rows. Pools are paged (`models/cache.py`): a layer's `attn` pool holds, per block, bs raw
K=V rows then the block's compressed entries, so a query's list mixes both kinds of row in one tensor. -1 pads.
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


def paged_attention_indices(
    positions: torch.Tensor,  # [T] absolute positions of the queries
    req_idx: torch.Tensor,  # [T] request row of each query
    block_tables: torch.Tensor,  # [R, max_blocks] block ids
    block_size: int,
    window: int,
    ratio: int,  # 1 = sliding only
    topk: torch.Tensor | None,  # [T, K] chosen compressed entries (-1 pad) for CSA; None = all visible (HCA)
    num_compressed: int,  # HCA: C, the compressed columns (entries j < C; each query sees j < (pos + 1) // ratio)
) -> torch.Tensor:
    """Causal sliding window, then compressed entries -> [T, W + K] (CSA) or [T, W + C] (HCA) int64 rows
    of the layer's `attn` pool (see `models/cache.py`), -1 padded."""
    return ops.paged_attention_indices(positions, req_idx, block_tables, block_size, window, ratio, topk,
                                       num_compressed)


def pool_rows(block_tables, req, positions, block_size, rows_per_block, first_row=0, ratio=1):
    """Pool rows of raw positions (ratio 1) or of compressed entries (positions = entry ids), -1 where < 0."""
    q = positions.clamp(min=0) * ratio
    blk = block_tables[req, q // block_size]
    return torch.where(positions >= 0, blk * rows_per_block + first_row + (q % block_size) // ratio, -1)


@native("paged_attention_indices")
def _paged_attention_indices_native(positions, req_idx, block_tables, block_size, window, ratio, topk,
                                    num_compressed):
    e = -(-block_size // ratio) if ratio > 1 else 0
    rows_per_block = block_size + e
    req = req_idx.unsqueeze(1)  # [T, 1]
    swa_pos = positions.unsqueeze(1) - torch.arange(window - 1, -1, -1, device=positions.device)  # [T, W] newest last
    swa = pool_rows(block_tables, req, swa_pos, block_size, rows_per_block)
    if ratio <= 1:
        return swa
    if topk is None:  # heavily compressed: every entry j < (pos + 1) // ratio
        j = torch.arange(num_compressed, device=positions.device).unsqueeze(0)  # [1, C]
        topk = torch.where(j < ((positions + 1) // ratio).unsqueeze(1), j, -1)
    comp = pool_rows(block_tables, req, topk, block_size, rows_per_block, block_size, ratio)
    return torch.cat([swa, comp], dim=1)


def window_rows(
    anchor: torch.Tensor,  # [R] position of each request's first block row (= committed positions)
    req: torch.Tensor,  # [R] request row in block_tables
    block_tables: torch.Tensor,  # [R', max_blocks]
    block_size: int,
    window: int,
) -> torch.Tensor:
    """Pool rows (rows_per_block = block_size) of the `window` positions before each anchor, oldest first ->
    [R, W], -1 for positions < 0. The context a drafter block reads."""
    pos = anchor.unsqueeze(1) - window + torch.arange(window, device=anchor.device)  # [R, W]
    return pool_rows(block_tables, req.unsqueeze(1), pos, block_size, block_size)


def dspark_block_indices(
    ctx_rows: torch.Tensor,  # [R, W] rows of a pool (-1 = none)
    num_pool_rows: int,  # rows of that pool; block rows are appended behind it
    num_block: int,
) -> torch.Tensor:
    """Non-causal block rows: every block query of request r reads its context rows and all k block rows of r
    (pool rows num_pool_rows + r·k ..) -> [R·k, dspark_index_width(W, k)]."""
    R = ctx_rows.shape[0]
    block = num_pool_rows + torch.arange(R * num_block, device=ctx_rows.device).view(R, num_block)
    row = torch.cat([ctx_rows, block], dim=1)  # [R, W + k]
    return row.repeat_interleave(num_block, dim=0)
