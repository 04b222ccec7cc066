"""(a) Temperature 0: every speculative method and k returns exactly the token ids of plain decoding.

22 prompts of 1..40 tokens in one batch, 28 new tokens each: sequences cross the sliding window (16) and the
compression ratios (4 and 16) of the tiny preset, during prefill and during verification, and requests
end at different steps (ragged k near the end). fp64 keeps argmax ties out of the comparison.
"""

import dataclasses

import pytest
import torch
from spec_helpers import drafter_tensors, mixed_prompts, one_thread, plain_generate, random_target, tiny_setup  # noqa: F401

from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode import SpeculativeGenerator, build_proposer

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS = [1, 2, 3, 5, 6, 7, 9, 11, 12, 14, 15, 16, 17, 18, 20, 24, 27, 30, 31, 33, 36, 40]
MAX_TOKENS = [28, 20, 28, 13]  # cycled over the prompts


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS)
    params = [SamplingParams(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], ignore_eos=True) for i in range(len(prompts))]
    reference = plain_generate(model, prompts, params)
    return cfg, model, tensors, prompts, params, reference


@pytest.mark.parametrize("method", ["dspark", "mtp", "ngram"])
@pytest.mark.parametrize("k", [1, 2, 3, 4])  # 4 = the tiny preset's dspark_block_size
def test_greedy_equals_plain_decoding(setup, method, k):
    _, model, tensors, prompts, params, reference = setup
    gen = SpeculativeGenerator(model, None, build_proposer(method, model, tensors, k))
    seqs = gen.generate(prompts, params)
    assert [s.output_ids for s in seqs] == reference
    m = gen.spec_metrics
    assert m.num_spec_tokens == k and m.method == method
    assert m.num_steps == sum(s.spec_metrics.num_steps for s in seqs) > 0
    for s in seqs:  # the prefill token, then accepted + 1 tokens per step (nothing is cut: ignore_eos, capped k)
        assert len(s.output_ids) == 1 + s.spec_metrics.num_steps + s.spec_metrics.num_accepted_tokens
    if method != "ngram":  # model drafters fill every step except the last one of each request
        assert m.num_draft_tokens > 0.5 * m.num_steps * k


def test_greedy_multi_layer_mtp_and_dspark_stages():
    """Two MTP layers (chained depth, then reuse of the last) and three DSpark stages stay lossless."""
    cfg, _, _ = tiny_setup()
    cfg = dataclasses.replace(cfg, num_nextn_predict_layers=2, n_mtp_layers=3)
    model = random_target(cfg, seed=5)
    tensors = drafter_tensors(cfg, seed=6)
    prompts = mixed_prompts(cfg.vocab_size, [3, 15, 17, 30], seed=2)
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    reference = plain_generate(model, prompts, params)
    for method in ("mtp", "dspark"):
        proposer = build_proposer(method, model, tensors, 3)
        assert proposer.drafter.num_layers == (2 if method == "mtp" else 3)
        out = SpeculativeGenerator(model, None, proposer).generate(prompts, params)
        assert [s.output_ids for s in out] == reference, method


def test_fp32_model_matches_too():
    """The CLI's dtype: fp32 weights, DSpark at the full block, a subset of the prompts."""
    cfg, _, tensors = tiny_setup()
    model = random_target(cfg, seed=0, dtype=torch.float32)
    prompts = mixed_prompts(cfg.vocab_size, [4, 16, 21, 35], seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    reference = plain_generate(model, prompts, params)
    out = SpeculativeGenerator(model, None, build_proposer("dspark", model, tensors)).generate(prompts, params)
    assert [s.output_ids for s in out] == reference


def test_eos_inside_accepted_drafts_stops_like_plain():
    """A request whose EOS arrives as an accepted draft (or a bonus) ends exactly where plain decoding ends."""
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, [6, 19], seed=4)
    free = plain_generate(model, prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    eos = free[0][9]  # make the 10th token of request 0 an end-of-sequence token
    cfg_eos = dataclasses.replace(cfg, eos_token_id=eos)
    model.cfg = cfg_eos
    try:
        params = SamplingParams(max_tokens=16)
        reference = plain_generate(model, prompts, params)
        assert reference[0][-1] == eos and len(reference[0]) <= 10
        for method in ("ngram", "dspark"):
            out = SpeculativeGenerator(model, None, build_proposer(method, model, tensors, 4)).generate(prompts, params)
            assert [s.output_ids for s in out] == reference
            assert out[0].finish_reason == "stop"
    finally:
        model.cfg = cfg
