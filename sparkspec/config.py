"""Typed, self-validating configuration for DeepSeek-V4-family checkpoints.

`ModelConfig.from_dict` reads both `config.json` forms that exist in the wild:

* the official DeepSeek form (`compress_ratios` per layer, `num_hash_layers`, `qk_rope_head_dim`,
  `rope_scaling` for YaRN, `dspark_*`, `n_mtp_layers` / `num_nextn_predict_layers`), and
* the form transformers writes (`layer_types`, `compress_rates`, `mlp_layer_types`,
  `rope_parameters` with `main` / `compress`, `partial_rotary_factor`).

Every missing or inconsistent field raises `ValueError` naming the field, the value and what was expected.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
MLP_TYPES = ("hash_moe", "moe")

PRESET_DIR = Path(__file__).parent / "presets"


def _fail(name: str, value: Any, expected: str) -> None:
    raise ValueError(f"config field '{name}' = {value!r}: expected {expected}")


@dataclass
class YarnConfig:
    """YaRN frequency interpolation used by the compressed-attention RoPE (attention factor is always 1)."""

    factor: float = 1.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass
class ModelConfig:
    # vocabulary and width
    vocab_size: int
    hidden_size: int  # H
    num_hidden_layers: int  # target layers; draft / MTP layers are numbered from here up
    # attention (MQA with one shared K=V latent)
    num_attention_heads: int
    head_dim: int  # K = V latent width (nope + rope)
    qk_rope_head_dim: int  # RoPE on the LAST qk_rope_head_dim dims, GPT-J interleaved pairs
    q_lora_rank: int
    o_lora_rank: int
    o_groups: int
    sliding_window: int  # window including the current token
    layer_types: list[str]  # per target layer: sliding / CSA (ratio 4) / HCA (large ratio)
    compress_rates: dict[str, int]
    # lightning indexer (CSA layers)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # RoPE
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = None  # only on compressed layers
    max_position_embeddings: int = 1 << 20
    # MoE
    n_routed_experts: int = 8
    num_experts_per_tok: int = 2
    n_shared_experts: int = 1
    moe_intermediate_size: int = 64
    mlp_layer_types: list[str] = field(default_factory=list)  # hash_moe | moe per target layer
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    swiglu_limit: float = 10.0
    # mHC
    hc_mult: int = 4  # n hyper-connection streams
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    # drafters
    num_nextn_predict_layers: int = 0  # classic MTP layers (checkpoint stages mtp.*)
    n_mtp_layers: int | None = None  # DSpark stages (official inference config name)
    dspark_block_size: int | None = None
    dspark_markov_rank: int | None = None
    dspark_target_layer_ids: list[int] | None = None
    dspark_noise_token_id: int | None = None
    # tokens
    bos_token_id: int | None = 0
    eos_token_id: int | list[int] | None = 1
    # storage
    torch_dtype: str = "bfloat16"
    expert_dtype: str | None = None
    quantization_config: dict | None = None
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                     "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window", "hc_mult",
                     "hc_sinkhorn_iters", "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                _fail(name, v, "a positive integer")
        if self.qk_rope_head_dim <= 0 or self.qk_rope_head_dim > self.head_dim or self.qk_rope_head_dim % 2:
            _fail("qk_rope_head_dim", self.qk_rope_head_dim, f"an even integer in [2, head_dim={self.head_dim}]")
        if self.num_attention_heads % self.o_groups:
            _fail("o_groups", self.o_groups, f"a divisor of num_attention_heads={self.num_attention_heads}")
        if len(self.layer_types) != self.num_hidden_layers:
            _fail("layer_types", self.layer_types, f"{self.num_hidden_layers} entries (num_hidden_layers)")
        for t in self.layer_types:
            if t not in LAYER_TYPES:
                _fail("layer_types", t, f"one of {LAYER_TYPES}")
        for t in (CSA, HCA):
            rate = self.compress_rates.get(t)
            if t in self.layer_types and not (isinstance(rate, int) and rate > 1):
                _fail("compress_rates", self.compress_rates, f"an integer ratio > 1 for '{t}'")
        if CSA in self.layer_types:
            for name in ("index_n_heads", "index_head_dim", "index_topk"):
                if getattr(self, name) < 1:
                    _fail(name, getattr(self, name), "a positive integer (the config has CSA layers)")
            if self.index_head_dim % 2 or self.qk_rope_head_dim > self.index_head_dim:
                _fail("index_head_dim", self.index_head_dim, f"even and >= qk_rope_head_dim={self.qk_rope_head_dim}")
        if not self.mlp_layer_types:
            self.mlp_layer_types = ["moe"] * self.num_hidden_layers
        if len(self.mlp_layer_types) != self.num_hidden_layers:
            _fail("mlp_layer_types", self.mlp_layer_types, f"{self.num_hidden_layers} entries")
        for t in self.mlp_layer_types:
            if t not in MLP_TYPES:
                _fail("mlp_layer_types", t, f"one of {MLP_TYPES}")
        if self.num_experts_per_tok > self.n_routed_experts:
            _fail("num_experts_per_tok", self.num_experts_per_tok, f"<= n_routed_experts={self.n_routed_experts}")
        if self.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            _fail("scoring_func", self.scoring_func, "one of sqrtsoftplus, sigmoid, softmax")
        if self.dspark_target_layer_ids is not None:
            ids = list(self.dspark_target_layer_ids)
            if not ids or any(not 0 <= i < self.num_hidden_layers for i in ids) or ids != sorted(set(ids)):
                _fail("dspark_target_layer_ids", ids,
                      f"strictly increasing 0-based layer ids in [0, {self.num_hidden_layers})")
        if self.dspark_block_size is not None and self.dspark_block_size < 1:
            _fail("dspark_block_size", self.dspark_block_size, "a positive integer")
        if self.dspark_noise_token_id is not None and not 0 <= self.dspark_noise_token_id < self.vocab_size:
            _fail("dspark_noise_token_id", self.dspark_noise_token_id, f"a token id in [0, {self.vocab_size})")
        if self.torch_dtype not in ("float32", "bfloat16", "float16"):
            _fail("torch_dtype", self.torch_dtype, "float32, bfloat16 or float16")

    # ---- derived facts (one source of truth each) ----
    def compress_ratio(self, layer_id: int) -> int:
        """Compression ratio of a layer; 1 = sliding window only. Draft/MTP layers (id >= L) are sliding-only."""
        if layer_id >= self.num_hidden_layers:
            return 1
        t = self.layer_types[layer_id]
        return 1 if t == SLIDING else self.compress_rates[t]

    def is_hash_layer(self, layer_id: int) -> bool:
        return layer_id < self.num_hidden_layers and self.mlp_layer_types[layer_id] == "hash_moe"

    @property
    def num_hash_layers(self) -> int:
        return sum(t == "hash_moe" for t in self.mlp_layer_types)

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size is not None and bool(self.dspark_target_layer_ids)

    @property
    def num_dspark_layers(self) -> int:
        return self.n_mtp_layers or (len(self.dspark_target_layer_ids or []) or 0)

    @property
    def eos_token_ids(self) -> list[int]:
        e = self.eos_token_id
        return [] if e is None else ([e] if isinstance(e, int) else list(e))

    # ---- serialisation ----
    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        if d.get("model_type", "deepseek_v4") not in ("deepseek_v4", "deepseek_v41", "deepseek_v4_dspark"):
            _fail("model_type", d.get("model_type"), "'deepseek_v4'")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim",
                    "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window")
        for name in required:
            if name not in d:
                _fail(name, None, "present (required field)")
        n = d["num_hidden_layers"]
        if not isinstance(n, int) or n < 1:
            _fail("num_hidden_layers", n, "a positive integer")
        rates = dict(d.get("compress_rates") or {CSA: 4, HCA: 128})
        if "compress_ratios" in d and "layer_types" not in d:  # official form
            ratios = d["compress_ratios"]
            if not isinstance(ratios, list) or len(ratios) < n:
                _fail("compress_ratios", ratios, f"a list with at least num_hidden_layers={n} entries")
            types = []
            for i, r in enumerate(ratios[:n]):
                if r in (0, 1):
                    types.append(SLIDING)
                elif r == 4:
                    types.append(CSA)
                    rates[CSA] = 4
                elif isinstance(r, int) and r > 4:
                    types.append(HCA)
                    if rates.get(HCA) not in (None, r) and HCA in types[:-1]:
                        _fail(f"compress_ratios[{i}]", r, f"the same heavy ratio as earlier layers ({rates[HCA]})")
                    rates[HCA] = r
                else:
                    _fail(f"compress_ratios[{i}]", r, "0 (sliding), 4 (CSA) or a heavy ratio > 4 (HCA)")
            layer_types = types
        elif "layer_types" in d:
            layer_types = list(d["layer_types"])[:n] if isinstance(d["layer_types"], list) else d["layer_types"]
        else:
            _fail("compress_ratios", None, "present (or 'layer_types' in the transformers form)")
        if "mlp_layer_types" in d:
            mlp_types = list(d["mlp_layer_types"])[:n]
        else:
            nh = d.get("num_hash_layers", 0)
            if not isinstance(nh, int) or not 0 <= nh <= n:
                _fail("num_hash_layers", nh, f"an integer in [0, {n}]")
            mlp_types = ["hash_moe"] * nh + ["moe"] * (n - nh)
        # RoPE
        rope_dim = d.get("qk_rope_head_dim")
        if rope_dim is None and d.get("partial_rotary_factor") is not None:
            rope_dim = int(round(d["head_dim"] * d["partial_rotary_factor"]))
        if rope_dim is None:
            _fail("qk_rope_head_dim", None, "present (or 'partial_rotary_factor')")
        rope_theta = d.get("rope_theta", 10000.0)
        compress_theta = d.get("compress_rope_theta", 160000.0)
        yarn_src = None
        rp = d.get("rope_parameters")
        if isinstance(rp, dict) and isinstance(rp.get("compress"), dict):
            rope_theta = rp.get("main", {}).get("rope_theta", rope_theta)
            compress_theta = rp["compress"].get("rope_theta", compress_theta)
            if rp["compress"].get("rope_type", "default") == "yarn":
                yarn_src = rp["compress"]
        elif isinstance(d.get("rope_scaling"), dict):
            rs = d["rope_scaling"]
            kind = rs.get("type", rs.get("rope_type"))
            if kind == "yarn":
                yarn_src = rs
            elif kind not in (None, "default"):
                _fail("rope_scaling.type", kind, "'yarn' or absent")
        yarn = None
        if yarn_src is not None:
            for k in ("factor",):
                if not isinstance(yarn_src.get(k), (int, float)) or yarn_src[k] < 1:
                    _fail(f"rope_scaling.{k}", yarn_src.get(k), "a number >= 1")
            yarn = YarnConfig(
                factor=float(yarn_src["factor"]),
                original_max_position_embeddings=int(yarn_src.get("original_max_position_embeddings", 65536)),
                beta_fast=float(yarn_src.get("beta_fast", 32)), beta_slow=float(yarn_src.get("beta_slow", 1)))
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw.update(layer_types=layer_types, compress_rates=rates, mlp_layer_types=mlp_types,
                  qk_rope_head_dim=rope_dim, rope_theta=float(rope_theta), compress_rope_theta=float(compress_theta),
                  yarn=yarn)
        kw.setdefault("index_n_heads", 1 if CSA not in layer_types else d.get("index_n_heads", 0))
        kw.setdefault("index_head_dim", 2 * rope_dim if CSA not in layer_types else 0)
        kw.setdefault("index_topk", 1 if CSA not in layer_types else 0)
        if "dtype" in d and "torch_dtype" not in d:
            kw["torch_dtype"] = d["dtype"]
        if "num_nextn_predict_layers" not in d and d.get("n_mtp_layers") and not d.get("dspark_block_size"):
            kw["num_nextn_predict_layers"] = d["n_mtp_layers"]
        # nested dataclass fields that came in as dicts
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The official DeepSeek form (what `sparkspec init` and the trainers write)."""
        ratio_of = {SLIDING: 0, CSA: self.compress_rates.get(CSA, 4), HCA: self.compress_rates.get(HCA, 128)}
        n_extra = max(self.num_nextn_predict_layers, self.n_mtp_layers or 0)
        d: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
            "compress_ratios": [ratio_of[t] for t in self.layer_types] + [0] * n_extra,
            "num_hash_layers": self.num_hash_layers,
        }
        skip = {"layer_types", "compress_rates", "mlp_layer_types", "yarn"}
        for f in dataclasses.fields(self):
            if f.name not in skip:
                v = getattr(self, f.name)
                if v is not None:
                    d[f.name] = v
        if self.yarn is not None:
            d["rope_scaling"] = {"type": "yarn", **dataclasses.asdict(self.yarn)}
        return d

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"config file not found: {path}")
        try:
            d = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
        if not isinstance(d, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return cls.from_dict(d)

    @classmethod
    def preset(cls, name: str) -> ModelConfig:
        path = PRESET_DIR / f"{name}.json"
        if not path.is_file():
            names = sorted(p.stem for p in PRESET_DIR.glob("*.json"))
            raise ValueError(f"unknown preset '{name}': expected one of {names}")
        return cls.from_file(path)


def yarn_inv_freq(dim: int, base: float, yarn: YarnConfig | None):
    """Inverse RoPE frequencies for `dim` rotary dims; YaRN-interpolated when `yarn` is given."""
    import torch

    inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None or yarn.factor == 1.0:
        return inv.float()

    def corr_dim(num_rot: float) -> float:
        return dim * math.log(yarn.original_max_position_embeddings / (num_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(corr_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(corr_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    return (inv / yarn.factor * (1 - extrapolate) + inv * extrapolate).float()
