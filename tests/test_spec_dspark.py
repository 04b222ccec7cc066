"""(d) DSpark block attention = a dense masked reference (non-causal), and differs from a causal one;
(e) the Markov head and the confidence head on hand-built weights; the batched block forward."""

import pytest
import torch
from spec_helpers import drafter_tensors, one_thread, random_target, tiny_config, tiny_setup  # noqa: F401

from sparkspec.engine.config import EngineConfig
from sparkspec.engine.llm_engine import LLMEngine
from sparkspec.loading.drafters import dspark_from_tensors
from sparkspec.models.dspark import context_rows
from sparkspec.ops import ops
from sparkspec.ops.indices import dspark_block_indices, dspark_index_width
from sparkspec.sampling_params import SamplingParams
from sparkspec.spec_decode import build_proposer

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def drafter():
    cfg, model, tensors = tiny_setup()
    d = dspark_from_tensors(cfg, tensors).double().eval()
    return cfg, model, d


def dense_block_attention(stage, h, positions, ctx_kv, causal: bool):
    """Reference: every block row attends to all of `ctx_kv` and to block rows (all of them, or j <= i), + sink."""
    a = stage.attn
    q, _ = a.project_q(h, positions)  # [k, heads, D]
    kv = torch.cat([ctx_kv, a.project_kv(h, positions)])  # [C + k, D]
    k, C = h.shape[0], ctx_kv.shape[0]
    mask = torch.ones(k, C + k, dtype=torch.bool)
    if causal:
        mask[:, C:] = torch.ones(k, k, dtype=torch.bool).tril()
    scores = torch.einsum("thd,sd->ths", q, kv) * a.scale
    scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
    sink = a.attn_sink.view(1, -1, 1).expand(k, -1, 1).to(scores.dtype)
    probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return a.project_out(torch.einsum("ths,sd->thd", probs, kv), positions)


@pytest.mark.parametrize("num_ctx", [0, 5, 16, 40])  # window 16
@pytest.mark.parametrize("k", [1, 2, 4])
def test_block_attention_is_non_causal_and_matches_dense_reference(drafter, num_ctx, k):
    cfg, _, d = drafter
    W = cfg.sliding_window
    g = torch.Generator().manual_seed(num_ctx * 10 + k)
    main_x = torch.randn(num_ctx, cfg.hidden_size, generator=g, dtype=torch.float64)
    stage = d.mtp[1]
    with torch.no_grad():
        ctx_kv = d.context_kv(main_x, torch.arange(num_ctx))[1]  # [num_ctx, D]
        h = torch.randn(k, cfg.hidden_size, generator=g, dtype=torch.float64)
        pos = torch.arange(num_ctx, num_ctx + k)
        indices = dspark_block_indices(context_rows(torch.tensor([[0, num_ctx]]), d.window), num_ctx, k)
        assert indices.shape == (k, dspark_index_width(W, k)) == (k, W + k)
        assert int((indices >= 0).sum(1).min()) == min(num_ctx, W) + k  # window + every block row, no overflow
        got = stage.block_attention(h, pos, ctx_kv, indices)
        want = dense_block_attention(stage, h, pos, ctx_kv[-W:] if num_ctx else ctx_kv, causal=False)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        if num_ctx > W:  # rows older than the window are never read
            stale = ctx_kv.clone()
            stale[: num_ctx - W] = 1e3
            torch.testing.assert_close(stage.block_attention(h, pos, stale, indices), got, rtol=0, atol=0)
        if k > 1:
            causal = dense_block_attention(stage, h, pos, ctx_kv[-W:] if num_ctx else ctx_kv, causal=True)
            assert (got[0] - causal[0]).abs().max() > 1e-3  # row 0 sees the later block rows
            # the last row sees the same rows either way
            torch.testing.assert_close(got[-1], causal[-1], rtol=1e-5, atol=1e-6)


