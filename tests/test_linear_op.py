"""`ops.linear` (`sparkspec.ops.linear`): the accelerated version sends a few rows of a 16-bit linear to the
batch-invariant Triton GEMM and everything else to `F.linear`; `models.fused_linear.dense` routes plain
`nn.Linear`s through it and leaves other modules to their own forward. On a CPU the kernel runs in Triton's
interpreter (the accelerated version is called directly: the op table gives CPU tensors the native one)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from conftest import DEVICE
from torch import nn

if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton in this process

pytest.importorskip("triton")

from sparkspec.models.fused_linear import dense, fused_linear  # noqa: E402
from sparkspec.ops import linear as linear_mod  # noqa: E402
from sparkspec.ops.batch_invariant import matmul_reference  # noqa: E402
from sparkspec.ops.registry import ops  # noqa: E402


def _rand(*shape, dtype=torch.bfloat16, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def _ulp_close(got: torch.Tensor, want: torch.Tensor) -> None:
    """bf16 outputs within 2 bf16 ulps of the fp32-accumulated oracle (the sum order differs)."""
    tol = 2 * torch.finfo(torch.bfloat16).eps * want.float().abs().clamp_min(1e-2)
    assert ((got.float() - want.float()).abs() <= tol).all(), (got.float() - want.float()).abs().max()


@pytest.mark.parametrize("rows", [1, 5, linear_mod.SMALL_M_MAX])
@pytest.mark.parametrize("bias", [False, True])
def test_small_rows_take_the_triton_gemm(rows, bias, monkeypatch):
    calls = []
    from sparkspec.ops.triton_kernels import batch_invariant as kernel

    real = kernel.matmul_invariant
    monkeypatch.setattr(kernel, "matmul_invariant", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, w = _rand(rows, 40, seed=1), _rand(24, 40, seed=2)
    b = _rand(24, seed=3) if bias else None
    y = linear_mod.linear_small_m(x, w, b)
    assert calls == [1] and y.shape == (rows, 24) and y.dtype == torch.bfloat16
    _ulp_close(y, matmul_reference(x, w.t(), b))


def test_leading_dims_and_strided_rows():
    """[T, n, K] inputs (MTP's h_proj) and a column slice of a wider tensor (fused_linear's outputs)."""
    x = _rand(3, 4, 40, seed=4)
    wide = _rand(6, 72, seed=5)
    w = _rand(16, 40, seed=6)
    y = linear_mod.linear_small_m(x, w)
    assert y.shape == (3, 4, 16)
    _ulp_close(y, matmul_reference(x.reshape(12, 40), w.t()).view(3, 4, 16))
    _ulp_close(linear_mod.linear_small_m(wide[:, 8:48], w), matmul_reference(wide[:, 8:48].contiguous(), w.t()))


@pytest.mark.parametrize("case", ["many_rows", "fp32", "grad"])
def test_other_calls_are_f_linear(case, monkeypatch):
    from sparkspec.ops.triton_kernels import batch_invariant as kernel

    monkeypatch.setattr(kernel, "matmul_invariant", lambda *a, **k: pytest.fail("took the Triton GEMM"))
    rows = linear_mod.SMALL_M_MAX + 1 if case == "many_rows" else 3
    dtype = torch.float32 if case == "fp32" else torch.bfloat16
    x, w = _rand(rows, 40, dtype=dtype, seed=7), _rand(8, 40, dtype=dtype, seed=8)
    if case == "grad":
        w.requires_grad_(True)
    torch.testing.assert_close(linear_mod.linear_small_m(x, w), F.linear(x, w), rtol=0, atol=0)


def test_dense_routes_plain_linears_only(monkeypatch):
    seen = []
    real = ops.linear
    monkeypatch.setattr(ops, "linear", lambda *a, **k: seen.append(a[1]) or real(*a, **k))
    plain, sub = nn.Linear(40, 8, bias=True), type("MyLinear", (nn.Linear,), {})(40, 8)
    x = torch.randn(3, 40)
    with torch.no_grad():
        torch.testing.assert_close(dense(plain, x), plain(x), rtol=0, atol=0)
        torch.testing.assert_close(dense(sub, x), sub(x), rtol=0, atol=0)
    assert len(seen) == 1 and seen[0] is plain.weight


@pytest.mark.parametrize("stackable", [True, False])
def test_fused_linear_goes_through_ops_linear(stackable, monkeypatch):
    """One call on the stacked weight where the linears share one; else one call per linear (a bias blocks it)."""
    seen = []
    real = ops.linear
    monkeypatch.setattr(ops, "linear", lambda *a, **k: seen.append(a[1]) or real(*a, **k))
    a, b = nn.Linear(40, 8, bias=not stackable), nn.Linear(40, 6, bias=False)
    x = torch.randn(3, 40)
    with torch.no_grad():
        want = (a(x), b(x))
        got = fused_linear(x, a, b)
    assert [tuple(w.shape) for w in seen] == ([(14, 40)] if stackable else [(8, 40), (6, 40)])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)
