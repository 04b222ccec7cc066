"""Triton kernels vs their PyTorch natives (the oracles).

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set below before triton is imported);
with SPARKSPEC_TEST_DEVICE=cuda the same tests run the compiled kernels. bf16 results are compared with the native
evaluated on fp32-upcast inputs and may differ by 1 bf16 ulp (the interpreter truncates; GPUs round and use tf32 dots on
the bf16-exact operands; values under 1/4 get the ulp at 1/4 because sums of ±terms cancel).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, triton_kernels  # SPARKSPEC_TEST_DEVICE=cuda runs the compiled kernels on a GPU

tri_attn, tri_comp, tri_mhc, tri_rope = triton_kernels("attention", "compressor", "mhc", "rope")

from sparkspec.ops import attention, compressor, indices, mhc, rope  # noqa: E402
from sparkspec.ops.registry import _ACCEL  # noqa: E402

WINDOW = 8  # small sliding window so that rows cross the window edge in a few tokens


def _seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def assert_close(actual: torch.Tensor, expected_fp32: torch.Tensor) -> None:
    """fp32: tight; bf16: within 1 ulp of the fp32 oracle."""
    assert actual.shape == expected_fp32.shape
    assert torch.isfinite(actual).all(), "non-finite output"
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected_fp32, rtol=2e-5, atol=2e-5)
        return
    mag = expected_fp32.abs().clamp(min=0.25)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)  # bf16 keeps 7 explicit mantissa bits
    err = (actual.float() - expected_fp32).abs()
    worst = (err / ulp).max().item()
    assert worst <= 1.0, f"max error {worst:.2f} bf16 ulp"


# --------------------------------------------------------------------------------------- sparse attention

def _attention_indices(case: str, gen) -> tuple[torch.Tensor, int]:
    """-> (indices [T, W] into a pool, pool rows)"""
    paged = indices._paged_attention_indices_native
    if case == "swa_causal":  # early positions: -1 at the start of the row
        tables = torch.tensor([[0, 1]], device=DEVICE)
        idx = paged(torch.arange(10, device=DEVICE), torch.zeros(10, dtype=torch.long, device=DEVICE), tables, 8,
                    WINDOW, 1, None, 0)
        return idx, 16
    if case == "csa_topk_ragged":  # two requests, paged blocks interleaved, chosen compressed entries
        tables = torch.tensor([[3, 0, 5], [1, 4, 2]], device=DEVICE)
        pos = torch.tensor([4, 5, 17, 22, 23], device=DEVICE)
        req = torch.tensor([0, 0, 1, 1, 1], device=DEVICE)
        topk = torch.randint(-1, 4, (5, 3), generator=gen).to(DEVICE)
        idx = paged(pos, req, tables, 8, WINDOW, 4, topk, 0)
        return idx, 6 * 10
    if case == "dspark_noncausal":  # width = window + k block rows
        ctx = torch.tensor([[-1, -1, -1, -1, -1, 0, 1, 2], list(range(8, 16))], device=DEVICE)
        idx = indices.dspark_block_indices(ctx, 30, 5)
        assert idx.shape[1] == indices.dspark_index_width(WINDOW, 5)
        return idx, 30 + 10
    if case == "random_padding":  # padding anywhere, one fully padded row, a row with one entry
        idx = torch.randint(0, 50, (6, 37), generator=gen)
        idx[torch.rand(idx.shape, generator=gen) < 0.4] = -1
        idx[1] = -1
        idx[2, :] = -1
        idx[2, 30] = 7
        return idx.to(DEVICE), 50
    raise KeyError(case)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("with_sink", [True, False], ids=["sink", "nosink"])
@pytest.mark.parametrize("case", ["swa_causal", "csa_topk_ragged", "dspark_noncausal", "random_padding"])
def test_sparse_attention(case, with_sink, dtype):
    gen = _seeded(3)
    idx, num_rows = _attention_indices(case, gen)
    T, h, D = idx.shape[0], 20, 48  # heads and width off the block sizes: exercises the masks
    q = _randn(T, h, D, gen=gen, dtype=dtype)
    kv = _randn(num_rows, D, gen=gen, dtype=dtype)
    sink = _randn(h, gen=gen) if with_sink else torch.full((h,), float("-inf"), device=DEVICE)
    got = tri_attn.sparse_attention(q, kv, idx, sink, D**-0.5)
    want = attention.sparse_attention(q.float(), kv.float(), idx, sink, D**-0.5)
    keep = (idx >= 0).any(dim=1) | with_sink  # no entry and no sink: native NaN, kernel zeros
    assert got.dtype == dtype
    assert_close(got[keep], want[keep])
    assert (got[~keep] == 0).all()


def test_sparse_attention_int32_indices_and_strided_q():
    gen = _seeded(4)
    idx, num_rows = _attention_indices("csa_topk_ragged", gen)
    q = _randn(idx.shape[0], 32, 64, gen=gen)[:, ::2]  # every other head: non-unit head stride
    kv = _randn(num_rows, 64, gen=gen)
    sink = _randn(16, gen=gen)
    got = tri_attn.sparse_attention(q, kv, idx.to(torch.int32), sink, 0.125)
    assert_close(got, attention.sparse_attention(q, kv, idx, sink, 0.125))


def test_sparse_attention_preconditions_are_messages():
    q = torch.zeros(2, 4, 16, device=DEVICE)
    with pytest.raises(ValueError, match="sink has 3 entries"):
        tri_attn.sparse_attention(q, torch.zeros(5, 16, device=DEVICE), torch.zeros(2, 3, dtype=torch.long,
                                                                                   device=DEVICE),
                                  torch.zeros(3, device=DEVICE), 1.0)


# --------------------------------------------------------------------------------------- mHC

def _mhc_inputs(n: int, T: int, H: int, num_mix: int, dtype, seed: int):
    gen = _seeded(seed)
    x = _randn(T, n, H, gen=gen, dtype=dtype)
    fn = _randn(num_mix, n * H, gen=gen, scale=0.05)
    base = _randn(num_mix, gen=gen, scale=0.5)
    return gen, x, fn, base


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,iters", [(4, 20), (4, 1), (3, 7)])
def test_mhc_pre(n, iters, dtype):
    T, H = 19, 96  # T not a multiple of the token block
    gen, x, fn, base = _mhc_inputs(n, T, H, (2 + n) * n, dtype, seed=5)
    scale = _randn(3, gen=gen, scale=0.3).abs() + 0.5
    layer_input, post, comb = tri_mhc.mhc_pre(x, fn, scale, base, 1e-6, 1e-6, iters)
    want_input, want_post, want_comb = mhc.mhc_pre(x.float(), fn, scale, base, 1e-6, 1e-6, iters)
    assert layer_input.dtype == dtype and post.dtype == comb.dtype == torch.float32
    assert_close(layer_input, want_input)
    torch.testing.assert_close(post, want_post, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb, want_comb, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n", [4, 3])
def test_mhc_post(n, dtype):
    T, H = 7, 80
    gen = _seeded(6)
    y = _randn(T, H, gen=gen, dtype=dtype)
    x = _randn(T, n, H, gen=gen, dtype=dtype)
    post = _randn(T, n, gen=gen).sigmoid() * 2
    comb = torch.softmax(_randn(T, n, n, gen=gen), dim=-1)
    got = tri_mhc.mhc_post(y, x, post, comb)
    assert got.dtype == dtype
    assert_close(got, mhc.mhc_post(y.float(), x.float(), post, comb))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("n,T", [(4, 19), (3, 19), (4, 1)])  # T=1: one token block split over 3 K chunks
def test_hc_head(n, T, dtype):
    H = 96
    gen, x, fn, base = _mhc_inputs(n, T, H, n, dtype, seed=7)
    scale = _randn(1, gen=gen).abs()
    got = tri_mhc.hc_head(x, fn, scale, base, 1e-6, 1e-6)
    assert_close(got, mhc.hc_head(x.float(), fn, scale, base, 1e-6, 1e-6))


def test_mhc_preconditions_are_messages():
    x = torch.zeros(2, 4, 8, device=DEVICE)
    with pytest.raises(ValueError, match=r"fn must be \[24, 32\]"):
        tri_mhc.mhc_pre(x, torch.zeros(24, 8, device=DEVICE), torch.ones(3, device=DEVICE),
                        torch.zeros(24, device=DEVICE), 1e-6, 1e-6, 3)


# --------------------------------------------------------------------------------------- RMS norm and RoPE

def _rotation(T: int, half: int, gen) -> torch.Tensor:
    angles = torch.rand(T, half, generator=gen) * 20 - 10
    return torch.polar(torch.ones_like(angles), angles).to(DEVICE)  # [T, R/2] complex64


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("weighted", [True, False], ids=["weight", "noweight"])
@pytest.mark.parametrize("shape", [(7, 96), (3, 5, 40), (1, 1000)])  # widths off the block sizes; a 1-row tile
def test_rms_norm(shape, weighted, dtype):
    gen = _seeded(11)
    x = _randn(*shape, gen=gen, dtype=dtype, scale=3.0)
    w = _randn(shape[-1], gen=gen) if weighted else None
    got = tri_rope.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype
    assert_close(got, rope.rms_norm(x.float(), w, 1e-6))
    assert tri_rope.rms_norm(x, w, 1e-6, torch.float32).dtype == torch.float32


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("inverse", [False, True], ids=["forward", "inverse"])
@pytest.mark.parametrize("norm", ["none", "plain", "weighted"])
@pytest.mark.parametrize("shape,half", [((5, 3, 24), 4), ((9, 16), 8), ((4, 2, 2, 12), 2)])  # all rotary: 16 / 16
def test_rope(shape, half, norm, inverse, dtype):
    gen = _seeded(12)
    x = _randn(*shape, gen=gen, dtype=dtype)
    rot = _rotation(shape[0], half, gen)
    w = _randn(shape[-1], gen=gen) if norm == "weighted" else None
    eps = None if norm == "none" else 1e-6
    got = tri_rope.rope(x, rot, inverse, w, eps)
    assert got.dtype == dtype
    assert_close(got, rope.rope(x.float(), rot, inverse, w, eps))


def test_rope_strided_input_and_fp32_output_of_bf16():
    gen = _seeded(13)
    x = _randn(6, 8, 32, gen=gen, dtype=torch.bfloat16)[:, ::2]  # every other head
    rot = _rotation(6, 8, gen)
    got = tri_rope.rope(x, rot, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, rope.rope(x, rot, out_dtype=torch.float32), rtol=1e-6, atol=1e-6)


def test_rope_preconditions_are_messages():
    x = torch.zeros(3, 16, device=DEVICE)
    with pytest.raises(ValueError, match="rot must be complex"):
        tri_rope.rope(x, torch.zeros(3, 4, device=DEVICE))
    with pytest.raises(ValueError, match="exceed the row width"):
        tri_rope.rope(x, _rotation(3, 9, _seeded(0)))


# --------------------------------------------------------------------------------------- compressor

@pytest.mark.parametrize("ratio,width", [(4, 24), (128, 40)])
def test_store_states(ratio, width):
    gen = _seeded(14)
    S, T = 30, 5
    pools = [_randn(S, width, gen=gen) for _ in range(2)]
    pools += [p.clone() for p in pools]  # kernel kv, score; native kv, score
    rows = torch.tensor([3, 17, 4, 29, 0], device=DEVICE)
    states = _randn(T, 2 * width, gen=gen)
    ape = _randn(ratio, width, gen=gen)
    positions = torch.tensor([0, 5, 127, 128, 1000], device=DEVICE)
    tri_comp.store_states(pools[0], pools[1], rows, states, ape, positions)
    compressor.store_states(pools[2], pools[3], rows, states, ape, positions)
    assert torch.equal(pools[0], pools[2]) and torch.equal(pools[1], pools[3])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("overlap,span,d,half", [(True, 8, 24, 4), (False, 40, 20, 5), (True, 8, 16, 8)])
def test_emit_entries(overlap, span, d, half, dtype):
    """Entries pooled from random state rows (some missing), normalised, rotated, written to random rows."""
    gen = _seeded(15)
    S, M, w = 50, 6, 2 * d if overlap else d
    kv_pool, score_pool = _randn(S, w, gen=gen), _randn(S, w, gen=gen, scale=2.0)
    gather = torch.randint(0, S, (M, span), generator=gen).to(DEVICE)
    missing = torch.zeros(M, span, dtype=torch.bool, device=DEVICE)
    missing[1, : span // 2] = True  # a first window: the previous one does not exist
    missing[2, :3] = True
    weight = _randn(d, gen=gen)
    rot = _rotation(M, half, gen)
    out_rows = torch.tensor([7, 0, 12, 3, 19, 8], device=DEVICE)
    got = torch.zeros(20, d, device=DEVICE, dtype=dtype)
    want = torch.zeros(20, d, device=DEVICE)
    tri_comp.emit_entries(kv_pool, score_pool, gather, missing, weight, 1e-6, rot, got, out_rows)
    compressor.emit_entries(kv_pool, score_pool, gather, missing, weight, 1e-6, rot, want, out_rows)
    assert_close(got, want)


@pytest.mark.parametrize("per_query", [False, True], ids=["by_request", "per_query"])
@pytest.mark.parametrize("T,ih,dim,C,topk", [(5, 4, 24, 37, 8), (3, 20, 16, 10, 16)])  # C < topk: padded
def test_indexer_topk(T, ih, dim, C, topk, per_query):
    gen = _seeded(16)
    q = _randn(T, ih, dim, gen=gen, dtype=torch.bfloat16)
    w = _randn(T, ih, gen=gen)
    keys = _randn(2, C, dim, gen=gen)
    keys[:, 3] = 0  # an all-zero key: ReLU scores 0, ties broken towards the lower id
    keys[:, 5] = 0
    req = torch.arange(T, device=DEVICE) % 2
    visible = torch.randint(0, C + 1, (T,), generator=gen).to(DEVICE)
    args = (keys[req], None) if per_query else (keys, req)
    got = tri_comp.indexer_topk(q, w, *args, visible, topk, 0.3)
    want = compressor.indexer_topk(q, w, keys, req, visible, topk, 0.3)
    assert torch.equal(got, want)


def test_emit_entries_preconditions_are_messages():
    pool = torch.zeros(10, 12, device=DEVICE)
    with pytest.raises(ValueError, match="state width 12 must be d or 2d"):
        tri_comp.emit_entries(pool, pool, torch.zeros(2, 4, dtype=torch.long, device=DEVICE),
                              torch.zeros(2, 4, dtype=torch.bool, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6,
                              _rotation(2, 2, _seeded(0)), torch.zeros(5, 8, device=DEVICE),
                              torch.zeros(2, dtype=torch.long, device=DEVICE))


# --------------------------------------------------------------------------------------- dispatch

@pytest.mark.parametrize("name", ["sparse_attention", "mhc_pre", "mhc_post", "mhc_post_pre", "hc_head", "rope",
                                  "rms_norm", "store_states", "emit_entries", "indexer_topk"])
def test_registered_for_every_accelerator(name):
    for platform in ("cuda", "rocm", "xpu"):
        assert (platform, name) in _ACCEL, f"{name} has no Triton version for {platform}"


# --------------------------------------------------------------------------------------- the whole model


@pytest.fixture
def accelerated_on_cpu():
    """CPU tensors get the accelerated (cuda) registration of every op that has one (kernels interpreted)."""
    from sparkspec.ops import ops
    from sparkspec.ops.registry import op_names

    swapped = [n for n in op_names() if ("cuda", n) in _ACCEL]
    for n in swapped:
        ops._impl[(n, "cpu")] = _ACCEL[("cuda", n)]
    yield swapped
    for n in swapped:
        ops._impl.pop((n, "cpu"), None)


def test_model_under_the_accelerated_op_table_equals_native(accelerated_on_cpu):
    """A small config end to end: logits within tolerance and the same greedy tokens through the engine."""
    from conftest import make_model, random_ids, run_full

    from sparkspec.engine.llm_engine import LLMEngine
    from sparkspec.ops import ops
    from sparkspec.sampling_params import SamplingParams

    assert {"sparse_attention", "mhc_pre", "mhc_post", "hc_head"} <= set(accelerated_on_cpu)
    model = make_model(seed=7)
    ids = random_ids(40, model.cfg.vocab_size, seed=8)
    prompts = [ids[:9].tolist(), ids[:23].tolist()]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with torch.no_grad():
        fast = run_full(model, ids).logits
        fast_tokens = [o.token_ids for o in LLMEngine(model).generate(prompts, params)]
    assert ops.implementation("sparse_attention", "cpu") != "native"
    for n in accelerated_on_cpu:
        ops._impl.pop((n, "cpu"), None)
    with torch.no_grad():
        slow = run_full(model, ids).logits
        slow_tokens = [o.token_ids for o in LLMEngine(model).generate(prompts, params)]
    torch.testing.assert_close(fast, slow, rtol=0, atol=1e-4)
    assert fast_tokens == slow_tokens
