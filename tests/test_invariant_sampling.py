"""The drafter-invariant (Gumbel-max) scheme, arXiv 2408.07978: its noise, its samples follow p, its acceptance
matches the coupling's closed form, its output equals plain decoding whatever the drafts, and (demo pair) the
same seeded tokens for none / DSpark / MTP / n-gram. Synthetic parts are deterministic (fixed seeds)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch
from helpers import chi2_pvalue
from torch.utils._python_dispatch import TorchDispatchMode

from sparkspec.ops.rng import gumbel
from sparkspec.ops.sampling import (
    STREAM_DRAFT,
    STREAM_GUMBEL,
    SamplingTensors,
    gumbel_sample,
    probs_for,
    sample_draft,
)
from sparkspec.sampling_params import SamplingParams as SP
from sparkspec.spec_decode.rejection import RejectionSampler

DEVICE = torch.device("cpu")
ALPHA = 1e-4  # chi-square p-value floor; the draws are deterministic, so a pass is a pass on every run


def st_of(params: list[SP], seeds: torch.Tensor, gumbel: torch.Tensor | bool = True) -> SamplingTensors:
    """Sampling tensors of `params` with the given seeds and scheme."""
    return SamplingTensors(
        torch.tensor([p.device_temperature for p in params], dtype=torch.float32),
        torch.tensor([p.top_k for p in params], dtype=torch.int64),
        torch.tensor([p.top_p for p in params], dtype=torch.float32),
        seeds.to(torch.int64), all(p.greedy for p in params), any(p.top_k > 0 for p in params),
        any(p.top_p < 1 for p in params), gumbel)




# ---------------------------------------------------------------- the noise


def test_gumbel_noise_is_standard_gumbel():
    n = 4000
    g = gumbel(torch.arange(n), torch.arange(n) * 7 + 3, STREAM_GUMBEL, 25).flatten().double()  # [n * 25]
    assert abs(float(g.mean()) - 0.5772156649) < 0.01 and abs(float(g.var()) - math.pi**2 / 6) < 0.03
    B = 50  # equiprobable bins of the standard Gumbel: edges at its quantiles -log(-log(i / B))
    edges = -torch.log(-torch.log(torch.arange(1, B, dtype=torch.float64) / B))
    counts = torch.bincount(torch.bucketize(g, edges), minlength=B)
    assert chi2_pvalue(counts, torch.full((B,), g.numel() / B)) > ALPHA
    assert torch.isfinite(g).all()


def test_gumbel_noise_depends_only_on_seed_offset_and_token():
    seeds, offs = torch.tensor([5, 9, 5, -1]), torch.tensor([10, 10, 11, 10])
    g = gumbel(seeds, offs, STREAM_GUMBEL, 11)  # [4, 11]
    for r in range(4):  # alone, or in another batch, or with a longer vocabulary: the same values
        assert torch.equal(gumbel(seeds[r : r + 1], offs[r : r + 1], STREAM_GUMBEL, 11), g[r : r + 1])
        assert torch.equal(gumbel(seeds[r : r + 1], offs[r : r + 1], STREAM_GUMBEL, 20)[:, :11], g[r : r + 1])
    for a, b in [(0, 1), (0, 2), (0, 3)]:  # another seed or position: other numbers
        assert not torch.isclose(g[a], g[b]).any()
    assert not torch.isclose(gumbel(seeds, offs, STREAM_DRAFT, 11), g).any()  # another stream too


# ---------------------------------------------------------------- (a) samples follow p

PARAMS = [SP(temperature=1.0), SP(temperature=0.7), SP(temperature=1.3, top_k=4), SP(temperature=0.9, top_p=0.8),
          SP(temperature=1.1, top_k=6, top_p=0.7)]


@pytest.mark.parametrize("params", PARAMS, ids=["t1", "t0.7", "topk", "topp", "both"])
def test_gumbel_samples_follow_the_processed_distribution(params):
    N, V = 30_000, 10
    logits = (torch.randn(V, generator=torch.Generator().manual_seed(3)) * 1.5).expand(N, V)
    st = st_of([params] * N, torch.arange(N) * 31 + 1)
    ids, ok = gumbel_sample(logits, st, torch.arange(N) % 113)
    p = probs_for(logits[:1], st.index_select(torch.tensor([0])))[0]  # [V] the distribution asked for
    assert ok.all()
    assert chi2_pvalue(torch.bincount(ids, minlength=V), p * N) > ALPHA


def test_greedy_rows_are_the_argmax_and_mixed_batches_are_row_independent():
    V = 12
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(0)) * 3
    params = [SP(), SP(temperature=1.0), SP(temperature=0.5, top_k=3), SP(), SP(temperature=2.0, top_p=0.5),
              SP(temperature=1.0)]
    seeds, pos = torch.tensor([1, 2, 3, 4, 5, 2]), torch.tensor([7, 8, 9, 10, 11, 8])
    ids, _ = gumbel_sample(logits, st_of(params, seeds), pos)
    assert ids[0] == logits[0].argmax() and ids[3] == logits[3].argmax()
    for r in range(6):
        alone, _ = gumbel_sample(logits[r : r + 1], st_of(params[r : r + 1], seeds[r : r + 1]), pos[r : r + 1])
        assert alone[0] == ids[r]


# ---------------------------------------------------------------- (b) acceptance = the coupling's prediction


def coupling_match(p: torch.Tensor, q: torch.Tensor) -> float:
    """Pr[argmax(log p + G) == argmax(log q + G)] for shared Gumbel G, in closed form: with E_u = exp(-G_u) ~
    Exp(1) iid, both pick v iff E_u >= E_v · max(p_u / p_v, q_u / q_v) for all u, so the chance is
    sum_v 1 / sum_u max(p_u / p_v, q_u / q_v) over the v with p_v, q_v > 0."""
    p, q = p.double(), q.double()
    both = (p > 0) & (q > 0)
    ratio = torch.maximum(p.unsqueeze(0) / p.unsqueeze(1), q.unsqueeze(0) / q.unsqueeze(1))  # [v, u]
    return float((1 / ratio[both].sum(-1)).sum())


def pq(case: str, V: int = 8) -> tuple[torch.Tensor, torch.Tensor]:  # -> logits of p and q [V] each
    g = torch.Generator().manual_seed({"close": 1, "far": 2, "peaked": 3}[case])
    lp = torch.randn(V, generator=g) * 1.5
    lq = {"close": lp + 0.3 * torch.randn(V, generator=g), "far": torch.randn(V, generator=g) * 1.5,
          "peaked": lp * 3}[case]
    return lp, lq


@pytest.mark.parametrize("case", ["close", "far", "peaked"])
@pytest.mark.parametrize("params", [SP(temperature=1.0), SP(temperature=0.7, top_k=5)], ids=["t1", "topk"])
def test_acceptance_matches_the_gumbel_coupling(case, params):
    """K = 1 verification over N rows: the accept rate is the closed form within 5 binomial sigmas, above the
    paper's bound (1 - TV) / (1 + TV), below rejection sampling's 1 - TV (which the rejection scheme then shows)."""
    N, V = 60_000, 8
    lp, lq = pq(case, V)
    st = st_of([params] * N, torch.arange(N) + 100)
    pos = torch.arange(N) % 97 + 5
    d, q_rows = sample_draft(lq.expand(N, V), st, pos, STREAM_DRAFT)  # Gumbel drafts with the target's noise
    assert q_rows is None  # every row is a Gumbel row: no q kept
    target = lp.expand(N, 2, V).contiguous()  # [N, K+1, V] (row 1: the bonus row, unused)
    _, L = RejectionSampler()(target, d.unsqueeze(1), None, st, pos)
    p = probs_for(lp.unsqueeze(0), st.index_select(torch.tensor([0])))[0]
    q = probs_for(lq.unsqueeze(0), st.index_select(torch.tensor([0])))[0]
    want, tv = coupling_match(p, q), 0.5 * float((p - q).abs().sum())
    got = float(L.double().mean())
    assert abs(got - want) < 5 * math.sqrt(want * (1 - want) / N) + 1e-9
    assert (1 - tv) / (1 + tv) - 1e-9 <= want <= 1 - tv + 1e-9
    # rejection sampling on the same p, q accepts with chance 1 - TV
    st_r = dataclasses.replace(st, gumbel=False)
    d_r, q_r = sample_draft(lq.expand(N, V), st_r, pos, STREAM_DRAFT)
    _, L_r = RejectionSampler()(target, d_r.unsqueeze(1), q_r.unsqueeze(1), st_r, pos)
    assert abs(float(L_r.double().mean()) - (1 - tv)) < 5 * math.sqrt(tv * (1 - tv) / N) + 1e-9


# ---------------------------------------------------------------- (c) lossless by construction


def markov_logits(V: int, seed: int) -> torch.Tensor:  # -> [V, V] logits of P(next | prev)
    return torch.randn(V, V, generator=torch.Generator().manual_seed(seed)) * 2


def plain_decode(P, st, first, pos0, steps):
    """Plain decoding: one 0-draft verification per token -> [R, steps]."""
    out, prev = [], first
    empty = torch.empty(first.shape[0], 0, dtype=torch.int64)
    for s in range(steps):
        tok, L = RejectionSampler()(P[prev].unsqueeze(1), empty, None, st, pos0 + s)
        assert (L == 0).all()
        prev = tok[:, 0]
        out.append(prev)
    return torch.stack(out, 1)


def spec_decode(P, st, first, pos0, steps, propose):
    """Speculative decoding with drafter `propose(done [R, t] tokens so far, pos [R], k) -> drafts [R, k]` (-1 =
    none), k cycling through 0..4 per step -> [R, steps] emitted tokens (R rows advance independently)."""
    R = first.shape[0]
    done = [[] for _ in range(R)]
    step = 0
    while min(len(x) for x in done) < steps:
        k = step % 5
        prev = torch.tensor([x[-1] if x else int(first[r]) for r, x in enumerate(done)])
        pos = pos0 + torch.tensor([len(x) for x in done])
        drafts = propose(done, prev, pos, k) if k else torch.empty(R, 0, dtype=torch.int64)
        ctx = torch.cat([prev.unsqueeze(1), drafts.clamp(min=0)], 1)  # [R, k+1] token before each verify row
        out, L = RejectionSampler()(P[ctx], drafts, None, st, pos)
        for r in range(R):
            done[r].extend(out[r, : int(L[r]) + 1].tolist())
        step += 1
    return torch.tensor([x[:steps] for x in done])


@pytest.mark.parametrize("params", [SP(temperature=1.0), SP(temperature=0.7, top_k=5, top_p=0.9)],
                         ids=["t1", "filtered"])
def test_emitted_tokens_equal_plain_decoding_for_any_drafts(params):
    """A replay drafter that knows plain decoding's tokens but injects an error at each draft position in turn
    (and a random garbage drafter, and a sampled Markov drafter with the shared noise): every emitted token
    equals plain Gumbel decoding's, token for token."""
    R, V, steps = 6, 16, 40
    P = markov_logits(V, 0)
    st = st_of([params] * R, torch.arange(R) * 11 + 3)
    first, pos0 = torch.arange(R) % V, torch.arange(R) * 5 + 10
    plain = plain_decode(P, st, first, pos0, steps)

    def replay(bad_every):
        def propose(done, prev, pos, k):
            out = torch.full((len(done), k), -1, dtype=torch.int64)
            for r, x in enumerate(done):
                truth = plain[r, len(x) : len(x) + k].tolist()
                for i, t in enumerate(truth):
                    wrong = (len(x) + i) % bad_every == 0  # an error at every position, across the runs
                    out[r, i] = (t + 1) % V if wrong else t
            return out
        return propose

    def garbage(done, prev, pos, k):
        return torch.randint(0, V, (len(done), k), generator=torch.Generator().manual_seed(int(pos.sum())))

    Q = markov_logits(V, 1) * 0.5 + P * 0.5

    def markov_drafter(done, prev, pos, k):
        ids, d = [], prev
        for i in range(k):
            d, q = sample_draft(Q[d], st, pos + i, STREAM_DRAFT)
            ids.append(d)
        return torch.stack(ids, 1)

    accepted_any = False
    for propose in [replay(2), replay(3), replay(5), replay(10**9), garbage, markov_drafter]:
        got = spec_decode(P, st, first, pos0, steps, propose)
        assert torch.equal(got, plain)
        accepted_any = True
    assert accepted_any


