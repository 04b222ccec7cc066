"""Checkpoint reading: config + safetensors shards, name mapping tables, FP8/FP4 dequantisation.

Accepted tensor names:
* official DeepSeek names (`embed.weight`, `layers.N.attn.wq_a.weight`, `layers.N.ffn.experts.E.w1.weight`,
  `layers.N.ffn.gate.bias`, `hc_head_fn`, `head.weight`, `mtp.S.*`) — the model's own names;
* what transformers' `save_pretrained` writes (`model.` prefix, `model.embed_tokens.weight`,
  `model.hc_head.hc_fn`, `attn.norm.weight` for the KV norm), and transformers' module names
  (`self_attn.q_a_proj`, `mlp.experts.gate_up_proj`, `lm_head.weight`, ...), through `TRANSFORMERS_RENAMES`.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from sparkspec.models.quant import dequant_fp4, dequant_fp8_block

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


class CheckpointError(ValueError):
    """A user-facing problem with a checkpoint directory (missing file/tensor, wrong shape, dtype)."""


def official_name(name: str) -> str:
    for pat, rep in TRANSFORMERS_RENAMES:
        name = re.sub(pat, rep, name)
    return name


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from None
        files = sorted({path / f for f in weight_map.values()})
        for f in files:
            if not f.is_file():
                raise CheckpointError(f"{f}: listed in {index.name} but missing")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    return files


def _split_fused_experts(name: str, t: torch.Tensor, out: dict[str, torch.Tensor]) -> bool:
    """transformers' module layout stacks experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    m = re.match(r"^(layers\.\d+\.ffn\.experts)\.(gate_up_proj|down_proj)$", name)
    if not m:
        return False
    for e in range(t.shape[0]):
        if m.group(2) == "gate_up_proj":
            w1, w3 = t[e].chunk(2, dim=0)
            out[f"{m.group(1)}.{e}.w1.weight"], out[f"{m.group(1)}.{e}.w3.weight"] = w1, w3
        else:
            out[f"{m.group(1)}.{e}.w2.weight"] = t[e]
    return True


def read_tensors(path: Path, progress: bool = False) -> dict[str, torch.Tensor]:
    """All tensors under official names, dequantised to fp32 where the checkpoint is FP8/FP4."""
    raw: dict[str, torch.Tensor] = {}
    files = checkpoint_files(path)
    iterator = files
    if progress and len(files) > 1:
        from tqdm import tqdm

        iterator = tqdm(files, desc="loading shards", unit="file")
    for f in iterator:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for k in sf.keys():
                    raw[k] = sf.get_tensor(k)
        except Exception as e:  # safetensors raises several types for corrupt files
            raise CheckpointError(f"{f}: cannot read safetensors ({e})") from None
    named: dict[str, torch.Tensor] = {}
    for k, t in raw.items():
        name = official_name(k)
        if not _split_fused_experts(name, t, named):
            named[name] = t
    out: dict[str, torch.Tensor] = {}
    for name, t in named.items():
        if name.endswith(".scale") and name[: -len(".scale")] + ".weight" in named:
            continue  # consumed with its weight
        scale = named.get(name[: -len(".weight")] + ".scale") if name.endswith(".weight") else None
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            if scale is None:
                raise CheckpointError(f"tensor '{name}': FP8 weight without a '.scale' / 'weight_scale_inv'")
            t = dequant_fp8_block(t, scale, name)
        elif t.dtype in (torch.int8, torch.uint8) and scale is not None:
            t = dequant_fp4(t, scale, name)
        elif t.dtype not in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32):
            raise CheckpointError(f"tensor '{name}': unsupported dtype {t.dtype}")
        out[name] = t
    return out


def load_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], prefix: str = "",
               source: str = "checkpoint", allow_extra: tuple[str, ...] = ("mtp.",)) -> None:
    """Copy `tensors` into `model` (names relative to `prefix`); every parameter must be present with its shape."""
    params = dict(model.named_parameters())
    params.update(dict(model.named_buffers()))
    expected = {n for n in params if not n.endswith("inv_freq")}
    have = {n[len(prefix):] for n in tensors if n.startswith(prefix)}
    missing = sorted(expected - have)
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor '{prefix}{missing[0]}'{more}")
    extra = sorted(n for n in have - expected if not (prefix + n).startswith(allow_extra))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CheckpointError(f"{source}: unexpected tensor '{prefix}{extra[0]}'{more}")
    with torch.no_grad():
        for n in expected:
            t, p = tensors[prefix + n], params[n]
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"{source}: tensor '{prefix}{n}' has shape {tuple(t.shape)}, "
                                      f"expected {tuple(p.shape)}")
            p.copy_(t.to(p.dtype))
