"""Graph-capturable decode / verify steps: the static, padded batches of `engine/cuda_graphs.py` give exactly the
tokens of the dynamic step. On CPU they run eagerly (`eager=True`: the padding and addressing are what can go
wrong); on a GPU (`-m gpu`, SPARKSPEC_TEST_DEVICE=cuda) the captured graphs replay and must agree with eager."""

from __future__ import annotations

import copy

import pytest
import torch
from spec_helpers import mixed_prompts, one_thread, tiny_setup  # noqa: F401
from test_spec_engine import ReplayProposer

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.cuda_graphs import capture_sizes
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode.methods import SPEC_METHODS

pytestmark = pytest.mark.usefixtures("one_thread")
LENGTHS = [3, 9, 17, 30, 5]  # 5 requests: padded to the captured size 8


def engine(model, tensors=None, proposer=None, method="none", static=False, **kw) -> LLMEngine:
    cfg = EngineConfig(max_num_seqs=8, speculative=method, num_spec_tokens=3 if method != "none" else None,
                       spec_budget="fixed", enforce_eager=True, **kw)
    eng = LLMEngine(model, None, cfg, tensors, proposer)
    if static:
        k = eng.spec.num_spec_tokens if eng.spec else 0
        eng.runner.use_graphs(cfg.max_num_seqs, eng.max_model_len, k, eager=True,
                              max_num_batched_tokens=cfg.max_num_batched_tokens)
    return eng


def record_keys(eng: LLMEngine) -> list:
    """The keys of the static steps `eng` runs from now on."""
    used, run = [], eng.runner.graphs.run
    eng.runner.graphs.run = lambda key, flat: used.append(key) or run(key, flat)
    return used


def test_capture_sizes():
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 64]
    assert capture_sizes(300) == [1, 2, 4, 8, 16, 32, 64, 128, 256, 300]
    assert capture_sizes(5) == [1, 2, 4, 5]


@pytest.mark.parametrize("method", [*SPEC_METHODS, "replay"])
def test_static_padded_steps_equal_dynamic_steps(method):
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS, seed=4)
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (24, 17, 30, 9, 21)]
    plain = [o.token_ids for o in engine(model).generate(prompts, params)]
    proposer = ReplayProposer(prompts, plain, 3, 2, cfg.vocab_size) if method == "replay" else None
    m = "none" if proposer else method
    eng = engine(model, tensors, proposer, m, static=True)
    used = record_keys(eng)
    assert [o.token_ids for o in eng.generate(prompts, params)] == plain
    assert used and {k.q for k in used} <= {1, 4, 16, 32} and {k.num_reqs for k in used} <= {1, 2, 4, 8}
    if method != "none":
        assert eng.stats.num_accepted > 0 or method != "replay"


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_one_request_prefill_runs_as_a_static_step(method, temperature):
    """A lone request's prompt (and, with a small token budget, its last chunk) runs padded to a prefill length:
    the padded rows write only past the prompt, the sampled row is the prompt's last, and the drafter's first
    drafts come from the same static step. Tokens equal the dynamic steps'."""
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, [3, 9, 17, 30, 5], seed=8)
    params = SamplingParams(max_tokens=10, temperature=temperature, seed=11, ignore_eos=True)
    for budget in (None, 24):  # 24: the 30-token prompt is chunked, its last chunk samples
        kw = {} if budget is None else {"max_num_batched_tokens": budget}
        want = [engine(model, tensors, method=method, **kw).generate([p], params)[0].token_ids for p in prompts]
        eng = engine(model, tensors, method=method, static=True, **kw)
        used = record_keys(eng)
        assert [eng.generate([p], params)[0].token_ids for p in prompts] == want
        prefill_keys = {k for k in used if k.draft_cols == 0 and k.q > 1}
        assert {k.q for k in prefill_keys} == ({16, 32} if budget is None else {16})
        assert all(k.num_reqs == 1 for k in prefill_keys)
        if method != "none":
            assert {k.num_drafts for k in prefill_keys} == {3}


