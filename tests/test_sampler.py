"""Counter RNG, batched sampling and batched rejection sampling (Leviathan et al., arXiv 2211.17192).

Statistical tests use fixed seeds, so they are deterministic; each checks a p-value against 1e-3.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
from helpers import chi2_pvalue, sample_tokens, sampling_tensors
from torch.utils._python_dispatch import TorchDispatchMode

from sparkspec.ops.rng import philox, to_unit, uniform, uniform_at
from sparkspec.ops.sampling import STREAM_DRAFT, STREAM_TARGET, SamplingTensors, process_logits, sample
from sparkspec.sampling_params import SamplingParams as SP
from sparkspec.spec_decode.rejection import RejectionSampler

DEVICE = torch.device(os.environ.get("SPARKSPEC_TEST_DEVICE", "cpu"))
ALPHA = 1e-3




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
    st = sampling_tensors([SP(), SP()], DEVICE, [1, 2])
    assert sample_tokens(logits, st, seeds_of(2)).tolist() == [1, 0]


def test_sample_tokens_same_seed_same_tokens_in_any_batch():
    params, V, steps = mixed_params(), 16, 6
    seeds = [1000 + i for i in range(len(params))]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(steps, len(params), V, generator=g).to(DEVICE) * 2
    pos = torch.tensor([5, 17, 3, 40, 9, 2, 33], device=DEVICE)
    st = sampling_tensors(params, DEVICE, seeds)
    perm = torch.tensor([3, 6, 0, 5, 1, 4, 2], device=DEVICE)
    st_perm = sampling_tensors([params[i] for i in perm.tolist()], DEVICE, [seeds[i] for i in perm.tolist()])
    for s in range(steps):
        batch = sample_tokens(logits[s], st, pos + s)
        assert torch.equal(sample_tokens(logits[s, perm], st_perm, pos[perm] + s), batch[perm])
        for r in range(len(params)):
            alone = sampling_tensors([params[r]], DEVICE, [seeds[r]])
            assert torch.equal(sample_tokens(logits[s, r : r + 1], alone, pos[r : r + 1] + s), batch[r : r + 1])


def test_sampling_tensors_seeds_and_helpers():
    st = sampling_tensors([SP(seed=7), SP(temperature=1.0), SP(seed=2**64 - 1)], DEVICE, [1, 2, 3])
    assert st.seeds.tolist() == [7, 2, -1] and not st.all_greedy and not st.any_top_k
    assert st.repeat_interleave(2).seeds.tolist() == [7, 7, 2, 2, -1, -1]
    assert st.index_select(torch.tensor([2, 0], device=DEVICE)).seeds.tolist() == [-1, 7]
    with pytest.raises(ValueError, match="seed"):
        sampling_tensors([SP()], DEVICE)


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
    """One verification step with target P and drafter Q (one-hot: drafts are Q's argmax, probs None; a Q with
    NaN rows: drafts as the device drafters make them, `sample_draft` of the logits log Q)."""
    K = int(n_drafts.max())
    if Q.isnan().any():
        from sparkspec.ops.sampling import sample_draft

        ids, probs, prev = [], [], first
        for i in range(K):
            prev, q = sample_draft(Q[prev].log(), st, pos + i, STREAM_DRAFT)
            ids.append(prev)
            probs.append(q)
        ids, q = torch.stack(ids, 1), torch.stack(probs, 1)
    elif one_hot:  # a deterministic drafter
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
    "broken": ("broken", False),  # NaN after tokens 0 and 3: those drafts become one-hot fallbacks
}


@pytest.mark.parametrize("drafter", DRAFTERS)
@pytest.mark.parametrize("params", [SP(temperature=1.0), SP(temperature=0.8, top_k=4, top_p=0.9)], ids=["t1", "topk"])
def test_rejection_sampler_preserves_target_distribution(drafter, params):
    """First emitted token ~ p(. | b) and the first two tokens jointly ~ p(x0 | b) p(x1 | x0)."""
    V, N, K, b = 6, 24_000, 3, 2
    kind, one_hot = DRAFTERS[drafter]
    logits_P = markov(V, 1, 1.5).log()
    st = sampling_tensors([params] * N, DEVICE, list(range(N)))
    P = process_logits(logits_P, st.temperature[:V], st.top_k[:V], st.top_p[:V])  # processed target
    Q = {"good": 0.8 * P + 0.2 / V, "bad": markov(V, 2, 2.0), "target": P,
         "broken": markov(V, 2, 2.0).index_fill(0, torch.tensor([0, 3], device=DEVICE), float("nan"))}[kind]
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
    st = sampling_tensors([SP()], DEVICE, [0])
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
    st = sampling_tensors(params, DEVICE, seeds)
    out, L = RejectionSampler()(logits, drafts, q, st, pos)
    cases = list(GREEDY_CASES.values())
    for r in (0, 4):  # greedy rows verify exactly as alone
        assert out[r].tolist() == cases[r][2] and int(L[r]) == cases[r][1]
    for r in range(len(params)):  # alone, with only as many columns as it has drafts
        k = max(int((drafts[r] >= 0).sum()), 0)
        alone = sampling_tensors([params[r]], DEVICE, [seeds[r]])
        qr = q[r : r + 1, :k] if q is not None else None
        o, l = RejectionSampler()(logits[r : r + 1, : k + 1], drafts[r : r + 1, :k], qr, alone, pos[r : r + 1])
        assert int(l[0]) == int(L[r]) and o[0].tolist() == out[r, : k + 1].tolist()
        assert (out[r, k + 1 :] == -1).all()


def test_zero_draft_rows_match_sample_tokens():
    params, seeds, logits, _, q = mixed_batch()
    st = sampling_tensors(params, DEVICE, seeds)
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
    st = sampling_tensors(params, DEVICE, seeds)
    pos = seeds_of(len(params), 3)
    with OpLog() as log:
        process_logits(logits[:, 0], st.temperature, st.top_k, st.top_p)
        sample_tokens(logits[:, 0], st, pos)
        RejectionSampler()(logits, drafts, q, st, pos)
        RejectionSampler()(logits, drafts, None, st, pos)
        greedy = sampling_tensors([SP()] * len(params), DEVICE, seeds)
        RejectionSampler()(logits, drafts, None, greedy, pos)
    assert len(log.ops) > 50 and syncs(log) == []


# ---------------------------------------------------------------- tiny temperatures and rows that are not finite

TINY_TEMPERATURES = [1e-45, 1e-40, 1e-38, 1e-30, 1e-6]  # fp32: denormal, denormal, normal, normal, normal
EDGE_FILTERS = [dict(), dict(top_k=1), dict(top_k=-1), dict(top_k=2**63 - 1), dict(top_p=5e-324), dict(top_p=1e-300),
                dict(top_p=1.0, top_k=7), dict(top_p=0.5, top_k=2)]


def test_tiny_temperatures_are_greedy_on_host_and_device():
    from sparkspec.sampling_params import MIN_TEMPERATURE

    assert MIN_TEMPERATURE == 1e-5 and not SP(temperature=MIN_TEMPERATURE).greedy
    params = [SP(temperature=t, **f) for t in TINY_TEMPERATURES for f in EDGE_FILTERS]
    assert all(p.greedy and p.device_temperature == 0.0 for p in params)
    st = sampling_tensors(params, DEVICE, list(range(len(params))))
    assert st.all_greedy and not st.any_top_k and not st.any_top_p and (st.temperature == 0).all()
    # a direct caller handing the raw temperatures to the device gets greedy rows too
    V = 32
    logits = torch.randn(len(params), V, generator=torch.Generator().manual_seed(4)).to(DEVICE) * 30
    raw = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=DEVICE)
    assert (raw > 0).all()  # none of them rounds to fp32 zero: the denormals are what used to overflow
    top_k = torch.tensor([p.top_k for p in params], device=DEVICE)
    top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=DEVICE)
    probs = process_logits(logits, raw, top_k, top_p)
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), V).float())
    direct = SamplingTensors(raw, top_k, top_p, st.seeds, False, True, True)
    assert torch.equal(sample_tokens(logits, direct, seeds_of(len(params))), logits.argmax(-1))


def test_tiny_temperatures_verify_like_greedy():
    """Tiny-T rows among sampled rows, through the sampled path of the rejection sampler: greedy verification."""
    drafts, want_L, want = GREEDY_CASES["mismatch_at_2"]
    params = [SP(temperature=1.0)] + [SP(temperature=t, **f) for t in TINY_TEMPERATURES for f in EDGE_FILTERS[:3]]
    R = len(params)
    st = sampling_tensors(params, DEVICE, list(range(R)))
    assert not st.all_greedy
    q = torch.full((R, 4, 8), 1 / 8, device=DEVICE)
    out, L, ok = RejectionSampler().verify(greedy_logits(R), torch.tensor([drafts] * R, device=DEVICE), q, st,
                                           seeds_of(R, 9))
    assert ok.all() and L[1:].tolist() == [want_L] * (R - 1) and out[1:].tolist() == [want] * (R - 1)


def test_filters_at_their_edges_give_the_argmax():
    """top_k = 1, and top_p below any probability, keep only the most likely token at any temperature."""
    V = 32
    logits = torch.randn(6, V, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    for f in (dict(top_k=1), dict(top_p=5e-324), dict(top_p=1e-300), dict(top_p=1e-30, top_k=3)):
        params = [SP(temperature=t, **f) for t in (1e-5, 0.5, 1.0, 2.0, 1.0, 1.0)]
        st = sampling_tensors(params, DEVICE, list(range(6)))
        assert torch.equal(sample_tokens(logits, st, seeds_of(6, 3)), logits.argmax(-1)), f


def bad_rows(V: int = 8) -> tuple[torch.Tensor, list[bool]]:
    """[6, V] logits: fine, NaN, +inf, all -inf, -inf but one finite, finite but 3e38 (overflows / T at T = 0.5)
    -> (logits, whether each row is finite at temperature 0.5)."""
    x = torch.randn(6, V, generator=torch.Generator().manual_seed(2))
    x[1, 3] = float("nan")
    x[2, 5] = float("inf")
    x[3] = float("-inf")
    x[4] = float("-inf")
    x[4, 6] = 1.0
    x[5, 2] = 3e38
    return x.to(DEVICE), [True, False, False, False, True, False]


def test_is_finite_dist_names_every_kind_of_broken_row():
    from sparkspec.ops.sampling import is_finite_dist, probs_for

    x, want = bad_rows()
    st = sampling_tensors([SP(temperature=0.5)] * 6, DEVICE, list(range(6)))
    assert is_finite_dist(x, probs_for(x, st)).tolist() == want
    assert is_finite_dist(x).tolist() == [True, False, False, False, True, True]  # greedy: 3e38 is a fine argmax


def test_inverse_cdf_stays_in_range_on_broken_rows():
    from sparkspec.ops.sampling import inverse_cdf

    V = 8
    probs = torch.stack([torch.zeros(V), torch.full((V,), float("nan")), torch.full((V,), float("inf")),
                         torch.softmax(torch.randn(V), 0)]).to(DEVICE)
    for u in (1e-12, 0.5, 1 - 1e-12):
        ids = inverse_cdf(probs, torch.full((4,), u, dtype=torch.float64, device=DEVICE))
        assert ((ids >= 0) & (ids < V)).all()


@pytest.mark.parametrize("greedy", [False, True])
@pytest.mark.parametrize("with_probs", [False, True])
def test_rows_that_are_not_finite_are_flagged_alone(greedy, with_probs):
    """Bad rows (column L of a request) are flagged, every id is in range, and the good rows are what they are
    in a batch without the bad ones."""
    V, K = 8, 4
    x, finite = bad_rows(V)
    R = 6
    T = 0.0 if greedy else 0.5
    st = sampling_tensors([SP(temperature=T)] * R, DEVICE, [7 * r for r in range(R)])
    logits = greedy_logits(R, V) * 0.3
    logits[:, 0] = x  # column 0: the pending token's row; drafts cannot get past a bad one
    drafts = torch.tensor([[3, 1, 4, 1]] * R, device=DEVICE)
    q = torch.softmax(torch.randn(R, K, V, generator=torch.Generator().manual_seed(1)), -1).to(DEVICE) \
        if with_probs else None
    pos = seeds_of(R, 11)
    out, L, ok = RejectionSampler().verify(logits, drafts, q, st, pos)
    want = [True, False, False, False, True, True] if greedy else finite
    assert ok.tolist() == want
    assert ((out >= -1) & (out < V)).all()
    assert all(int(L[r]) == 0 for r in range(R) if not want[r])  # never accepted past a broken row
    good = [r for r in range(R) if want[r]]
    alone = sampling_tensors([SP(temperature=T)] * len(good), DEVICE, [7 * r for r in good])
    o, l, k = RejectionSampler().verify(logits[good], drafts[good], None if q is None else q[good], alone, pos[good])
    assert k.all() and torch.equal(o, out[good]) and torch.equal(l, L[good])


def test_a_broken_row_past_the_rejection_is_never_looked_at():
    """A NaN at a row after the first rejected draft does not fail the request (plain decoding never sees it);
    a NaN at the row that emits does."""
    st = sampling_tensors([SP()] * 2, DEVICE, [0, 1])
    logits = greedy_logits(2)
    logits[:, 3] = float("nan")
    drafts = torch.tensor([[3, 0, 4, 1], [3, 1, 4, 1]], device=DEVICE)  # request 0 rejects at column 1
    out, L, ok = RejectionSampler().verify(logits, drafts, None, st, seeds_of(2))
    assert L.tolist() == [1, 3] and ok.tolist() == [True, False]
    assert out[0].tolist() == [3, 1, -1, -1, -1]
    assert out[1, :3].tolist() == [3, 1, 4] and 0 <= int(out[1, 3]) < 8 and int(out[1, 4]) == -1


def test_sample_draft_replaces_broken_rows_by_a_one_hot_draft():
    from sparkspec.ops.sampling import probs_for, sample_draft

    V = 8
    x, finite = bad_rows(V)
    st = sampling_tensors([SP(temperature=0.5, seed=3)] * 6, DEVICE)
    offsets = seeds_of(6, 20)
    ids, q = sample_draft(x, st, offsets, STREAM_DRAFT)
    assert ((ids >= 0) & (ids < V)).all() and torch.isfinite(q).all()
    assert torch.allclose(q.sum(-1), torch.ones(6, device=DEVICE))
    for r in range(6):
        if finite[r]:  # untouched: the draw and q of the row's own distribution
            assert int(ids[r]) == int(sample(probs_for(x, st), st.seeds, offsets, STREAM_DRAFT)[r])
            assert torch.equal(q[r], probs_for(x, st)[r])
        else:  # deterministic: the argmax of the row's non-NaN logits, with q one-hot on it
            assert int(ids[r]) == int(x[r].nan_to_num(float("-inf")).argmax()) and float(q[r, ids[r]]) == 1.0


def test_finiteness_checks_add_no_host_sync():
    from sparkspec.ops.sampling import sample_draft

    params, seeds, logits, drafts, q = mixed_batch()
    st = sampling_tensors(params, DEVICE, seeds)
    pos = seeds_of(len(params), 3)
    logits[2, 1] = float("nan")
    with OpLog() as log:
        RejectionSampler().verify(logits, drafts, q, st, pos)
        sample_draft(logits[:, 0], st, pos, STREAM_DRAFT)
    assert len(log.ops) > 50 and syncs(log) == []


def test_indexed_draft_probs_equal_the_dense_q():
    """The sampler reading q rows in place (`IndexedDraftProbs`: the drafter's q store by row, one-hot where the
    row is -1) gives exactly the tokens of the dense [R, K, V] q it replaces, for accepted, rejected, bonus and
    greedy rows, with and without padded drafts."""
    from sparkspec.spec_decode.rejection import IndexedDraftProbs, RejectionSampler

    params = mixed_params()
    R, K, V, N = len(params), 3, 12, 9
    g = torch.Generator().manual_seed(3)
    store = torch.softmax(torch.randn(N, K + 1, V, generator=g) * 2, -1).to(DEVICE)  # k = K + 1 >= K
    rows = torch.tensor([4, -1, 0, 8, -1, 2, 5], device=DEVICE)
    sampler, st = RejectionSampler(), sampling_tensors(params, DEVICE, [50 + i for i in range(R)])
    for trial in range(20):
        logits = (torch.randn(R, K + 1, V, generator=g) * 2).to(DEVICE)
        d = torch.randint(0, V, (R, K), generator=g).to(DEVICE)
        # a third of the drafts copy the target's argmax so that some are accepted; padding on two rows
        d = torch.where(torch.rand(R, K, generator=g).to(DEVICE) < 0.4, logits[:, :K].argmax(-1), d)
        d[1, 2:] = -1
        d[3, 1:] = -1 if trial % 2 else d[3, 1:]
        one_hot = torch.zeros(R, K, V, device=DEVICE).scatter_(2, d.clamp(min=0).unsqueeze(2), 1.0)
        dense = torch.where((rows >= 0).view(R, 1, 1), store[rows.clamp(min=0), :K], one_hot)
        pos = torch.arange(R, device=DEVICE) * 7 + trial
        want = sampler.verify(logits, d, dense, st, pos)
        got = sampler.verify(logits, d, IndexedDraftProbs(store, rows), st, pos)
        for a, b in zip(want, got):
            assert torch.equal(a, b), trial
