"""MoE expert compute: the sync-free native paths (grouped GEMM and dense fallback) against a per-token loop,
its op count (fixed by shapes, not by tokens or routing), autocast, the stacked expert weights, and the
Triton grouped GEMM against the native (TRITON_INTERPRET=1 on a CPU).

Legend: T tokens, H hidden, E experts, A active experts, I expert width.
"""

from __future__ import annotations

import os
from collections import Counter

import pytest
import torch
from conftest import DEVICE, tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

if DEVICE.type == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # must precede the first import of triton in this process

from sparkspec.models.deepseek_v4 import MoE  # noqa: E402
from sparkspec.ops import moe  # noqa: E402

LIMIT = 1.5  # small, so that the clamps bite


def _case(T, H, I, E, A, routing, seed=0, dtype=torch.float32):
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], weights [T, A] fp32, ids [T, A] int64."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w13 = torch.randn(E, 2 * I, H, generator=g) / H**0.5 * 2
    w2 = torch.randn(E, H, I, generator=g) / I**0.5
    if routing == "topk":  # distinct experts per token; the last two experts never picked
        ids = torch.rand(T, E - 2, generator=g).topk(A, dim=-1).indices
    else:  # hash-like: repeats within a token, a few experts hit often, expert 1 never
        ids = torch.randint(0, 3, (T, A), generator=g) * 2
    weights = torch.rand(T, A, generator=g)
    return [t.to(DEVICE) for t in (x.to(dtype), w13.to(dtype), w2.to(dtype), weights, ids)]


def _loop_reference(x, w13, w2, weights, ids, limit):
    """Per token, per slot, fp32 -> [T, H]."""
    x, w13, w2 = x.float(), w13.float(), w2.float()
    I = w2.shape[2]
    y = torch.zeros_like(x)
    for t in range(ids.shape[0]):
        for a in range(ids.shape[1]):
            e = int(ids[t, a])
            h = moe.swiglu(w13[e, :I] @ x[t], w13[e, I:] @ x[t], limit)
            y[t] += weights[t, a] * (w2[e] @ h)
    return y


CASES = [(T, r) for T in (1, 64) for r in ("topk", "hash")]


@pytest.mark.parametrize("T,routing", CASES)
@pytest.mark.parametrize("path", ["grouped", "dense"])
def test_native_matches_loop(T, routing, path, monkeypatch):
    if path == "dense":
        monkeypatch.setattr(moe, "grouped_mm_ok", lambda *a: False)
    elif not moe.grouped_mm_ok(torch.float32, DEVICE, 32, 16):
        pytest.skip("torch._grouped_mm is not usable here")
    x, w13, w2, w, ids = _case(T, 32, 16, 8, 3, routing)
    y = moe.moe_experts(x, w13, w2, w, ids, LIMIT)
    assert y.shape == x.shape and y.dtype == x.dtype
    torch.testing.assert_close(y, _loop_reference(x, w13, w2, w, ids, LIMIT), rtol=1e-5, atol=1e-5)


def test_unaligned_width_takes_the_dense_path():
    x, w13, w2, w, ids = _case(5, 30, 6, 4, 2, "topk")  # H, I not multiples of 16 bytes
    assert not moe.grouped_mm_ok(torch.float32, DEVICE, 30, 6)
    y = moe.moe_experts(x, w13, w2, w, ids, LIMIT)
    torch.testing.assert_close(y, _loop_reference(x, w13, w2, w, ids, LIMIT), rtol=1e-5, atol=1e-5)


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _count(fn, *args):
    with _CountOps() as c:
        fn(*args)
    return c.ops


@pytest.mark.parametrize("path", ["grouped", "dense"])
def test_op_count_independent_of_tokens_and_routing(path, monkeypatch):
    if path == "dense":
        monkeypatch.setattr(moe, "grouped_mm_ok", lambda *a: False)
    counts = [_count(moe.moe_experts, *_case(T, 32, 16, 8, 3, r, seed=T), LIMIT) for T, r in
              [(1, "topk"), (32, "topk"), (32, "hash")]]
    assert counts[0] == counts[1] == counts[2]
    banned = [op for op in counts[1] if any(b in op for b in ("_local_scalar_dense", "nonzero", "unique", "item"))]
    assert not banned, f"host syncs: {banned}"


def test_bf16_autocast_returns_x_dtype():
    x, w13, w2, w, ids = _case(16, 32, 16, 8, 3, "topk")
    with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
        y = moe.moe_experts(x, w13, w2, w, ids, LIMIT)
    assert y.dtype == torch.float32
    ref = _loop_reference(x, w13, w2, w, ids, LIMIT)
    torch.testing.assert_close(y, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    yb = moe.moe_experts(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), w, ids, LIMIT)
    assert yb.dtype == torch.bfloat16


