"""The shipped demo checkpoint: it loads, and greedy generation through the engine is identical with and without
speculation."""

import pytest

from sparkspec.engine.llm import LLM
from sparkspec.loading.checkpoint import load_checkpoint
from sparkspec.paths import DEFAULT_MODEL
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode.methods import DRAFT_METHODS
from sparkspec.spec_decode.metrics import SpecMetrics

PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?", "def fibonacci(n):"]
ENGINE = {"max_num_seqs": 4, "max_model_len": 256}  # a small KV cache: three short prompts


@pytest.fixture(scope="module")
def demo():
    ckpt = load_checkpoint(DEFAULT_MODEL, device="cpu")
    ids = [ckpt.tokenizer.encode(ckpt.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
           for p in PROMPTS]
    plain = LLM(ckpt, "none", **ENGINE).generate(ids, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    return ckpt, ids, plain


def test_demo_has_both_drafters(demo):
    ckpt, _, _ = demo
    assert ckpt.config.has_dspark
    assert any(k.endswith("main_proj.weight") for k in ckpt.drafter_tensors)
    assert any(k.endswith("e_proj.weight") for k in ckpt.drafter_tensors)


@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_demo_greedy_is_identical_with_and_without_speculation(demo, method):
    ckpt, ids, plain = demo
    llm = LLM(ckpt, method, spec_budget="fixed", **ENGINE)
    spec = llm.generate(ids, SamplingParams(temperature=0, max_tokens=48, ignore_eos=True))
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    if method == "dspark":  # a trained drafter: several tokens per target forward
        assert SpecMetrics.from_request("dspark", llm.num_spec_tokens, spec[0].metrics).acceptance_length > 2.0
