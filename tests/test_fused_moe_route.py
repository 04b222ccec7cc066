"""The fused routing glue (`triton_kernels.moe_route`: router top-k, sort by expert, packed SwiGLU), the
column-slice reads of the norm / RoPE kernel, and the stacked linears (`models.fused_linear`) against their
PyTorch references. Kernels run under TRITON_INTERPRET=1 on a CPU (SPARKSPEC_TEST_DEVICE=cuda: compiled)."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE, triton_kernels
from torch import nn

tri, tri_rope = triton_kernels("moe_route", "rope")

from sparkspec.models.fused_linear import fused_linear, stacked_linear, stacked_weight  # noqa: E402
from sparkspec.ops import moe, rope  # noqa: E402
from sparkspec.ops.registry import _ACCEL  # noqa: E402


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots in expert-id order (the native leaves the slot order to torch.topk(sorted=False))."""
    ids_sorted, perm = ids.sort(dim=-1)
    return weights.gather(1, perm), ids_sorted


def test_registered():
    for op in ("moe_route", "sort_by_expert", "swiglu_packed"):
        assert ("cuda", op) in _ACCEL


# --------------------------------------------------------------------------------------- moe_route

@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid", "softmax"])
@pytest.mark.parametrize("bias,norm", [(True, True), (False, True), (True, False)], ids=["bias-norm", "norm",
                                                                                      "bias-raw"])
@pytest.mark.parametrize("T,E,A", [(1, 32, 4), (13, 48, 6), (3, 7, 7)])  # more tokens than a program; E not 2^k
def test_moe_route(scoring, bias, norm, T, E, A):
    g = _gen(T * E + A)
    logits = (torch.randn(T, E, generator=g) * 4).to(DEVICE)
    logits[0, :3] = torch.tensor([-60.0, 25.0, -19.0])  # the tails of softplus: linear above 20, tiny below
    b = (torch.randn(E, generator=g) * 0.3).to(DEVICE) if bias else None
    got_w, got_ids = tri.moe_route(logits, b, None, A, scoring, norm, 1.5)
    want_w, want_ids = moe.moe_route(logits, b, None, A, scoring, norm, 1.5)
    assert got_ids.dtype == torch.long and got_w.dtype == torch.float32
    got_w, got_ids = _by_expert(got_w, got_ids)
    want_w, want_ids = _by_expert(want_w, want_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)  # fp32: exp / log differ


def test_moe_route_slots_descend_by_selection_score():
    g = _gen(5)
    logits, b = torch.randn(9, 32, generator=g).to(DEVICE), torch.randn(32, generator=g).to(DEVICE)
    _, ids = tri.moe_route(logits, b, None, 6, "sigmoid", True, 1.0)
    sel = torch.sigmoid(logits) + b
    picked = sel.gather(1, ids)
    assert (picked[:, :-1] >= picked[:, 1:]).all()


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "softmax"])
def test_moe_route_hash_layer(scoring):
    g = _gen(7)
    T, E, A = 11, 24, 4
    logits = torch.randn(T, E, generator=g).to(DEVICE)
    hash_ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)]).to(DEVICE)
    got_w, got_ids = tri.moe_route(logits, None, hash_ids, A, scoring, True, 2.0)
    want_w, want_ids = moe.moe_route(logits, None, hash_ids, A, scoring, True, 2.0)
    assert torch.equal(got_ids, want_ids)  # the table's order, kept
    torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-7)  # fp32: exp / log differ


def test_moe_route_falls_back_under_autograd():
    logits = torch.randn(2, 8, device=DEVICE, requires_grad=True)
    with torch.enable_grad():
        w, _ = tri.moe_route(logits, None, None, 2, "sigmoid", True, 1.0)
    assert w.requires_grad


# --------------------------------------------------------------------------------------- sort_by_expert