def _tiny_moe(seed=0):
    torch.manual_seed(seed)
    m = MoE(tiny_config(), layer_id=3).to(DEVICE)  # layer 3: top-k routed
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return m


def test_stack_experts_keeps_state_dict_and_shares_storage():
    m = _tiny_moe()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    w13, w2 = moe.stack_experts_(m)
    after = m.state_dict()
    assert list(after) == list(before)
    for k in before:
        assert torch.equal(after[k], before[k]), k
    E, I = w2.shape[0], w2.shape[2]
    assert w13.shape == (E, 2 * I, m.cfg.hidden_size)
    ex = m.experts[E - 1]
    assert torch.equal(w13[E - 1, :I], ex.w1.weight) and torch.equal(w13[E - 1, I:], ex.w3.weight)
    with torch.no_grad():  # an in-place load lands in the stacks
        ex.w3.weight.copy_(torch.full_like(ex.w3.weight, 0.5))
        ex.w2.weight.copy_(torch.full_like(ex.w2.weight, -0.5))
    assert (w13[E - 1, I:] == 0.5).all() and (w2[E - 1] == -0.5).all()
    with torch.inference_mode():
        assert moe.expert_weights(m)[0] is w13  # still shared: no restack
    # every gate/up parameter is a view of the one stack (checkpoint writers clone before safetensors)
    assert all(v.untyped_storage().data_ptr() == w13.untyped_storage().data_ptr()
               for k, v in after.items() if k.startswith("experts.") and ".w2." not in k)


def test_expert_weights_restacks_after_placement_and_trains():
    m = _tiny_moe()
    w13, _ = moe.stack_experts_(m)
    m.to(torch.float64)  # replaces p.data: sharing broken
    with torch.no_grad():
        w13b, w2b = moe.expert_weights(m)
    assert w13b is not w13 and w13b.dtype == torch.float64
    assert w13b.data_ptr() == m.experts[0].w1.weight.data_ptr()
    m.to(torch.float32)
    x, _, _, w, ids = _case(6, m.cfg.hidden_size, 1, m.cfg.n_routed_experts, 2, "topk")
    w13, w2 = moe.expert_weights(m)  # grad enabled: a differentiable stack
    assert w13.requires_grad
    moe.moe_experts(x, w13, w2, w, ids, LIMIT).square().sum().backward()
    grads = {n: p.grad.clone() for n, p in m.experts.named_parameters()}
    m.zero_grad()
    ref = torch.stack([torch.cat([e.w1.weight, e.w3.weight]) for e in m.experts]), \
        torch.stack([e.w2.weight for e in m.experts])
    _loop_reference(x, *ref, w, ids, LIMIT).square().sum().backward()
    for n, p in m.experts.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)


# ------------------------------------------------------------------------------------------ Triton kernel

def _triton_moe():
    try:
        import triton.language as tl

        if DEVICE.type == "cpu" and type(tl.sum).__name__ != "InterpretedFunction":
            pytest.skip("triton was imported before TRITON_INTERPRET=1 was set")
        from sparkspec.ops.triton_kernels import moe as tri_moe
    except ImportError as exc:
        pytest.skip(f"triton not importable: {exc}")
    return tri_moe


@pytest.mark.parametrize("T,routing", CASES + [(0, "topk")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_native(T, routing, dtype):
    tri = _triton_moe()
    x, w13, w2, w, ids = _case(T, 40, 24, 5, 2, routing, seed=3, dtype=dtype)  # odd sizes: masked tiles
    y = tri.moe_experts_triton(x, w13, w2, w, ids, LIMIT)
    assert y.shape == x.shape and y.dtype == dtype
    ref = moe.moe_experts(x.float(), w13.float(), w2.float(), w, ids, LIMIT)
    if dtype == torch.float32 or T == 0:
        torch.testing.assert_close(y.float(), ref, rtol=2e-5, atol=2e-5)
        return
    mag = ref.abs().clamp(min=0.25)  # bf16: within 1 ulp of the fp32 oracle (ulp at 1/4 below 1/4)
    ulp = torch.exp2(torch.floor(torch.log2(mag)) - 7)
    assert ((y.float() - ref).abs() / ulp).max().item() <= 1.0


@pytest.mark.parametrize("T", [4, 100])  # T·A = 12 (Triton on accelerators) and 300 (torch._grouped_mm there)
def test_registered_version_matches_native(T):
    from sparkspec.ops.registry import ops

    x, w13, w2, w, ids = _case(T, 64, 32, 8, 3, "hash", seed=T, dtype=torch.bfloat16)
    y = ops.moe_experts(x, w13, w2, w, ids, LIMIT)
    assert y.dtype == torch.bfloat16 and y.shape == x.shape
    ref = moe.moe_experts(x.float(), w13.float(), w2.float(), w, ids, LIMIT)
    torch.testing.assert_close(y.float(), ref, rtol=0.02, atol=0.02 * ref.abs().max().item())
