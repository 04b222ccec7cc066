"""Attention over per-query index lists with a per-head sink.

Legend: T query tokens, h heads, D latent width (K = V), S pooled KV rows, W index width.
Every attention kind (sliding window, compressed sparse, heavily compressed, DSpark's non-causal block)
is expressed as an index list into a pool of KV rows; -1 marks padding.
"""

from __future__ import annotations

import torch

from sparkspec.ops.registry import native


@native("sparse_attention")
def sparse_attention(
    q: torch.Tensor,  # [T, h, D]
    kv: torch.Tensor,  # [S, D]
    indices: torch.Tensor,  # [T, W] int, rows of kv; -1 = padding
    sink: torch.Tensor,  # [h] fp32 learned logit that joins the softmax denominator
    scale: float,
) -> torch.Tensor:
    """out[t, h] = Σ_w softmax_w(q·k_w·scale ∪ sink)[w] · kv_w  -> [T, h, D] (q.dtype)."""
    valid = indices >= 0  # [T, W]
    gathered = kv[indices.clamp(min=0)]  # [T, W, D]
    logits = torch.einsum("thd,twd->thw", q.float(), gathered.float()) * scale
    logits = logits.masked_fill(~valid.unsqueeze(1), float("-inf"))
    sink_col = sink.float().view(1, -1, 1).expand(logits.shape[0], -1, 1)
    full = torch.cat([logits, sink_col], dim=-1)
    probs = torch.softmax(full - full.amax(dim=-1, keepdim=True), dim=-1)[..., :-1]
    return torch.einsum("thw,twd->thd", probs, gathered.float()).to(q.dtype)