@pytest.mark.parametrize("T,A,E", [(1, 4, 32), (5, 6, 16), (64, 4, 32), (30, 8, 300), (1, 1, 1)])
def test_sort_by_expert_is_the_stable_sort(T, A, E):
    g = _gen(T + A + E)
    ids = torch.randint(0, E, (T, A), generator=g)
    ids[0, 0] = ids[-1, -1] = E - 1  # repeats of the last expert across the whole range
    ids = ids.to(DEVICE)
    order, ends = tri.sort_by_expert(ids, E)
    want_order, want_ends = moe.sort_by_expert_native(ids, E)
    assert order.dtype == torch.long and ends.dtype == torch.int32
    assert torch.equal(order, want_order)
    assert torch.equal(ends, want_ends)


def test_sort_by_expert_large_batches_take_the_native():
    ids = torch.randint(0, 8, (tri.SORT_MAX_PAIRS + 1, 1), generator=_gen(1)).to(DEVICE)
    order, ends = tri.sort_by_expert(ids, 8)
    want_order, want_ends = moe.sort_by_expert_native(ids, 8)
    assert torch.equal(order, want_order) and torch.equal(ends, want_ends)


# --------------------------------------------------------------------------------------- swiglu_packed

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,I", [(1, 512), (7, 48), (3, 1100)])  # a row over two programs; odd widths
def test_swiglu_packed(dtype, T, I):
    h = (torch.randn(T, 2 * I, generator=_gen(I)) * 6).to(DEVICE, dtype)  # beyond the clamp at 10 too
    got = tri.swiglu_packed(h, 10.0)
    want = moe.swiglu_packed(h, 10.0)
    assert got.dtype == dtype and got.shape == (T, I)
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    else:  # rounded where torch rounds (silu, then the product): 1 ulp each at most (the interpreter truncates)
        exact = moe.swiglu_packed(h.float(), 10.0)
        torch.testing.assert_close(got.float(), exact, rtol=2 ** -6, atol=1e-6)
        if DEVICE.type != "cpu":  # compiled: round-to-nearest as torch, so nearly every value is torch's
            assert (got == want).float().mean() > 0.95


def test_swiglu_packed_reads_a_strided_view():
    h = torch.randn(4, 100, generator=_gen(2)).to(DEVICE)[:, :64]
    torch.testing.assert_close(tri.swiglu_packed(h, 3.0), moe.swiglu_packed(h, 3.0), rtol=2e-6, atol=2e-6)


