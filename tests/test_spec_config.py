"""(f) Configuration errors and warnings of `build_proposer`, checkpoint detection of both drafters, metrics,
n-gram lookup."""

import dataclasses
import warnings

import pytest
import torch
from spec_helpers import drafter_tensors, mixed_prompts, one_thread, tiny_setup  # noqa: F401

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.loading.drafters import dspark_from_tensors, find_mtp_stages, mtp_from_tensors
from sparkspec.loading.random_init import init_drafter_tensors
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode import build_proposer
from sparkspec.spec_decode.methods import DRAFT_METHODS
from sparkspec.spec_decode.ngram import lookup

pytestmark = pytest.mark.usefixtures("one_thread")


def generate(model, prompts, params, proposer=None) -> list[list[int]]:
    eng = LLMEngine(model, None, EngineConfig(spec_budget="fixed"), proposer=proposer)
    return [o.token_ids for o in eng.generate(prompts, params)]


@pytest.mark.parametrize("k", [0, -1, 2.5, True])
@pytest.mark.parametrize("method", DRAFT_METHODS)
def test_num_spec_tokens_below_one_is_an_error(method, k):
    _, model, tensors = tiny_setup()
    with pytest.raises(ValueError, match="num_spec_tokens"):
        build_proposer(method, model, tensors, k)


def test_default_k_per_method():
    cfg, model, tensors = tiny_setup()
    assert build_proposer("dspark", model, tensors).num_spec_tokens == cfg.dspark_block_size == 4
    assert build_proposer("mtp", model, tensors).num_spec_tokens == 1
    assert build_proposer("ngram", model, {}).num_spec_tokens == 4


def test_unknown_method():
    _, model, tensors = tiny_setup()
    with pytest.raises(ValueError, match="expected one of dspark, mtp, ngram"):
        build_proposer("eagle", model, tensors)


def test_k_above_block_warns_and_stays_lossless():
    cfg, model, tensors = tiny_setup()
    with pytest.warns(UserWarning, match="never trained"):
        proposer = build_proposer("dspark", model, tensors, cfg.dspark_block_size + 2)
    prompts = mixed_prompts(cfg.vocab_size, [3, 17, 26], seed=9)
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    assert generate(model, prompts, params, proposer) == generate(model, prompts, params)


def test_k_within_block_does_not_warn():
    cfg, model, tensors = tiny_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for k in range(1, cfg.dspark_block_size + 1):
            build_proposer("dspark", model, tensors, k)


def test_mtp_k_above_its_layers_warns_as_dspark_does():
    cfg, model, tensors = tiny_setup()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_proposer("mtp", model, tensors, cfg.num_nextn_predict_layers)
    with pytest.warns(UserWarning, match=r"num_spec_tokens = 99 > MTP layers = 1: draft positions 2\.\.99"):
        build_proposer("mtp", model, tensors, 99)


def test_missing_drafter_weights_name_the_tensor():
    _, model, tensors = tiny_setup()
    only_mtp = {n: t for n, t in tensors.items() if "e_proj" in n or not n.startswith(("mtp.0.", "mtp.1."))}
    with pytest.raises(ValueError, match=r"missing tensor 'mtp\.0\.main_proj\.weight'"):
        build_proposer("dspark", model, {})
    with pytest.raises(ValueError, match=r"missing tensor 'mtp\.0\.e_proj\.weight'"):
        build_proposer("mtp", model, {})
    partial = {n: t for n, t in tensors.items() if not n.endswith("markov_w2.weight")}
    with pytest.raises(ValueError, match=r"missing tensor 'mtp\.1\.markov_head\.markov_w2\.weight'"):
        build_proposer("dspark", model, partial)
    assert find_mtp_stages(only_mtp) == [2]


def test_wrong_shape_is_an_error():
    _, model, tensors = tiny_setup()
    bad = dict(tensors)
    bad["mtp.0.main_proj.weight"] = bad["mtp.0.main_proj.weight"][:, :-1]
    with pytest.raises(ValueError, match=r"'mtp\.0\.main_proj\.weight' has shape"):
        build_proposer("dspark", model, bad)


def test_config_without_dspark_fields_is_an_error():
    cfg, _, tensors = tiny_setup()
    for field in ("dspark_block_size", "dspark_target_layer_ids", "dspark_markov_rank", "dspark_noise_token_id"):
        with pytest.raises(ValueError, match=field):
            dspark_from_tensors(dataclasses.replace(cfg, **{field: None}), tensors)


def test_both_drafters_in_one_checkpoint():
    """DSpark stages mtp.0..n-1 (own main_proj), classic MTP layers after them (own e_proj)."""
    cfg, _, _ = tiny_setup()
    tensors = init_drafter_tensors(cfg, torch.Generator().manual_seed(0), "both")
    n = cfg.num_dspark_layers
    assert f"mtp.{n - 1}.markov_head.markov_w1.weight" in tensors and f"mtp.{n}.e_proj.weight" in tensors
    assert f"mtp.{n}.main_proj.weight" not in tensors and "mtp.0.e_proj.weight" not in tensors
    mtp = mtp_from_tensors(cfg, tensors)
    assert mtp.first_stage == n and mtp.num_layers == cfg.num_nextn_predict_layers
    assert set(mtp.state_dict()) <= set(tensors)
    assert set(dspark_from_tensors(cfg, tensors).state_dict()) <= set(tensors)
    assert set(init_drafter_tensors(cfg, torch.Generator(), "mtp")) == {
        n_.replace(f"mtp.{n}.", "mtp.0.") for n_ in tensors if n_.startswith(f"mtp.{n}.")}
    with pytest.raises(ValueError, match="drafter"):
        init_drafter_tensors(cfg, torch.Generator(), "eagle")


def test_optional_heads():
    """No confidence head: drafts carry no confidences. No `mtp.S.norm`: the MTP uses the target's norm."""
    cfg, model, tensors = tiny_setup()
    no_conf = {n: t for n, t in tensors.items() if "confidence_head" not in n}
    assert not dspark_from_tensors(cfg, no_conf).has_confidence
    no_norm = {n: t for n, t in tensors.items() if not n.endswith(f"mtp.{cfg.num_dspark_layers}.norm.weight")}
    assert mtp_from_tensors(cfg, no_norm).layer(0).norm is None
    prompts = mixed_prompts(cfg.vocab_size, [5, 18], seed=10)
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    reference = generate(model, prompts, params)
    for method, t in (("dspark", no_conf), ("mtp", no_norm)):
        assert generate(model, prompts, params, build_proposer(method, model, t, 2)) == reference
    proposer = build_proposer("dspark", model, no_conf, 2)
    eng = LLMEngine(model, None, EngineConfig(spec_budget="fixed"), proposer=proposer)
    seqs = [eng.add_request(p, params) for p in prompts]
    eng.step()
    assert all(s.spec.confidences is None and len(s.spec.draft_ids) == 2 for s in seqs)


@pytest.mark.parametrize("ids,k,want", [
    ([1, 2, 3, 9, 1, 2, 3], 3, [9, 1, 2]),  # longest suffix [1, 2, 3] matched earlier
    ([5, 6, 7, 5, 8, 5], 2, [8, 5]),  # most recent occurrence of [5]
    ([1, 2, 3, 4], 3, []),  # nothing repeats
    ([4, 4, 4, 4], 5, [4]),  # continuation runs into the end
    ([7], 2, []),
])
def test_ngram_lookup(ids, k, want):
    assert lookup(ids, k, max_ngram=3, min_ngram=1) == want
