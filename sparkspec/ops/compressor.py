"""KV compression (gated pooling) and the lightning indexer.

Legend: N compressed entries being emitted, R rows pooled per entry, d entry width, T queries,
C visible compressed entries, ih indexer heads, id indexer head dim, S pool rows, w = c·d state width
(c = 2 for overlapping windows, else 1), M entry slots of a step.

A compressor's per-position state goes to its pools once per token (`store_states`); an entry is pooled from the
state rows of its window, normalised, rotated and written to its pool in one op (`emit_entries`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from sparkspec.ops.registry import native, ops


@native("compress_pool")
def compress_pool(
    kv: torch.Tensor,  # [N, R, d] fp32 rows feeding each entry
    score: torch.Tensor,  # [N, R, d] fp32 gate scores (+ ape); -inf for rows that do not exist
) -> torch.Tensor:
    """Per-feature softmax over the rows, then the weighted sum -> [N, d] fp32."""
    w = torch.softmax(score.float(), dim=1)
    return (w * kv.float()).sum(dim=1)


@native("store_states")
def store_states(
    kv_pool: torch.Tensor,  # [S, w] fp32
    score_pool: torch.Tensor,  # [S, w] fp32
    rows: torch.Tensor,  # [T] pool rows of the tokens
    states: torch.Tensor,  # [T, 2w] fp32: projected kv, then gate score (one GEMM for both)
    ape: torch.Tensor,  # [ratio, w] learned score bias by position within the window
    positions: torch.Tensor,  # [T]
) -> None:
    """kv_pool[rows] = kv; score_pool[rows] = score + ape[positions % ratio]."""
    kv, score = states.float().chunk(2, dim=-1)
    kv_pool.index_copy_(0, rows, kv)
    score_pool.index_copy_(0, rows, score + ape.float()[positions % ape.shape[0]])


@native("emit_entries")
def emit_entries(
    kv_pool: torch.Tensor,  # [S, w] fp32 per-position states
    score_pool: torch.Tensor,  # [S, w] fp32
    gather: torch.Tensor,  # [M, R] state rows pooled by each entry, oldest first
    missing: torch.Tensor,  # [M, R] bool: no such position (before the sequence's start)
    norm_weight: torch.Tensor,  # [d] weight of the entries' RMS norm
    eps: float,
    rot: torch.Tensor,  # [M, R'/2] complex64 rotation at each entry's first position
    out: torch.Tensor,  # [S', d] the pool the entries go to
    out_rows: torch.Tensor,  # [M] rows of `out` (a trash row for pads)
) -> None:
    """out[out_rows] = RoPE(RMSNorm(compress_pool(window states))). With overlapping windows (w = 2d) an entry
    pools the previous window's first-half features (masked where `missing`) and its own second half."""
    d = norm_weight.numel()
    kv, score = kv_pool[gather], score_pool[gather]  # [M, R, w]
    if kv_pool.shape[1] == 2 * d:  # previous window contributes its first half, the current one its second half
        r = gather.shape[1] // 2
        kv = torch.cat([kv[:, :r, :d], kv[:, r:, d:]], dim=1)
        score = torch.cat([score[:, :r, :d].masked_fill(missing[:, :r].unsqueeze(-1), float("-inf")),
                           score[:, r:, d:]], dim=1)
    pooled = ops.compress_pool(kv, score)
    out.index_copy_(0, out_rows, ops.rope(pooled, rot, False, norm_weight, eps, out.dtype))


@native("indexer_topk")
def indexer_topk(
    q: torch.Tensor,  # [T, ih, id] indexer queries (RoPE applied)
    weights: torch.Tensor,  # [T, ih] per-head weights (times weight_scale)
    keys: torch.Tensor,  # [R, C, id] compressed indexer keys of each request (rows past its entries: anything)
    req_idx: torch.Tensor | None,  # [T] request of each query; None: keys are already per query ([T, C, id])
    num_visible: torch.Tensor,  # [T] int: entries j < num_visible[t] may be chosen
    topk: int,
    scale: float,
    weight_scale: float = 1.0,  # w = weights (in fp32) · weight_scale: the head weights' factor, taken here
    key_rows: torch.Tensor | None = None,  # [R or T, C] rows of keys, then a pool [S, id]: keys[key_rows] are the keys
    lists: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,  # (window rows [T, W], entry table, req [T])
) -> torch.Tensor:
    """Lightning indexer: score[t, j] = Σ_h w[t,h]·ReLU(q[t,h]·k[r(t), j])·scale, keep the top `topk` visible
    entries -> [T, topk] int64 entry ids, -1 padded (ties broken towards the lower id). With `key_rows` the keys
    are read from their pool through those rows (an accelerator gathers nothing first). With `lists` the attention
    index lists of the choice instead, `ops.indices.chosen_rows(*lists[:2], lists[2], ids)` -> [T, W + topk] (an
    accelerator writes them from the select launch)."""
    ids = _indexer_ids(q, weights, keys[key_rows] if key_rows is not None else keys, req_idx, num_visible, topk,
                       scale, weight_scale)
    return ids if lists is None else ops.chosen_rows(lists[0], lists[1], lists[2], ids)


def _indexer_ids(q, weights, keys, req_idx, num_visible, topk, scale, weight_scale):
    T, C = q.shape[0], keys.shape[1]
    k = min(topk, C)
    if k == 0:
        return torch.full((T, topk), -1, dtype=torch.long, device=q.device)
    keys = keys.float() if req_idx is None else keys.float()[req_idx]  # [T, C, id]
    s = torch.relu(torch.einsum("thd,tcd->thc", q.float(), keys)) * scale
    s = (s * (weights.float() * weight_scale).unsqueeze(-1)).sum(dim=1)  # [T, C]
    visible = torch.arange(C, device=q.device).unsqueeze(0) < num_visible.unsqueeze(1)
    s = torch.where(visible, s, float("-inf"))
    # a stable sort (not torch.topk, whose tie order is unspecified) keeps equal scores in id order;
    # ties are common: an entry whose ReLU scores are all 0 scores exactly 0
    values, order = torch.sort(s, dim=-1, descending=True, stable=True)
    ids = torch.where(values[:, :k] > float("-inf"), order[:, :k], -1)  # invisible (and NaN) scores: -1
    return ids if k == topk else F.pad(ids, (0, topk - k), value=-1)
