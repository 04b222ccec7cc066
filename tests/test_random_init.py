"""Random weights built on the device for one rank (`random_model`): finite logits in bf16, replicated tensors
equal on every rank, expert-parallel experts equal to a single process's, and the memory check that refuses
before allocating."""

from __future__ import annotations

import pytest
import torch

from sparkspec.config import ModelConfig
from sparkspec.distributed import ParallelGroup
from sparkspec.loading.random_model import random_model
from sparkspec.models.forward_batch import forward_sequences

CPU = torch.device("cpu")


def test_bf16_random_model_gives_finite_varied_logits():
    cfg = ModelConfig.preset("tiny")
    model, drafter = random_model(cfg, CPU, torch.bfloat16, drafter="dspark")
    assert model.layers[0].attn.wq_a.weight.dtype == torch.bfloat16
    assert model.layers[0].hc_attn_fn.dtype == torch.float32
    ids = torch.randint(2, cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        logits = forward_sequences(model, ids, [48]).logits
    assert torch.isfinite(logits).all() and 1 < logits.std() < 4
    assert len(set(logits.argmax(-1).tolist())) > 10
    assert all(not p.is_meta for p in [*drafter.parameters(), *model.buffers()])


def test_ranks_agree_on_replicated_tensors_and_expert_parallel_experts_are_the_single_process_ones():
    cfg = ModelConfig.preset("tiny")
    whole, _ = random_model(cfg, CPU, torch.float32)
    ranks = [random_model(cfg, CPU, torch.float32, ParallelGroup(r, 2), expert_parallel=True)[0] for r in (0, 1)]
    a, b = (dict(m.named_parameters()) | dict(m.named_buffers()) for m in ranks)
    half = cfg.n_routed_experts // 2
    for name, t in a.items():
        if ".experts." in name:
            layer, rest = name.split(".ffn.experts.")
            e, _, leaf = rest.partition(".")
            global_name = f"{layer}.ffn.experts.{int(e) + half}.{leaf}"
            assert torch.equal(b[name], whole.get_parameter(global_name)), name
        elif not any(s in name for s in ("wq_b", "attn_sink", "wo_a", "wo_b", "shared_experts", "embed", "head.")):
            assert torch.equal(t, b[name]), name  # replicated: routing, mHC and the latent agree on every rank
    assert a["layers.0.attn.wq_b.weight"].shape[0] == whole.layers[0].attn.wq_b.weight.shape[0] // 2


def test_too_big_is_refused_before_anything_is_allocated():
    cfg = ModelConfig.preset("deepseek-v4-flash")  # 284B parameters: only the meta model is ever built
    with pytest.raises(ValueError, match=r"need 2\d\d\.\d GB on this rank.*of 43 layers would fit"):
        random_model(cfg, CPU, torch.bfloat16, ParallelGroup(0, 2), expert_parallel=True, max_bytes=140 << 30)
