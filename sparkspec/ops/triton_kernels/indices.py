"""Per-step addressing in one launch each (Triton): `pool_rows` (positions -> pool rows through the block tables),
`emission_plan` (where one ratio's compressed entries of the step come from and go to) and `chosen_rows` (a CSA
layer's index lists from the step's window rows and its top-k entries).

Legend as in `sparkspec.ops.indices`: T queries, R requests, W window, K chosen entries, C compressed entries.
The natives take a handful of integer kernels each (clamp, divide, remainder, gather, add, compare, select);
at batch 1 every one of them is a launch of a few microseconds, and a step has a dozen such calls.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkspec.ops.registry import accelerated
from sparkspec.ops.triton_kernels.common import check, same_device

_BLOCK = 1024  # elements per program (integer arithmetic only)


@triton.jit
def _pool_rows_kernel(
    tables_ptr,  # [R, max_blocks] int block ids (row stride stride_tab)
    req_ptr,  # [A, B] request rows (strides stride_qa, stride_qb; 0 where broadcast)
    pos_ptr,  # [A, B] positions (raw, or compressed entry ids with RATIO > 1), < 0 = none
    out_ptr,  # [A, B] int64 contiguous
    num_cols,  # B
    num_elements,  # A·B
    table_width,  # max_blocks
    stride_tab,
    stride_qa,
    stride_qb,
    stride_pa,
    stride_pb,
    per_block,  # positions per block (block_size // ratio), or 0: one entry every blocks_per_entry blocks
    blocks_per_entry,  # ratio // block_size where per_block is 0
    rows_per_block,
    first_row,
    fill,  # what a position < 0 gets
    BLOCK: tl.constexpr,
):
    idx = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = idx < num_elements
    a = idx // num_cols
    b = idx % num_cols
    p = tl.load(pos_ptr + a * stride_pa + b * stride_pb, mask=ok, other=-1).to(tl.int64)
    r = tl.load(req_ptr + a * stride_qa + b * stride_qb, mask=ok, other=0).to(tl.int64)
    valid = p >= 0
    p = tl.maximum(p, 0)
    safe_per_block = tl.maximum(per_block, 1)
    col = tl.where(per_block > 0, p // safe_per_block, p * blocks_per_entry)
    offset = tl.where(per_block > 0, p % safe_per_block, 0)
    blk = tl.load(tables_ptr + r * stride_tab + col, mask=ok & valid & (col < table_width), other=0).to(tl.int64)
    rows = blk * rows_per_block + first_row + offset
    tl.store(out_ptr + idx, tl.where(valid, rows, fill), mask=ok)


@accelerated("pool_rows", "cuda", "rocm", "xpu")
def pool_rows(block_tables: torch.Tensor, req: torch.Tensor, positions: torch.Tensor, block_size: int,
              rows_per_block: int, first_row: int = 0, ratio: int = 1, fill: int = -1) -> torch.Tensor:
    """Triton twin of `ops.indices.pool_rows`: one launch -> int64 rows of the broadcast shape of req and positions
    (at most 2-D)."""
    check(block_tables.dim() == 2, f"pool_rows: block_tables must be [R, max_blocks], got {tuple(block_tables.shape)}")
    check(same_device(block_tables, req, positions), "pool_rows: all tensors must share a device")
    check(ratio >= 1 and (block_size % ratio == 0 or ratio % block_size == 0),
          f"pool_rows: ratio {ratio} must divide block_size {block_size} or be a multiple of it")
    req, positions = torch.broadcast_tensors(req, positions)
    shape = positions.shape
    check(len(shape) <= 2, f"pool_rows: positions must be at most 2-D, got {tuple(shape)}")
    req2, pos2 = (t.reshape((1,) * (2 - t.dim()) + tuple(t.shape)) for t in (req, positions))  # views
    out = torch.empty(shape, dtype=torch.int64, device=positions.device)
    n = out.numel()
    if n == 0:
        return out
    per_block = block_size // ratio if block_size % ratio == 0 else 0
    _pool_rows_kernel[(triton.cdiv(n, _BLOCK),)](
        block_tables, req2, pos2, out, pos2.shape[1], n, block_tables.shape[1], block_tables.stride(0),
        req2.stride(0), req2.stride(1), pos2.stride(0), pos2.stride(1), per_block,
        ratio // block_size if per_block == 0 else 0, rows_per_block, first_row, fill, BLOCK=_BLOCK,
    )
    return out


@triton.jit
def _entry_row(tables_ptr, req, j, stride_tab, per_block, blocks_per_entry, rows_per_block, first_row):
    """Pool row of compressed entry j >= 0 of request `req` (`ops.indices.pool_rows` at ratio > 1): per_block > 0
    entries share a block, else entry j has block j · blocks_per_entry."""
    safe = tl.maximum(per_block, 1)
    col = tl.where(per_block > 0, j // safe, j * blocks_per_entry)
    blk = tl.load(tables_ptr + req * stride_tab + col).to(tl.int64)
    return blk * rows_per_block + first_row + tl.where(per_block > 0, j % safe, 0)


@triton.jit
def _emission_plan_kernel(
    emit_ptr,  # [M] step rows closing an entry (-1 pads)
    pos_ptr,  # [T] positions
    req_ptr,  # [T] request rows
    tables_ptr,  # [R, max_blocks] (row stride stride_tab)
    last_ptr,  # [M] int64 out
    entry_ptr,  # [M] int64 out
    first_ptr,  # [M] int64 out
    gather_ptr,  # [M, span] int64 out
    missing_ptr,  # [M, span] bool out
    attn_ptr,  # [M] int64 out
    keys_ptr,  # [M] int64 out
    span,
    stride_tab,
    block_size,
    ratio,
    per_block,  # entries per block where several share one (block_size // ratio), else 0
    blocks_per_entry,  # ratio // block_size where per_block is 0
    entries,  # entries per block: ceil(block_size / ratio)
    trash_attn,
    trash_keys,
    BLOCK_S: tl.constexpr,
):
    m = tl.program_id(0).to(tl.int64)
    e = tl.load(emit_ptr + m).to(tl.int64)
    valid = e >= 0
    row = tl.maximum(e, 0)
    last = tl.where(valid, tl.load(pos_ptr + row).to(tl.int64), -1)
    req = tl.load(req_ptr + row).to(tl.int64)
    j = tl.where(valid, (last + 1) // ratio - 1, -1)
    tl.store(last_ptr + m, last)
    tl.store(entry_ptr + m, j)
    tl.store(first_ptr + m, last + 1 - ratio)
    jj = tl.maximum(j, 0)
    attn = _entry_row(tables_ptr, req, jj, stride_tab, per_block, blocks_per_entry, block_size + entries, block_size)
    keys = _entry_row(tables_ptr, req, jj, stride_tab, per_block, blocks_per_entry, entries, 0)
    tl.store(attn_ptr + m, tl.where(j >= 0, attn, trash_attn))
    tl.store(keys_ptr + m, tl.where(j >= 0, keys, trash_keys))
    for s0 in range(0, span, BLOCK_S):
        s = s0 + tl.arange(0, BLOCK_S)
        s_ok = s < span
        p = last - span + 1 + s
        seen = p >= 0
        pc = tl.maximum(p, 0)
        blk = tl.load(tables_ptr + req * stride_tab + pc // block_size, mask=s_ok & seen, other=0).to(tl.int64)
        tl.store(gather_ptr + m * span + s, tl.where(seen, blk * block_size + pc % block_size, 0), mask=s_ok)
        tl.store(missing_ptr + m * span + s, (p < 0).to(tl.int1), mask=s_ok)


@accelerated("emission_plan", "cuda", "rocm", "xpu")
def emission_plan(emit: torch.Tensor, positions: torch.Tensor, req_idx: torch.Tensor, block_tables: torch.Tensor,
                  block_size: int, ratio: int, span: int, trash_attn: int, trash_keys: int
                  ) -> tuple[torch.Tensor, ...]:
    """Triton twin of `ops.indices.emission_plan` in one launch (a program per entry slot) -> (last, entry_ids,
    first, gather, missing, attn_rows, key_rows)."""
    check(emit.dim() == 1 and positions.shape == req_idx.shape and positions.dim() == 1,
          f"emission_plan: emit, positions and req_idx must be 1-D [M], [T], [T], got {tuple(emit.shape)}, "
          f"{tuple(positions.shape)}, {tuple(req_idx.shape)}")
    check(ratio > 1 and (block_size % ratio == 0 or ratio % block_size == 0),
          f"emission_plan: ratio {ratio} must be > 1 and divide block_size {block_size} or be a multiple of it")
    check(same_device(emit, positions, req_idx, block_tables), "emission_plan: all tensors must share a device")
    M, dev = emit.shape[0], emit.device
    last, entry_ids, first, attn, keys = (torch.empty(M, dtype=torch.int64, device=dev) for _ in range(5))
    gather = torch.empty((M, span), dtype=torch.int64, device=dev)
    missing = torch.empty((M, span), dtype=torch.bool, device=dev)
    if M > 0:
        _emission_plan_kernel[(M,)](
            emit, positions, req_idx, block_tables, last, entry_ids, first, gather, missing, attn, keys, span,
            block_tables.stride(0), block_size, ratio, block_size // ratio if block_size % ratio == 0 else 0,
            ratio // block_size if block_size % ratio else 0, -(-block_size // ratio), trash_attn, trash_keys,
            BLOCK_S=min(triton.next_power_of_2(span), 1024),
        )
    return last, entry_ids, first, gather, missing, attn, keys


@triton.jit
def _chosen_rows_kernel(
    window_ptr,  # [T, W] int64 (row stride stride_w)
    table_ptr,  # [R, C + 1] int64 (row stride stride_tab): entry rows, then -1
    req_ptr,  # [T] request row of each query
    topk_ptr,  # [T, K] chosen entries (-1 pads; row stride stride_k)
    out_ptr,  # [T, W + K] int64 contiguous
    window,  # W
    num_chosen,  # K
    num_entries,  # C
    stride_w,
    stride_tab,
    stride_k,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    width = window + num_chosen
    for c0 in range(0, width, BLOCK):
        c = c0 + tl.arange(0, BLOCK)
        in_window = c < window
        chosen = (c >= window) & (c < width)
        w = tl.load(window_ptr + t * stride_w + c, mask=in_window, other=-1)
        j = tl.load(topk_ptr + t * stride_k + (c - window), mask=chosen, other=-1).to(tl.int64)
        j = tl.where((j >= 0) & (j < num_entries), j, num_entries)  # -1 pads: the table's -1 column
        r = tl.load(req_ptr + t).to(tl.int64)
        e = tl.load(table_ptr + r * stride_tab + j, mask=chosen, other=-1)
        tl.store(out_ptr + t * width + c, tl.where(in_window, w, e), mask=c < width)


@accelerated("chosen_rows", "cuda", "rocm", "xpu")
def chosen_rows(window_rows: torch.Tensor, table: torch.Tensor, req_idx: torch.Tensor, topk: torch.Tensor
                ) -> torch.Tensor:
    """Triton twin of `ops.indices.chosen_rows`: the window rows and the chosen entries' rows in one launch
    -> [T, W + K] int64."""
    T, W = window_rows.shape
    check(topk.dim() == 2 and topk.shape[0] == T, f"chosen_rows: topk must be [{T}, K], got {tuple(topk.shape)}")
    check(table.dim() == 2 and req_idx.shape == (T,),
          f"chosen_rows: table must be [R, C + 1] and req_idx [{T}], got {tuple(table.shape)}, {tuple(req_idx.shape)}")
    check(window_rows.dtype == table.dtype == torch.int64, "chosen_rows: window rows and table must be int64")
    check(same_device(window_rows, table, req_idx, topk), "chosen_rows: all tensors must share a device")
    K = topk.shape[1]
    out = torch.empty((T, W + K), dtype=torch.int64, device=window_rows.device)
    if out.numel() == 0:
        return out
    window_rows, table, topk = (x if x.stride(-1) == 1 else x.contiguous() for x in (window_rows, table, topk))
    _chosen_rows_kernel[(T,)](
        window_rows, table, req_idx, topk, out, W, K, table.shape[1] - 1, window_rows.stride(0), table.stride(0),
        topk.stride(0), BLOCK=min(triton.next_power_of_2(W + K), 1024),
    )
    return out
