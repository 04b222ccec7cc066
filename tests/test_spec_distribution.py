"""(c) Temperature > 0: speculative sampling reproduces the target's distribution (Leviathan et al.,
arXiv 2211.17192, Theorem 1), for a good and for a deliberately bad drafter.

1. The rejection sampler alone on fixed Markov-chain targets p and drafters q (vocabulary 5, three draft
   tokens per step, 1.2·10^4 sampled continuations of 3 tokens each), chi-square against the exact law.
2. End to end on a vocabulary-8 target: 10^4 seeded requests, the joint law of the first three generated
   tokens against the exact one computed from the target.
"""

import dataclasses
import math

import pytest
import torch
from spec_helpers import drafter_tensors, one_thread, random_target, tiny_config  # noqa: F401

from sparkspec.models.deepseek_v4 import Batch
from sparkspec.ops import ops
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode import SpeculativeGenerator, build_proposer
from sparkspec.spec_decode.proposer import Draft, Proposer
from sparkspec.spec_decode.rejection import RejectionSampler

pytestmark = pytest.mark.usefixtures("one_thread")


def chi_square(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> tuple[float, float]:
    """Pearson statistic (cells with expected < min_expected pooled) and its critical value at z = 5
    (one-sided p ~ 3e-7, Wilson–Hilferty) -> (statistic, critical)."""
    n = counts.sum()
    expected = probs.flatten().double() * n
    counts = counts.flatten().double()
    small = expected < min_expected
    exp_cells = torch.cat([expected[~small], expected[small].sum().view(1)])
    obs_cells = torch.cat([counts[~small], counts[small].sum().view(1)])
    keep = exp_cells > 0
    assert (obs_cells[~keep] == 0).all(), "a sample landed where the target has no mass"
    stat = float(((obs_cells[keep] - exp_cells[keep]) ** 2 / exp_cells[keep]).sum())
    dof = int(keep.sum()) - 1
    z = 5.0
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    return stat, crit


# ---- 1. the sampler on fixed p / q ----

V, K, N = 5, 3, 12_000


def chain(seed: int, spread: float) -> torch.Tensor:
    """[V, V]: row x is the next-token law after x."""
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g) * spread, dim=-1)


P = chain(0, 1.2)
DRAFTERS = {
    "good": 0.8 * P + 0.2 / V,  # close to the target
    "bad": torch.softmax(-4 * P.log(), dim=-1),  # prefers what the target dislikes
    "one_hot": None,  # deterministic drafts (n-gram style): d = (x + 1) % V
}


def run_chain(p_chain: torch.Tensor, q_chain: torch.Tensor | None, params: SamplingParams, q_claimed=None,
              num: int = N, seed: int = 0) -> torch.Tensor:
    """num continuations of 3 tokens from anchor 0, speculating K drafts per step -> counts [V, V, V]."""
    sampler = RejectionSampler()
    g = torch.Generator().manual_seed(seed)
    gens = [torch.Generator().manual_seed(seed * 1_000_003 + i) for i in range(num)]
    outs = [[] for _ in range(num)]
    last = torch.zeros(num, dtype=torch.long)
    todo = torch.arange(num)
    while todo.numel():
        x, toks, qs = last[todo], [], []
        for _ in range(K):  # draft K tokens for every unfinished continuation at once
            if q_chain is None:
                x = (x + 1) % V
            else:
                qs.append((q_chain if q_claimed is None else q_claimed)[x])
                x = torch.multinomial(q_chain[x], 1, generator=g).squeeze(1)
            toks.append(x)
        toks = torch.stack(toks, dim=1)  # [n, K]
        probs = torch.stack(qs, dim=1) if qs else None  # [n, K, V]
        logits = p_chain[torch.cat([last[todo, None], toks], dim=1)].log().flatten(0, 1)  # [n (K + 1), V]
        drafts = [Draft(t, None if probs is None else probs[j]) for j, t in enumerate(toks.tolist())]
        spans = [(j * (K + 1), (j + 1) * (K + 1)) for j in range(len(drafts))]
        ids = todo.tolist()
        verdicts = sampler(logits, spans, drafts, [params] * len(ids), [gens[i] for i in ids])
        for i, v in zip(ids, verdicts):
            outs[i] += v.token_ids
            last[i] = v.token_ids[-1]
        todo = torch.tensor([i for i in ids if len(outs[i]) < 3], dtype=torch.long)
    counts = torch.zeros(V, V, V)
    for o in outs:
        counts[o[0], o[1], o[2]] += 1
    return counts


def exact_law(p_chain: torch.Tensor) -> torch.Tensor:
    """P(x1, x2, x3 | anchor 0) = p(x1 | 0) p(x2 | x1) p(x3 | x2) -> [V, V, V]."""
    return p_chain[0][:, None, None] * p_chain[:, :, None] * p_chain[None, :, :]


def processed(p_chain: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    t, k, tp = (torch.full((V,), float(params.temperature)), torch.full((V,), params.top_k),
                torch.full((V,), float(params.top_p)))
    return ops.process_logits(p_chain.log(), t, k, tp)


@pytest.mark.parametrize("drafter", list(DRAFTERS))
@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4)],
                         ids=["T1", "T0.7-topk4"])
def test_rejection_sampler_preserves_the_target_law(drafter, params):
    counts = run_chain(P, DRAFTERS[drafter], params)
    stat, crit = chi_square(counts, exact_law(processed(P, params)))
    assert stat < crit, (drafter, stat, crit)