def test_prefill_graphs_compute_the_logits_of_the_sampled_rows_only():
    """A prefill graph samples each request's last row: the head runs on its R rows, not on all R·q (at a 129k
    vocabulary and R·q = 32k that was a 17 GB logits tensor per graph, and an int32 overflow in the head kernel),
    while decode / verify graphs keep logits on every row. Tokens equal the dynamic steps'."""
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, [3, 9, 17, 30, 5], seed=9)
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = [o.token_ids for o in engine(model, tensors, method="dspark").generate(prompts, params)]
    eng = engine(model, tensors, method="dspark", static=True)
    used, logits_rows, decode = record_keys(eng), [], eng.runner.decode
    eng.runner.decode = lambda batch, out, *a: logits_rows.append(out.logits.shape[0]) or decode(batch, out, *a)
    assert [o.token_ids for o in eng.generate(prompts, params)] == want
    assert len(used) == len(logits_rows)
    assert any(k.q > k.draft_cols + 1 for k in used) and any(k.q == k.draft_cols + 1 for k in used)
    assert logits_rows == [k.num_reqs if k.q > k.draft_cols + 1 else k.num_reqs * k.q for k in used]


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_prompts_of_several_requests_run_as_one_static_step(method, temperature):
    """Prompts of several requests joining at once run padded to one (R, q) prefill graph per group: each
    request's rows at i·q, padding rows past its prompt, dummy requests past the last. Tokens equal the dynamic
    steps'; with a small budget the group is cut to what the captured (R, q) hold."""
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, [3, 9, 17, 30, 5, 12, 7], seed=9)
    params = [SamplingParams(max_tokens=6 + i, temperature=temperature, seed=20 + i, ignore_eos=True)
              for i in range(len(prompts))]
    for budget in (None, 32):  # 32: R·q <= 64, so the prompts need several graphs and the 30-token one is chunked
        kw = {} if budget is None else {"max_num_batched_tokens": budget}
        want = [o.token_ids for o in engine(model, tensors, method=method, **kw).generate(prompts, params)]
        eng = engine(model, tensors, method=method, static=True, **kw)
        used = record_keys(eng)
        assert [o.token_ids for o in eng.generate(prompts, params)] == want
        prefill_keys = [k for k in used if k.draft_cols == 0 and k.q > 1]
        assert max(k.num_reqs for k in prefill_keys) > 1, "several prompts share a prefill graph"
        assert all(k.num_reqs * k.q <= eng.config.max_num_batched_tokens or k.num_reqs == 1
                   for k in prefill_keys)


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
def test_prefix_hit_tails_run_as_one_static_prefill(method):
    """Prompts that share a cached prefix leave short tails that start mid-sequence (num_cached > 0): several of
    them share one padded prefill graph, whose rows sit at positions past the hit. Tokens equal the dynamic steps'
    (with the cache too), the cache is hit, and a prefill graph of several requests with a cached start runs."""
    cfg, model, tensors = tiny_setup()
    shared = mixed_prompts(cfg.vocab_size, [48], seed=21)[0]
    tails = mixed_prompts(cfg.vocab_size, [3, 9, 5, 12], seed=22)
    params = SamplingParams(max_tokens=8, temperature=0.8, seed=4, ignore_eos=True)
    first = [shared + [7]]  # fills the cache with the shared prefix
    later = [shared + t for t in tails]
    dyn = engine(model, tensors, method=method)
    want = [o.token_ids for o in dyn.generate(first, params) + dyn.generate(later, params)]
    eng = engine(model, tensors, method=method, static=True)
    used, starts, pack = record_keys(eng), [], eng.runner.graphs.pack
    eng.runner.graphs.pack = lambda key, ids, tables, st: starts.append((key, list(st))) or pack(key, ids, tables, st)
    got = [o.token_ids for o in eng.generate(first, params) + eng.generate(later, params)]
    assert got == want
    assert eng.stats.num_prefix_cache_hits > 0
    assert any(k.draft_cols == 0 and k.q > 1 and k.num_reqs > 1 and len([x for x in st if x > 0]) > 1
               for k, st in starts), "hit tails shared a prefill graph"
    assert used


def test_prefill_groups_fit_captured_shapes():
    from sparkspec.engine.cuda_graphs import GraphRunner

    g = GraphRunner.__new__(GraphRunner)  # shapes only: no cache, nothing captured
    g.sizes, g.query_lens, g.prefill_lens, g.decode_context = capture_sizes(64), (1,), (16, 32, 64), True
    g.prefill_sizes = {q: [R for R in g.sizes if R == 1 or R * q <= 128] for q in g.prefill_lens}
    assert g.prefill_sizes == {16: [1, 2, 4, 8], 32: [1, 2, 4], 64: [1, 2]}
    assert g.key_for(3, 20, "greedy", 0).num_reqs == 4 and g.key_for(3, 20, "greedy", 0).q == 32
    assert g.key_for(5, 20, "greedy", 0) is None and g.key_for(1, 64, "greedy", 0).q == 64
    lengths = [60, 3, 10, 30, 16, 2, 40, 9, 11, 12, 13, 14]
    groups = g.prefill_groups(lengths)
    assert sorted(i for grp in groups for i in grp) == list(range(len(lengths)))
    for grp in groups:
        assert g.key_for(len(grp), max(lengths[i] for i in grp), "greedy", 0) is not None
    assert groups == [[5, 1, 7, 2, 8, 9, 10, 11], [4, 3], [6, 0]]  # the shortest eight fill (8, 16)


