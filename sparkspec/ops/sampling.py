"""Sampling: temperature / top-k / top-p processing and seeded sampling. Legend: B rows, V vocabulary.

Sampling uses the exponential race (argmax p / E, E ~ Exp(1)), which equals a categorical draw from p,
needs no cumulative sum and no host sync, and is reproducible from one torch.Generator per request.
"""

from __future__ import annotations

import torch

from sparkspec.ops.registry import native


@native("process_logits")
def process_logits(
    logits: torch.Tensor,  # [B, V]
    temperature: torch.Tensor,  # [B] fp32; rows with 0 are greedy (one-hot on the argmax)
    top_k: torch.Tensor,  # [B] int; <= 0 disables
    top_p: torch.Tensor,  # [B] fp32; 1 disables
) -> torch.Tensor:
    """The distribution a request samples from -> probs [B, V] fp32 (rows sum to 1)."""
    logits = logits.float()
    B, V = logits.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float().unsqueeze(1)
    x = logits / t
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    if bool((k < V).any()):
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (k - 1).long().unsqueeze(1))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if bool((top_p < 1).any()):
        sp, si = torch.sort(probs, dim=-1, descending=True)
        before = sp.cumsum(-1) - sp  # mass strictly above each entry
        drop = before >= top_p.float().unsqueeze(1)
        drop[:, 0] = False
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs


@native("sample")
def sample(
    probs: torch.Tensor,  # [B, V]
    generators: list[torch.Generator | None],  # one per row (None: global RNG)
) -> torch.Tensor:
    """One categorical draw per row -> [B] int64."""
    noise = torch.empty_like(probs, dtype=torch.float32)
    for i, g in enumerate(generators):
        noise[i].exponential_(generator=g)
    return (probs / noise).argmax(dim=-1)