def test_chi_square_has_power_against_an_inexact_q():
    """Negative control: claiming a q other than the one the drafts were drawn from biases the output, and the
    same test catches it (why drafters must return the exact, Markov-corrected q)."""
    params = SamplingParams(temperature=1.0)
    counts = run_chain(P, DRAFTERS["bad"], params, q_claimed=DRAFTERS["good"], num=N // 3)
    stat, crit = chi_square(counts, exact_law(P))
    assert stat > 3 * crit


# ---- 2. end to end on a vocabulary-8 model ----

SMALL_V, NUM_REQUESTS, PROMPT = 8, 10_000, [5, 2, 7, 4, 6]


class TemperedOracle(Proposer):
    """A good drafter: samples the target itself at 1.25x the request's temperature (q close to p, not equal)."""

    method = "oracle"

    def __init__(self, model, k: int):
        super().__init__(k)
        self.model, self.memo = model, {}

    def dist(self, prefixes: list[tuple[int, ...]], params: SamplingParams) -> None:
        missing = [p for p in set(prefixes) if p not in self.memo]
        if missing:
            logits = last_logits(self.model, [list(p) for p in missing])
            t = torch.full((len(missing),), params.temperature * 1.25)
            q = ops.process_logits(logits, t, torch.zeros(len(missing), dtype=torch.long), torch.ones(len(missing)))
            self.memo.update(zip(missing, q))

    def propose(self, seqs, num_tokens):
        toks = [[] for _ in seqs]
        for i in range(max(num_tokens)):
            rows = [r for r, k in enumerate(num_tokens) if k > i]
            prefixes = [tuple(seqs[r].all_ids + toks[r]) for r in rows]
            self.dist(prefixes, seqs[0].params)
            q = torch.stack([self.memo[p] for p in prefixes])
            for r, d in zip(rows, ops.sample(q, [seqs[r].generator for r in rows]).tolist()):
                toks[r].append(d)
        return [Draft(t, torch.stack([self.memo[tuple(s.all_ids + t[:i])] for i in range(len(t))]) if t else None)
                for s, t in zip(seqs, toks)]


def last_logits(model, seqs: list[list[int]]) -> torch.Tensor:
    spans, off = [], 0
    for s in seqs:
        spans.append((off, off + len(s)))
        off += len(s)
    with torch.inference_mode():
        out = model(torch.tensor([t for s in seqs for t in s]), Batch(spans, [0] * len(seqs),
                    [model.new_cache() for _ in seqs]), logits_rows=torch.tensor([e - 1 for _, e in spans]))
    return out.logits


@pytest.fixture(scope="module")
def small_model():
    torch.set_num_threads(1)
    cfg = dataclasses.replace(
        tiny_config(), vocab_size=SMALL_V, num_hidden_layers=2, layer_types=["sliding_attention"] * 2,
        mlp_layer_types=["hash_moe", "moe"], dspark_target_layer_ids=[0, 1])
    return cfg, random_target(cfg, seed=11, head_scale=1.0)


def exact_first_three(model, params: SamplingParams) -> torch.Tensor:
    """P(x1, x2, x3 | PROMPT) under the processed target -> [V, V, V]."""
    prefixes = [PROMPT] + [PROMPT + [a] for a in range(SMALL_V)] + [PROMPT + [a, b] for a in range(SMALL_V)
                                                                      for b in range(SMALL_V)]
    logits = last_logits(model, prefixes)
    n = len(prefixes)
    probs = ops.process_logits(logits, torch.full((n,), params.temperature), torch.full((n,), params.top_k),
                               torch.full((n,), params.top_p))
    p1, p2, p3 = probs[0], probs[1 : 1 + SMALL_V], probs[1 + SMALL_V :].view(SMALL_V, SMALL_V, SMALL_V)
    return p1[:, None, None] * p2[:, :, None] * p3


@pytest.mark.parametrize("drafter,params", [
    ("dspark_random", SamplingParams(max_tokens=4, temperature=1.0, ignore_eos=True)),
    ("oracle", SamplingParams(max_tokens=4, temperature=0.8, top_k=6, ignore_eos=True)),
])
def test_end_to_end_sampling_matches_the_target(small_model, drafter, params):
    cfg, model = small_model
    if drafter == "oracle":
        proposer = TemperedOracle(model, 2)
    else:
        proposer = build_proposer("dspark", model, drafter_tensors(cfg, 12, "dspark"), 2)
    gen = SpeculativeGenerator(model, None, proposer)
    reqs = [dataclasses.replace(params, seed=i) for i in range(NUM_REQUESTS)]
    seqs = gen.generate([PROMPT] * NUM_REQUESTS, reqs)
    counts = torch.zeros(SMALL_V, SMALL_V, SMALL_V)
    for s in seqs:
        counts[s.output_ids[0], s.output_ids[1], s.output_ids[2]] += 1
    stat, crit = chi_square(counts, exact_first_three(model, params))
    assert stat < crit, (drafter, stat, crit)
    rate = gen.spec_metrics.acceptance_rate
    assert (rate > 0.5) if drafter == "oracle" else (rate < 0.5), rate
    # same seeds, same tokens
    again = SpeculativeGenerator(model, None, proposer).generate([PROMPT] * 50, reqs[:50])
    assert [s.output_ids for s in again] == [s.output_ids for s in seqs[:50]]
