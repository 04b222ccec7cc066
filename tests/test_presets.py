"""The `deepseek-v4-flash` preset: the official DeepSeek-V4-Flash shape (284B total, 13B active), its parameter
count derived here from the config by hand and compared with the model built on the meta device."""

from __future__ import annotations

import torch

from sparkspec.config import CSA, HCA, PRESET_DIR, ModelConfig
from sparkspec.loading.meta import meta_model


def expected_target_params(cfg: ModelConfig) -> tuple[int, int]:
    """(total, routed-expert) parameters of the target from the config arithmetic alone."""
    H, V, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    h, D, q, o, g = cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_lora_rank, cfg.o_groups
    E, I = cfg.n_routed_experts, cfg.moe_intermediate_size
    expert = 3 * H * I
    attention = H * q + q + q * h * D + H * D + D + (h * D // g) * (g * o) + g * o * H + h
    mix = (2 + n) * n
    hc = 2 * (mix * n * H + mix + 3)
    total, routed = 2 * V * H + H + n * n * H + n + 1, 0  # embed, head, final norm, hc_head
    for layer, kind in enumerate(cfg.layer_types):
        total += attention + hc + 2 * H  # attn_norm, ffn_norm
        if kind == CSA:  # overlapping compressor (2D wide) + indexer (its own compressor, 2 x index_head_dim wide)
            r, d = cfg.compress_rates[CSA], cfg.index_head_dim
            total += 2 * H * 2 * D + r * 2 * D + D
            total += q * cfg.index_n_heads * d + H * cfg.index_n_heads + 2 * H * 2 * d + r * 2 * d + d
        elif kind == HCA:
            r = cfg.compress_rates[HCA]
            total += 2 * H * D + r * D + D
        total += E * H + (0 if cfg.is_hash_layer(layer) else E)  # router weight, bias (hash layers: tid2eid)
        total += E * expert + expert * cfg.n_shared_experts
        routed += E * expert
    return total, routed


def test_flash_preset_has_the_official_shape_and_size():
    assert "deepseek-v4-flash" in sorted(p.stem for p in PRESET_DIR.glob("*.json"))
    cfg = ModelConfig.preset("deepseek-v4-flash")
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok) == (43, 4096, 256, 6)
    assert cfg.layer_types[:2] == ["sliding_attention"] * 2 and cfg.layer_types[2] == CSA and cfg.layer_types[3] == HCA
    assert cfg.layer_types.count(CSA) == 21 and cfg.layer_types.count(HCA) == 20 and cfg.num_hash_layers == 3
    assert cfg.has_dspark and cfg.num_dspark_layers == 3 and cfg.num_nextn_predict_layers == 1
    assert cfg.dspark_target_layer_ids == [40, 41, 42] and cfg.dspark_block_size == 5

    model = meta_model(cfg, torch.bfloat16)  # no memory: shapes only
    count = sum(p.numel() for p in model.parameters())
    total, routed = expected_target_params(cfg)
    assert count == total
    assert 283e9 < count < 285e9  # "284B total"
    active = count - routed - cfg.vocab_size * cfg.hidden_size + cfg.num_hidden_layers * cfg.num_experts_per_tok \
        * routed // (cfg.n_routed_experts * cfg.num_hidden_layers)  # per token: no embedding rows, 6 of 256 experts
    assert 12e9 < active < 14e9  # "13B active"
