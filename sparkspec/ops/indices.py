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


def pool_rows(block_tables, req, positions, block_size, rows_per_block, first_row=0, ratio=1, fill=-1):
    """Pool rows of raw positions (ratio 1) or of compressed entries (positions = entry ids), `fill` where < 0
    (-1; a caller that needs a valid row passes the trash row or 0). One op (`ops.pool_rows`): an accelerator takes
    it in one launch, where the native takes one integer kernel per step of the arithmetic."""
    return ops.pool_rows(block_tables, req, positions, block_size, rows_per_block, first_row, ratio, fill)


@native("pool_rows")
def _pool_rows_native(
    block_tables: torch.Tensor,  # [R, max_blocks]
    req: torch.Tensor,  # [*] request rows (broadcast with positions)
    positions: torch.Tensor,  # [*]
    block_size: int,
    rows_per_block: int,
    first_row: int = 0,
    ratio: int = 1,
    fill: int = -1,
) -> torch.Tensor:
    p = positions.clamp(min=0)
    if block_size % ratio == 0:  # ratio 1, or several entries per block
        per_block = block_size // ratio
        col, offset = p // per_block, p % per_block
    else:  # one entry per block, every (ratio / block_size)-th block
        col, offset = p * (ratio // block_size), None
    blk = block_tables[req, col]
    if offset is None:
        rows = blk * rows_per_block + first_row
    else:
        rows = torch.add(offset + first_row if first_row else offset, blk, alpha=rows_per_block)
    return torch.where(positions >= 0, rows, fill)


def emission_plan(
    emit: torch.Tensor,  # [M] rows of the step whose position closes an entry (-1 pads)
    positions: torch.Tensor,  # [T]
    req_idx: torch.Tensor,  # [T]
    block_tables: torch.Tensor,  # [R, max_blocks]
    block_size: int,
    ratio: int,
    span: int,  # positions an entry pools (ratio, or 2·ratio with overlapping windows)
    trash_attn: int,  # the `attn` pool's trash row (pads write there)
    trash_keys: int,  # the `idx_keys` pool's
) -> tuple[torch.Tensor, ...]:
    """Where this step's compressed entries of one ratio come from and go to (`models.forward_batch.Emission`) ->
    (last [M]: the position closing each entry, -1 for pads; entry_ids [M]: j = (last + 1) / ratio - 1, -1 for pads;
    first [M]: last + 1 - ratio, the entry's first position (its rotation); gather [M, span]: per-position pool rows
    of positions last - span + 1 .. last, 0 where < 0; missing [M, span]: those positions < 0; attn_rows [M],
    key_rows [M]: the entries' rows in the `attn` pool (after the bs raw rows of a block) and the `idx_keys` pool,
    the trash rows for pads). One op: an accelerator takes it in one launch, the native in a score of small ones."""
    return ops.emission_plan(emit, positions, req_idx, block_tables, block_size, ratio, span, trash_attn, trash_keys)


@native("emission_plan")
def _emission_plan_native(emit, positions, req_idx, block_tables, block_size, ratio, span, trash_attn, trash_keys):
    valid = emit >= 0
    last = torch.where(valid, positions[emit.clamp(min=0)], -1)
    req = req_idx[emit.clamp(min=0)]
    entry_ids = torch.where(valid, (last + 1) // ratio - 1, -1)
    pos = last.unsqueeze(1) - span + 1 + torch.arange(span, device=last.device)  # [M, span]
    gather = pool_rows(block_tables, req.unsqueeze(1), pos, block_size, block_size, fill=0)
    e = -(-block_size // ratio)
    attn = pool_rows(block_tables, req, entry_ids, block_size, block_size + e, block_size, ratio, trash_attn)
    keys = pool_rows(block_tables, req, entry_ids, block_size, e, 0, ratio, trash_keys)
    return last, entry_ids, last + 1 - ratio, gather, pos < 0, attn, keys


def window_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """Positions pos - W + 1 .. pos of each query's causal sliding window, newest last -> [T, W] (< 0 before 0)."""
    return positions.unsqueeze(1) - torch.arange(window - 1, -1, -1, device=positions.device)


def sliding_rows(positions, req_idx, block_tables, block_size, window, rows_per_block) -> torch.Tensor:
    """Causal sliding window: rows of positions pos - W + 1 .. pos, newest last -> [T, W], -1 before 0."""
    return pool_rows(block_tables, req_idx.unsqueeze(1), window_positions(positions, window), block_size,
                     rows_per_block)


def entry_table(block_tables: torch.Tensor, block_size: int, ratio: int, num_compressed: int) -> torch.Tensor:
    """`attn`-pool rows of every request's compressed entries j < C, then one -1 column -> [R, C + 1]. Indexing it
    with chosen entry ids sends their -1 pads to that column: one gather per layer (`chosen_rows`)."""
    R, dev = block_tables.shape[0], block_tables.device
    j = torch.arange(num_compressed + 1, device=dev)
    j = torch.where(j < num_compressed, j, -1).unsqueeze(0)  # [1, C + 1]
    reqs = torch.arange(R, device=dev).unsqueeze(1)  # [R, 1]
    return pool_rows(block_tables, reqs, j, block_size, block_size + -(-block_size // ratio), block_size, ratio)


def chosen_rows(
    window_rows: torch.Tensor,  # [T, W] `sliding_rows`
    table: torch.Tensor,  # [R, C + 1] `entry_table`
    req_idx: torch.Tensor,  # [T]
    topk: torch.Tensor,  # [T, K] chosen entries j < C, -1 pads
) -> torch.Tensor:
    """CSA index lists from per-step pieces -> [T, W + K]: `paged_attention_indices` with top-k, as one op (the
    native gathers and concatenates; an accelerator writes the lists in one launch)."""
    return ops.chosen_rows(window_rows, table, req_idx, topk)


@native("chosen_rows")
def _chosen_rows_native(window_rows, table, req_idx, topk):
    return torch.cat([window_rows, table[req_idx.unsqueeze(1), topk]], dim=1)


@native("paged_attention_indices")
def _paged_attention_indices_native(positions, req_idx, block_tables, block_size, window, ratio, topk,
                                    num_compressed):
    e = -(-block_size // ratio) if ratio > 1 else 0
    rows_per_block = block_size + e
    swa = sliding_rows(positions, req_idx, block_tables, block_size, window, rows_per_block)
    if ratio <= 1:
        return swa
    if topk is None:  # heavily compressed: every entry j < (pos + 1) // ratio
        j = torch.arange(num_compressed, device=positions.device).unsqueeze(0)  # [1, C]
        topk = torch.where(j < ((positions + 1) // ratio).unsqueeze(1), j, -1)
    comp = pool_rows(block_tables, req_idx.unsqueeze(1), topk, block_size, rows_per_block, block_size, ratio)
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
