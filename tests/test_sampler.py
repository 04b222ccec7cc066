"""Counter RNG, batched sampling and batched rejection sampling (Leviathan et al., arXiv 2211.17192).

Statistical tests use fixed seeds, so they are deterministic; each checks a p-value against 1e-3.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sparkspec.ops.rng import philox, to_unit, uniform, uniform_at
from sparkspec.ops.sampling import (STREAM_DRAFT, STREAM_TARGET, SamplingTensors, process_logits, sample,
                                    sample_tokens)
from sparkspec.sampling_params import SamplingParams as SP
from sparkspec.spec_decode.rejection import RejectionSampler

DEVICE = torch.device(os.environ.get("SPARKSPEC_TEST_DEVICE", "cpu"))
ALPHA = 1e-3


def chi2_pvalue(counts: torch.Tensor, expected: torch.Tensor) -> float:  # both [C]
    """Pearson chi-square p-value; cells with zero expectation must be empty."""
    assert counts[expected == 0].sum() == 0, "drew an event of probability 0"
    keep = expected > 0
    c, e = counts[keep].double(), expected[keep].double()
    stat = ((c - e) ** 2 / e).sum()
    return float(torch.special.gammaincc(torch.tensor((len(e) - 1) / 2, dtype=torch.float64), stat / 2))


def seeds_of(n: int, start: int = 0) -> torch.Tensor:
    return torch.arange(start, start + n, dtype=torch.int64, device=DEVICE)


# ---------------------------------------------------------------- counter RNG


@pytest.mark.parametrize(("words", "want"), [  # Random123 known-answer vectors: counter[4], key[2] -> out[4]
    ([0] * 6, [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]),
    ([0xFFFFFFFF] * 6, [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]),
    ([0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344, 0xA4093822, 0x299F31D0],
     [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]),
])
def test_philox_known_answers(words, want):
    got = philox(*[torch.tensor([w], device=DEVICE) for w in words])
    assert [int(w) for w in got] == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform_is_uniform_on_open_interval(dtype):
    u = uniform(seeds_of(1000), seeds_of(1000, 7) * 3, STREAM_TARGET, 100, dtype).flatten().double().cpu()
    n = len(u)
    assert u.dtype == torch.float64 and (u > 0).all() and (u < 1).all()
    ks = ((torch.arange(1, n + 1, dtype=torch.float64) / n - u.sort().values).abs().max())
    assert ks < 1.95 / math.sqrt(n)  # Kolmogorov-Smirnov at alpha = 1e-3
    counts = torch.bincount((u * 100).long(), minlength=100)
    assert chi2_pvalue(counts, torch.full((100,), n / 100)) > ALPHA


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_uniform_extremes_stay_open(dtype):
    words = torch.tensor([0, 2**12, 2**31, 2**32 - 1], device=DEVICE)
    u = to_unit(words, words, dtype)
    assert (u > 0).all() and (u < 1).all() and u.unique().numel() == 4


def test_uniform_independent_across_streams_offsets_seeds_and_index():
    n = 100_000
    s, o = seeds_of(n) * 7919, seeds_of(n, 100)

    def u(seeds, offsets, stream, j):
        return uniform_at(seeds, offsets, stream, j).double().cpu()

    base = u(s, o, 0, 0)
    for other in (u(s, o, 1, 0), u(s, o + 1, 0, 0), u(s + 1, o, 0, 0), u(s, o, 0, 1), u(s, o + 2**32, 0, 0)):
        corr = torch.corrcoef(torch.stack([base, other]))[0, 1]
        assert abs(float(corr)) < 4.5 / math.sqrt(n)
        assert (base == other).double().mean() < 1e-3


def test_uniform_deterministic_and_row_independent():
    seeds, offsets = torch.tensor([3, -1, 2**62, 3], device=DEVICE), torch.tensor([0, 5, 9, 1], device=DEVICE)
    a = uniform(seeds, offsets, 2, 5)
    assert torch.equal(a, uniform(seeds, offsets, 2, 5))
    for r in range(4):
        assert torch.equal(a[r : r + 1], uniform(seeds[r : r + 1], offsets[r : r + 1], 2, 5))
        assert torch.equal(a[r, 2:3], uniform_at(seeds[r], offsets[r], 2, 2).reshape(1))
    if DEVICE.type != "cpu":  # integer ops only: bit-identical on every device
        assert torch.equal(a.cpu(), uniform(seeds.cpu(), offsets.cpu(), 2, 5))


# ---------------------------------------------------------------- process_logits


def old_process_logits(logits, temperature, top_k, top_p):
    """The implementation before batching (with host syncs), kept as the reference."""
    logits = logits.float()
    B, V = logits.shape
    greedy = temperature <= 0
    t = torch.where(greedy, torch.ones_like(temperature), temperature).float().unsqueeze(1)
    x = logits / t
    k = torch.where(top_k > 0, top_k.clamp(max=V), torch.full_like(top_k, V))
    if bool((k < V).any()):
        kth = torch.sort(x, dim=-1, descending=True).values.gather(1, (k - 1).long().unsqueeze(1))
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if bool((top_p < 1).any()):
        sp, si = torch.sort(probs, dim=-1, descending=True)
        before = sp.cumsum(-1) - sp
        drop = before >= top_p.float().unsqueeze(1)
        drop[:, 0] = False
        sp = sp.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(1, si, sp)
        probs = probs / probs.sum(-1, keepdim=True)
    if bool(greedy.any()):
        onehot = torch.zeros_like(probs).scatter(1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy.unsqueeze(1), onehot, probs)
    return probs


PL_CASES = {  # name: rows of (temperature, top_k, top_p)
    "plain": [(1.0, 0, 1.0), (0.5, 0, 1.0)],
    "top_k": [(1.0, 3, 1.0), (0.7, 1, 1.0), (1.0, 99, 1.0)],
    "top_p": [(1.0, 0, 0.5), (1.3, 0, 0.9), (1.0, 0, 1e-6)],
    "both": [(0.8, 4, 0.7), (1.0, 2, 0.99)],
    "greedy_mixed": [(0.0, 0, 1.0), (0.0, 3, 0.5), (1.0, 5, 0.8), (1.0, 0, 1.0)],
}


@pytest.mark.parametrize("case", PL_CASES)
def test_process_logits_matches_old_implementation(case):
    rows = PL_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    logits = (torch.randn(len(rows), 12, generator=g) * 2).to(DEVICE)
    logits[0, 5] = logits[0, 2]  # a tie
    t, k, p = (torch.tensor(c, device=DEVICE) for c in zip(*rows))
    want = old_process_logits(logits, t.float(), k.long(), p.float())
    got = process_logits(logits, t.float(), k.long(), p.float())
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_process_logits_hand_built_masks_and_fast_path():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0], [1.0, 3.0, 3.0, 0.0, 2.0]], device=DEVICE)
    one, ks, no_p = torch.ones(2, device=DEVICE), torch.tensor([2, 2], device=DEVICE), torch.ones(2, device=DEVICE)
    keep = process_logits(logits, one, ks, no_p) > 0
    assert keep.tolist() == [[True, True, False, False, False], [False, True, True, False, False]]
    keep = process_logits(logits, one, torch.tensor([2, 1], device=DEVICE), no_p) > 0  # ties at the k-th stay
    assert keep[1].tolist() == [False, True, True, False, False]
    p0 = torch.softmax(logits[0], -1)
    cut = torch.full((2,), float(p0[0] + p0[1]) - 1e-4, device=DEVICE)
    assert (process_logits(logits[:1], one[:1], ks[:1] * 0, cut[:1]) > 0)[0].tolist() == [1, 1, 0, 0, 0]
    zeros = torch.zeros(2, dtype=torch.long, device=DEVICE)
    fast = process_logits(logits, one * 0.7, zeros, no_p, any_top_k=False, any_top_p=False)
    torch.testing.assert_close(fast, process_logits(logits, one * 0.7, zeros, no_p))


# ---------------------------------------------------------------- sample / sample_tokens


def test_sample_draws_from_probs():
    n = 20_000
    probs = torch.tensor([0.3, 0.0, 0.05, 0.2, 0.0, 0.15, 0.1, 0.2, 1e-3, 0.0], device=DEVICE)
    tok = sample(probs.expand(n, -1), seeds_of(n, 11), seeds_of(n) % 97, STREAM_TARGET)
    counts = torch.bincount(tok.cpu(), minlength=10)
    assert chi2_pvalue(counts, probs.cpu() * n) > ALPHA


def test_sample_never_picks_zero_probability_tokens():
    n, V = 4000, 8
    probs = torch.zeros(3 * n, V, device=DEVICE)
    probs[:n, 0] = 1.0  # only the first token
    probs[n : 2 * n, V - 1] = 1.0  # only the last
    probs[2 * n :, 3] = 1e-30  # a tiny mass beside zeros
    tok = sample(probs, seeds_of(3 * n), seeds_of(3 * n), STREAM_TARGET)
    assert (tok[:n] == 0).all() and (tok[n : 2 * n] == V - 1).all() and (tok[2 * n :] == 3).all()


def mixed_params():
    return [SP(temperature=0.0), SP(temperature=1.0), SP(temperature=0.7, top_k=5), SP(temperature=1.2, top_p=0.8),
            SP(temperature=0.0, top_k=3), SP(temperature=1.0, seed=123), SP(temperature=0.9, top_k=4, top_p=0.9)]


def test_sample_tokens_greedy_takes_lowest_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [3.0, 3.0, 3.0, 3.0]], device=DEVICE)
    st = SamplingTensors.from_params([SP(), SP()], DEVICE, [1, 2])
    assert sample_tokens(logits, st, seeds_of(2)).tolist() == [1, 0]


def test_sample_tokens_same_seed_same_tokens_in_any_batch():
    params, V, steps = mixed_params(), 16, 6
    seeds = [1000 + i for i in range(len(params))]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(steps, len(params), V, generator=g).to(DEVICE) * 2
    pos = torch.tensor([5, 17, 3, 40, 9, 2, 33], device=DEVICE)
    st = SamplingTensors.from_params(params, DEVICE, seeds)
    perm = torch.tensor([3, 6, 0, 5, 1, 4, 2], device=DEVICE)
    st_perm = SamplingTensors.from_params([params[i] for i in perm.tolist()], DEVICE, [seeds[i] for i in perm.tolist()])
    for s in range(steps):
        batch = sample_tokens(logits[s], st, pos + s)
        assert torch.equal(sample_tokens(logits[s, perm], st_perm, pos[perm] + s), batch[perm])
        for r in range(len(params)):
            alone = SamplingTensors.from_params([params[r]], DEVICE, [seeds[r]])
            assert torch.equal(sample_tokens(logits[s, r : r + 1], alone, pos[r : r + 1] + s), batch[r : r + 1])


def test_sampling_tensors_seeds_and_helpers():
    st = SamplingTensors.from_params([SP(seed=7), SP(temperature=1.0), SP(seed=2**64 - 1)], DEVICE, [1, 2, 3])
    assert st.seeds.tolist() == [7, 2, -1] and not st.all_greedy and not st.any_top_k
    assert st.repeat_interleave(2).seeds.tolist() == [7, 7, 2, 2, -1, -1]
    assert st.index_select(torch.tensor([2, 0], device=DEVICE)).seeds.tolist() == [-1, 7]
    with pytest.raises(ValueError, match="seed"):
        SamplingTensors.from_params([SP()], DEVICE)


# ---------------------------------------------------------------- rejection sampler: distribution


def markov(V: int, seed: int, sharp: float) -> torch.Tensor:  # -> [V, V] rows P(next | prev)
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(V, V, generator=g) * sharp, -1).to(DEVICE)


def draft_chain(Q, first, seeds, pos, K):
    """K drafts from the Markov drafter Q after token `first` [N] -> (ids [N, K], probs [N, K, V])."""
    ids, probs, prev = [], [], first
    for i in range(K):
        q = Q[prev]
        prev = sample(q, seeds, pos + i, STREAM_DRAFT)
        ids.append(prev)
        probs.append(q)
    return torch.stack(ids, 1), torch.stack(probs, 1)


def spec_step(P, Q, one_hot, first, st, pos, n_drafts):
    """One verification step with target P and drafter Q (one-hot: drafts are Q's argmax, probs None)."""
    K = int(n_drafts.max())
    if one_hot:  # a deterministic drafter
        ids, prev = [], first
        for _ in range(K):
            prev = Q[prev].argmax(-1)
            ids.append(prev)
        ids, q = torch.stack(ids, 1), None
    else:
        ids, q = draft_chain(Q, first, st.seeds, pos, K)
    ids = ids.masked_fill(torch.arange(K, device=DEVICE) >= n_drafts.unsqueeze(1), -1)
    ctx = torch.cat([first.unsqueeze(1), ids.clamp(min=0)], 1)  # [N, K+1] token before each verify row
    return RejectionSampler()(P[ctx].log(), ids, q, st, pos)


DRAFTERS = {  # name: (drafter chain Q, one-hot: drafts are argmax Q and draft_probs is None)
    "good": ("good", False),
    "bad": ("bad", False),
    "one_hot": ("bad", True),
    "one_hot_good": ("target", True),
}


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("params", [SP(temperature=1.0), SP(temperature=0.8, top_k=4, top_p=0.9)], ids=["t1", "topk"])
def test_rejection_sampler_preserves_target_distribution(drafter, params):
    """First emitted token ~ p(. | b) and the first two tokens jointly ~ p(x0 | b) p(x1 | x0)."""
    V, N, K, b = 6, 24_000, 3, 2
    kind, one_hot = DRAFTERS[drafter]
    logits_P = markov(V, 1, 1.5).log()
    st = SamplingTensors.from_params([params] * N, DEVICE, list(range(N)))
    P = process_logits(logits_P, st.temperature[:V], st.top_k[:V], st.top_p[:V])  # processed target
    Q = {"good": 0.8 * P + 0.2 / V, "bad": markov(V, 2, 2.0), "target": P}[kind]
    pos = seeds_of(N) % 50 + 10
    n_drafts = seeds_of(N) % (K + 1)  # 0..K drafts: plain rows, partial and full acceptance
    first = torch.full((N,), b, device=DEVICE)
    out, L = spec_step(logits_P.exp(), Q, one_hot, first, st, pos, n_drafts)
    assert ((L <= n_drafts) & (out.gather(1, L.unsqueeze(1)).squeeze(1) >= 0)).all()
    x0 = out[:, 0]
    # the second token: from this step when a draft was accepted, else from the next step at position + 1
    out2, _ = spec_step(logits_P.exp(), Q, one_hot, x0, st, pos + 1, n_drafts)
    x1 = torch.where(L >= 1, out[:, 1], out2[:, 0])
    assert chi2_pvalue(torch.bincount(x0.cpu(), minlength=V), P[b].cpu() * N) > ALPHA
    joint = (P[b].unsqueeze(1) * P).flatten().cpu() * N
    assert chi2_pvalue(torch.bincount((x0 * V + x1).cpu(), minlength=V * V), joint) > ALPHA
    if drafter == "one_hot_good":  # drafts are the target's mode: some are accepted, some not
        assert 0 < float((L == n_drafts).double().mean()) < 1


# ---------------------------------------------------------------- rejection sampler: greedy and batches


TARGET_ARGMAX = [3, 1, 4, 1, 5]  # K = 4


def greedy_logits(R: int, V: int = 8) -> torch.Tensor:  # [R, K+1, V] with argmax TARGET_ARGMAX per row
    g = torch.Generator().manual_seed(5)
    x = torch.randn(R, len(TARGET_ARGMAX), V, generator=g)
    x[:, torch.arange(5), TARGET_ARGMAX] = 10.0
    return x.to(DEVICE)


GREEDY_CASES = {  # name: (drafts, want num_accepted, want output ids)
    "perfect_match_bonus": ([3, 1, 4, 1], 4, [3, 1, 4, 1, 5]),
    "mismatch_at_0": ([0, 1, 4, 1], 0, [3, -1, -1, -1, -1]),
    "mismatch_at_1": ([3, 0, 4, 1], 1, [3, 1, -1, -1, -1]),
    "mismatch_at_2": ([3, 1, 0, 1], 2, [3, 1, 4, -1, -1]),
    "mismatch_at_3": ([3, 1, 4, 0], 3, [3, 1, 4, 1, -1]),
    "short_draft_all_accepted": ([3, 1, -1, -1], 2, [3, 1, 4, -1, -1]),
    "empty_draft": ([-1, -1, -1, -1], 0, [3, -1, -1, -1, -1]),
}


@pytest.mark.parametrize("case", GREEDY_CASES)
@pytest.mark.parametrize("with_probs", [False, True])
def test_greedy_cases(case, with_probs):
    drafts, want_L, want = GREEDY_CASES[case]
    st = SamplingTensors.from_params([SP()], DEVICE, [0])
    q = torch.full((1, 4, 8), 1 / 8, device=DEVICE) if with_probs else None  # ignored by greedy requests
    out, L = RejectionSampler()(greedy_logits(1), torch.tensor([drafts], device=DEVICE), q, st, seeds_of(1, 9))
    assert L.tolist() == [want_L] and out.tolist() == [want]


def mixed_batch():
    """7 requests: greedy and sampled, 0..4 drafts. -> (params, seeds, logits [7, 5, V], drafts [7, 4], q)"""
    params = mixed_params()
    V = 8
    logits = greedy_logits(len(params), V) * 0.3  # sampled rows still have spread
    cases = list(GREEDY_CASES.values())
    drafts = torch.tensor([c[0] for c in cases], device=DEVICE)
    g = torch.Generator().manual_seed(3)
    q = torch.softmax(torch.randn(len(params), 4, V, generator=g), -1).to(DEVICE)
    return params, [50 + i for i in range(len(params))], logits, drafts, q


@pytest.mark.parametrize("with_probs", [False, True])
def test_mixed_batch_same_seed_same_tokens_in_any_batch(with_probs):
    params, seeds, logits, drafts, q = mixed_batch()
    q = q if with_probs else None
    pos = torch.tensor([4, 8, 15, 16, 23, 42, 7], device=DEVICE)
    st = SamplingTensors.from_params(params, DEVICE, seeds)
    out, L = RejectionSampler()(logits, drafts, q, st, pos)
    cases = list(GREEDY_CASES.values())
    for r in (0, 4):  # greedy rows verify exactly as alone
        assert out[r].tolist() == cases[r][2] and int(L[r]) == cases[r][1]
    for r in range(len(params)):  # alone, with only as many columns as it has drafts
        k = max(int((drafts[r] >= 0).sum()), 0)
        alone = SamplingTensors.from_params([params[r]], DEVICE, [seeds[r]])
        qr = q[r : r + 1, :k] if q is not None else None
        o, l = RejectionSampler()(logits[r : r + 1, : k + 1], drafts[r : r + 1, :k], qr, alone, pos[r : r + 1])
        assert int(l[0]) == int(L[r]) and o[0].tolist() == out[r, : k + 1].tolist()
        assert (out[r, k + 1 :] == -1).all()


def test_zero_draft_rows_match_sample_tokens():
    params, seeds, logits, _, q = mixed_batch()
    st = SamplingTensors.from_params(params, DEVICE, seeds)
    pos = seeds_of(len(params), 30)
    for K in (0, 3):
        none = torch.full((len(params), K), -1, device=DEVICE)
        out, L = RejectionSampler()(logits[:, : K + 1], none, q[:, :K], st, pos)
        assert (L == 0).all()
        assert torch.equal(out[:, 0], sample_tokens(logits[:, 0], st, pos, STREAM_TARGET))


# ---------------------------------------------------------------- no host sync


SYNC_OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "item", "equal", "masked_select", "unique")


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.name())
        return func(*args, **(kwargs or {}))


def syncs(log: OpLog) -> list[str]:
    return [op for op in log.ops if op.split("::")[-1].split(".")[0] in SYNC_OPS]


def test_op_log_sees_syncs():
    x = torch.ones(3, device=DEVICE)
    with OpLog() as log:
        x.sum().item()
        bool(x.any())
        x.tolist()
    assert "aten::_local_scalar_dense" in syncs(log)


def test_no_host_sync():
    params, seeds, logits, drafts, q = mixed_batch()
    st = SamplingTensors.from_params(params, DEVICE, seeds)
    pos = seeds_of(len(params), 3)
    with OpLog() as log:
        process_logits(logits[:, 0], st.temperature, st.top_k, st.top_p)
        sample_tokens(logits[:, 0], st, pos)
        RejectionSampler()(logits, drafts, q, st, pos)
        RejectionSampler()(logits, drafts, None, st, pos)
        greedy = SamplingTensors.from_params([SP()] * len(params), DEVICE, seeds)
        RejectionSampler()(logits, drafts, None, greedy, pos)
    assert len(log.ops) > 50 and syncs(log) == []
