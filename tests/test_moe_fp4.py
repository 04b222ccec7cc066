"""FP4 routed-expert kernels (`triton_kernels.moe_fp4`) against the native oracle (dequantise, then matmul),
under TRITON_INTERPRET=1 on a CPU (SPARKSPEC_TEST_DEVICE=cuda: the real compiler).

Legend: T tokens, H hidden, E experts, A active experts, I expert width.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import DEVICE

if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton in this process

from sparkspec.ops import moe  # noqa: E402
from sparkspec.ops.formats import FP4_VALUES, Quantized  # noqa: E402

try:
    import triton
    import triton.language as tl

    from sparkspec.ops.triton_kernels.moe_fp4 import e2m1_pair, group_scale

    @triton.jit
    def _decode_kernel(b_ptr, s_ptr, lo_ptr, hi_ptr, sc_ptr):  # [256] uint8 in, [256] fp32 out
        i = tl.arange(0, 256)
        lo, hi = e2m1_pair(tl.load(b_ptr + i).to(tl.int32))
        tl.store(lo_ptr + i, lo * 16384.0)
        tl.store(hi_ptr + i, hi * 16384.0)
        tl.store(sc_ptr + i, group_scale(tl.load(s_ptr + i).to(tl.int32)))
except ImportError:  # _kernels() skips
    pass

LIMIT = 1.5  # small, so that the clamps bite


def _kernels():
    try:
        import triton.language as tl

        if DEVICE.type == "cpu" and type(tl.sum).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
        from sparkspec.ops.triton_kernels import moe_fp4
    except ImportError as exc:
        pytest.skip(f"triton not importable: {exc}")
    return moe_fp4


def _fp4_stack(E, R, K, g, extreme):
    """A random FP4 stack [E, R, K]: every byte value, scales 2^-8..2^4 around 1/sqrt(K); with `extreme`, some
    groups at the e8m0 ends that stay finite here (bytes 0, 1, 2 and 2^40 on whole rows)."""
    codes = torch.randint(0, 256, (E, R, K // 2), generator=g, dtype=torch.uint8)
    base = 127 - int(torch.tensor(K).log2().item()) // 2
    s = torch.randint(base - 8, base + 5, (E, R, K // 32), generator=g).to(torch.uint8)
    if extreme:
        s[0, :, 0] = 0  # 2^-127 (the kernels read 0: below any product that matters)
        s[-1, 1, :] = 1  # 2^-126
        s[0, 2, -1] = 2
        s[-1, 3, :] = 127 + 40  # a row at 2^40
    return Quantized(codes, s)


def _case(T, H, I, E, A, seed=0, dtype=torch.float32, extreme=True, repeats=False):
    """x [T, H], w13 / w2 FP4 stacks, weights [T, A] fp32, ids [T, A] int64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = _fp4_stack(E, 2 * I, H, g, extreme)
    w2 = _fp4_stack(E, H, I, g, extreme)
    if repeats:  # hash-like: repeated experts inside a token, a few experts hit often
        ids = torch.randint(0, 3, (T, A), generator=g) * 2
    else:
        ids = torch.rand(T, E, generator=g).topk(A, dim=-1).indices
    weights = torch.rand(T, A, generator=g)
    to = [Quantized(w.data.to(DEVICE), w.scale.to(DEVICE)) for w in (w13, w2)]
    return x.to(dtype).to(DEVICE), *to, weights.to(DEVICE), ids.to(DEVICE)


def _reference(x, w13, w2, w, ids):
    return moe.moe_experts(x.float(), w13, w2, w, ids, LIMIT)  # dequantised to fp32, then matmul


def _assert_close(y, ref, rel):
    """|y - ref| <= rel * (max |ref| of its output column + the median of those): per column, since the 2^40
    weight row makes one column huge; the median, since at T = 1 a column's one value may be a cancellation."""
    err = (y.float() - ref).abs()  # [T, H]
    col = ref.abs().amax(dim=0, keepdim=True)  # [1, H]
    scale = col + col.median()
    bad = err > rel * scale + 1e-30
    assert not bad.any(), f"{int(bad.sum())} elements off; worst err/scale {(err / scale).max().item():.3e}"


