"""Shard a loaded target model across the ranks of a group (tensor parallelism, Megatron style).

Legend: h attention heads, g output groups, D head dim, I expert width, V vocabulary, W = world size.

What each rank keeps, and the one collective that makes the result whole again:
* attention: h/W query heads (`wq_b` rows, `attn_sink`) and the g/W output groups those heads feed (`wo_a`
  rows, `wo_b` columns); `wo_b`'s partial sums are all-reduced. The shared K=V latent, the compressor and the
  indexer are replicated: the latent is one head wide, and the indexer's top-k must be the same on every rank.
* MoE, tensor parallel: every routed and shared expert keeps I/W of its width (`w1`/`w3` rows, `w2`
  columns); routing is replicated; the layer's output is all-reduced.
* MoE, expert parallel (`expert_parallel=True`): each rank keeps E/W whole routed experts and computes the
  routed pairs that land on them (the others weigh 0); the shared experts stay width-split; the same
  all-reduce combines both.
* embedding: V/W rows (vocab parallel); a token's row comes from the rank that holds it (all-reduce).
* LM head: V/W rows; the ranks' logits are gathered (`models.deepseek_v4.head_logits`).
mHC, norms and the KV caches are replicated. Drafters stay replicated and use the sharded embedding and head.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sparkspec.distributed import ParallelGroup, all_reduce


class VocabParallelEmbedding(nn.Module):
    """Rows start .. start + V/W of the embedding; other ids contribute zeros, and the ranks' sum is the lookup."""

    def __init__(self, full: nn.Embedding, pg: ParallelGroup):
        super().__init__()
        rows = pg.shard(full.num_embeddings, "vocab_size")
        self.start, self.num_rows, self.tp = rows.start, rows.stop - rows.start, pg
        self.weight = nn.Parameter(full.weight.detach()[rows].clone(), requires_grad=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # ids [T] -> [T, H]
        local = ids - self.start
        held = (local >= 0) & (local < self.num_rows)
        x = F.embedding(local.clamp(0, self.num_rows - 1), self.weight) * held.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(x, self.tp)


def _keep(module: nn.Module, name: str, value: torch.Tensor) -> None:
    setattr(module, name, nn.Parameter(value.detach().clone(), requires_grad=False))


def shard_attention_(attn, pg: ParallelGroup) -> None:
    cfg = attn.cfg
    heads = pg.shard(attn.n_heads, "num_attention_heads")
    groups = pg.shard(cfg.o_groups, "o_groups")
    if attn.n_heads % cfg.o_groups:
        raise ValueError(f"num_attention_heads = {attn.n_heads}: not divisible by o_groups = {cfg.o_groups}")
    D, r = attn.head_dim, cfg.o_lora_rank
    _keep(attn.wq_b, "weight", attn.wq_b.weight.view(attn.n_heads, D, -1)[heads].flatten(0, 1))
    _keep(attn, "attn_sink", attn.attn_sink[heads])
    _keep(attn.wo_a, "weight", attn.wo_a.weight.view(cfg.o_groups, r, -1)[groups].flatten(0, 1))
    _keep(attn.wo_b, "weight", attn.wo_b.weight[:, groups.start * r : groups.stop * r])
    attn.n_heads = heads.stop - heads.start
    attn.tp = pg


def shard_moe_(moe, pg: ParallelGroup) -> None:
    for expert in [*moe.experts, moe.shared_experts]:
        width = pg.shard(expert.w1.weight.shape[0], "moe_intermediate_size")
        _keep(expert.w1, "weight", expert.w1.weight[width])
        _keep(expert.w3, "weight", expert.w3.weight[width])
        _keep(expert.w2, "weight", expert.w2.weight[:, width])
    if hasattr(moe, "_stacked_experts"):
        del moe._stacked_experts  # stacked again from the shards on the next forward
    moe.tp = pg


def shard_experts_(moe, pg: ParallelGroup) -> None:
    """Expert parallel: whole routed experts E/W per rank; the shared experts are width-split as under TP."""
    held = pg.shard(len(moe.experts), "n_routed_experts")
    moe.experts = nn.ModuleList(list(moe.experts)[held])
    moe.experts_held = (held.start, held.stop - held.start)
    shared = moe.shared_experts
    width = pg.shard(shared.w1.weight.shape[0], "shared expert width")
    _keep(shared.w1, "weight", shared.w1.weight[width])
    _keep(shared.w3, "weight", shared.w3.weight[width])
    _keep(shared.w2, "weight", shared.w2.weight[:, width])
    if hasattr(moe, "_stacked_experts"):
        del moe._stacked_experts
    moe.tp = pg


def shard_(model, pg: ParallelGroup, expert_parallel: bool = False) -> None:
    """Shard a loaded `DeepseekV4Model` in place for rank `pg.rank` of `pg.world_size` (call on every rank,
    with the same weights; before the first forward)."""
    if pg.world_size == 1:
        return
    for layer in model.layers:
        shard_attention_(layer.attn, pg)
        (shard_experts_ if expert_parallel else shard_moe_)(layer.ffn, pg)
    model.embed = VocabParallelEmbedding(model.embed, pg)
    _keep(model.head, "weight", model.head.weight[pg.shard(model.head.weight.shape[0], "vocab_size")])
    model.head.tp = pg
