"""Tensor names: what transformers writes, mapped onto the official DeepSeek names the model uses.

Accepted tensor names:
* official DeepSeek names (`embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
  `layers.N.ffn.gate.bias`, `hc_head_fn`, `head.weight`, `mtp.S.*`) — the model's own names;
* what transformers' `save_pretrained` writes (`model.` prefix, `model.embed_tokens.weight`,
  `model.hc_head.hc_fn`, `attn.norm.weight` for the KV norm), and transformers' module names
  (`self_attn.q_a_proj`, `mlp.experts.gate_up_proj`, `lm_head.weight`, ...), through `TRANSFORMERS_RENAMES`;
  transformers' fused expert tensors (`FUSED_EXPERTS`) split into one official tensor per expert and projection.
"""

from __future__ import annotations

import re

import torch

# (pattern, replacement) applied in order to names that are not official yet
TRANSFORMERS_RENAMES: list[tuple[str, str]] = [
    (r"^model\.", ""),
    (r"^embed_tokens\.weight$", "embed.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^hc_head\.hc_(fn|base|scale)$", r"hc_head_\1"),
    (r"\.self_attn\.", ".attn."),
    (r"\.mlp\.", ".ffn."),
    (r"\.attn_hc\.(fn|base|scale)$", r".hc_attn_\1"),
    (r"\.ffn_hc\.(fn|base|scale)$", r".hc_ffn_\1"),
    (r"\.input_layernorm\.", ".attn_norm."),
    (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.attn\.sinks$", ".attn.attn_sink"),
    (r"\.attn\.norm\.weight$", ".attn.kv_norm.weight"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."),
    (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."),
    (r"\.position_bias$", ".ape"),
    (r"\.q_a_proj\.", ".wq_a."),
    (r"\.q_a_norm\.", ".q_norm."),
    (r"\.q_b_proj\.", ".wq_b."),
    (r"\.kv_proj\.", ".wkv."),
    (r"\.gate_proj\.", ".wgate."),
    (r"\.o_a_proj\.", ".wo_a."),
    (r"\.o_b_proj\.", ".wo_b."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"),
    (r"\.shared_experts\.wgate\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."),
    (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"\.weight_scale_inv$", ".scale"),
]
FUSED_EXPERTS = re.compile(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$")


def official_name(name: str) -> str:
    for pat, rep in TRANSFORMERS_RENAMES:
        name = re.sub(pat, rep, name)
    return name


def split_fused_experts(name: str, t: torch.Tensor, out: dict[str, torch.Tensor]) -> bool:
    """transformers' module layout stacks experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    m = FUSED_EXPERTS.match(name)
    if not m:
        return False
    for e in range(t.shape[0]):
        if m.group(2) == "gate_up_proj":
            w1, w3 = t[e].chunk(2, dim=0)
            out[f"{m.group(1)}.{e}.w1.weight"], out[f"{m.group(1)}.{e}.w3.weight"] = w1, w3
        else:
            out[f"{m.group(1)}.{e}.w2.weight"] = t[e]
    return True
