"""The reworked Triton compressor emission, indexer scores and LM head vs their PyTorch natives (the oracles).

On a CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is imported); with
SPARKSPEC_TEST_DEVICE=cuda the same tests run the compiled kernels (bf16 tensor-core dots there).
"""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, triton_kernels

tri_comp, tri_head = triton_kernels("compressor", "head")

from sparkspec.ops import compressor, head  # noqa: E402
from sparkspec.ops.registry import _ACCEL  # noqa: E402


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(*shape, gen, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=gen) * scale).to(device=DEVICE, dtype=dtype)


def _rotation(M: int, half: int, gen) -> torch.Tensor:
    angles = torch.rand(M, half, generator=gen) * 6.3
    return torch.polar(torch.ones_like(angles), angles).to(DEVICE)


# --------------------------------------------------------------------------------------- emit_entries

@pytest.mark.parametrize("overlap,span,d,half", [
    (False, 128, 160, 16),  # HCA-like: a long span (4 row tiles), 3 feature blocks, the last one partial
    (True, 8, 128, 8),  # CSA-like: overlapping windows, 2 feature blocks
    (True, 8, 24, 4),  # one partial feature block
])
def test_emit_entries_feature_blocks_and_pads(overlap, span, d, half):
    """Entries split over feature blocks equal the native; pad slots (newest position missing) write nothing."""
    gen = _gen(21)
    S, M, w = 300, 5, 2 * d if overlap else d
    kv_pool, score_pool = _randn(S, w, gen=gen), _randn(S, w, gen=gen, scale=2.0)
    gather = torch.randint(0, S, (M, span), generator=gen).to(DEVICE)
    missing = torch.zeros(M, span, dtype=torch.bool, device=DEVICE)
    missing[1, : span // 2] = True  # a first window (overlap: its previous half does not exist)
    missing[3] = True  # a pad slot: every position < 0
    weight = _randn(d, gen=gen)
    rot = _rotation(M, half, gen)
    out_rows = torch.tensor([7, 0, 12, 19, 3], device=DEVICE)
    got = torch.full((20, d), 5.0, device=DEVICE)
    want = got.clone()
    tri_comp.emit_entries(kv_pool, score_pool, gather, missing, weight, 1e-6, rot, got, out_rows)
    compressor.emit_entries(kv_pool, score_pool, gather, missing, weight, 1e-6, rot, want, out_rows)
    real = torch.tensor([7, 0, 12, 3], device=DEVICE)
    torch.testing.assert_close(got[real], want[real], rtol=2e-5, atol=2e-5)
    assert (got[19] == 5.0).all(), "a pad slot wrote its (trash) row"
    untouched = torch.ones(20, dtype=torch.bool, device=DEVICE)
    untouched[out_rows] = False
    assert (got[untouched] == 5.0).all()


# --------------------------------------------------------------------------------------- indexer_topk

def test_split3_bf16_is_exact():
    """The three bf16 pieces of an fp32 value sum back to it exactly (24 bits), here through the LM head on a
    one-hot weight: out[m, n] = h[m, j] * 1, with no rounding anywhere."""
    gen = _gen(22)
    M, K = 3, 40
    h = _randn(M, K, gen=gen) * torch.exp2(torch.randint(-20, 20, (M, K), generator=gen)).to(DEVICE)
    h[0, :4] = torch.tensor([1 + 2**-23, -(1 - 2**-24), 3.14159265, 2**-100], device=DEVICE)
    cols = torch.arange(K, device=DEVICE).flip(0)
    weight = torch.nn.functional.one_hot(cols, K).to(torch.bfloat16)  # [K, K]: row n picks h[:, K-1-n]
    got = tri_head.lm_head_triton(h, weight)
    assert torch.equal(got, h[:, cols])


@pytest.mark.parametrize("per_query", [False, True], ids=["by_request", "per_query"])
@pytest.mark.parametrize("T,ih,dim,C,topk", [(3, 20, 40, 150, 16), (2, 64, 128, 70, 64)])
def test_indexer_topk_split_dots(T, ih, dim, C, topk, per_query):
    """bf16 queries against fp32 keys (the model's dtypes: the three-piece dots) over several key blocks."""
    gen = _gen(23)
    q = _randn(T, ih, dim, gen=gen, dtype=torch.bfloat16)
    w = _randn(T, ih, gen=gen)
    keys = _randn(2, C, dim, gen=gen)
    keys[:, 3] = 0  # an all-zero key: ReLU scores 0, ties broken towards the lower id
    req = torch.arange(T, device=DEVICE) % 2
    visible = torch.tensor([C, C // 3, 1][:T], device=DEVICE)
    args = (keys[req], None) if per_query else (keys, req)
    got = tri_comp.indexer_topk(q, w, *args, visible, topk, 0.3)
    want = compressor.indexer_topk(q, w, keys, req, visible, topk, 0.3)
    assert torch.equal(got, want)


def test_indexer_scores_match_the_native_scores():
    """The scores themselves (not only their order): fp32 sums of exact products, close to the einsum."""
    gen = _gen(24)
    T, ih, dim, C = 2, 16, 64, 70
    q = _randn(T, ih, dim, gen=gen, dtype=torch.bfloat16)
    w = _randn(T, ih, gen=gen)
    keys = _randn(T, C, dim, gen=gen)
    visible = torch.tensor([C, 9], device=DEVICE)
    scores = torch.empty(T, C, device=DEVICE)
    tri_comp._indexer_scores_kernel[(T, 2)](
        q, w, keys, visible, visible, visible, scores, ih, C, dim, 0.3, q.stride(0), q.stride(1), w.stride(0),
        keys.stride(0), keys.stride(1), 1.0, HAS_REQ=False, HAS_ROWS=False, SPLIT=True, BF16_DOT=DEVICE.type != "cpu",
        BLOCK_H=16, BLOCK_C=64, BLOCK_D=64,
    )
    s = torch.relu(torch.einsum("thd,tcd->thc", q.double(), keys.double())) * 0.3
    want = (s * w.double().unsqueeze(-1)).sum(dim=1)
    want[1, 9:] = float("-inf")
    torch.testing.assert_close(scores.double(), want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------- lm_head

@pytest.mark.parametrize("M,N,K", [(1, 100, 72), (5, 130, 256), (40, 70, 130)])
def test_lm_head_matches_native(M, N, K):
    gen = _gen(25)
    h = _randn(M, K, gen=gen)
    weight = _randn(N, K, gen=gen, dtype=torch.bfloat16)
    got = tri_head.lm_head_triton(h, weight)
    want = head.lm_head(h, weight)
    exact = h.double() @ weight.double().T
    assert got.shape == (M, N) and got.dtype == torch.float32
    # both are fp32 sums of exact products: as close to the float64 value as the native is, or (Hopper's bf16
    # tensor cores add the products with a few bits less than fp32) within 2^-20 of the sum of |products|,
    # which a lost piece of h (2^-16 relative) or a wrong tile (O(1)) exceeds by far
    err, ref_err = (got.double() - exact).abs().max(), (want.double() - exact).abs().max()
    scale = (h.double().abs() @ weight.double().abs().T).max()
    assert err <= max(4 * ref_err + 1e-6, 2 ** -20 * scale), f"{err} vs the native's {ref_err} (scale {scale})"


def test_lm_head_native_uses_the_supplied_fp32_weight():
    gen = _gen(26)
    h, weight = _randn(2, 8, gen=gen), _randn(6, 8, gen=gen, dtype=torch.bfloat16)
    calls = []

    def fp32():
        calls.append(1)
        return weight.float()

    assert torch.equal(head.lm_head(h, weight, fp32), head.lm_head(h, weight)) and calls == [1]


def test_lm_head_preconditions_are_messages():
    h = torch.zeros(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="reads a bf16 weight"):
        tri_head.lm_head_triton(h, torch.zeros(4, 8, device=DEVICE))
    with pytest.raises(ValueError, match="want h"):
        tri_head.lm_head_triton(h, torch.zeros(4, 9, device=DEVICE, dtype=torch.bfloat16))


def test_lm_head_registered_for_every_accelerator():
    for platform in ("cuda", "rocm", "xpu"):
        assert (platform, "lm_head") in _ACCEL
