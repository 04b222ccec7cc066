"""Expert load during a benchmark: tokens per routed expert per target layer, and optionally routing forced
to be uniform. Legend: L target layers, E routed experts, A active experts per token, T tokens of a call.

`RoutingProbe(model, uniform)` is a context manager around the engine's life (enter it BEFORE the engine is
built: CUDA graphs captured at start-up then contain its counting and its routing). It wraps the op table's
`moe_route` for as long as it is open, so the router itself is unchanged:

* counting: every target MoE layer adds its (token, slot) expert ids to `counts[layer]` on the device (an
  `index_add_`, no host sync, captured with the graphs). `load(before, after)` turns two snapshots into the
  imbalance over the steps between them: max / mean tokens per expert, and per expert-parallel rank.
* `uniform`: token t's j-th expert becomes (t·A + j) mod E (the router's weights are kept), so that every
  expert gets the same number of (token, slot) pairs, to within one, whatever the weights look like: random
  weights route unevenly, trained ones evenly (the auxiliary-loss-free bias), and the uniform case is the one a
  real model approaches.

The same override as a model flag would be one line in `MoE.forward` (sparkspec/models/deepseek_v4.py), right
after `ops.moe_route(...)`: `if self.route_hook is not None: weights, ids = self.route_hook(self, weights, ids)`.
"""

from __future__ import annotations

from typing import Self

import torch

from sparkspec.ops import ops


def uniform_ids(num_tokens: int, top_k: int, num_experts: int, device: torch.device) -> torch.Tensor:
    """[T, A] int64: (t·A + j) mod E."""
    t = torch.arange(num_tokens, device=device).unsqueeze(1)
    return (t * top_k + torch.arange(top_k, device=device)) % num_experts


class RoutingProbe:
    def __init__(self, model, uniform: bool = False, num_ranks: int = 1):
        """`num_ranks`: expert-parallel ranks (each holds E / num_ranks consecutive experts), for `load`."""
        cfg = model.cfg
        self.model, self.uniform, self.num_ranks = model, uniform, num_ranks
        self.num_experts = cfg.n_routed_experts
        device = next(model.parameters()).device
        self.counts = torch.zeros(cfg.num_hidden_layers, self.num_experts, dtype=torch.int64,
                                  device=device)  # [L, E]
        self.layer: int | None = None  # the target layer whose router runs now (None: a drafter's, not counted)
        self._hooks: list = []
        self._saved = None

    def __enter__(self) -> Self:
        route = ops.moe_route  # the dispatching function (resolved per device on each call)
        self._saved = ops.__dict__.get("moe_route")

        def probed(logits, bias, hash_ids, top_k, *rest):
            weights, ids = route(logits, bias, hash_ids, top_k, *rest)
            if self.uniform:
                ids = uniform_ids(ids.shape[0], top_k, self.num_experts, ids.device)
            if self.layer is not None:
                ones = torch.ones(ids.numel(), dtype=torch.int64, device=ids.device)
                self.counts[self.layer].index_add_(0, ids.reshape(-1), ones)
            return weights, ids

        object.__setattr__(ops, "moe_route", probed)
        for i, layer in enumerate(self.model.layers):
            self._hooks.append(layer.ffn.register_forward_pre_hook(lambda m, a, i=i: setattr(self, "layer", i)))
            self._hooks.append(layer.ffn.register_forward_hook(lambda m, a, out: setattr(self, "layer", None)))
        return self

    def __exit__(self, *exc) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        if self._saved is None:
            ops.__dict__.pop("moe_route", None)
        else:
            object.__setattr__(ops, "moe_route", self._saved)

    def snapshot(self) -> torch.Tensor:
        return self.counts.clone()

    def load(self, before: torch.Tensor, after: torch.Tensor) -> dict:
        """Imbalance over the steps between two snapshots, averaged over the layers that routed tokens:
        `expert_max_mean` = max / mean tokens per expert; expert parallel also `rank_max_mean`, the same over
        the ranks' tokens."""
        num_ranks = self.num_ranks
        tokens = (after - before).double()  # [L, E]
        used = tokens.sum(1) > 0
        if not bool(used.any()):
            return {}
        tokens = tokens[used]
        out = {"expert_max_mean": round(float((tokens.max(1).values / tokens.mean(1)).mean()), 3)}
        if num_ranks > 1:
            per_rank = tokens.view(tokens.shape[0], num_ranks, -1).sum(2)
            out["rank_max_mean"] = round(float((per_rank.max(1).values / per_rank.mean(1)).mean()), 3)
        return out
