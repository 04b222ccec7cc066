"""The shipped demo checkpoint: it loads, and greedy generation is identical with and without speculation."""

from pathlib import Path

import pytest

from sparkspec.checkpoint import load_checkpoint
from sparkspec.generation import Generator
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode import SpeculativeGenerator, build_proposer

DEMO = Path(__file__).resolve().parent.parent / "checkpoints" / "demo"
PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?", "def fibonacci(n):"]


@pytest.fixture(scope="module")
def demo():
    ckpt = load_checkpoint(DEMO, device="cpu")
    ids = [ckpt.tokenizer.encode(ckpt.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
           for p in PROMPTS]
    return ckpt, ids


def test_demo_has_both_drafters(demo):
    ckpt, _ = demo
    assert ckpt.config.has_dspark
    assert any(k.endswith("main_proj.weight") for k in ckpt.drafter_tensors)
    assert any(k.endswith("e_proj.weight") for k in ckpt.drafter_tensors)


@pytest.mark.parametrize("method", ["dspark", "mtp", "ngram"])
def test_demo_greedy_is_identical_with_and_without_speculation(demo, method):
    ckpt, ids = demo
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    plain = Generator(ckpt.model, ckpt.tokenizer).generate(ids, params)
    spec = SpeculativeGenerator(ckpt.model, ckpt.tokenizer,
                                build_proposer(method, ckpt.model, ckpt.drafter_tensors)).generate(ids, params)
    assert [s.output_ids for s in spec] == [s.output_ids for s in plain]
    if method == "dspark":  # a trained drafter: several tokens per target forward
        assert spec[0].spec_metrics.acceptance_length > 2.0