# --------------------------------------------------------------------------------------- norm / rope column slices

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_norm_rope_read_column_slices_in_place(dtype):
    """A slice of a wider GEMM output (tokens `stride` apart) gives what its contiguous copy gives, bit for bit."""
    g = _gen(3)
    T, h, D, R = 5, 3, 32, 8
    wide = torch.randn(T, 40 + h * D + 40, generator=g).to(DEVICE, dtype)
    q = wide[:, 40 : 40 + h * D].view(T, h, D)  # heads contiguous within a token, tokens 40 + h·D + 40 apart
    kv = wide[:, 40 + h * D :][:, :D]
    assert not q.is_contiguous() and not kv.is_contiguous()
    w = torch.randn(D, generator=g).to(DEVICE)
    rot = torch.polar(torch.ones(T, R // 2), torch.randn(T, R // 2, generator=g)).to(DEVICE)
    assert torch.equal(tri_rope.rope(q, rot, False, None, 1e-6), tri_rope.rope(q.contiguous(), rot, False, None, 1e-6))
    assert torch.equal(tri_rope.rope(kv, rot, True, w, 1e-6), tri_rope.rope(kv.contiguous(), rot, True, w, 1e-6))
    assert torch.equal(tri_rope.rms_norm(kv, w, 1e-6), tri_rope.rms_norm(kv.contiguous(), w, 1e-6))
    want = rope.rope(q.float(), rot, False, None, 1e-6)
    torch.testing.assert_close(tri_rope.rope(q, rot, False, None, 1e-6).float(), want.to(dtype).float(),
                               rtol=2 ** -7, atol=1e-5)


# --------------------------------------------------------------------------------------- stacked linears

def _linears(*outs: int, dim: int = 24, dtype=torch.float32) -> list[nn.Linear]:
    torch.manual_seed(0)
    return [nn.Linear(dim, n, bias=False).to(DEVICE, dtype) for n in outs]


def test_fused_linear_equals_the_separate_linears():
    a, b, c = _linears(16, 8, 5)
    x = torch.randn(7, 24, device=DEVICE)
    with torch.no_grad():
        want = [m(x) for m in (a, b, c)]
        before = [{k: v.clone() for k, v in m.state_dict().items()} for m in (a, b, c)]
        got = fused_linear(x, a, b, c)
        stack = stacked_weight((a, b, c))
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-5, atol=1e-5)
    assert stack is not None and stack.shape == (29, 24)
    assert a.weight.data_ptr() == stack.data_ptr()  # the parameters are views of the stack: no copy kept
    assert c.weight.data_ptr() == stack[24:].data_ptr()
    after = [m.state_dict() for m in (a, b, c)]
    assert all(b_.keys() == a_.keys() and all(torch.equal(b_[k], a_[k]) for k in b_) for b_, a_ in zip(before, after))


def test_stacked_weight_follows_loads_and_replaced_storage():
    a, b = _linears(6, 4)
    x = torch.randn(3, 24, device=DEVICE)
    with torch.no_grad():
        stacked_linear(x, a, b)
        b.weight.copy_(torch.ones_like(b.weight))  # an in-place load lands in the stack
        torch.testing.assert_close(stacked_linear(x, a, b)[:, 6:], b(x))
        b.weight.data = torch.full_like(b.weight, 2.0)  # a replaced storage: stacked again
        torch.testing.assert_close(stacked_linear(x, a, b)[:, 6:], b(x))
        assert b.weight.data_ptr() == stacked_weight((a, b))[6:].data_ptr()


def test_stacked_weight_declines_what_it_cannot_stack():
    a, b = _linears(6, 4)
    x = torch.randn(3, 24, device=DEVICE)
    with torch.enable_grad():  # training: each parameter its own gradient
        assert stacked_weight((a, b)) is None
        outs = fused_linear(x, a, b)
        assert outs[0].requires_grad
    with torch.no_grad():
        half, = _linears(4, dtype=torch.bfloat16)
        assert stacked_weight((a, half)) is None  # dtypes differ
        biased = nn.Linear(24, 4).to(DEVICE)
        assert stacked_weight((a, biased)) is None
        assert stacked_weight((a,)) is None  # nothing to fuse


# --------------------------------------------------------------------------------------- the experts' slot sum

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("S,T,A,H", [(1, 1, 4, 1024), (1, 5, 6, 100), (4, 3, 2, 2000)])
def test_sum_slots(dtype, S, T, A, H):
    from sparkspec.ops.triton_kernels.moe import sum_slots

    part = torch.randn(S, T, A, H, generator=_gen(S + T + A)).to(DEVICE)
    got = sum_slots(part, dtype)
    want = part.double().sum(dim=(0, 2))
    assert got.dtype == dtype and got.shape == (T, H)
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)
    else:  # one rounding of the fp32 sum (the interpreter truncates: up to 1 ulp)
        torch.testing.assert_close(got.double(), want, rtol=2 ** -7, atol=1e-6)


