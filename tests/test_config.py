"""ModelConfig: both config.json forms, round trips, presets, and one ValueError per bad or missing field."""

from __future__ import annotations

import json
import re

import pytest
from conftest import TINY_CONFIG

from sparkspec.config import CSA, HCA, PRESET_DIR, SLIDING, ModelConfig

DRAFTER_KEYS = ("n_mtp_layers", "dspark_block_size", "dspark_markov_rank", "dspark_target_layer_ids",
                "dspark_noise_token_id")

# The same model as TINY_CONFIG (minus the DSpark fields), in the form transformers' save_pretrained writes.
TRANSFORMERS_FORM = {
    "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "vocab_size": 96, "hidden_size": 32,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "partial_rotary_factor": 0.5, "q_lora_rank": 16, "o_lora_rank": 8, "o_groups": 2, "sliding_window": 8,
    "layer_types": [SLIDING, CSA, HCA, CSA],
    "compress_rates": {CSA: 4, HCA: 8},
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "rope_theta": 10000.0,
    "rope_parameters": {
        "main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1, "attention_factor": 1.0, "partial_rotary_factor": 0.5},
    },
    "max_position_embeddings": 1024, "index_n_heads": 8, "index_head_dim": 8, "index_topk": 3,
    "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 1, "moe_intermediate_size": 16,
    "scoring_func": "sqrtsoftplus", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hc_mult": 2, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "num_nextn_predict_layers": 1,
    "bos_token_id": 0, "eos_token_id": 1, "dtype": "float32", "attention_bias": False, "hidden_act": "silu",
    "initializer_range": 0.02, "tie_word_embeddings": False, "use_cache": True, "transformers_version": "5.24.0",
}


def official_without_drafter() -> dict:
    return {k: v for k, v in TINY_CONFIG.items() if k not in DRAFTER_KEYS}


def test_both_forms_parse_to_the_same_config():
    official = ModelConfig.from_dict(official_without_drafter())
    hf = ModelConfig.from_dict(TRANSFORMERS_FORM)
    assert official == hf
    assert official.layer_types == [SLIDING, CSA, HCA, CSA]
    assert [official.compress_ratio(i) for i in range(5)] == [1, 4, 8, 4, 1]  # id 4 = a drafter layer
    assert official.qk_rope_head_dim == 8 and official.yarn.factor == 4.0
    assert official.num_hash_layers == 1 and official.is_hash_layer(0) and not official.is_hash_layer(1)


def test_official_form_round_trips_through_to_dict():
    cfg = ModelConfig.from_dict(TINY_CONFIG)
    d = cfg.to_dict()
    assert d["compress_ratios"] == [0, 4, 8, 4, 0, 0]  # target layers + one entry per drafter layer
    assert ModelConfig.from_dict(json.loads(json.dumps(d))) == cfg


@pytest.mark.parametrize("name", sorted(p.stem for p in PRESET_DIR.glob("*.json")))
def test_presets_parse_and_round_trip(name):
    cfg = ModelConfig.preset(name)
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg


def test_tiny_preset_has_every_layer_kind():
    cfg = ModelConfig.preset("tiny")
    assert set(cfg.layer_types) == {SLIDING, CSA, HCA}
    assert set(cfg.mlp_layer_types) == {"hash_moe", "moe"}


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="unknown preset 'nope'.*tiny"):
        ModelConfig.preset("nope")


def _expect_error(d: dict, field: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"'{field}'")):
        ModelConfig.from_dict(d)


@pytest.mark.parametrize("field", ["vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                                   "head_dim", "q_lora_rank", "o_lora_rank", "o_groups", "sliding_window",
                                   "compress_ratios", "qk_rope_head_dim"])
def test_missing_field(field):
    d = {k: v for k, v in TINY_CONFIG.items() if k != field}
    _expect_error(d, field)


BAD_VALUES = [
    ("model_type", "llama"),
    ("vocab_size", 0),
    ("hidden_size", "64"),
    ("num_hidden_layers", -1),
    ("num_attention_heads", 2.5),
    ("sliding_window", 0),
    ("hc_mult", 0),
    ("n_routed_experts", True),
    ("qk_rope_head_dim", 7),
    ("qk_rope_head_dim", 32),
    ("o_groups", 3),
    ("num_experts_per_tok", 5),
    ("num_hash_layers", 5),
    ("scoring_func", "relu"),
    ("index_topk", 0),
    ("index_head_dim", 6),
    ("dspark_target_layer_ids", [2, 1]),
    ("dspark_target_layer_ids", [4]),
    ("dspark_block_size", 0),
    ("dspark_noise_token_id", 96),
    ("torch_dtype", "int8"),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_value(field, value):
    _expect_error({**TINY_CONFIG, field: value}, field)


@pytest.mark.parametrize(("ratios", "field"), [
    ([0, 4, 8], "compress_ratios"),  # fewer entries than layers
    ([0, 3, 8, 4], "compress_ratios[1]"),  # no such attention kind
    ([0, 4, 8, 16], "compress_ratios[3]"),  # two different heavy ratios
])
def test_bad_compress_ratios(ratios, field):
    _expect_error({**TINY_CONFIG, "compress_ratios": ratios}, field)


@pytest.mark.parametrize(("key", "value", "field"), [
    ("rope_scaling", {"type": "linear", "factor": 2.0}, "rope_scaling.type"),
    ("rope_scaling", {"type": "yarn", "factor": 0.5}, "rope_scaling.factor"),
    ("layer_types", [SLIDING, CSA, "global_attention", CSA], "layer_types"),
    ("layer_types", [SLIDING, CSA], "layer_types"),
    ("mlp_layer_types", ["moe", "dense", "moe", "moe"], "mlp_layer_types"),
    ("compress_rates", {CSA: 4}, "compress_rates"),
])
def test_bad_transformers_form(key, value, field):
    if key == "rope_scaling":
        d = {**official_without_drafter(), key: value}
    else:
        d = {**TRANSFORMERS_FORM, key: value}
    _expect_error(d, field)


def test_transformers_form_without_rotary_dims():
    d = {k: v for k, v in TRANSFORMERS_FORM.items() if k != "partial_rotary_factor"}
    _expect_error(d, "qk_rope_head_dim")


def test_from_file_errors_name_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="config file not found"):
        ModelConfig.from_file(tmp_path / "config.json")
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    with pytest.raises(ValueError, match=re.escape(str(bad))):
        ModelConfig.from_file(bad)
    bad.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        ModelConfig.from_file(bad)