def test_per_request_scheme_in_one_batch():
    """A [R] bool `gumbel` gives each row exactly what an all-Gumbel or all-rejection batch gives it."""
    R, K, V = 8, 3, 10
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(R, K + 1, V, generator=g) * 2
    drafts = torch.randint(0, V, (R, K), generator=g).masked_fill(torch.arange(K) >= (torch.arange(R) % 4)
                                                                   .unsqueeze(1), -1)
    q = torch.softmax(torch.randn(R, K, V, generator=g), -1)
    params = [SP(temperature=1.0), SP(), SP(temperature=0.8, top_k=4)] * 3
    seeds, pos = torch.arange(R) + 50, torch.arange(R) * 3
    which = torch.tensor([True, False, True, True, False, False, True, False])
    mixed = RejectionSampler().verify(logits, drafts, q, st_of(params[:R], seeds, which), pos)
    gum = RejectionSampler().verify(logits, drafts, q, st_of(params[:R], seeds, True), pos)
    rej = RejectionSampler().verify(logits, drafts, q, st_of(params[:R], seeds, False), pos)
    for a, b, c in zip(mixed, gum, rej):
        assert torch.equal(a, torch.where(which.view(-1, *[1] * (a.dim() - 1)), b, c))
    ids, q_mixed = sample_draft(logits[:, 0], st_of(params[:R], seeds, which), pos, STREAM_DRAFT)
    assert q_mixed is not None  # the rejection rows need theirs
    assert torch.equal(ids[which], sample_draft(logits[:, 0], st_of(params[:R], seeds), pos, STREAM_DRAFT)[0][which])


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name().split("::")[-1].split(".")[0])
        return func(*args, **(kwargs or {}))


