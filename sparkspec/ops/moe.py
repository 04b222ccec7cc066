"""MoE routing and expert compute. Legend: T tokens, H hidden, E experts, A active experts, I expert width."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sparkspec.ops.registry import native


def score_fn(logits: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


@native("moe_route")
def moe_route(
    logits: torch.Tensor,  # [T, E] fp32 router logits
    bias: torch.Tensor | None,  # [E] e_score_correction_bias: used for SELECTION only
    hash_ids: torch.Tensor | None,  # [T, A] experts fixed by tid2eid (hash layers)
    top_k: int,
    scoring_func: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, A] fp32, expert ids [T, A] int64)."""
    scores = score_fn(logits.float(), scoring_func)
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        sel = scores if bias is None else scores + bias.float()
        ids = torch.topk(sel, top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor, ids


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SwiGLU with the V4 clamp: gate clamped above at `limit`, up clamped to ±`limit`."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@native("moe_experts")
def moe_experts(
    x: torch.Tensor,  # [T, H]
    w1: Sequence[torch.Tensor] | torch.Tensor,  # E x [I, H] gate (a list or a stacked [E, I, H])
    w2: Sequence[torch.Tensor] | torch.Tensor,  # E x [H, I] down
    w3: Sequence[torch.Tensor] | torch.Tensor,  # E x [I, H] up
    weights: torch.Tensor,  # [T, A]
    ids: torch.Tensor,  # [T, A]
    limit: float,
) -> torch.Tensor:
    """Σ_a weights[t, a] · expert_{ids[t, a]}(x[t]) -> [T, H]."""
    T, A = ids.shape
    y = x.new_zeros(T, A, x.shape[1])  # [T, A, H] one row per (token, slot): no scatter-add collisions
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        xe = x[tok]
        h = swiglu(xe @ w1[e].t(), xe @ w3[e].t(), limit) @ w2[e].t()
        y[tok, slot] = h.to(y.dtype)  # autocast may compute h in bf16
    return (y * weights.unsqueeze(-1).to(x.dtype)).sum(dim=1)
