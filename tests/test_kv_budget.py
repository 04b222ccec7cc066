"""KV budget = allocation: the engine's KV plan prices every tensor that `ModelRunner.allocate` makes (the target's
pools, the drafter's pools, their scratch block and trash rows, `q_store`) in the dtype it is allocated in, which
is the loaded model's, not the config's (the CPU demo: config bf16, loaded fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from spec_helpers import drafter_tensors, one_thread, random_target, tiny_config  # noqa: F401

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.cuda_graphs import MIXED_PROMPTS
from sparkspec.engine.kv_plan import cache_bytes_per_token, plan_kv_cache
from sparkspec.engine.llm_engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
NUM_SPEC_TOKENS = {"none": None, "ngram": 3, "dspark": 3, "mtp": 1}


def allocated_bytes(engine: LLMEngine) -> dict[str, int]:
    """What the engine really holds for its caches, measured on the tensors."""
    runner = engine.runner
    pools = getattr(runner.proposer, "pools", None) or []
    return {"target pools": sum(t.nbytes for layer in runner.cache.layers for t in layer.values()),
            "drafter pools": sum(t.nbytes for t in pools),
            "q_store": runner.q_store.nbytes if runner.q_store is not None else 0}


@pytest.mark.parametrize("config_dtype, load_dtype", [("float32", "float32"), ("bfloat16", "float32"),
                                                      ("bfloat16", "bfloat16"), ("float32", "bfloat16")])
@pytest.mark.parametrize("method", list(NUM_SPEC_TOKENS))
@pytest.mark.parametrize("budget", [{}, {"kv_cache_memory": 300_000}])
def test_the_plan_covers_what_is_allocated(config_dtype, load_dtype, method, budget):
    cfg = dataclasses.replace(tiny_config(), torch_dtype=config_dtype)
    model = random_target(cfg, dtype=DTYPES[load_dtype])
    config = EngineConfig(max_num_seqs=8, max_model_len=96, block_size=16, speculative=method,
                          num_spec_tokens=NUM_SPEC_TOKENS[method], spec_budget="fixed", **budget)
    engine = LLMEngine(model, None, config, drafter_tensors(cfg))
    plan, allocated = engine.kv_plan, allocated_bytes(engine)
    total = sum(allocated.values())
    assert total <= plan.total_bytes <= total + plan.bytes_per_block, (plan.describe(), allocated)
    if method in ("dspark", "mtp"):  # context pools; on-device drafts keep their q: [max_num_seqs + P, k, V] fp32
        assert allocated["drafter pools"] > 0
        q_bytes = (8 + MIXED_PROMPTS) * NUM_SPEC_TOKENS[method] * cfg.vocab_size * 4  # (a mixed graph's prompts)
        assert allocated["q_store"] == plan.overhead_bytes["q_store"] == q_bytes
    if not budget:
        assert plan.num_blocks == 8 * (96 // 16)  # sized for max_num_seqs x max_model_len
    else:  # an explicit budget is the blocks' alone
        assert plan.num_blocks == 300_000 // plan.bytes_per_block


def test_latents_are_priced_in_the_loaded_dtype():
    """The CPU demo's case: a bf16 config loaded in fp32 allocates (and is charged) 4 bytes a latent element."""
    cfg = dataclasses.replace(tiny_config(), torch_dtype="bfloat16")
    bf16, fp32 = cache_bytes_per_token(cfg, 16), cache_bytes_per_token(cfg, 16, torch.float32)
    assert bf16["swa_kv"] == cfg.num_hidden_layers * cfg.head_dim * 2
    assert fp32["swa_kv"] == cfg.num_hidden_layers * cfg.head_dim * 4
    assert fp32["indexer"] == bf16["indexer"] and fp32["compressor_state"] == bf16["compressor_state"]  # fp32 always


def test_a_share_of_free_memory_covers_the_overhead_too(monkeypatch):
    """`--kv-cache-fraction` and the default cap bound everything allocated, q_store and scratch block included."""
    import sparkspec.engine.kv_plan as kv_plan

    cfg = tiny_config()
    monkeypatch.setattr(kv_plan, "available_memory_bytes", lambda device="cpu": 4 << 20)
    q_store = {"q_store": 64 * 5 * cfg.vocab_size * 4}  # 1.3 MB of the 4 MB
    for kw in ({"memory_fraction": 0.5}, {"max_model_len": cfg.max_position_embeddings}):
        plan = plan_kv_cache(cfg, block_size=16, max_num_seqs=64, buffer_bytes=q_store, **kw)
        assert plan.total_bytes <= plan.budget_bytes < plan.total_bytes + plan.bytes_per_block
    with pytest.raises(ValueError, match="besides the"):
        plan_kv_cache(cfg, block_size=16, memory_fraction=0.25, buffer_bytes=q_store)