def test_decode_is_exact_for_every_byte_and_scale():
    _kernels()
    b = torch.arange(256, device=DEVICE, dtype=torch.int32).to(torch.uint8)
    lo, hi, sc = (torch.empty(256, device=DEVICE) for _ in range(3))
    _decode_kernel[(1,)](b, b, lo, hi, sc)
    vals = FP4_VALUES.to(DEVICE)
    ib = b.long()
    assert torch.equal(lo, vals[ib & 15]) and torch.equal(hi, vals[ib >> 4])
    assert torch.equal(torch.signbit(lo), torch.signbit(vals[ib & 15]))  # -0 stays -0
    want = torch.exp2(ib[:255].double() - 127).float()
    want[0] = 0.0  # 2^-127 is an fp32 subnormal; the kernels read byte 0 as 0
    assert torch.equal(sc[:255], want)
    # every code times every scale exponent in fp32, as the kernels apply it (2^14 first, then 2^(s-127)) and
    # as the oracle dequantises (fp32 product: its subnormals and its overflow to inf at 6 * 2^127 alike)
    prod = lo[:16, None] * sc[None, 1:255]  # [16 codes, 254 exponents]
    assert torch.equal(prod, vals[:16, None] * want[None, 1:])


# (T, E, A, routing with repeats): T = 1, 3, 17 as the brief names them, 2..6 active experts of 8
CASES = [(1, 8, 6, False), (3, 8, 2, False), (3, 8, 4, True), (17, 8, 3, False), (17, 8, 6, True)]
CONFIGS = {"fma_m1": (1, 16, 1), "fma_m4": (4, 32, 2), "dot_m16": (16, 16, 1)}


@pytest.mark.parametrize("T,E,A,repeats", CASES)
@pytest.mark.parametrize("path", list(CONFIGS))
def test_fp4_matches_dequantised_reference(T, E, A, repeats, path):
    k = _kernels()
    bm, bn, g = CONFIGS[path]
    if (bm == 1 and T > 3) or (bm < 16 and T > 3 and not repeats):
        pytest.skip("slow under the interpreter (a program per row or few): T = 1 and 3 cover the FMA rows")
    cfg = k.Fp4Config(block_m=bm, block_n=bn, groups=g, num_stages=1)
    x, w13, w2, w, ids = _case(T, 64, 32, E, A, seed=T * 10 + A, repeats=repeats)  # 2 K groups in H, 1 in I
    y = k.moe_experts_fp4(x, w13, w2, w, ids, LIMIT, cfg)
    assert y.shape == x.shape and y.dtype == x.dtype
    _assert_close(y, _reference(x, w13, w2, w, ids), 2e-5)


# the newer knobs: split-K (partial sums + the swiglu finish kernel), W·xᵀ dots, gate and up in one tile.
# H = 128, I = 64 with groups = 1: 4 K steps in the up projection, 2 in the down (split_k = 4 clamps there)
KNOBS = {
    "fma_m1_split4_fused": dict(block_m=1, block_n=32, groups=1, split_k=4, fuse_gate_up=True),
    "fma_m2_fused_xpairs": dict(block_m=2, block_n=16, groups=2, fuse_gate_up=True, x_pairs=True),
    "dot_swap": dict(block_m=16, block_n=16, groups=2, swap=True),
    "dot_swap_split2_fused": dict(block_m=16, block_n=16, groups=1, swap=True, split_k=2, fuse_gate_up=True),
    "dot_m16_split4_fused_xpairs": dict(block_m=16, block_n=32, groups=1, split_k=4, fuse_gate_up=True, x_pairs=True),
}
KNOB_CASES = [(1, 8, 6, False), (3, 8, 4, True)]  # T = 3 with repeats: several rows per expert block