def sampled_params(filtered: bool) -> list[SamplingParams]:
    """Seeded sampling; `filtered` adds top-k / top-p requests, a greedy one and one asking for logprobs (its
    steps run eagerly: graph steps return no logprobs)."""
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=7 + i, ignore_eos=True) for i in range(5)]
    if filtered:
        params[1] = SamplingParams(max_tokens=24, temperature=1.0, top_k=5, seed=3, ignore_eos=True)
        params[2] = SamplingParams(max_tokens=10, temperature=0.7, top_p=0.9, seed=4, ignore_eos=True)
        params[3] = SamplingParams(max_tokens=11, ignore_eos=True)
        params[4] = SamplingParams(max_tokens=4, temperature=0.9, seed=5, logprobs=2, ignore_eos=True)
    return params


@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
@pytest.mark.parametrize("filtered", [False, True])
def test_static_steps_keep_seeded_sampling(method, filtered):
    """Sampled steps in the static layout (dummy requests sample greedily next to real ones; drafts and their q
    go through the shared q buffer) give exactly the dynamic steps' tokens and logprobs."""
    cfg, model, tensors = tiny_setup()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS, seed=5)
    params = sampled_params(filtered)
    want = engine(model, tensors, method=method).generate(prompts, params)
    eng = engine(model, tensors, method=method, static=True)
    used = record_keys(eng)
    got = eng.generate(prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.logprobs for o in got] == [o.logprobs for o in want]
    assert "filter" in {k.mode for k in used} if filtered else {k.mode for k in used} == {"sample"}
    if method != "none":  # k = 3 (0 only at a step where every request ends: `SpecPolicy.all_end`)
        proposed = {k.num_drafts for k in used}
        assert 3 in proposed and proposed <= {0, 3}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("method", ["none", "dspark", "mtp"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_graphs_equal_eager(method, dtype):
    """Captured graphs replay the eager step. fp32: the same greedy (and seeded sampled) tokens as the dynamic eager
    steps. bf16: the padded graph batch and the dynamic eager batch are GEMMs of other shapes, so their logits
    differ by bf16 rounding, and through the indexer's top-k (a discrete choice) a prompt's state can differ by
    more than a rounding before any token does: there the graphs must give exactly the tokens of the same static,
    padded steps run eagerly (the same kernels on the same shapes)."""
    cfg, model, tensors = tiny_setup()
    model = copy.deepcopy(model).to("cuda", dtype).keep_fp32()
    prompts = mixed_prompts(cfg.vocab_size, LENGTHS, seed=6)
    params = SamplingParams(max_tokens=20, ignore_eos=True)

    def run(eager: bool, p=params, static: bool = False):
        # a 64-token budget: the prompts (<= 30 tokens) fit, and 6 prefill shapes are captured, not 22 (each capture
        # compiles kernels for its shapes: the test's time on the GPU)
        c = EngineConfig(max_num_seqs=8, speculative=method, num_spec_tokens=3 if method != "none" else None,
                         spec_budget="fixed", enforce_eager=eager, max_num_batched_tokens=64)
        eng = LLMEngine(model, None, c, tensors)
        assert (eng.runner.graphs is None) == eager
        if static:
            k = eng.spec.num_spec_tokens if eng.spec else 0
            eng.runner.use_graphs(c.max_num_seqs, eng.max_model_len, k, eager=True,
                                  max_num_batched_tokens=c.max_num_batched_tokens)
        return [o.token_ids for o in eng.generate(prompts, p)]

    graphs = run(False)
    if dtype == torch.float32:
        assert graphs == run(True)
        sampled = sampled_params(filtered=True)  # sampled modes (the filter mode is captured on first use)
        assert run(False, sampled) == run(True, sampled)
    else:
        assert graphs == run(True, static=True)
