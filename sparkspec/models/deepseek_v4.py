"""The DeepSeek-V4 target model: one definition for every platform.

Legend: T tokens in the flattened ragged batch, B sequences, n hc streams, H hidden, h heads,
D latent width (K = V), R rotary dims, E experts, A active experts.

Parameter names follow the official checkpoint (`layers.N.attn.wq_a.weight`, `layers.N.hc_attn_fn`,
`layers.N.ffn.experts.E.w1.weight`, `hc_head_fn`, `head.weight`, ...), so the official layout loads
without renaming. Compute-heavy pieces go through `sparkspec.ops` (chosen once per platform).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sparkspec.config import CSA, ModelConfig, yarn_inv_freq
from sparkspec.distributed import ParallelGroup, all_gather_last, all_reduce
from sparkspec.models.cache import compressor_width, entries_per_block
from sparkspec.models.forward_batch import Emission, ForwardBatch
from sparkspec.models.fused_linear import dense, fused_linear, stacked_linear
from sparkspec.ops import ops
from sparkspec.ops.moe import expert_weights, swiglu

FP32_PARAM_SUFFIXES = ("attn_sink", "ape", "gate.bias", "hc_attn_fn", "hc_attn_base", "hc_attn_scale",
                       "hc_ffn_fn", "hc_ffn_base", "hc_ffn_scale", "hc_head_fn", "hc_head_base", "hc_head_scale")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """In fp32 whatever the input dtype, rounded once to x.dtype (`ops.rms_norm`: one launch)."""
        return ops.rms_norm(x, fp32_weight(self), self.eps)


def fp32_weight(*modules: nn.Module) -> torch.Tensor:
    """The `weight` of `modules` in fp32, concatenated along the output dim when there are several: cast once and
    kept on the first module (not copied on every call; recast if a weight is replaced, moved or modified in
    place). Under autograd the live parameters are used so that gradients reach them."""
    ws = tuple(m.weight for m in modules)
    if torch.is_grad_enabled() or (len(ws) == 1 and ws[0].dtype == torch.float32):
        return ws[0].float() if len(ws) == 1 else torch.cat([w.float() for w in ws])
    # _version: an in-place load changes the values (inference tensors keep no version counter)
    key = tuple((w, 0 if w.is_inference() else w._version, w.device) for w in ws)
    cached = getattr(modules[0], "_fp32_weight", None)
    if cached is None or len(cached[0]) != len(key) or any(a[0] is not b[0] or a[1:] != b[1:]
                                                          for a, b in zip(cached[0], key)):
        fp32 = ws[0].detach().float() if len(ws) == 1 else torch.cat([w.detach().float() for w in ws])
        cached = modules[0]._fp32_weight = (key, fp32)
    return cached[1]


def head_logits(head: nn.Linear, h: torch.Tensor) -> torch.Tensor:
    """h [T, H] fp32 (normed) -> logits [T, V] fp32 with the LM head; a vocab-parallel head (`head.tp`, see
    `sparkspec.distributed.tensor_parallel`) holds V / world rows and gathers the ranks' logits. `ops.lm_head`:
    the native version multiplies by the cached fp32 copy of the weight, the accelerated one reads the bf16 weight
    (no fp32 copy is made)."""
    return all_gather_last(ops.lm_head(h, head.weight, lambda: fp32_weight(head)), getattr(head, "tp", None))


class Rotary(nn.Module):
    """GPT-J (interleaved pairs) RoPE on the last `dim` features."""

    def __init__(self, dim: int, inv_freq: torch.Tensor, key=None):
        """`key`: what determines `inv_freq` (modules with equal keys share rotations within a forward)."""
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self._unit: torch.Tensor | None = None  # |e^{iθ}| = 1 on the device, broadcast (`rotation`)
        self.inv_freq_fp32 = inv_freq.float().clone()  # master copy: `.to(bf16)` would round the buffer
        self.freq_key = (dim, key if key is not None else id(self))

    def rotation(self, positions: torch.Tensor) -> torch.Tensor:
        """e^{i·pos·freq} -> [T, R/2] complex64 (two launches: the int positions promote to fp32 in the product)."""
        freqs = positions.unsqueeze(-1) * self.inv_freq.float()  # [T, R/2] fp32
        if self._unit is None or self._unit.device != freqs.device:  # made once, not a ones_like per call
            self._unit = torch.ones((), device=freqs.device)
        return torch.polar(self._unit, freqs)

    def rotations(self, batch: ForwardBatch, key, positions_fn) -> torch.Tensor:
        """The rotation at positions_fn(), computed once per forward for every layer that shares this module's
        frequencies (`batch.memo`); `ops.rope` inverts it by `inverse=True`."""
        return batch.memo(("rotation", self.freq_key, key), lambda: self.rotation(positions_fn()))

    def apply(self, x: torch.Tensor, positions: torch.Tensor | None, inverse: bool = False,
              rot: torch.Tensor | None = None, norm: RMSNorm | float | None = None,
              out_dtype: torch.dtype | None = None, out: torch.Tensor | None = None,
              out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """x: [T, ..., F] with the rotary dims last; positions [T] (or `rot`, their rotation from `rotations`).
        `norm`: an RMSNorm (or the eps of an unweighted one) applied to each row first, fused with the rotation
        (`ops.rope`: one launch, one rounding to `out_dtype`, default x.dtype). `out` / `out_rows`: x [T, F]'s rows
        go to out[out_rows] instead (a cache write in the same launch)."""
        rot = self.rotation(positions) if rot is None else rot
        if isinstance(norm, RMSNorm):
            return ops.rope(x, rot, inverse, fp32_weight(norm), norm.eps, out_dtype, out, out_rows)
        return ops.rope(x, rot, inverse, None, norm, out_dtype, out, out_rows)


class Compressor(nn.Module):
    """Gated pooling of `ratio` positions into one compressed entry (ratio 4: overlapping windows of 2·ratio)."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int):
        super().__init__()
        self.ratio, self.head_dim = ratio, head_dim
        self.overlap = ratio == 4
        width = compressor_width(ratio, head_dim)
        self.wkv = nn.Linear(cfg.hidden_size, width, bias=False)
        self.wgate = nn.Linear(cfg.hidden_size, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(head_dim, cfg.rms_norm_eps)

    def store_states(self, kv_pool: torch.Tensor, score_pool: torch.Tensor, states: torch.Tensor,
                     batch: ForwardBatch) -> None:
        """This step's per-position partial state -> its rows of the pools: kv [T, c·d] and score + ape[pos % ratio]
        [T, c·d], fp32. `states` [T, 2·c·d]: (kv, score) from the layer's one GEMM (`Attention.compressor_states`)."""
        ops.store_states(kv_pool, score_pool, batch.state_rows(), states, self.ape, batch.positions)

    def emit(
        self,
        kv_pool: torch.Tensor,  # [N·bs + 1, c·d] fp32 per-position state rows (this step's already stored)
        score_pool: torch.Tensor,  # [N·bs + 1, c·d] fp32
        plan: Emission,  # which entries this step closes and which state rows each pools
        rot: torch.Tensor,  # [M, R/2] rotation at the entries' first positions j·r
        out: torch.Tensor,  # [S, d] the pool the entries go to
        out_rows: torch.Tensor,  # [M] their rows (the trash row for pads)
    ) -> None:
        """Entries j -> out[out_rows], pooling positions j·r .. j·r + r - 1 (and, for overlapping windows, the first
        half of positions (j-1)·r .. j·r - 1); normalised and rotated in fp32, rounded once (one op)."""
        ops.emit_entries(kv_pool, score_pool, plan.gather, plan.missing, fp32_weight(self.norm), self.norm.eps, rot,
                         out, out_rows)


class Indexer(nn.Module):
    """Lightning indexer: picks the top `index_topk` compressed entries per query (CSA layers)."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg, ratio, self.head_dim)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        self.n_heads, self.head_dim = cfg.num_attention_heads, cfg.head_dim
        self.window = cfg.sliding_window
        self.ratio = cfg.compress_ratio(layer_id)
        self.scale = self.head_dim ** -0.5
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(self.n_heads * self.head_dim // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(self.n_heads))
        self.tp: ParallelGroup | None = None  # set by `distributed.tensor_parallel.shard_`
        compressed = self.ratio > 1
        theta = cfg.compress_rope_theta if compressed else cfg.rope_theta
        inv = yarn_inv_freq(cfg.qk_rope_head_dim, theta, cfg.yarn if compressed else None)
        self.rotary = Rotary(cfg.qk_rope_head_dim, inv, key=(theta, compressed))
        self.compressor = Compressor(cfg, self.ratio, self.head_dim) if compressed else None
        is_csa = layer_id < cfg.num_hidden_layers and cfg.layer_types[layer_id] == CSA
        self.indexer = Indexer(cfg, self.ratio) if is_csa else None

    # -- pieces reused by the drafters --
    def project_q(self, x: torch.Tensor, positions: torch.Tensor, rot: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (q [T, h, D] normalised + RoPE, q_lora [T, q_lora_rank])."""
        qr = self.q_norm(dense(self.wq_a, x))
        q = dense(self.wq_b, qr).view(x.shape[0], self.n_heads, self.head_dim)
        return self.rotary.apply(q, positions, rot=rot, norm=self.cfg.rms_norm_eps), qr

    def project_kv(self, x: torch.Tensor, positions: torch.Tensor, rot: torch.Tensor | None = None,
                   out: torch.Tensor | None = None, out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """-> kv [T, D]: the shared K = V latent, normalised, RoPE at `positions`; with `out` / `out_rows` its rows
        go to out[out_rows] in the same launch (a pool write) -> out."""
        return self.rotary.apply(dense(self.wkv, x), positions, rot=rot, norm=self.kv_norm, out=out, out_rows=out_rows)

    def project_qkv(self, x: torch.Tensor, positions: torch.Tensor, rot: torch.Tensor | None = None,
                    kv_pool: torch.Tensor | None = None, kv_rows: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`project_q` and `project_kv` with the indexer's projections of the same inputs (CSA layers), each input's
        linears as one GEMM of their stacked weights (`fused_linear`: wq_a / wkv / weights_proj on x, wq_b / the
        indexer's wq_b on q_lora) -> (q [T, h, D], kv [T, D], indexer q [T, ih, id] with RoPE, indexer head
        weights [T, ih] fp32, scaled by ih^-1/2), the indexer's None without one."""
        ix, T = self.indexer, x.shape[0]
        qa, kv, *iw = fused_linear(x, self.wq_a, self.wkv, *([ix.weights_proj] if ix is not None else []))
        qb, *iq = fused_linear(self.q_norm(qa), self.wq_b, *([ix.wq_b] if ix is not None else []))
        q = self.rotary.apply(qb.view(T, self.n_heads, self.head_dim), positions, rot=rot, norm=self.cfg.rms_norm_eps)
        kv = self.rotary.apply(kv, positions, rot=rot, norm=self.kv_norm, out=kv_pool, out_rows=kv_rows)
        if ix is None:
            return q, kv, None, None
        iq = self.rotary.apply(iq[0].view(T, ix.n_heads, ix.head_dim), positions, rot=rot)
        return q, kv, iq, iw[0]

    def project_out(self, o: torch.Tensor, positions: torch.Tensor, rot: torch.Tensor | None = None
                    ) -> torch.Tensor:
        """o [T, h, D] -> inverse RoPE (`rot`: the rotation at `positions`) -> grouped wo_a -> wo_b -> [T, H]."""
        T, g = o.shape[0], self.wo_a.weight.shape[0] // self.cfg.o_lora_rank  # this rank's groups (all: 1 rank)
        o = self.rotary.apply(o, positions, inverse=True, rot=rot).reshape(T, g, -1)  # [T, g, h·D/g]
        w = self.wo_a.weight.view(g, self.cfg.o_lora_rank, -1)  # [g, o_lora, h·D/g]
        z = torch.einsum("tgi,goi->tgo", o, w).reshape(T, -1)
        return all_reduce(dense(self.wo_b, z), self.tp)  # tensor parallel: each rank holds some heads' share

    # -- target forward over a flat batch --
    def forward(self, x: torch.Tensor, batch: ForwardBatch, x_fp32: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] (x_fp32: the same in fp32, if the caller has it) -> [T, H]. Stores this step's rows of every cache
        kind, emits the compressed entries the step's positions close, then attends over the pools through one index
        list per query. Addressing that only depends on the ratio is computed once per forward and shared by the
        layers (`batch.memo`)."""
        pos, r = batch.positions, self.ratio
        pools = batch.cache.layers[self.layer_id]
        rot = self.rotary.rotations(batch, "tokens", lambda: pos)
        q, _, iq, iw = self.project_qkv(x, pos, rot, pools["attn"], batch.token_rows(r))  # kv -> its cache rows
        num_compressed = 0
        if self.compressor is not None:
            plan = batch.emission(r, 2 * r if self.compressor.overlap else r)
            states, index_states = self.compressor_states(x if x_fp32 is None else x_fp32)
            self.compressor.store_states(pools["comp_kv"], pools["comp_score"], states, batch)
            entry_rot = self.rotary.rotations(batch, ("entries", r), lambda: plan.first)
            self.compressor.emit(pools["comp_kv"], pools["comp_score"], plan, entry_rot, pools["attn"], plan.attn_rows)
            num_compressed = batch.max_seq_len // r
        if (ix := self.indexer) is not None:
            ix.compressor.store_states(pools["idx_kv"], pools["idx_score"], index_states, batch)
            ix.compressor.emit(pools["idx_kv"], pools["idx_score"], plan, entry_rot, pools["idx_keys"], plan.key_rows)
            key_rows = batch.memo(("key_rows", r), lambda: self.key_rows(batch, num_compressed))  # [T, C]
            # the window rows and this layer's choice: the select launch writes the lists (`chosen_rows`)
            lists = (batch.sliding_rows(self.window, r), batch.entry_table(r), batch.req_idx)
            indices = ops.indexer_topk(iq, iw, pools["idx_keys"], None, batch.visible(r), ix.topk, ix.head_dim ** -0.5,
                                       ix.n_heads ** -0.5, key_rows, lists)
        else:  # sliding and heavily compressed layers: the same lists for every layer of the ratio
            indices = batch.memo(("indices", r), lambda: self.indices(batch))
        o = ops.sparse_attention(q, pools["attn"], indices, self.attn_sink, self.scale)
        return self.project_out(o, pos, rot)

    def compressor_states(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [T, H] (fp32 already, or cast here) -> (kv, score) of the compressor [T, 2·c·d] and of the indexer's
        [T, 2·c·d'] (None without an indexer): one fp32 GEMM for all of them."""
        parts = [self.compressor.wkv, self.compressor.wgate]
        if self.indexer is not None:
            parts += [self.indexer.compressor.wkv, self.indexer.compressor.wgate]
        states = F.linear(x.float(), fp32_weight(*parts))
        w = 2 * self.compressor.wkv.weight.shape[0]
        return states[:, :w], (states[:, w:] if self.indexer is not None else None)

    def indices(self, batch: ForwardBatch) -> torch.Tensor:
        """`ops.paged_attention_indices` of a sliding or heavily compressed layer from the step's pieces (`batch`: the
        window rows shared by every ratio); CSA layers' lists come from their indexer (`indexer_topk(..., lists)`)."""
        window = batch.sliding_rows(self.window, self.ratio)
        if self.ratio <= 1:
            return window
        return torch.cat([window, batch.visible_entry_rows(self.ratio)], dim=1)  # HCA: every visible entry

    def key_rows(self, batch: ForwardBatch, num_compressed: int) -> torch.Tensor:
        """[T, C] `idx_keys` rows of every entry j < C of each query's request (pads: rows of a real block or of the
        scratch block, never chosen: the indexer masks j >= what the query sees); the indexer reads its keys
        through them."""
        j = torch.arange(num_compressed, device=batch.positions.device).unsqueeze(0)  # [1, C]
        return batch.entry_rows(j, batch.req_idx.unsqueeze(1), self.ratio,
                                entries_per_block(batch.block_size, self.ratio), 0)


def store(pool: torch.Tensor, rows: torch.Tensor, values: torch.Tensor) -> None:
    """The one cache write: pool[rows] = values. Rows come from the block tables (padded rows of a static batch
    address the scratch block, entries that close nothing the pool's trash row), so every row is valid."""
    pool.index_copy_(0, rows, values.to(pool.dtype))


class Expert(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, inter, bias=False)  # gate
        self.w2 = nn.Linear(inter, hidden, bias=False)  # down
        self.w3 = nn.Linear(hidden, inter, bias=False)  # up


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, is_hash: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if is_hash:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))  # e_score_correction_bias


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        self.is_hash = cfg.is_hash_layer(layer_id)
        self.gate = Gate(cfg, self.is_hash)
        self.experts = nn.ModuleList(Expert(cfg.hidden_size, cfg.moe_intermediate_size)
                                     for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts)
        self.tp: ParallelGroup | None = None  # set by `distributed.tensor_parallel.shard_`
        self.experts_held: tuple[int, int] | None = None  # expert parallel: (first expert id, count) held here

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor, x_fp32: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, H] (x_fp32: the same in fp32, if the caller has it: the router's GEMM is fp32) -> [T, H]."""
        cfg = self.cfg
        logits = F.linear(x.float() if x_fp32 is None else x_fp32, fp32_weight(self.gate))
        hash_ids = self.gate.tid2eid[input_ids] if self.is_hash else None
        weights, ids = ops.moe_route(logits, self.gate.bias, hash_ids, cfg.num_experts_per_tok, cfg.scoring_func,
                                     cfg.norm_topk_prob, cfg.routed_scaling_factor)
        if self.experts_held is not None:  # expert parallel: this rank computes only the experts it holds
            first, num = self.experts_held
            local = ids - first
            held = (local >= 0) & (local < num)
            ids, weights = local.clamp(0, num - 1), weights * held
        se = self.shared_experts
        gate_up = stacked_linear(x, se.w1, se.w3)  # [T, 2I] one GEMM where w1 / w3 can share a stacked weight
        act = (swiglu(dense(se.w1, x), dense(se.w3, x), cfg.swiglu_limit) if gate_up is None
               else ops.swiglu_packed(gate_up, cfg.swiglu_limit))
        shared = dense(se.w2, act)
        w13, w2 = expert_weights(self)  # stacked once (views share the parameters' storage)
        fused = shared.dtype == x.dtype  # routed + shared in the experts' last launch
        y = ops.moe_experts(x, w13, w2, weights, ids, cfg.swiglu_limit, shared if fused else None)
        # tensor parallel: each rank holds a slice of every expert
        return all_reduce(y if fused else y + shared, self.tp)


class Block(nn.Module):
    """One V4 decoder layer: mHC pre -> attn -> mHC post; mHC pre -> MoE -> mHC post."""

    def __init__(self, cfg: ModelConfig, layer_id: int):
        super().__init__()
        self.cfg = cfg
        self.layer_id = layer_id
        n, H = cfg.hc_mult, cfg.hidden_size
        mix = (2 + n) * n
        self.attn = Attention(cfg, layer_id)
        self.ffn = MoE(cfg, layer_id)
        self.attn_norm = RMSNorm(H, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(H, cfg.rms_norm_eps)
        for part in ("attn", "ffn"):
            setattr(self, f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, n * H)))
            setattr(self, f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
            setattr(self, f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def hc_pre(self, x: torch.Tensor, part: str):
        """-> (the sublayer's input, collapsed from the streams and normalised by its norm, post, comb[, that input
        in fp32 where the sublayer takes it so: `fp32_input`])."""
        c, norm = self.cfg, getattr(self, f"{part}_norm")
        return ops.mhc_pre(x, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_scale"),
                           getattr(self, f"hc_{part}_base"), c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters,
                           fp32_weight(norm), norm.eps, self.fp32_input(part))

    def hc_post_pre(self, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, part: str):
        """The previous sublayer's mHC post (its output y, its input streams x, post, comb), then this block's `part`
        pre on the new streams, as one op (`ops.mhc_post_pre`: one launch fewer) -> (streams, input, post, comb[,
        input in fp32])."""
        c, norm = self.cfg, getattr(self, f"{part}_norm")
        return ops.mhc_post_pre(y, x, post, comb, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_scale"),
                                getattr(self, f"hc_{part}_base"), c.rms_norm_eps, c.hc_eps, c.hc_sinkhorn_iters,
                                fp32_weight(norm), norm.eps, self.fp32_input(part))

    def fp32_input(self, part: str) -> bool:
        """Whether the sublayer also takes its input in fp32 (the router's GEMM; the compressor's): the mHC launch
        that writes the input writes that copy too, instead of a cast per layer."""
        return part == "ffn" or self.attn.compressor is not None

    def forward(self, x: torch.Tensor, positions: torch.Tensor, input_ids: torch.Tensor, attn_fn,
                pre: tuple | None = None, next_layer: Block | None = None):
        """x: [T, n, H] streams; `attn_fn(normed [T, H][, the same in fp32]) -> [T, H]` runs this layer's attention
        (the fp32 copy where `fp32_input("attn")`) -> the output streams. `pre`: this layer's attention pre of x
        where the layer before took it in its last op; with `next_layer` this layer does so for that layer ->
        (output streams, the next layer's pre)."""
        h, post, comb, *h32 = self.hc_pre(x, "attn") if pre is None else pre
        x, h, post, comb, h32 = self.hc_post_pre(attn_fn(h, *h32), x, post, comb, "ffn")
        y = self.ffn(h, input_ids, h32)
        if next_layer is None:
            return ops.mhc_post(y, x, post, comb)
        x, *next_pre = next_layer.hc_post_pre(y, x, post, comb, "attn")
        return x, tuple(next_pre)


@dataclass
class ModelOutput:
    logits: torch.Tensor  # [L, V] fp32 for the requested rows
    taps: torch.Tensor | None = None  # [T, len(tap_layers), H] mean over hc streams of chosen layer outputs
    final_streams: torch.Tensor | None = None  # [T, n·H] residual before hc_head (MTP input)
    hidden: torch.Tensor | None = None  # [T, H] hc_head output (pre-norm)


class DeepseekV4Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        n, H = cfg.hc_mult, cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, H)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.head = nn.Linear(H, cfg.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(torch.zeros(n, n * H))
        self.hc_head_base = nn.Parameter(torch.zeros(n))
        self.hc_head_scale = nn.Parameter(torch.ones(1))

    @property
    def compress_ratios(self) -> tuple[int, ...]:
        """The distinct compress ratios (> 1) of the target layers: the batch precomputes entry rows per ratio."""
        return tuple(sorted({layer.attn.ratio for layer in self.layers if layer.attn.ratio > 1}))

    # -- drafter interface --
    def logits_from_hidden(self, h: torch.Tensor) -> torch.Tensor:
        """h [T, H] (pre-norm hc_head output) -> logits [T, V] fp32 with the shared norm and head."""
        return head_logits(self.head, self.norm(h).float())

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        c = self.cfg
        return ops.hc_head(x, self.hc_head_fn, self.hc_head_scale, self.hc_head_base, c.rms_norm_eps, c.hc_eps)

    def forward(
        self,
        batch: ForwardBatch,
        tap_layers: tuple[int, ...] = (),  # 0-based layers whose OUTPUT streams (mean over hc) are captured
        capture_final_streams: bool = False,
    ) -> ModelOutput:
        x = self.embed(batch.input_ids)
        x = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # [T, n, H]
        taps, pre, layers = [], None, list(self.layers)
        for i, layer in enumerate(layers):
            # each layer's last mHC post and the next layer's first pre: one op (`Block.hc_post_pre`)
            nxt = layers[i + 1] if i + 1 < len(layers) else None
            out = layer(x, batch.positions, batch.input_ids, lambda h, *h32, a=layer.attn: a(h, batch, *h32), pre, nxt)
            x, pre = out if nxt is not None else (out, None)
            if i in tap_layers:
                taps.append(x.mean(dim=1, dtype=torch.float32))  # one launch: the upcast inside the reduction
        hidden = self.collapse(x)
        rows = hidden if batch.logits_rows is None else hidden[batch.logits_rows]
        return ModelOutput(
            logits=self.logits_from_hidden(rows),
            taps=torch.stack(taps, dim=1) if taps else None,
            final_streams=x.flatten(1) if capture_final_streams else None,
            hidden=hidden,
        )

    def keep_fp32(self) -> DeepseekV4Model:
        """Cast mHC, sink, ape and router-bias parameters back to fp32 after a `.to(bf16)`."""
        for name, p in self.named_parameters():
            if name.endswith(FP32_PARAM_SUFFIXES) or "norm" in name.split(".")[-2:-1]:
                p.data = p.data.float()
        for m in self.modules():
            if isinstance(m, Rotary):
                m.inv_freq = m.inv_freq_fp32.to(m.inv_freq.device)
        return self