@pytest.mark.parametrize("T,E,A,repeats", KNOB_CASES)
@pytest.mark.parametrize("path", list(KNOBS))
def test_fp4_knobs_match_dequantised_reference(T, E, A, repeats, path):
    k = _kernels()
    if KNOBS[path]["block_m"] == 1 and T > 1:
        pytest.skip("slow under the interpreter (a program per row): T = 1 covers the one-row FMA path")
    cfg = k.Fp4Config(num_stages=1, **KNOBS[path])
    x, w13, w2, w, ids = _case(T, 128, 64, E, A, seed=T * 7 + A, repeats=repeats)
    y = k.moe_experts_fp4(x, w13, w2, w, ids, LIMIT, cfg)
    _assert_close(y, _reference(x, w13, w2, w, ids), 2e-5)


def test_k_split_covers_k_without_empty_splits():
    k = _kernels()
    for K in (32, 64, 96, 4096):
        for groups in (1, 2, 4, 8):
            for split in (1, 2, 4, 8, 16):
                n, chunk = k._k_split(K, k.Fp4Config(groups=groups, split_k=split))
                assert chunk % (groups * 16) == 0 and 1 <= n <= split
                assert (n - 1) * chunk < K // 2 <= n * chunk  # the last split holds >= 1 step, all K covered


def test_fp4_bf16_and_default_configs():
    k = _kernels()
    x, w13, w2, w, ids = _case(2, 96, 64, 8, 3, seed=7, dtype=torch.bfloat16)  # H = 3 groups: a ragged K tile
    ref = _reference(x, w13, w2, w, ids)
    for cfg in (None, k.Fp4Config(block_m=16, block_n=16, groups=2, num_stages=1),
                k.Fp4Config(block_m=16, block_n=32, groups=2, num_stages=1, swap=True, x_pairs=True)):
        y = k.moe_experts_fp4(x, w13, w2, w, ids, LIMIT, cfg)
        assert y.dtype == torch.bfloat16
        _assert_close(y, ref, 1e-2)  # bf16 output (and bf16 activations on the dot path)


def test_fp4_can_fail():
    """The comparison sees a wrong scale: one flipped scale byte changes the output beyond the tolerance."""
    k = _kernels()
    x, w13, w2, w, ids = _case(1, 64, 32, 8, 6, seed=1, extreme=False)
    ref = _reference(x, w13, w2, w, ids)
    s2 = w2.scale.clone()
    s2[ids[0, 0], :, 0] += 3
    y = k.moe_experts_fp4(x, w13, Quantized(w2.data, s2), w, ids, LIMIT, k.Fp4Config(1, 16, 1, num_stages=1))
    with pytest.raises(AssertionError):
        _assert_close(y, ref, 2e-5)


def test_fp4_wrapper_checks():
    k = _kernels()
    x, w13, w2, w, ids = _case(2, 64, 32, 4, 2)
    with pytest.raises(ValueError, match="scales"):
        k.moe_experts_fp4(x, w13, Quantized(w2.data, w2.scale[..., :0]), w, ids, LIMIT)
    with pytest.raises(ValueError, match="power of two"):
        k.Fp4Config(block_m=3)
    with pytest.raises(ValueError, match="power of two"):
        k.Fp4Config(split_k=3)
    with pytest.raises(ValueError, match="swap"):
        k.Fp4Config(block_m=4, swap=True)
    assert k.moe_experts_fp4(x[:0], w13, w2, w[:0], ids[:0], LIMIT).shape == (0, 64)


def test_registered_version_matches_reference():
    """The registered op on FP4 stacks (an accelerator: `moe_experts_fp4`; a CPU: the native)."""
    from sparkspec.ops.registry import ops

    x, w13, w2, w, ids = _case(4, 64, 32, 8, 3, seed=4, dtype=torch.bfloat16)
    y = ops.moe_experts(x, w13, w2, w, ids, LIMIT)
    _assert_close(y, _reference(x, w13, w2, w, ids), 1e-2)