def test_no_host_sync():
    R, K, V = 4, 2, 9
    logits = torch.randn(R, K + 1, V, generator=torch.Generator().manual_seed(0))
    drafts = torch.tensor([[1, 2], [3, -1], [-1, -1], [4, 5]])
    params = [SP(temperature=1.0), SP(temperature=0.6, top_k=3, top_p=0.9), SP(), SP(temperature=1.0)]
    with OpLog() as log:
        for gum in (True, torch.tensor([True, False, True, False])):
            st = st_of(params, torch.arange(R), gum)
            RejectionSampler().verify(logits, drafts, None, st, torch.arange(R))
            sample_draft(logits[:, 0], st, torch.arange(R), STREAM_DRAFT)
    syncs = {"_local_scalar_dense", "nonzero", "is_nonzero", "item", "equal", "masked_select", "unique"}
    assert len(log.ops) > 30 and not syncs & set(log.ops)


# ---------------------------------------------------------------- (d) the demo pair, end to end

DEMO_PROMPTS = ["Write a haiku about the sea.", "What is 17 times 23?", "def fibonacci(n):", "Tell me a story.",
                "List three prime numbers.", "Explain gravity to a child."]


@pytest.fixture(scope="module")
def demo():
    from sparkspec.loading.checkpoint import load_checkpoint
    from sparkspec.paths import DEFAULT_MODEL

    ckpt = load_checkpoint(DEFAULT_MODEL, device="cpu")
    ids = [ckpt.tokenizer.encode(ckpt.tokenizer.apply_chat_template([{"role": "user", "content": p}]))
           for p in DEMO_PROMPTS]
    return ckpt, ids


