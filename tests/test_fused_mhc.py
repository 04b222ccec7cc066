"""The mHC post of one sublayer and the next sublayer's mhc_pre split-K pass in one launch
(`triton_kernels.mhc.mhc_post_pre`) against the native `mhc_post` then `mhc_pre` (the oracle). Under
TRITON_INTERPRET=1 on a CPU (SPARKSPEC_TEST_DEVICE=cuda: compiled)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, triton_kernels

(tri_mhc,) = triton_kernels("mhc")

from sparkspec.ops import mhc, rope  # noqa: E402


def _inputs(T: int, n: int, H: int, dtype, seed: int):
    g = torch.Generator().manual_seed(seed)

    def randn(*shape, scale=1.0, dt=torch.float32):
        return (torch.randn(*shape, generator=g) * scale).to(device=DEVICE, dtype=dt)

    y, x = randn(T, H, dt=dtype), randn(T, n, H, dt=dtype)
    post = randn(T, n).sigmoid() * 2
    comb = torch.softmax(randn(T, n, n), dim=-1)
    M = (2 + n) * n
    fn, base = randn(M, n * H, scale=0.05), randn(M, scale=0.5)
    scale = randn(3, scale=0.3).abs() + 0.5
    norm_weight = randn(H, scale=0.1) + 1.0
    return y, x, post, comb, fn, scale, base, norm_weight


def _ulps(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """Worst error in bf16 ulps of |expected| (at least the ulp at 1/4: sums of ±terms cancel)."""
    ulp = torch.exp2(torch.floor(torch.log2(expected.abs().clamp(min=0.25))) - 7)
    return ((actual.float() - expected.float()).abs() / ulp).max().item()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,n,H,norm", [(1, 4, 96, True), (19, 4, 80, False), (5, 3, 64, True), (17, 4, 100, True)])
def test_post_pre_is_post_then_pre(T, n, H, norm, dtype):
    """Streams as `mhc_post`; layer input, post and comb as `mhc_pre` of the streams the launch wrote (the rounded
    ones: the next sublayer reads those). H not a multiple of the chunk, T not of the token block, n < NP."""
    y, x, post, comb, fn, scale, base, w = _inputs(T, n, H, dtype, seed=T + H)
    nw, ne = (w, 1e-6) if norm else (None, None)
    streams, h, post2, comb2 = tri_mhc.mhc_post_pre(y, x, post, comb, fn, scale, base, 1e-6, 1e-6, 20, nw, ne)
    assert streams.dtype == h.dtype == dtype and post2.dtype == comb2.dtype == torch.float32
    want_streams = mhc.mhc_post(y.float(), x.float(), post, comb)
    assert _ulps(streams, want_streams) <= 1.0
    want_h, want_post, want_comb = mhc.mhc_pre(streams.float(), fn, scale, base, 1e-6, 1e-6, 20)
    if norm:  # the norm of the layer input rounded to the streams' dtype (what the sublayer's norm read)
        want_h = rope.rms_norm(want_h.to(dtype).float(), w, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(streams, want_streams, rtol=2e-5, atol=2e-5)
        torch.testing.assert_close(h, want_h, rtol=2e-5, atol=2e-5)
    elif norm:  # an ulp of the rounding before the norm, scaled by the norm, then one more rounding
        torch.testing.assert_close(h.float(), want_h, rtol=2 ** -6, atol=1e-3)
    else:
        assert _ulps(h, want_h) <= 1.0
    unfused = tri_mhc.mhc_pre(streams, fn, scale, base, 1e-6, 1e-6, 20, nw, ne)[0]  # only the sum order differs
    assert _ulps(h, unfused) <= 1.0
    torch.testing.assert_close(post2, want_post, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb2, want_comb, rtol=1e-5, atol=1e-5)


def test_native_is_post_then_pre():
    """The oracle itself: the native op is literally the op table's mhc_post, then its mhc_pre on the new streams
    (the natives on a CPU, the registered kernels on a GPU: the same calls either way)."""
    from sparkspec.ops.registry import ops

    y, x, post, comb, fn, scale, base, w = _inputs(3, 4, 32, torch.float32, seed=1)
    got = mhc.mhc_post_pre(y, x, post, comb, fn, scale, base, 1e-6, 1e-6, 5, w, 1e-6)
    streams = ops.mhc_post(y, x, post, comb)
    want = (streams, *ops.mhc_pre(streams, fn, scale, base, 1e-6, 1e-6, 5, w, 1e-6))
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_rows_do_not_depend_on_the_batch():
    """Batch-invariant mode: a token's outputs are the same alone as among 37 others (the split count is fixed by
    H, and every T takes the one-token programs)."""
    from sparkspec.ops.batch_invariant import batch_invariant

    args = _inputs(37, 4, 96, torch.bfloat16, seed=3)
    y, x, post, comb, fn, scale, base, w = args
    with batch_invariant(dispatch_keys=()):
        assert tri_mhc.post_mix_config(37, 96) == tri_mhc.post_mix_config(1, 96)
        assert tri_mhc.norm_finish_config(37, 96) == tri_mhc.norm_finish_config(1, 96)
        for interpreted in (False, True):
            for T in (2, 15, 16, 37, 4096):
                assert tri_mhc.mix_partial_config(T, 4 * 96, interpreted) == tri_mhc.mix_partial_config(1, 4 * 96,
                                                                                                   interpreted)
                assert tri_mhc.finish_config(T, 96, interpreted) == tri_mhc.finish_config(1, 96, interpreted)
        full = tri_mhc.mhc_post_pre(y, x, post, comb, fn, scale, base, 1e-6, 1e-6, 20, w, 1e-6)
        one = tri_mhc.mhc_post_pre(y[20:21], x[20:21], post[20:21], comb[20:21], fn, scale, base, 1e-6, 1e-6, 20,
                                   w, 1e-6)
        pre_full = [tri_mhc.mhc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, *nw) for nw in ((), (w, 1e-6))]
        pre_one = [tri_mhc.mhc_pre(x[20:21], fn, scale, base, 1e-6, 1e-6, 20, *nw) for nw in ((), (w, 1e-6))]
        head_full = tri_mhc.hc_head(x, fn[:4], scale[:1], base[:4], 1e-6, 1e-6)
        head_one = tri_mhc.hc_head(x[20:21], fn[:4], scale[:1], base[:4], 1e-6, 1e-6)
    for a, b in zip([*full, *pre_full[0], *pre_full[1], head_full], [*one, *pre_one[0], *pre_one[1], head_one]):
        assert torch.equal(a[20:21], b)


def test_decode_tokens_take_the_one_token_programs():
    """Below 16 tokens the stream update runs one token per program without tl.dot, and the normed finish one
    token per program; from 16 the tiles. Both agree with each other to the order of the fp32 sums (the oracle
    tests above check each against the natives)."""
    assert tri_mhc.post_mix_config(1, 4096)[::2] == (1, False)
    assert tri_mhc.post_mix_config(15, 4096)[2] is False and tri_mhc.post_mix_config(16, 4096)[2] is True
    assert tri_mhc.norm_finish_config(1, 4096)[0] == 1 and tri_mhc.norm_finish_config(16, 4096)[0] > 1
    y, x, post, comb, fn, scale, base, w = _inputs(18, 4, 96, torch.float32, seed=4)
    full = tri_mhc.mhc_post_pre(y, x, post, comb, fn, scale, base, 1e-6, 1e-6, 20, w, 1e-6)  # the dot tile
    few = tri_mhc.mhc_post_pre(y[:3], x[:3], post[:3], comb[:3], fn, scale, base, 1e-6, 1e-6, 20, w, 1e-6)
    for a, b in zip(full, few):
        torch.testing.assert_close(a[:3], b, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,n,H,norm", [(1, 4, 96, True), (5, 4, 80, False), (5, 3, 64, True), (1, 2, 64, False),
                                        (17, 4, 100, True), (19, 3, 96, False)])
def test_pre_and_head_match_the_natives(T, n, H, norm, dtype):
    """mhc_pre and hc_head against the natives: below 16 tokens the split-K pass one token per program without tl.dot
    and the finish one token per program (the Sinkhorn on register scalars at n <= 4 < 8: NP = 4; the tile at NP = 2),
    from 16 the tiles. H not a multiple of the chunks, n < NP."""
    few = T < 16
    assert tri_mhc.mix_partial_config(T, n * H)[3] is not few and (tri_mhc.finish_config(T, H)[0] == 1) is few
    y, x, post, comb, fn, scale, base, w = _inputs(T, n, H, dtype, seed=T + n + H)
    nw, ne = (w, 1e-6) if norm else (None, None)
    h, post2, comb2 = tri_mhc.mhc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, nw, ne)
    want_h, want_post, want_comb = mhc.mhc_pre(x.float(), fn, scale, base, 1e-6, 1e-6, 20)
    if norm:
        want_h = rope.rms_norm(want_h.to(dtype).float(), w, 1e-6)
    if dtype == torch.float32:
        torch.testing.assert_close(h, want_h, rtol=2e-5, atol=2e-5)
    elif norm:
        torch.testing.assert_close(h.float(), want_h, rtol=2 ** -6, atol=1e-3)
    else:
        assert _ulps(h, want_h) <= 1.0
    torch.testing.assert_close(post2, want_post, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb2, want_comb, rtol=1e-5, atol=1e-5)
    hscale = scale[:1]
    got = tri_mhc.hc_head(x, fn[:n], hscale, base[:n], 1e-6, 1e-6)
    want = mhc.hc_head(x.float(), fn[:n], hscale, base[:n], 1e-6, 1e-6)
    assert got.dtype == dtype and _ulps(got, want) <= 1.0


@pytest.mark.parametrize("op", ["mhc_pre", "mhc_pre_norm", "hc_head"])
def test_decode_pre_agrees_with_the_tiles(op):
    """The one-token paths (split-K without tl.dot, one-token finish, the Sinkhorn on scalars) against the tiles on
    the same tokens among 18: the same values to the order of the fp32 sums."""
    y, x, post, comb, fn, scale, base, w = _inputs(18, 4, 96, torch.float32, seed=5)

    def run(x):
        if op == "hc_head":
            return [tri_mhc.hc_head(x, fn[:4], scale[:1], base[:4], 1e-6, 1e-6)]
        return tri_mhc.mhc_pre(x, fn, scale, base, 1e-6, 1e-6, 20, *((w, 1e-6) if op == "mhc_pre_norm" else ()))

    for a, b in zip(run(x), run(x[:3])):
        torch.testing.assert_close(a[:3], b, rtol=2e-5, atol=2e-5)


def test_one_token_finish_sums_the_splits_in_steps(monkeypatch):
    """A one-token finish sums the split-K partials BLOCK_S at a time; forced to 2 a step over the interpreter's 3
    splits (the tail of the last step masked), the outputs still match the natives."""
    monkeypatch.setattr(tri_mhc, "_sum_block", lambda splits, block_t, block_m: 2 if block_t == 1 else 1)
    y, x, post, comb, fn, scale, base, w = _inputs(1, 4, 96, torch.float32, seed=6)
    streams, h, post2, comb2 = tri_mhc.mhc_post_pre(y, x, post, comb, fn, scale, base, 1e-6, 1e-6, 20)
    want_streams = mhc.mhc_post(y, x, post, comb)
    got = [h, post2, comb2, *tri_mhc.mhc_pre(x, fn, scale, base, 1e-6, 1e-6, 20),
           tri_mhc.hc_head(x, fn[:4], scale[:1], base[:4], 1e-6, 1e-6)]
    want = [*mhc.mhc_pre(want_streams, fn, scale, base, 1e-6, 1e-6, 20),
            *mhc.mhc_pre(x, fn, scale, base, 1e-6, 1e-6, 20), mhc.hc_head(x, fn[:4], scale[:1], base[:4], 1e-6, 1e-6)]
    torch.testing.assert_close(streams, want_streams, rtol=2e-5, atol=2e-5)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_preconditions_are_messages():
    y, x, post, comb, fn, scale, base, _ = _inputs(2, 4, 8, torch.float32, seed=0)
    with pytest.raises(ValueError, match=r"y must be \[2, 8\]"):
        tri_mhc.mhc_post_pre(y[:, :4], x, post, comb, fn, scale, base, 1e-6, 1e-6, 3)
    with pytest.raises(ValueError, match=r"fn must be \[24, 32\]"):
        tri_mhc.mhc_post_pre(y, x, post, comb, fn[:, :8], scale, base, 1e-6, 1e-6, 3)


@pytest.mark.parametrize("fused", [False, True], ids=["mhc_pre", "mhc_post_pre"])
@pytest.mark.parametrize("norm", [True, False])
def test_fp32_copy_is_the_layer_input_upcast(fused, norm):
    """fp32_copy: one more output, exactly `layer_input.float()` (the router / compressor GEMMs read it instead of a
    cast), and the other outputs unchanged; the native likewise."""
    y, x, post, comb, fn, scale, base, w = _inputs(17, 4, 96, torch.bfloat16, seed=9)
    nw, ne = (w, 1e-6) if norm else (None, None)
    head = (y, x, post, comb) if fused else (x,)
    for impl in (tri_mhc, mhc):
        op = impl.mhc_post_pre if fused else impl.mhc_pre
        plain = op(*head, fn, scale, base, 1e-6, 1e-6, 20, nw, ne)
        *outs, h32 = op(*head, fn, scale, base, 1e-6, 1e-6, 20, nw, ne, True)
        assert len(outs) == len(plain) and all(torch.equal(a, b) for a, b in zip(outs, plain))
        assert h32.dtype == torch.float32 and torch.equal(h32, outs[-3].float())
