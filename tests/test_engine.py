"""The engine: continuous batching equals one-at-a-time decoding (greedy, every speculative method, with chunked
prefill and preemption), KV accounting, abort, and adaptive verification (Algorithm 1 with early stop)."""

from __future__ import annotations

import itertools
import json
import random

import pytest
import torch

from sparkspec.engine.acceptance import AcceptanceEstimator, survival, verify_lengths
from sparkspec.engine.budget import VerificationBudget
from sparkspec.engine.config import EngineConfig
from sparkspec.engine.cost_table import CostTable, load_or_measure
from sparkspec.engine.kv_plan import cache_bytes_per_token, parse_memory, plan_kv_cache
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.ops.sampling import SamplingTensors
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode.proposer import HostProposer
from sparkspec.spec_decode.rejection import RejectionSampler

GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpt(tiny_checkpoint_with_drafters):
    from sparkspec.loading.checkpoint import load_checkpoint

    return load_checkpoint(tiny_checkpoint_with_drafters)


@pytest.fixture(scope="module")
def prompts(ckpt):
    texts = ["Hello world", "The quick brown fox jumps over the lazy dog. The quick brown fox",
             "def f(x): return x", "a b a b a b a b a b a b", "Once upon a time", "1 2 3 1 2 3 1 2 3"]
    return [ckpt.tokenizer.encode(t, add_special_tokens=True) for t in texts]


@pytest.fixture(scope="module")
def reference(ckpt, prompts):
    """Plain greedy decoding, one prompt at a time."""
    return [LLMEngine(ckpt.model).generate([p], GREEDY)[0].token_ids for p in prompts]


def engine(ckpt, proposer=None, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 4)
    kw.setdefault("max_num_batched_tokens", 24)  # small: forces chunked prefill next to decode rows
    return LLMEngine(ckpt.model, ckpt.tokenizer, EngineConfig(**kw), ckpt.drafter_tensors, proposer=proposer)


class OracleProposer(HostProposer):
    """Drafts the reference continuation with a wrong token every few positions, so steps accept ragged
    prefixes."""

    method = "oracle"

    def __init__(self, k: int, refs: dict[tuple, list[int]], vocab: int):
        super().__init__(k)
        self.refs, self.vocab = refs, vocab

    def propose_ids(self, token_ids, k):
        out = []
        for ids in token_ids:
            prompt = next((p for p in self.refs if tuple(ids[: len(p)]) == p), None)
            if prompt is None:
                out.append([])
                continue
            n = len(ids) - len(prompt)
            tokens = (list(self.refs[prompt][n : n + k]) + [5] * k)[:k]
            bad = (n + len(prompt)) % 3  # corrupt one position of most blocks
            if bad < k:
                tokens[bad] = (tokens[bad] + 1) % self.vocab
            out.append(tokens)
        return out


# ---------------------------------------------------------------- batch == one at a time


@pytest.mark.parametrize("spec,budget", [("none", "fixed"), ("ngram", "fixed"), ("dspark", "fixed"),
                                         ("dspark", "adaptive"), ("mtp", "fixed"), ("mtp", "adaptive")])
def test_batch_equals_one_at_a_time(ckpt, prompts, reference, spec, budget, tmp_path):
    eng = engine(ckpt, speculative=spec, spec_budget=budget, num_spec_tokens=3 if spec != "none" else None,
                 cost_cache_dir=str(tmp_path))
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert eng.scheduler.block_manager.num_free_blocks == eng.kv_plan.num_blocks
    if spec in ("dspark", "mtp"):
        assert eng.stats.num_drafted > 0 or eng.stats.num_drafter_skipped_steps > 0


@pytest.mark.parametrize("budget", ["fixed", "adaptive"])
def test_ragged_acceptance_is_lossless(ckpt, prompts, reference, budget, tmp_path):
    """A drafter that is often right: ragged accepted prefixes per request, rollback of the rest."""
    refs = {tuple(p): r for p, r in zip(prompts, reference)}
    eng = engine(ckpt, OracleProposer(4, refs, ckpt.config.vocab_size), spec_budget=budget,
                 cost_cache_dir=str(tmp_path))
    outs = eng.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    st = eng.stats
    assert 0 < st.num_accepted < st.num_drafted
    assert st.num_steps < len(prompts) * GREEDY.max_tokens  # speculation saved steps
    assert sum(o.metrics["spec_accepted"] for o in outs) == st.num_accepted