def demo_tokens(ckpt, ids, method, **kw):
    from sparkspec.engine.llm import LLM

    llm = LLM(ckpt, method, max_num_seqs=8, max_model_len=256, **kw)
    params = [SP(temperature=1.0, seed=5 + i, max_tokens=40, ignore_eos=True) for i in range(len(ids))]
    return [o.token_ids for o in llm.generate(ids, params)]


@pytest.mark.parametrize("method", ["dspark", "mtp", "ngram"])
def test_demo_seeded_tokens_identical_with_any_drafter(demo, method):
    """EngineConfig.sampling_scheme = "gumbel": the same tokens for none and each drafter, fixed and adaptive."""
    ckpt, ids = demo
    plain = demo_tokens(ckpt, ids, "none", sampling_scheme="gumbel")
    assert demo_tokens(ckpt, ids, method, sampling_scheme="gumbel", spec_budget="fixed") == plain
    assert demo_tokens(ckpt, ids, method, sampling_scheme="gumbel") == plain
    assert demo_tokens(ckpt, ids, "none", sampling_scheme="rejection") != plain  # rejection draws other tokens
    assert demo_tokens(ckpt, ids, method) == plain  # the default ("auto"): seeded requests take the Gumbel scheme


def test_auto_scheme_takes_gumbel_for_seeded_rejection_for_unseeded(demo):
    """The default scheme, per request in one batch: seeded requests give their "gumbel" tokens (plain decoding's),
    unseeded ones draw as "rejection" does (their seeds come from the engine's RNG, seeded here for both runs)."""
    from sparkspec.engine.llm import LLM

    ckpt, ids = demo
    params = [SP(temperature=1.0, seed=7 + i if i % 2 else None, max_tokens=30, ignore_eos=True)
              for i in range(len(ids))]

    def run(method, scheme):
        llm = LLM(ckpt, method, max_num_seqs=8, max_model_len=256, spec_budget="fixed", sampling_scheme=scheme)
        llm.engine._rng.seed(3)
        return [o.token_ids for o in llm.generate(ids, params)]

    auto, gumbel, rejection = run("dspark", "auto"), run("none", "gumbel"), run("dspark", "rejection")
    seeded = [i for i, sp in enumerate(params) if sp.seed is not None]
    assert [auto[i] for i in seeded] == [gumbel[i] for i in seeded]
    assert [auto[i] for i in seeded] != [rejection[i] for i in seeded]
    assert [o for i, o in enumerate(auto) if i not in seeded] == [o for i, o in enumerate(rejection) if i not in seeded]


