"""A checkpoint written by transformers' DeepseekV4ForCausalLM.save_pretrained loads through load_checkpoint and
gives the same logits and the same greedy tokens as transformers (fp32, one sequence at a time: transformers
mishandles left-padded batches). Configs cover all three attention kinds and hash layers; every parameter that
transformers initialises to a neutral value (sinks, ape, router bias, hc biases, tid2eid) is randomised so that
a mistake in any of them shows. Enough indexer heads keep the indexer's top-k free of ties. Both configs keep
n_shared_experts = 1: transformers sizes the shared expert by moe_intermediate_size alone (the official code
multiplies by n_shared_experts; real V4 checkpoints have 1)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, run_full
from safetensors.torch import save_file

from sparkspec.config import CSA, HCA, SLIDING
from sparkspec.engine.llm import LLM
from sparkspec.loading.checkpoint import load_checkpoint
from sparkspec.sampling_params import SamplingParams

transformers = pytest.importorskip("transformers")

CONFIGS = {
    "all-kinds": dict(
        vocab_size=128, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, head_dim=16,
        partial_rotary_factor=0.5, q_lora_rank=16, o_lora_rank=8, o_groups=2, sliding_window=8,
        layer_types=[SLIDING, CSA, HCA, CSA], compress_rates={CSA: 4, HCA: 8},
        mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
        index_n_heads=8, index_head_dim=8, index_topk=3, n_routed_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, hc_mult=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                         "beta_fast": 32, "beta_slow": 1},
    ),
    "hash2-clamp-hc3": dict(
        vocab_size=160, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, head_dim=32,
        partial_rotary_factor=0.25, q_lora_rank=24, o_lora_rank=12, o_groups=4, sliding_window=12,
        layer_types=[CSA, HCA, SLIDING], compress_rates={CSA: 4, HCA: 16},
        mlp_layer_types=["hash_moe", "hash_moe", "moe"],
        index_n_heads=16, index_head_dim=16, index_topk=5, n_routed_experts=6, num_experts_per_tok=3,
        moe_intermediate_size=16, hc_mult=3, hc_sinkhorn_iters=5, swiglu_limit=1.0,
        routed_scaling_factor=2.0, rms_norm_eps=1e-5, max_position_embeddings=512,
    ),
}
SEQ_LEN = 80  # several windows; many ratio-4 blocks, >= 5 heavy blocks
PROMPT_LEN, NEW_TOKENS = 10, 32


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Weights of O(1) activations (fan-in scaled), and nonzero values where transformers' init is neutral."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p.shape[-1] ** -0.5)
            elif name.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("scale"):
                p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
            else:  # sinks, position_bias (ape), hc biases
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("tid2eid"):
                num_experts = model.config.n_routed_experts
                b.copy_(torch.rand(b.shape[0], num_experts, generator=g).argsort(-1)[:, : b.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                b.copy_(0.5 * torch.randn(b.shape, generator=g))


@pytest.fixture(scope="module", params=list(CONFIGS), ids=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(transformers model, our loaded checkpoint) from one save_pretrained directory."""
    torch.manual_seed(0)
    cfg = transformers.DeepseekV4Config(**CONFIGS[request.param])
    hf = transformers.DeepseekV4ForCausalLM(cfg).eval()
    randomise(hf, seed=len(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours = load_checkpoint(path, device=DEVICE, dtype="float32")
    return hf, ours


def prompt_ids(vocab: int, n: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, vocab, (n,), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_same_logits(pair):
    hf, ours = pair
    ids = prompt_ids(ours.config.vocab_size, SEQ_LEN)
    want = hf(ids.unsqueeze(0)).logits[0]
    got = run_full(ours.model, ids.to(DEVICE)).logits
    assert float(want.std()) > 0.5  # the comparison is sensitive: logits are O(1), not ~0
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)


@torch.no_grad()
def test_same_greedy_tokens(pair):
    hf, ours = pair
    llm = LLM(ours, max_num_seqs=1, max_model_len=PROMPT_LEN + NEW_TOKENS)
    for seed in (2, 3):
        ids = prompt_ids(ours.config.vocab_size, PROMPT_LEN, seed)
        hf.generation_config.eos_token_id = None  # compare all NEW_TOKENS, never stopping early
        want = hf.generate(ids.unsqueeze(0), max_new_tokens=NEW_TOKENS, do_sample=False,
                           pad_token_id=0)[0, PROMPT_LEN:].tolist()
        got = llm.generate([ids.tolist()], SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True))
        assert got[0].token_ids == want
        assert len(set(want)) > 5  # a varied continuation, not one repeated token


def test_transformers_module_names_load(tmp_path):
    """The names transformers uses in memory (`model.layers.N.self_attn.q_a_proj`, fused experts ...) load too."""
    cfg = transformers.DeepseekV4Config(**CONFIGS["all-kinds"])
    hf = transformers.DeepseekV4ForCausalLM(cfg).eval()
    randomise(hf, seed=7)
    hf.save_pretrained(tmp_path)  # config.json
    (tmp_path / "model.safetensors").unlink()
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    assert "model.layers.1.self_attn.q_a_proj.weight" in state and "model.layers.0.mlp.experts.gate_up_proj" in state
    save_file(state, str(tmp_path / "model.safetensors"))
    ours = load_checkpoint(tmp_path, device=DEVICE, dtype="float32")
    ids = prompt_ids(cfg.vocab_size, 40)
    with torch.no_grad():
        want = hf(ids.unsqueeze(0)).logits[0]
        got = run_full(ours.model, ids.to(DEVICE)).logits
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=0)