def test_batched_blocks_equal_blocks_run_alone(drafter):
    """forward_block over blocks with different context lengths == each block alone (index offsets)."""
    cfg, model, d = drafter
    g = torch.Generator().manual_seed(3)
    sizes, k = [0, 5, 16, 23], 3
    main_x = [torch.randn(n, cfg.hidden_size, generator=g, dtype=torch.float64) for n in sizes]
    ctx = [d.context_kv(x, torch.arange(x.shape[0])) for x in main_x]
    ids = torch.randint(4, cfg.vocab_size, (len(sizes), k), generator=g)
    prev = torch.randint(4, cfg.vocab_size, (len(sizes), k), generator=g)
    starts = torch.tensor(sizes)
    with torch.no_grad():
        ends = torch.tensor(sizes).cumsum(0)
        batched = d.forward_block(model.embed, model.head, ids, starts,
                                  [torch.cat([c[l] for c in ctx]) for l in range(d.num_layers)],
                                  context_rows(torch.stack([ends - torch.tensor(sizes), ends], 1), d.window), prev)
        for b, n in enumerate(sizes):
            alone = d.forward_block(model.embed, model.head, ids[b : b + 1], starts[b : b + 1], ctx[b],
                                    context_rows(torch.tensor([[0, n]]), d.window), prev[b : b + 1])
            for f in ("hidden", "base_logits", "markov_logits", "confidence_logits"):
                torch.testing.assert_close(getattr(batched, f)[b], getattr(alone, f)[0], rtol=1e-4, atol=1e-5)


def test_markov_head_on_hand_built_weights(drafter):
    cfg, _, d = drafter
    a, b, c, r = 10, 20, 30, cfg.dspark_markov_rank
    mh = d.last.markov_head
    saved = mh.markov_w1.weight.clone(), mh.markov_w2.weight.clone()
    try:
        with torch.no_grad():
            mh.markov_w1.weight.zero_()
            mh.markov_w2.weight.zero_()
            mh.markov_w1.weight[a, 0] = 1.0  # e(a) = u0
            mh.markov_w1.weight[b, 1] = 2.0  # e(b) = 2 u1
            mh.markov_w2.weight[b, 0] = 5.0  # bias(a -> b) = 5
            mh.markov_w2.weight[c, 1] = 3.0  # bias(b -> c) = 2 * 3 = 6
            mh.markov_w2.weight[a, 1] = -1.0  # bias(b -> a) = -2
            U = torch.linspace(-1, 1, cfg.vocab_size, dtype=torch.float64).expand(3, -1)
            out = d.markov_logits(U, torch.tensor([a, b, c]))
        want = U.clone()
        want[0, b] += 5
        want[1, c] += 6
        want[1, a] -= 2
        torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-6)
        assert r >= 2
    finally:
        with torch.no_grad():
            mh.markov_w1.weight.copy_(saved[0])
            mh.markov_w2.weight.copy_(saved[1])


def test_confidence_head_on_hand_built_weights(drafter):
    cfg, _, d = drafter
    H, r = cfg.hidden_size, cfg.dspark_markov_rank
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 3, H, generator=g, dtype=torch.float64)
    prev = torch.tensor([[7, 8, 9], [9, 9, 9]])
    w = torch.zeros(1, H + r, dtype=torch.float64)
    w[0, 0], w[0, H + 2] = 0.5, -1.5  # 0.5 * h[0] - 1.5 * markov_w1[prev][2]
    saved = d.last.confidence_head.proj.weight.clone()
    try:
        with torch.no_grad():
            d.last.confidence_head.proj.weight.copy_(w)
            got = d.confidence_logits(hidden, prev)
        e = d.last.markov_head.markov_w1.weight[prev]  # [2, 3, r]
        torch.testing.assert_close(got.double(), 0.5 * hidden[..., 0] - 1.5 * e[..., 2], rtol=1e-5, atol=1e-6)
    finally:
        with torch.no_grad():
            d.last.confidence_head.proj.weight.copy_(saved)


def prefill_and_draft(model, proposer, prompt, params):
    """One engine step over `prompt`: the target samples the pending token and the drafter proposes."""
    eng = LLMEngine(model, None, EngineConfig(spec_budget="fixed", max_num_seqs=2), proposer=proposer)
    seq = eng.add_request(prompt, params)
    eng.step()
    return eng, seq


def test_markov_chain_drives_greedy_drafts_left_to_right():
    """With a zero LM head (U = 0) the pending token is 0 (argmax of equal logits) and the drafts are exactly
    the Markov chain from it: 0 -> 50 -> 60 -> 0 -> 50."""
    cfg = tiny_config()
    model = random_target(cfg, seed=0)
    with torch.no_grad():
        model.head.weight.zero_()
    tensors = drafter_tensors(cfg, 1, "dspark")
    n = cfg.num_dspark_layers - 1
    w1 = torch.zeros_like(tensors[f"mtp.{n}.markov_head.markov_w1.weight"])
    w2 = torch.zeros_like(tensors[f"mtp.{n}.markov_head.markov_w2.weight"])
    chain = {0: 50, 50: 60, 60: 0}
    for i, (src, dst) in enumerate(chain.items()):
        w1[src, i] = 1.0
        w2[dst, i] = 10.0
    tensors[f"mtp.{n}.markov_head.markov_w1.weight"] = w1
    tensors[f"mtp.{n}.markov_head.markov_w2.weight"] = w2
    eng, seq = prefill_and_draft(model, build_proposer("dspark", model, tensors, 4), [5, 6, 7],
                                 SamplingParams(max_tokens=8))
    assert seq.output_ids == [0]
    assert seq.spec.draft_ids == [50, 60, 0, 50]
    assert seq.spec.draft_row == -1 and len(seq.spec.confidences) == 4  # greedy drafts: one-hot, no q row


