"""Every native op against an independent naive per-token / per-row loop written here, plus the attention
kinds and the compressor as they are used by an attention layer.

Legend: T tokens, n hc streams, H hidden, h heads, D latent width, E experts, A active experts, V vocabulary.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import DEVICE, make_model, random_ids, tiny_config

from sparkspec.models.cache import KVCache
from sparkspec.models.forward_batch import build_batch, forward_sequences
from sparkspec.ops import native_ops as ops
from sparkspec.ops.moe import swiglu


def rand(*shape, seed=0, std=1.0):
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * std).to(DEVICE)


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a, b, atol=tol, rtol=tol)


# ---------------------------------------------------------------- mHC


def _sinkhorn(c, n, eps, iters):
    """In place on an n x n list of lists: normalise columns, then (rows, columns) iters - 1 more times."""
    passes = ["cols"] + ["rows", "cols"] * (iters - 1)
    for kind in passes:
        if kind == "rows":
            for i in range(n):
                s = sum(c[i]) + eps
                c[i] = [v / s for v in c[i]]
        else:
            for j in range(n):
                s = sum(c[i][j] for i in range(n)) + eps
                for i in range(n):
                    c[i][j] /= s


def naive_mhc_pre(x, fn, scale, base, rms_eps, hc_eps, iters):
    T, n, _ = x.shape
    inputs, posts, combs = [], [], []
    for t in range(T):
        flat = x[t].reshape(-1).double()
        r = flat / math.sqrt(float((flat * flat).mean()) + rms_eps)
        mix = fn.double() @ r
        pre = [1 / (1 + math.exp(-(float(mix[i]) * float(scale[0]) + float(base[i])))) + hc_eps for i in range(n)]
        post = [2 / (1 + math.exp(-(float(mix[n + i]) * float(scale[1]) + float(base[n + i])))) for i in range(n)]
        c = [[float(mix[2 * n + i * n + j]) * float(scale[2]) + float(base[2 * n + i * n + j]) for j in range(n)]
             for i in range(n)]
        for i in range(n):  # softmax over each row, then + eps
            m = max(c[i])
            e = [math.exp(v - m) for v in c[i]]
            c[i] = [v / sum(e) + hc_eps for v in e]

        _sinkhorn(c, n, hc_eps, iters)
        inputs.append(sum(pre[i] * x[t, i].double() for i in range(n)))
        posts.append(post)
        combs.append(c)
    f = {"dtype": torch.float32, "device": x.device}
    return torch.stack(inputs).float(), torch.tensor(posts, **f), torch.tensor(combs, **f)


def test_mhc_pre_matches_naive_and_is_doubly_stochastic():
    T, n, H = 5, 3, 8
    M = (2 + n) * n
    x, fn, base = rand(T, n, H, seed=1), rand(M, n * H, seed=2, std=0.3), rand(M, seed=3, std=0.5)
    scale = torch.tensor([0.7, 1.3, 2.0], device=DEVICE)
    got = ops.mhc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
    want = naive_mhc_pre(x, fn, scale, base, 1e-6, 1e-6, 20)
    for g, w in zip(got, want):
        close(g, w)
    comb = got[2]
    close(comb.sum(dim=-2), torch.ones(T, n, device=DEVICE), tol=1e-4)  # columns: exact after the last pass
    close(comb.sum(dim=-1), torch.ones(T, n, device=DEVICE), tol=1e-2)  # rows: near-converged after 20 passes
    assert bool((comb > 0).all())


def test_mhc_post_matches_naive():
    T, n, H = 4, 3, 6
    y, x, post, comb = rand(T, H, seed=1), rand(T, n, H, seed=2), rand(T, n, seed=3), rand(T, n, n, seed=4)
    want = torch.zeros(T, n, H, device=DEVICE)
    for t in range(T):
        for j in range(n):
            want[t, j] = post[t, j] * y[t] + sum(comb[t, i, j] * x[t, i] for i in range(n))
    close(ops.mhc_post(y, x, post, comb), want)


def test_hc_head_matches_naive():
    T, n, H = 4, 3, 6
    x, fn, base, scale = rand(T, n, H, seed=1), rand(n, n * H, seed=2), rand(n, seed=3), torch.tensor([0.8])
    want = torch.zeros(T, H, device=DEVICE)
    for t in range(T):
        flat = x[t].reshape(-1)
        r = flat / torch.sqrt((flat * flat).mean() + 1e-6)
        for i in range(n):
            w = 1 / (1 + math.exp(-(float(fn[i] @ r) * 0.8 + float(base[i])))) + 1e-6
            want[t] += w * x[t, i]
    close(ops.hc_head(x, fn, scale.to(DEVICE), base, 1e-6, 1e-6), want)


# ---------------------------------------------------------------- attention


def naive_attention(q, kv, indices, sink, scale):
    T, h, D = q.shape
    out = torch.zeros(T, h, D, device=q.device)
    for t in range(T):
        rows = [int(i) for i in indices[t] if i >= 0]
        for head in range(h):
            logits = [float(q[t, head] @ kv[r]) * scale for r in rows] + [float(sink[head])]
            m = max(logits)
            e = [math.exp(v - m) for v in logits]
            for w, r in zip(e[:-1], rows):
                out[t, head] += w / sum(e) * kv[r]
    return out


def test_sparse_attention_with_sink_matches_naive():
    T, h, D, S = 6, 3, 8, 10
    q, kv, sink = rand(T, h, D, seed=1), rand(S, D, seed=2), rand(h, seed=3)
    indices = torch.tensor([[0, 1, 2, -1], [3, -1, -1, -1], [-1, -1, -1, -1],  # a row of padding only: all sink
                            [9, 8, 7, 6], [5, 5, 2, -1], [4, -1, 0, 1]], device=DEVICE)
    got = ops.sparse_attention(q, kv, indices, sink, D ** -0.5)
    close(got, naive_attention(q, kv, indices, sink, D ** -0.5))
    assert float(got[2].abs().max()) == 0.0


def test_sink_takes_probability_mass():
    q, kv = torch.zeros(1, 1, 4, device=DEVICE), torch.ones(2, 4, device=DEVICE)
    idx = torch.tensor([[0, 1]], device=DEVICE)
    for sink, mass in [(-1e9, 1.0), (math.log(2.0), 0.5)]:  # two keys with logit 0 vs a sink of weight 2
        out = ops.sparse_attention(q, kv, idx, torch.tensor([sink], device=DEVICE), 1.0)
        close(out, torch.full_like(out, mass))


# ---------------------------------------------------------------- compressor and indexer


def test_compress_pool_matches_naive():
    N, R, d = 3, 5, 4
    kv, score = rand(N, R, d, seed=1), rand(N, R, d, seed=2)
    score[0, :2] = float("-inf")  # rows that do not exist (entry 0's missing previous block)
    want = torch.zeros(N, d, device=DEVICE)
    for i in range(N):
        for f in range(d):
            rows = [r for r in range(R) if math.isfinite(float(score[i, r, f]))]
            e = [math.exp(float(score[i, r, f])) for r in rows]
            want[i, f] = sum(w / sum(e) * kv[i, r, f] for w, r in zip(e, rows))
    close(ops.compress_pool(kv, score), want)


def naive_topk(q, w, keys, num_visible, topk, scale):
    out = []
    for t in range(q.shape[0]):
        scored = []
        for j in range(int(num_visible[t])):
            s = sum(float(w[t, hh]) * max(float(q[t, hh] @ keys[j]), 0.0) for hh in range(q.shape[1])) * scale
            scored.append((-s, j))  # highest score first, ties to the lower id
        ids = [j for _, j in sorted(scored)[:topk]]
        out.append(ids + [-1] * (topk - len(ids)))
    return torch.tensor(out, device=q.device)


def test_indexer_topk_matches_naive_with_visibility():
    T, ih, idd, C, k = 7, 4, 8, 9, 3
    q, w, keys = rand(T, ih, idd, seed=1), rand(T, ih, seed=2), rand(C, idd, seed=3)
    num_visible = torch.tensor([0, 1, 2, 3, 5, 9, 9], device=DEVICE)  # fewer visible than topk -> -1 padding
    got = ops.indexer_topk(q, w, keys.unsqueeze(0), torch.zeros(T, dtype=torch.long, device=DEVICE), num_visible, k,
                           idd ** -0.5)
    assert got.tolist() == naive_topk(q, w, keys, num_visible, k, idd ** -0.5).tolist()
    assert got[0].tolist() == [-1, -1, -1] and sorted(got[2].tolist()) == [-1, 0, 1]
    for t in range(T):
        assert all(j < int(num_visible[t]) for j in got[t].tolist() if j >= 0)


def test_indexer_topk_ties_go_to_the_lower_id():
    q, w = torch.ones(2, 2, 4, device=DEVICE), torch.ones(2, 2, device=DEVICE)
    keys = -torch.ones(6, 4, device=DEVICE)  # ReLU(q·k) = 0 for every entry: all scores tie at 0
    got = ops.indexer_topk(q, w, keys.unsqueeze(0), torch.zeros(2, dtype=torch.long, device=DEVICE),
                           torch.tensor([6, 4], device=DEVICE), 3, 1.0)
    assert got.tolist() == [[0, 1, 2], [0, 1, 2]]


# ---------------------------------------------------------------- MoE


def naive_route(logits, bias, hash_ids, top_k, norm, factor):
    T, E = logits.shape
    weights, ids = [], []
    for t in range(T):
        score = [math.sqrt(math.log1p(math.exp(float(v)))) for v in logits[t]]
        if hash_ids is not None:
            chosen = [int(e) for e in hash_ids[t]]
        else:
            sel = [score[e] + (float(bias[e]) if bias is not None else 0.0) for e in range(E)]
            chosen = sorted(range(E), key=lambda e: -sel[e])[:top_k]
        w = [score[e] for e in chosen]
        if norm:
            w = [v / sum(w) for v in w]
        weights.append([v * factor for v in w])
        ids.append(chosen)
    return weights, ids


def _as_dict(weights, ids):
    return [dict(zip(map(int, i), map(float, w))) for w, i in zip(weights, ids)]


@pytest.mark.parametrize("norm", [True, False])
def test_moe_route_bias_selects_but_does_not_weight(norm):
    T, E, A = 6, 8, 2
    logits, bias = rand(T, E, seed=1), rand(E, seed=2)
    w, ids = ops.moe_route(logits, bias, None, A, "sqrtsoftplus", norm, 1.5)
    ww, wi = naive_route(logits, bias, None, A, norm, 1.5)
    got, want = _as_dict(w, ids), _as_dict(ww, wi)
    assert [set(g) for g in got] == [set(x) for x in want]
    for g, x in zip(got, want):
        for e in x:
            assert g[e] == pytest.approx(x[e], rel=1e-5)


def test_moe_route_bias_changes_selection_only():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]], device=DEVICE)
    bias = torch.tensor([0.0, 0.0, 5.0, 5.0], device=DEVICE)
    w, ids = ops.moe_route(logits, bias, None, 2, "sqrtsoftplus", True, 2.0)
    order = ids[0].argsort()
    assert ids[0][order].tolist() == [2, 3]  # the bias moved the choice to experts 2 and 3 ...
    s = torch.sqrt(torch.nn.functional.softplus(logits[0, 2:]))  # ... but weights come from the unbiased scores
    close(w[0][order], s / s.sum() * 2.0)


def test_moe_route_hash_ids_are_used():
    logits = rand(3, 4, seed=1)
    hash_ids = torch.tensor([[3, 0], [1, 2], [2, 3]], device=DEVICE)
    w, ids = ops.moe_route(logits, None, hash_ids, 2, "sqrtsoftplus", True, 1.5)
    assert ids.tolist() == hash_ids.tolist()
    ww, _ = naive_route(logits, None, hash_ids, 2, True, 1.5)
    close(w, torch.tensor(ww, device=DEVICE))


def test_swiglu_clamps_gate_above_and_up_both_sides():
    gate = torch.tensor([20.0, -20.0, 3.0, 20.0], device=DEVICE)
    up = torch.tensor([-30.0, 5.0, 30.0, 4.0], device=DEVICE)
    def silu(v):
        return v / (1 + math.exp(-v))

    want = torch.tensor([silu(10) * -10, silu(-20) * 5, silu(3) * 10, silu(10) * 4], device=DEVICE)
    close(swiglu(gate, up, 10.0), want)


# ---------------------------------------------------------------- sampling


def _probs(logits, temperature=1.0, top_k=0, top_p=1.0):
    B = logits.shape[0]
    return ops.process_logits(logits, torch.full((B,), temperature, device=DEVICE),
                              torch.full((B,), top_k, device=DEVICE), torch.full((B,), top_p, device=DEVICE))


def naive_probs(row, temperature, top_k, top_p):
    V = len(row)
    if temperature == 0:
        best = max(range(V), key=lambda i: row[i])
        return [1.0 if i == best else 0.0 for i in range(V)]
    x = [v / temperature for v in row]
    order = sorted(range(V), key=lambda i: -x[i])
    keep = set(order[:top_k] if top_k > 0 else order)
    m = max(x)
    p = [math.exp(x[i] - m) if i in keep else 0.0 for i in range(V)]
    p = [v / sum(p) for v in p]
    if top_p < 1:
        kept, mass = set(), 0.0
        for i in sorted(range(V), key=lambda i: -p[i]):
            if mass >= top_p:  # the smallest prefix whose mass reaches top_p
                break
            kept.add(i)
            mass += p[i]
        p = [p[i] if i in kept else 0.0 for i in range(V)]
        p = [v / sum(p) for v in p]
    return p


@pytest.mark.parametrize(("temperature", "top_k", "top_p"), [
    (1.0, 0, 1.0), (0.7, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.6), (1.3, 7, 0.8), (0.0, 0, 1.0), (0.0, 3, 0.5),
])
def test_process_logits_matches_naive(temperature, top_k, top_p):
    logits = rand(4, 16, seed=7, std=2.0)
    got = _probs(logits, temperature, top_k, top_p)
    want = torch.tensor([naive_probs(r.tolist(), temperature, top_k, top_p) for r in logits], device=DEVICE)
    close(got, want)
    close(got.sum(-1), torch.ones(4, device=DEVICE))


def test_top_k_and_top_p_masks():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, 0.0]], device=DEVICE)
    assert (_probs(logits, top_k=2)[0] > 0).tolist() == [True, True, False, False, False]
    p = torch.softmax(logits[0], -1)
    cut = float(p[0] + p[1])  # top_p equal to the mass of the first two keeps exactly two
    assert (_probs(logits, top_p=cut - 1e-4)[0] > 0).tolist() == [True, True, False, False, False]
    assert (_probs(logits, top_p=1e-6)[0] > 0).tolist() == [True, False, False, False, False]


def test_greedy_rows_are_one_hot_beside_sampled_rows():
    logits = rand(2, 10, seed=3)
    probs = ops.process_logits(logits, torch.tensor([0.0, 1.0], device=DEVICE),
                               torch.zeros(2, dtype=torch.long, device=DEVICE), torch.ones(2, device=DEVICE))
    assert probs[0].tolist() == torch.nn.functional.one_hot(logits[0].argmax(), 10).float().tolist()
    close(probs[1], torch.softmax(logits[1], -1))


# ---------------------------------------------------------------- attention kinds inside a layer


def naive_compressed_entries(comp, x, ratio, rotary):
    """Entry j pools positions [j·r, (j+1)·r) per feature (softmax over gate + ape); at ratio 4 it also pools the
    previous block through the first half of the features (overlap). Then norm and RoPE at position j·r."""
    d = comp.head_dim
    kv = x @ comp.wkv.weight.t()  # [T, c·d]
    score = x @ comp.wgate.weight.t()
    score = score + comp.ape[torch.arange(x.shape[0], device=x.device) % ratio]
    entries = []
    for j in range(x.shape[0] // ratio):
        pooled = torch.zeros(d, device=x.device)
        for f in range(d):
            rows = [(p, f + (d if comp.overlap else 0)) for p in range(j * ratio, (j + 1) * ratio)]
            if comp.overlap and j > 0:
                rows += [(p, f) for p in range((j - 1) * ratio, j * ratio)]
            s = torch.stack([score[p, c] for p, c in rows])
            v = torch.stack([kv[p, c] for p, c in rows])
            pooled[f] = (torch.softmax(s, 0) * v).sum()
        entries.append(pooled)
    if not entries:
        return torch.zeros(0, d, device=x.device)
    e = comp.norm(torch.stack(entries))
    return rotary.apply(e, torch.arange(len(entries), device=x.device) * ratio)


def naive_layer_attention(attn, x):
    """Dense per-token reference of one attention layer: sliding window (incl. the current token) plus, by kind,
    nothing / every visible compressed entry (HCA) / the indexer's top-k visible entries (CSA); sink; scale."""
    T = x.shape[0]
    pos = torch.arange(T, device=x.device)
    q, qr = attn.project_q(x, pos)
    kv = attn.project_kv(x, pos)
    r = attn.ratio
    comp = naive_compressed_entries(attn.compressor, x, r, attn.rotary) if r > 1 else None
    if attn.indexer is not None:
        ix = attn.indexer
        keys = naive_compressed_entries(ix.compressor, x, r, attn.rotary)
        iq = attn.rotary.apply(ix.wq_b(qr).view(T, ix.n_heads, ix.head_dim), pos)
        iw = ix.weights_proj(x) * ix.n_heads ** -0.5
        chosen = naive_topk(iq, iw, keys, (pos + 1) // r, ix.topk, ix.head_dim ** -0.5)
    out = torch.zeros_like(q)
    for t in range(T):
        rows = [kv[p] for p in range(max(0, t - attn.window + 1), t + 1)]
        if r > 1:
            visible = range((t + 1) // r) if attn.indexer is None else [int(j) for j in chosen[t] if j >= 0]
            rows += [comp[j] for j in visible]
        pool = torch.stack(rows)
        idx = torch.arange(len(rows), device=x.device).unsqueeze(0)
        out[t] = naive_attention(q[t:t + 1], pool, idx, attn.attn_sink, attn.scale)[0]
    return attn.project_out(out, pos)


@pytest.mark.parametrize("layer_id", [0, 1, 2], ids=["sliding", "csa", "hca"])
def test_attention_kind_matches_dense_reference(layer_id):
    model = make_model(seed=1)
    attn = model.layers[layer_id].attn
    x = rand(37, model.cfg.hidden_size, seed=layer_id)  # > window, several blocks of ratio 4 and 8
    with torch.no_grad():
        cache, tables = KVCache.for_lengths(model, [37])
        got = attn(x, build_batch(cache, [0] * 37, tables, [0], [37], None, model.compress_ratios))
        want = naive_layer_attention(attn, x)
    close(got, want, tol=1e-4)


@pytest.mark.parametrize("layer_id", [1, 2], ids=["csa-ratio4-overlap", "hca-ratio8"])
@pytest.mark.parametrize("block_size", [4, 16])
def test_compressor_emits_entries_exactly_at_block_boundaries(layer_id, block_size):
    """Token by token through the paged pools: entry j lands in its pool row once position (j+1)·r - 1 is
    written, and equals the naive pooling (compressed K=V in the `attn` pool, indexer keys in `idx_keys`)."""
    model = make_model(seed=2)
    attn = model.layers[layer_id].attn
    T, r = 26, attn.ratio
    x = rand(T, model.cfg.hidden_size, seed=5)
    cache, tables = KVCache.for_lengths(model, [T], block_size)
    pools = cache.layers[layer_id]
    e = -(-block_size // r)

    def entries(kind: str, batch) -> torch.Tensor:  # [(t+1)//r, d] entries held so far
        j = torch.arange(batch.max_seq_len // r, device=DEVICE)
        rows_per_block, first = (block_size + e, block_size) if kind == "attn" else (e, 0)
        return pools[kind][batch.entry_rows(j, torch.zeros_like(j), r, rows_per_block, first)]

    with torch.no_grad():
        for t in range(T):
            batch = build_batch(cache, [0], tables, [t], [1], None, model.compress_ratios)
            attn(x[t:t + 1], batch)
            assert entries("attn", batch).shape[0] == (t + 1) // r
        close(entries("attn", batch), naive_compressed_entries(attn.compressor, x, r, attn.rotary), tol=1e-5)
        if attn.indexer is not None:
            want = naive_compressed_entries(attn.indexer.compressor, x, r, attn.rotary)
            close(entries("idx_keys", batch), want, tol=1e-5)


def test_index_rows_of_a_decode_token_stay_inside_its_sequence():
    """A ragged batch: each query reads only its own sequence's pool rows."""
    model = make_model(seed=4)
    ids = random_ids(30, model.cfg.vocab_size, seed=9)
    with torch.no_grad():
        alone = [forward_sequences(model, ids[s:e], [e - s]).logits for s, e in [(0, 12), (12, 30)]]
        both = forward_sequences(model, ids, [12, 18]).logits
    close(both, torch.cat(alone), tol=1e-5)


def test_tiny_config_covers_every_kind():
    cfg = tiny_config()
    assert [cfg.compress_ratio(i) for i in range(cfg.num_hidden_layers)] == [1, 4, 8, 4]
