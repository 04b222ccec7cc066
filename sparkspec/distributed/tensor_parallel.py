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
mHC, norms and the KV caches are replicated. Drafters loaded from a checkpoint stay replicated and use the sharded
embedding and head; `shard_drafter_` shards a drafter's blocks the same way (what random real-size drafters
use: a V4-Flash DSpark stage is a whole MoE layer, 6.6B parameters).

`shard_` works on a loaded model and on one still on the meta device: slicing a meta tensor gives a meta tensor
of the sharded shape. It returns (and keeps as `model.shard_cuts`) which part of which checkpoint tensor every
sliced or renamed parameter holds, so that `load_checkpoint(..., parallel=pg)` reads only those parts.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from sparkspec.distributed import ParallelGroup, all_reduce


class Cut(NamedTuple):
    """Where a sharded parameter comes from: checkpoint tensor `source` (relative to the module that was
    sharded until `shard_` prefixes it), rows / columns `start:stop` along `dim`; `dim` None: the whole tensor
    (an expert-parallel rank's experts are renumbered from 0, so their names differ from the checkpoint's)."""

    source: str
    dim: int | None = None
    start: int = 0
    stop: int = 0


def _cut(name: str, dim: int, span: slice, scale: int = 1) -> dict[str, Cut]:
    return {name: Cut(name, dim, span.start * scale, span.stop * scale)}


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


def shard_attention_(attn, pg: ParallelGroup) -> dict[str, Cut]:
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
    return {**_cut("wq_b.weight", 0, heads, D), **_cut("attn_sink", 0, heads),
            **_cut("wo_a.weight", 0, groups, r), **_cut("wo_b.weight", 1, groups, r)}


def _split_width_(expert, pg: ParallelGroup, what: str, prefix: str) -> dict[str, Cut]:
    """An expert's I/W slice: `w1` / `w3` rows and `w2` columns."""
    width = pg.shard(expert.w1.weight.shape[0], what)
    _keep(expert.w1, "weight", expert.w1.weight[width])
    _keep(expert.w3, "weight", expert.w3.weight[width])
    _keep(expert.w2, "weight", expert.w2.weight[:, width])
    return {**_cut(f"{prefix}w1.weight", 0, width), **_cut(f"{prefix}w3.weight", 0, width),
            **_cut(f"{prefix}w2.weight", 1, width)}


def shard_moe_(moe, pg: ParallelGroup) -> dict[str, Cut]:
    cuts = {}
    for e, expert in enumerate(moe.experts):
        cuts.update(_split_width_(expert, pg, "moe_intermediate_size", f"experts.{e}."))
    cuts.update(_split_width_(moe.shared_experts, pg, "moe_intermediate_size", "shared_experts."))
    if hasattr(moe, "_stacked_experts"):
        del moe._stacked_experts  # stacked again from the shards on the next forward
    moe.tp = pg
    return cuts


def shard_experts_(moe, pg: ParallelGroup) -> dict[str, Cut]:
    """Expert parallel: whole routed experts E/W per rank; the shared experts are width-split as under TP."""
    held = pg.shard(len(moe.experts), "n_routed_experts")
    names = [n for n, _ in moe.experts.named_parameters()]
    moe.experts = nn.ModuleList(list(moe.experts)[held])
    moe.experts_held = (held.start, held.stop - held.start)
    cuts = {}
    for n in names:  # 'E.w1.weight': held experts are renumbered from 0
        e, _, rest = n.partition(".")
        if held.start <= int(e) < held.stop:
            cuts[f"experts.{int(e) - held.start}.{rest}"] = Cut(f"experts.{n}")
    cuts.update(_split_width_(moe.shared_experts, pg, "shared expert width", "shared_experts."))
    if hasattr(moe, "_stacked_experts"):
        del moe._stacked_experts
    moe.tp = pg
    return cuts


def shard_(model, pg: ParallelGroup, expert_parallel: bool = False) -> dict[str, Cut]:
    """Shard a `DeepseekV4Model` (loaded, or on the meta device) in place for rank `pg.rank` of
    `pg.world_size` (call on every rank, with the same weights; before the first forward). Returns, and keeps
    as `model.shard_cuts`, what each sliced or renamed parameter holds (names the model's, sources the
    checkpoint's): what a sharded load reads. Sharding twice is an error: it would slice the slices."""
    if getattr(model, "shard_cuts", None) is not None:
        raise ValueError("this model is already sharded")
    if pg.world_size == 1:
        return {}
    cuts: dict[str, Cut] = {}
    for i, layer in enumerate(model.layers):
        cuts.update(_prefixed(f"layers.{i}.attn.", shard_attention_(layer.attn, pg)))
        ffn = (shard_experts_ if expert_parallel else shard_moe_)(layer.ffn, pg)
        cuts.update(_prefixed(f"layers.{i}.ffn.", ffn))
    vocab = pg.shard(model.head.weight.shape[0], "vocab_size")
    model.embed = VocabParallelEmbedding(model.embed, pg)
    _keep(model.head, "weight", model.head.weight[vocab])
    model.head.tp = pg
    cuts.update({**_cut("embed.weight", 0, vocab), **_cut("head.weight", 0, vocab)})
    model.shard_cuts = cuts
    return cuts


def shard_drafter_(drafter, pg: ParallelGroup, expert_parallel: bool = False) -> dict[str, Cut]:
    """Shard every V4 block of a drafter (DSpark stages `mtp.i`, MTP layers) as `shard_` shards the target's
    layers; the Markov / confidence heads, projections and norms stay whole. Returns the cuts, named as
    `drafter.named_parameters()` names them."""
    if getattr(drafter, "shard_cuts", None) is not None:
        raise ValueError("this drafter is already sharded")
    cuts: dict[str, Cut] = {}
    if pg.world_size > 1:
        for name, block in drafter.named_modules():
            if hasattr(block, "attn") and hasattr(block, "ffn") and hasattr(block.ffn, "experts"):
                cuts.update(_prefixed(f"{name}.attn.", shard_attention_(block.attn, pg)))
                ffn = (shard_experts_ if expert_parallel else shard_moe_)(block.ffn, pg)
                cuts.update(_prefixed(f"{name}.ffn.", ffn))
    drafter.shard_cuts = cuts
    return cuts


def _prefixed(prefix: str, cuts: dict[str, Cut]) -> dict[str, Cut]:
    return {prefix + n: c._replace(source=prefix + c.source) for n, c in cuts.items()}