def test_preemption_recomputes_exactly(ckpt, prompts, reference):
    """A KV budget far below the batch's needs: requests are preempted and recomputed, outputs unchanged."""
    cfg = ckpt.config
    per_block = 4 * sum(cache_bytes_per_token(cfg).values())
    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    eng = engine(ckpt, block_size=4, kv_cache_memory=per_block * (-(-longest // 4) + 2), max_num_seqs=6,
                 max_num_batched_tokens=64)
    outs = eng.generate(prompts, GREEDY)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert eng.scheduler.block_manager.num_free_blocks == eng.kv_plan.num_blocks


@pytest.mark.parametrize("spec", ["oracle", "dspark", "mtp"])
def test_preemption_with_speculation(ckpt, prompts, reference, spec):
    """Preempted requests drop their drafter state too; the recompute rebuilds it from the committed tokens."""
    refs = {tuple(p): r for p, r in zip(prompts, reference)}
    per_block = 4 * sum(cache_bytes_per_token(ckpt.config).values())
    longest = max(len(p) for p in prompts) + GREEDY.max_tokens
    proposer = OracleProposer(3, refs, ckpt.config.vocab_size) if spec == "oracle" else None
    eng = engine(ckpt, proposer, speculative="none" if proposer else spec, spec_budget="fixed", block_size=4,
                 num_spec_tokens=None if proposer else 3, kv_cache_memory=per_block * (-(-longest // 4) + 4),
                 max_num_seqs=6, max_num_batched_tokens=64)
    outs = eng.generate(prompts, GREEDY)
    assert eng.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference


@pytest.mark.parametrize("spec", ["none", "dspark"])
def test_seeded_sampling_batch_equals_alone(ckpt, prompts, spec):
    params = [SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(prompts))]
    batch = engine(ckpt, speculative=spec, spec_budget="fixed").generate(prompts, params)
    alone = [engine(ckpt, speculative=spec, spec_budget="fixed").generate([p], sp)[0]
             for p, sp in zip(prompts[:3], params[:3])]
    assert [o.token_ids for o in batch[:3]] == [o.token_ids for o in alone]


def test_request_too_large_and_abort(ckpt, prompts):
    per_block = 16 * sum(cache_bytes_per_token(ckpt.config).values())
    eng = engine(ckpt, kv_cache_memory=per_block * 2, block_size=16)
    with pytest.raises(ValueError, match="KV blocks"):
        eng.add_request(list(range(10, 40)), SamplingParams(max_tokens=8))
    with pytest.raises(ValueError, match="context length"):
        eng.add_request([5, 6], SamplingParams(max_tokens=10**6))
    seq = eng.add_request(prompts[0], SamplingParams(max_tokens=20, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.kv_usage > 0
    assert eng.abort_request(seq.request_id)
    assert eng.kv_usage == 0 and not eng.has_unfinished() and seq.finish_reason == "abort"
    assert not eng.abort_request(seq.request_id)


def test_stop_strings_and_eos(ckpt, prompts):
    eng = engine(ckpt)
    free = eng.generate([prompts[1]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    stop = free.text[3:6]
    assert stop
    out = eng.generate([prompts[1]], SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop" and out.text == free.text[: free.text.index(stop)]


def test_llm_offline_api(tiny_checkpoint_with_drafters):
    from sparkspec.engine.llm import LLM

    llm = LLM(tiny_checkpoint_with_drafters, speculative="ngram", spec_budget="fixed", max_num_seqs=4)
    outs = llm.generate(["Hello", "World wide"], SamplingParams(max_tokens=4, ignore_eos=True))
    assert [len(o.token_ids) for o in outs] == [4, 4] and all(o.finished for o in outs)
    assert llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3)).finished


# ---------------------------------------------------------------- KV accounting


def test_kv_plan_counts_every_cache_kind(ckpt):
    kinds = cache_bytes_per_token(ckpt.config)
    assert all(kinds[k] > 0 for k in ("swa_kv", "compressor_state", "compressed_kv", "indexer"))
    plan = plan_kv_cache(ckpt.config, block_size=8, max_num_seqs=4, max_model_len=64, drafter_bytes_per_token=64)
    assert plan.num_blocks == 4 * 8 and plan.bytes_per_token["drafter"] == 64
    small = plan_kv_cache(ckpt.config, block_size=8, kv_cache_memory=plan.bytes_per_block * 10)
    assert small.num_blocks == 10
    with pytest.raises(ValueError, match="holds no block"):
        plan_kv_cache(ckpt.config, block_size=8, kv_cache_memory=10)
    assert parse_memory("2M") == 2 << 20 and parse_memory("1.5GiB") == int(1.5 * 2**30)


# ---------------------------------------------------------------- adaptive verification


def test_survival_and_early_stop_appendix_a():
    assert survival([0.5, 0.5, 2.0]) == [0.5, 0.25, 0.25]
    sps = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__
    # Θ0 = 1.0, Θ1 = 1.8 × 0.5 = 0.9: stop before looking at a2 (the global argmax would take l = 2 if c2 = 0.9)
    assert verify_lengths([[0.8, 0.72]], sps, 1, 1) == [0]
    def flat(n):
        return 1.0

    assert verify_lengths([[0.9, 0.5], [0.8, 0.0]], flat, 2, 2) == [2, 1]
    def linear(n):  # compute-bound: extra tokens never pay
        return 1.0 / n

    assert verify_lengths([[0.99, 0.98]], linear, 1, 1) == [0]


def test_budget_shrinks_as_batch_grows():
    # memory-bound up to 32 tokens, then cost grows linearly with tokens
    table = CostTable({r: [(1, 0.01), (32, 0.01), (256, 0.08), (1024, 0.32)] for r in (1, 4, 16, 64)})
    budget = VerificationBudget("adaptive", 4, table)
    conf = [0.8, 0.8, 0.8, 0.8]
    mean_len = []
    for r in (1, 4, 16, 64):
        ls = budget.lengths([4] * r, [conf] * r, r, r)
        mean_len.append(sum(ls) / r)
    assert mean_len[0] == 4 and mean_len[-1] == 0
    assert all(a >= b for a, b in itertools.pairwise(mean_len)), mean_len
    assert budget.plan_num_drafts(64, 64) == 0 and budget.plan_num_drafts(1, 1) > 0
    assert VerificationBudget("fixed", 4).lengths([4, 2], [None, None], 2, 2) == [4, 2]


def test_padded_budget_verifies_every_draft_or_none():
    """Graph steps cost the same for one verified draft as for k: the padded rule verifies all k drafts where
    their expected tokens pay for the q = 1 + k step (and the drafter), else none, from past acceptance only."""
    k = 4
    # R requests: the plain step costs R ms up to 64 rows, the verify step 8x its rows' worth past that
    def points(r):
        return [(r, 0.001 * max(r, 16)), (r * (1 + k), 0.001 * max(r * (1 + k), 16) * (2 if r > 8 else 1))]

    table = CostTable({r: points(r) for r in (1, 4, 16, 64)}, [(r, 0.0005) for r in (1, 4, 16, 64)])
    budget = VerificationBudget("adaptive", k, table, padded=True)
    for _ in range(200):
        budget.observe(k, 3)  # positions 0-2 accepted, 3 rejected: tau = 1 + ~3 per request
    conf = [[0.1] * k] * 4  # the drafts' own confidences do not enter the padded rule
    assert budget.lengths([k, 2, k, 1], conf, 4, 4) == [k, 2, k, 1]
    assert budget.plan_num_drafts(1, 1) == k and budget.plan_num_drafts(4, 4) == k
    assert budget.lengths([k] * 64, [None] * 64, 64, 64) == [0] * 64 and budget.plan_num_drafts(64, 64) == 0
    for _ in range(2000):
        budget.observe(k, 0)  # nothing accepted any more: speculation never pays
    assert budget.lengths([k], [None], 1, 1) == [0] and budget.plan_num_drafts(1, 1) == 0


def test_acceptance_estimator_and_cost_cache(tmp_path):
    est = AcceptanceEstimator(3, prior=0.5, prior_weight=1, decay=1.0)
    for _ in range(50):
        est.observe(3, 1)  # position 0 always accepted, position 1 always rejected, position 2 never tested
    r = est.rates()
    assert r[0] > 0.95 and r[1] < 0.05 and r[2] == 0.5
    calls = []

    def measure():
        calls.append(1)
        return CostTable({1: [(1, 0.01), (4, 0.02)]}, [(1, 0.001)])

    a = load_or_measure("k1", measure, tmp_path)
    b = load_or_measure("k1", measure, tmp_path)
    assert len(calls) == 1 and a.target == b.target
    assert b.target_seconds(1, 2) == pytest.approx(0.01 + 0.01 / 3)


APPENDIX_A_SPS = {1: 1.0, 2: 0.5, 3: 0.45}.__getitem__


def _first_tokens(early_stop: bool, trials: int, sps=APPENDIX_A_SPS, seed: int = 0) -> tuple[float, float]:
    """DSpark App. A: target p = (0.7, 0.3) then (0.6, 0.4); drafter q = uniform; c1 = 0.8, c2 = 0.9 after 'A' and
    0 after 'B'. Returns the frequencies of 'A' as first and as second emitted token."""
    p = torch.tensor([[0.7, 0.3], [0.6, 0.4], [0.6, 0.4]], dtype=torch.float64)
    q = torch.full((2, 2), 0.5, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    first = second = 0
    for _ in range(trials):
        d = [rng.randrange(2), rng.randrange(2)]
        a = survival([0.8, 0.9 if d[0] == 0 else 0.0])
        if early_stop:
            ell = verify_lengths([a], sps, 1, 1)[0]
        else:  # global argmax over every prefix: looks at c2, which depends on d0
            thetas = [(1 + sum(a[:n])) * sps(1 + n) for n in range(3)]
            ell = max(range(3), key=lambda n: thetas[n])
        st = SamplingTensors(torch.ones(1), torch.zeros(1, dtype=torch.long), torch.ones(1),
                             torch.tensor([rng.getrandbits(62)]), False, False, False)
        out, L = RejectionSampler()(p[: ell + 1].log().float().unsqueeze(0), torch.tensor([d[:ell]]).view(1, ell),
                                    q[:ell].float().unsqueeze(0), st, torch.zeros(1, dtype=torch.long))
        tokens = out[0, : int(L[0]) + 1].tolist()
        if len(tokens) == 1:  # one more plain step for the second token
            tokens = tokens + [int(torch.multinomial(p[1], 1, generator=gen))]
        first += tokens[0] == 0
        second += tokens[1] == 0
    return first / trials, second / trials


def test_early_stop_is_lossless_statistically():
    n = 6000
    tol = 4 * (0.25 / n) ** 0.5  # 4 sigma
    a1, a2 = _first_tokens(True, n)
    assert abs(a1 - 0.7) < tol and abs(a2 - 0.6) < tol
    b1, _ = _first_tokens(False, n)
    assert abs(b1 - 0.85) < tol  # the test has power: without the early stop the output is biased
    # flat cost: drafts are admitted (l = 2 after 'A', 1 after 'B') and the output is still the target's
    c1, c2 = _first_tokens(True, n, sps=lambda b: 1.0, seed=1)
    assert abs(c1 - 0.7) < tol and abs(c2 - 0.6) < tol


def test_bench_offline_smoke(tiny_checkpoint_with_drafters, tmp_path):
    from sparkspec.cli import main

    out, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(["bench", "offline", "--model", str(tiny_checkpoint_with_drafters), "--settings", "none,ngram:fixed:2",
               "--concurrency", "1,2", "--output-len", "4", "--min-requests", "2", "--requests-per-client", "1",
               "--json", str(out), "--plot", str(png)])
    assert rc == 0
    rows = json.loads(out.read_text())["results"]
    assert [(r["setting"], r["concurrency"]) for r in rows] == [("none", 1), ("none", 2), ("ngram fixed k=2", 1),
                                                                ("ngram fixed k=2", 2)]
    assert all(r["output_tokens"] == 4 * r["num_requests"] and r["tok_s_total"] > 0 for r in rows)
    assert png.stat().st_size > 1000