def test_demo_seeded_tokens_do_not_depend_on_the_batch_or_n(demo):
    """Under "gumbel", a seeded request's tokens are the same alone, among 10 other requests, and as choice 0 of
    n = 3 (its samples 1, 2 draw other noise), with DSpark's adaptive budget."""
    from sparkspec.engine.llm import LLM

    ckpt, ids = demo
    llm = LLM(ckpt, "dspark", max_num_seqs=16, max_model_len=256, sampling_scheme="gumbel")
    sp = SP(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True)
    alone = llm.generate([ids[0]], sp)[0].token_ids
    others = [SP(temperature=0.8, seed=100 + i, max_tokens=20 + i, ignore_eos=True) for i in range(10)]
    crowd = llm.generate([ids[0]] + [ids[1 + i % (len(ids) - 1)] for i in range(10)], [sp] + others)
    assert crowd[0].token_ids == alone
    samples = llm.generate([ids[0]], SP(temperature=1.0, seed=11, max_tokens=40, ignore_eos=True, n=3))[0].outputs
    assert samples[0].token_ids == alone and samples[1].token_ids != alone


def test_generate_flag_sampling_scheme(capsys):
    """generate --sampling-scheme gumbel: DSpark's seeded text equals plain decoding's."""
    from sparkspec.cli import main

    def run(*flags) -> list:
        assert main(["generate", "--prompt", "Tell me a story.", "--prompt", "def add(a, b):", "--max-tokens", "24",
                     "--temperature", "1", "--seed", "4", "--device", "cpu", "--json", *flags]) == 0
        lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
        return [json.loads(line)["text"] for line in lines]

    plain = run("--spec", "none", "--sampling-scheme", "gumbel")
    assert len(plain) == 2 and run("--spec", "dspark", "--sampling-scheme", "gumbel") == plain
    assert run("--spec", "none", "--sampling-scheme", "rejection") != plain
    assert run("--spec", "dspark") == plain  # the default, "auto": a seeded request takes the Gumbel scheme
