"""KV compression (gated pooling) and the lightning indexer.

Legend: N compressed entries being emitted, R rows pooled per entry, d entry width, T queries,
C visible compressed entries, ih indexer heads, id indexer head dim.
"""

from __future__ import annotations

import torch

from sparkspec.ops.registry import native


@native("compress_pool")
def compress_pool(
    kv: torch.Tensor,  # [N, R, d] fp32 rows feeding each entry
    score: torch.Tensor,  # [N, R, d] fp32 gate scores (+ ape); -inf for rows that do not exist
) -> torch.Tensor:
    """Per-feature softmax over the rows, then the weighted sum -> [N, d] fp32."""
    w = torch.softmax(score.float(), dim=1)
    return (w * kv.float()).sum(dim=1)


@native("indexer_topk")
def indexer_topk(
    q: torch.Tensor,  # [T, ih, id] indexer queries (RoPE applied)
    weights: torch.Tensor,  # [T, ih] per-head weights (already scaled)
    keys: torch.Tensor,  # [R, C, id] compressed indexer keys of each request (rows past its entries: anything)
    req_idx: torch.Tensor,  # [T] request of each query
    num_visible: torch.Tensor,  # [T] int: entries j < num_visible[t] may be chosen
    topk: int,
    scale: float,
) -> torch.Tensor:
    """Lightning indexer: score[t, j] = Σ_h w[t,h]·ReLU(q[t,h]·k[r(t), j])·scale, keep the top `topk` visible
    entries -> [T, topk] int64 entry ids, -1 padded (ties broken towards the lower id)."""
    T, C = q.shape[0], keys.shape[1]
    k = min(topk, C)
    out = torch.full((T, topk), -1, dtype=torch.long, device=q.device)
    if k == 0:
        return out
    s = torch.relu(torch.einsum("thd,tcd->thc", q.float(), keys.float()[req_idx])) * scale
    s = (s * weights.float().unsqueeze(-1)).sum(dim=1)  # [T, C]
    visible = torch.arange(C, device=q.device).unsqueeze(0) < num_visible.unsqueeze(1)
    s = s.masked_fill(~visible, float("-inf"))
    # a stable sort (not torch.topk, whose tie order is unspecified) keeps equal scores in id order;
    # ties are common: an entry whose ReLU scores are all 0 scores exactly 0
    values, order = torch.sort(s, dim=-1, descending=True, stable=True)
    values, order = values[:, :k], order[:, :k]
    ids = torch.where(torch.isfinite(values), order, torch.full_like(order, -1))
    out[:, :k] = ids
    return out