# --------------------------------------------------------------------------------------- mhc_pre with the norm

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("T,n,H", [(1, 4, 1024), (11, 4, 300), (3, 3, 40)])  # H over several chunks; ragged
def test_mhc_pre_with_the_sublayer_norm(dtype, T, n, H):
    """The normalised layer input from the finish launch = rms_norm of the unfused launch's rounded input."""
    from sparkspec.ops import mhc
    from sparkspec.ops.triton_kernels import mhc as tri_mhc

    g = _gen(T + H)
    M = (2 + n) * n
    x = torch.randn(T, n, H, generator=g).to(DEVICE, dtype)
    fn, base = (torch.randn(M, n * H, generator=g) * 0.05).to(DEVICE), (torch.randn(M, generator=g) * 0.5).to(DEVICE)
    scale, w = torch.rand(3, generator=g).to(DEVICE), (1 + torch.randn(H, generator=g) * 0.2).to(DEVICE)
    args = (x, fn, scale, base, 1e-6, 1e-6, 20)
    plain, post, comb = tri_mhc.mhc_pre(*args)
    normed, post_n, comb_n = tri_mhc.mhc_pre(*args, w, 1e-6)
    assert torch.equal(post, post_n) and torch.equal(comb, comb_n)
    want = rope.rms_norm(plain.float(), w, 1e-6)  # fp32 norm of the same rounded input
    assert normed.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(normed, want, rtol=1e-5, atol=1e-5)
    else:
        torch.testing.assert_close(normed.float(), want, rtol=2 ** -7, atol=1e-5)
    native, _, _ = mhc.mhc_pre(x.float(), fn, scale, base, 1e-6, 1e-6, 20, w, 1e-6)
    torch.testing.assert_close(normed.float(), native, rtol=2 ** -6 if dtype == torch.bfloat16 else 1e-4, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_moe_experts_adds_the_shared_output_in_its_last_launch(dtype):
    """moe_experts(..., shared) = moe_experts(...) + shared, the add after the rounding (as the model added)."""
    from sparkspec.ops.triton_kernels.moe import moe_experts_triton

    g = _gen(9)
    T, H, I, E, A = 5, 64, 32, 8, 2
    x = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    w13 = (torch.randn(E, 2 * I, H, generator=g) * 0.1).to(DEVICE, dtype)
    w2 = (torch.randn(E, H, I, generator=g) * 0.1).to(DEVICE, dtype)
    w = torch.rand(T, A, generator=g).to(DEVICE)
    ids = torch.stack([torch.randperm(E, generator=g)[:A] for _ in range(T)]).to(DEVICE)
    shared = torch.randn(T, H, generator=g).to(DEVICE, dtype)
    got = moe_experts_triton(x, w13, w2, w, ids, 10.0, shared=shared)
    want = moe_experts_triton(x, w13, w2, w, ids, 10.0) + shared
    if DEVICE.type != "cpu" or dtype == torch.float32:
        assert torch.equal(got, want)
    else:  # the interpreter truncates where the device (and torch's add) round to nearest
        torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)
    assert torch.equal(moe.moe_experts(x, w13, w2, w, ids, 10.0, shared), moe.moe_experts(x, w13, w2, w, ids, 10.0)
                       + shared)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_writes_its_rows_into_a_pool(dtype):
    """rope(..., out=pool, out_rows=rows) = pool.index_copy_(0, rows, rope(...)): the KV cache write in the norm /
    RoPE launch; the other pool rows untouched."""
    g = _gen(12)
    T, D, R = 6, 64, 16
    wide = torch.randn(T, D + 30, generator=g).to(DEVICE, dtype)
    kv = wide[:, 30:]  # a column slice, as the stacked projection gives it
    w = torch.randn(D, generator=g).to(DEVICE)
    rot = torch.polar(torch.ones(T, R // 2), torch.randn(T, R // 2, generator=g)).to(DEVICE)
    rows = torch.tensor([9, 2, 17, 0, 5, 11], device=DEVICE)
    pool = torch.randn(20, D, generator=g).to(DEVICE, dtype)
    want = pool.clone().index_copy_(0, rows, tri_rope.rope(kv, rot, False, w, 1e-6))
    got = tri_rope.rope(kv, rot, False, w, 1e-6, None, pool, rows)
    assert got is pool and torch.equal(pool, want)
    native_pool = pool.clone()
    rope.rope(kv.float(), rot, False, w, 1e-6, None, native_pool, rows)
    torch.testing.assert_close(native_pool.float(), want.float(), rtol=2 ** -7, atol=1e-5)