def test_sampled_drafts_return_the_exact_markov_corrected_q(drafter):
    """q_i = processed(U_i + bias(prev_i)) with prev_0 = anchor, prev_i = d_{i-1}; teacher-forced forward_block
    with those predecessors over the pooled context reproduces the same q (training and inference share one
    path)."""
    cfg, model, _ = drafter
    tensors = tiny_setup()[2]
    proposer = build_proposer("dspark", model, tensors, 4)
    prompt = [9, 8, 7, 6, 5, 4, 33, 21]
    eng, seq = prefill_and_draft(model, proposer, prompt,
                                 SamplingParams(max_tokens=10, temperature=0.9, top_k=50, seed=1))
    probs, tokens = eng.runner.q_store[seq.spec.draft_row], seq.spec.draft_ids
    assert probs.shape == (4, cfg.vocab_size)
    torch.testing.assert_close(probs.sum(-1), torch.ones(4, dtype=probs.dtype))
    assert ((probs > 0).sum(-1) <= 50).all()
    assert all(probs[i, t] > 0 for i, t in enumerate(tokens))
    N, bs = len(prompt), eng.kv_plan.block_size
    rows = torch.tensor([seq.block_ids[p // bs] * bs + p % bs for p in range(N)])  # the pooled context rows
    ctx = [pool[rows] for pool in proposer.pools]
    anchor = seq.output_ids[-1]
    ids = torch.tensor([[anchor] + [cfg.dspark_noise_token_id] * 3])
    prev = torch.tensor([[anchor] + tokens[:3]])
    with torch.no_grad():
        out = proposer.drafter.forward_block(model.embed, model.head, ids, torch.tensor([N]), ctx,
                                             context_rows(torch.tensor([[0, N]]), proposer.window), prev)
    q = ops.process_logits(out.markov_logits[0], torch.full((4,), 0.9), torch.full((4,), 50), torch.ones(4))
    torch.testing.assert_close(probs, q.to(probs.dtype))
    torch.testing.assert_close(torch.tensor(seq.spec.confidences), torch.sigmoid(out.confidence_logits[0]).double(),
                               check_dtype=False)


def test_calibrated_confidence_uses_per_position_temperatures():
    """`sparkspec train calibrate` stores T_k; the drafter then reports sigmoid(z_k / T_k), the last T past the end."""
    cfg, _, tensors = tiny_setup()
    last = f"mtp.{cfg.num_dspark_layers - 1}.confidence_head.temperature"
    raw = dspark_from_tensors(cfg, tensors)
    temps = torch.tensor([0.5, 2.0, 4.0])
    cal = dspark_from_tensors(cfg, {**tensors, last: temps})
    z = torch.tensor([1.2, -0.7])
    for pos, t in [(0, 0.5), (1, 2.0), (2, 4.0), (5, 4.0)]:
        torch.testing.assert_close(cal.confidence(z, pos), torch.sigmoid(z / t))
        torch.testing.assert_close(raw.confidence(z, pos), torch.sigmoid(z))


def test_survival_map_is_loaded_and_replaces_the_temperatures():
    from sparkspec.models.dspark import calibrated_confidences, survival_confidences

    cfg, _, tensors = tiny_setup()
    name = f"mtp.{cfg.num_dspark_layers - 1}.confidence_head"
    table = torch.linspace(0, 1, 11).pow(2).expand(cfg.dspark_block_size, -1).contiguous()
    cal = dspark_from_tensors(cfg, {**tensors, f"{name}.temperature": torch.full((3,), 2.0),
                                              f"{name}.survival_map": table})
    z = torch.randn(4, cfg.dspark_block_size)
    head = cal.last.confidence_head  # what the proposer reads (`DSparkProposer.markov_confidence_weights`)
    got = calibrated_confidences(z, head.temperature, head.survival_map)
    torch.testing.assert_close(got, survival_confidences(z, table))
    survival = got.cumprod(-1)
    assert (survival[:, 1:] <= survival[:, :-1] + 1e-6).all()
    with pytest.raises(ValueError, match="survival_map"):
        dspark_from_tensors(cfg, {**tensors, f"{name}.survival_map": torch.ones(5)})
