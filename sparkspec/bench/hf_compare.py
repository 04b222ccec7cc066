"""transformers' `DeepseekV4ForCausalLM` beside ours on the same random weights, for `bench latency
--compare-transformers`: the pair, and transformers' own decode time per step (`generate`, greedy)."""

from __future__ import annotations

import time

import torch

from sparkspec.bench.common import sync
from sparkspec.config import ModelConfig


def transformers_config(cfg: ModelConfig) -> dict:
    """Our config in the form `transformers.DeepseekV4Config` takes."""
    d = {"vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size,
         "num_hidden_layers": cfg.num_hidden_layers,
         "num_attention_heads": cfg.num_attention_heads, "head_dim": cfg.head_dim,
         "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim, "q_lora_rank": cfg.q_lora_rank,
         "o_lora_rank": cfg.o_lora_rank, "o_groups": cfg.o_groups, "sliding_window": cfg.sliding_window,
         "layer_types": list(cfg.layer_types), "compress_rates": dict(cfg.compress_rates),
         "mlp_layer_types": list(cfg.mlp_layer_types), "index_n_heads": cfg.index_n_heads,
         "index_head_dim": cfg.index_head_dim, "index_topk": cfg.index_topk,
         "n_routed_experts": cfg.n_routed_experts,
         "num_experts_per_tok": cfg.num_experts_per_tok, "n_shared_experts": cfg.n_shared_experts,
         "moe_intermediate_size": cfg.moe_intermediate_size, "hc_mult": cfg.hc_mult,
         "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters, "hc_eps": cfg.hc_eps, "rms_norm_eps": cfg.rms_norm_eps,
         "routed_scaling_factor": cfg.routed_scaling_factor, "swiglu_limit": cfg.swiglu_limit,
         "max_position_embeddings": cfg.max_position_embeddings, "bos_token_id": cfg.bos_token_id,
         "eos_token_id": cfg.eos_token_id}
    if cfg.yarn is not None:
        d["rope_parameters"] = {"rope_type": "yarn", "factor": cfg.yarn.factor,
                                "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
                                "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow}
    return d


def transformers_pair(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """(transformers model, our model) with the same random weights: built by transformers, copied into ours."""
    import transformers

    from sparkspec.loading.names import official_name, split_fused_experts
    from sparkspec.loading.state import load_state
    from sparkspec.models.deepseek_v4 import DeepseekV4Model

    torch.manual_seed(seed)
    with torch.device(device):
        hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**transformers_config(cfg)))
    hf = hf.to(dtype).eval()
    with torch.no_grad():
        for _name, p in hf.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p.shape[-1] ** -0.5)
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):
                b.copy_(torch.randint(0, cfg.n_routed_experts, b.shape, device=b.device))
    tensors: dict[str, torch.Tensor] = {}
    for name, t in hf.state_dict().items():
        name = official_name(name)
        if not split_fused_experts(name, t, tensors):
            tensors[name] = t
    with torch.device(device):
        ours = DeepseekV4Model(cfg)
    ours = ours.to(dtype)
    if hasattr(ours, "keep_fp32"):
        ours.keep_fp32()
    load_state(ours, {k: v for k, v in tensors.items() if not k.startswith("mtp.")})
    return hf, ours.eval()


def transformers_step_ms(hf, batch: int, input_len: int, output_len: int, seed: int = 0) -> float:
    """Decode milliseconds per step of `generate` (greedy), prefill subtracted."""
    device = next(hf.parameters()).device
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, hf.config.vocab_size, (batch, input_len), generator=g).to(device)

    def run(n: int) -> float:
        sync(device)
        t0 = time.perf_counter()
        with torch.no_grad():
            hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                        do_sample=False, pad_token_id=0)
        sync(device)
        return time.perf_counter() - t0

    run(2)  # warm-up
    return 1000 * (run(output_len) - run(1)) / (output_len - 1)
