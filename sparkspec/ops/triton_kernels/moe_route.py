"""MoE routing glue in one launch per op (Triton): the router's scores and top-k (`moe_route`), the (token, slot)
pairs sorted by expert (`sort_by_expert`) and the shared expert's SwiGLU on its fused gate / up projection
(`swiglu_packed`). Legend: T tokens, E experts (EP = next power of two), A active experts, P = T·A pairs.

Why: in torch each of these is a chain of small kernels (softplus, sqrt, add, topk, gather, sum, div, mul; a radix
sort, an arange and a searchsorted; two clamps, a silu and a mul), a dozen launches per layer at decode sizes
where each costs more in launch gap than in work.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sparkspec.ops.registry import accelerated
from sparkspec.ops.triton_kernels.common import check, next_pow2, same_device

_SCORES = {"softmax": 0, "sigmoid": 1, "sqrtsoftplus": 2}


@triton.jit
def _softplus(x):
    """log(1 + e^x) as torch's softplus (beta 1, linear above 20), accurate for very negative x as well."""
    u = tl.exp(-tl.abs(x))
    log1p = tl.where(u < 1e-4, u * (1.0 - 0.5 * u), tl.log(1.0 + u))
    return tl.where(x > 20.0, x, tl.maximum(x, 0.0) + log1p)


@triton.jit
def _moe_route_kernel(
    logits_ptr,  # [T, E] fp32 router logits (row stride stride_lt)
    bias_ptr,  # [E] fp32 selection bias (unused without HAS_BIAS)
    hash_ptr,  # [T, A] int expert ids of hash layers (unused without HASH)
    weights_ptr,  # [T, A] fp32 out
    ids_ptr,  # [T, A] int64 out
    num_tokens,
    num_experts,
    stride_lt,
    scaling,
    SCORE: tl.constexpr,  # 0 softmax, 1 sigmoid, 2 sqrt(softplus)
    HAS_BIAS: tl.constexpr,
    HASH: tl.constexpr,
    NORM: tl.constexpr,
    TOP_K: tl.constexpr,
    AP: tl.constexpr,  # next power of two of TOP_K
    BLOCK_T: tl.constexpr,
    EP: tl.constexpr,
):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, EP)
    tok_ok = toks < num_tokens
    col_ok = cols < num_experts
    t64 = toks.to(tl.int64)
    ok = tok_ok[:, None] & col_ok[None, :]
    x = tl.load(logits_ptr + t64[:, None] * stride_lt + cols[None, :], mask=ok, other=0.0)  # [BLOCK_T, EP]
    if SCORE == 0:
        z = tl.where(col_ok[None, :], x, float("-inf"))  # rows past T hold zeros: finite
        e = tl.exp(z - tl.max(z, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    elif SCORE == 1:
        scores = tl.sigmoid(x)
    else:
        scores = tl.sqrt_rn(_softplus(x))
    sel = scores
    if HAS_BIAS:
        sel = sel + tl.load(bias_ptr + cols, mask=col_ok, other=0.0)[None, :]
    sel = tl.where(ok, sel, float("-inf"))
    slots = tl.arange(0, AP)
    w = tl.zeros([BLOCK_T, AP], dtype=tl.float32)
    ids = tl.zeros([BLOCK_T, AP], dtype=tl.int64)
    for a in tl.static_range(TOP_K):  # the largest first; ties to the lower expert id
        if HASH:
            pick = tl.load(hash_ptr + t64 * TOP_K + a, mask=tok_ok, other=0).to(tl.int32)
        else:
            pick = tl.argmax(sel, axis=1).to(tl.int32)  # [BLOCK_T]
        hit = cols[None, :] == pick[:, None]
        w_a = tl.sum(tl.where(hit, scores, 0.0), axis=1)
        sel = tl.where(hit, float("-inf"), sel)
        w = tl.where(slots[None, :] == a, w_a[:, None], w)
        ids = tl.where(slots[None, :] == a, pick.to(tl.int64)[:, None], ids)
    if NORM:
        w = w / (tl.sum(w, axis=1)[:, None] + 1e-20)
    out = t64[:, None] * TOP_K + slots[None, :]
    out_ok = tok_ok[:, None] & (slots[None, :] < TOP_K)
    tl.store(weights_ptr + out, w * scaling, mask=out_ok)
    tl.store(ids_ptr + out, ids, mask=out_ok)


_ROUTE_BLOCK_T = 8


@accelerated("moe_route", "cuda", "rocm", "xpu")
def moe_route(
    logits: torch.Tensor,  # [T, E] fp32
    bias: torch.Tensor | None,  # [E]
    hash_ids: torch.Tensor | None,  # [T, A]
    top_k: int,
    scoring_func: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `ops.moe.moe_route` in one launch -> (weights [T, A] fp32, ids [T, A] int64), the slots in
    descending order of the selection score (the native leaves their order to `torch.topk(sorted=False)`; ties,
    if any, go to the lower expert id). Autograd, or an unknown scoring function: the native."""
    from sparkspec.ops.moe import moe_route as native

    needs_grad = torch.is_grad_enabled() and (logits.requires_grad or (bias is not None and bias.requires_grad))
    if needs_grad or scoring_func not in _SCORES:
        return native(logits, bias, hash_ids, top_k, scoring_func, norm_topk_prob, routed_scaling_factor)
    check(logits.dim() == 2, f"moe_route: logits must be [T, E], got {tuple(logits.shape)}")
    T, E = logits.shape
    check(1 <= top_k <= E, f"moe_route: top_k {top_k} must be in 1..{E}")
    if bias is not None:
        check(bias.numel() == E, f"moe_route: bias must have {E} entries, got {bias.numel()}")
    check(hash_ids is None or tuple(hash_ids.shape) == (T, top_k),
          f"moe_route: hash_ids must be [{T}, {top_k}], got {None if hash_ids is None else tuple(hash_ids.shape)}")
    logits = logits.float()
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    bias_f = bias.float().contiguous() if bias is not None else logits
    hashed = hash_ids.contiguous() if hash_ids is not None else logits
    check(same_device(logits, bias_f, hashed), "moe_route: one device for all")
    weights = torch.empty(T, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(T, top_k, dtype=torch.long, device=logits.device)
    if T == 0:
        return weights, ids
    _moe_route_kernel[(triton.cdiv(T, _ROUTE_BLOCK_T),)](
        logits, bias_f, hashed, weights, ids, T, E, logits.stride(0), float(routed_scaling_factor),
        SCORE=_SCORES[scoring_func], HAS_BIAS=bias is not None, HASH=hash_ids is not None, NORM=bool(norm_topk_prob),
        TOP_K=top_k, AP=next_pow2(top_k), BLOCK_T=_ROUTE_BLOCK_T, EP=max(next_pow2(E), 2), num_warps=4,
    )
    return weights, ids


@triton.jit
def _moe_sort_kernel(
    ids_ptr,  # [P] int expert ids of the flat (token, slot) pairs
    order_ptr,  # [P] int64 out: pairs sorted by expert, stable
    ends_ptr,  # [E] int32 out: end of each expert's run in that order
    num_pairs,
    num_experts,
    BLOCK: tl.constexpr,
):
    """Program i ranks pairs i·BLOCK .. (among all P: the pairs of a lower expert, then the same expert's earlier
    pairs) and counts the pairs up to experts i·BLOCK ..: an exact counting sort, O(P²) compares."""
    i = tl.program_id(0)
    ps = i * BLOCK + tl.arange(0, BLOCK)
    p_ok = ps < num_pairs
    mine = tl.load(ids_ptr + ps, mask=p_ok, other=0)
    es = i * BLOCK + tl.arange(0, BLOCK)
    rank = tl.zeros([BLOCK], dtype=tl.int32)
    upto = tl.zeros([BLOCK], dtype=tl.int32)
    for q0 in range(0, num_pairs, BLOCK):
        qs = q0 + tl.arange(0, BLOCK)
        q_ok = qs < num_pairs
        other = tl.load(ids_ptr + qs, mask=q_ok, other=0)
        before = (other[None, :] < mine[:, None]) | ((other[None, :] == mine[:, None]) & (qs[None, :] < ps[:, None]))
        rank += tl.sum((before & q_ok[None, :]).to(tl.int32), axis=1)
        upto += tl.sum(((other[None, :] <= es[:, None]) & q_ok[None, :]).to(tl.int32), axis=1)
    tl.store(order_ptr + rank, ps.to(tl.int64), mask=p_ok)
    tl.store(ends_ptr + es, upto, mask=es < num_experts)


_SORT_BLOCK = 64
SORT_MAX_PAIRS = 4096  # above: torch.sort (O(P²) compares stop being cheap)


@accelerated("sort_by_expert", "cuda", "rocm", "xpu")
def sort_by_expert(
    ids: torch.Tensor,  # [T, A] int expert ids
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `ops.moe.sort_by_expert` in one launch for up to SORT_MAX_PAIRS pairs (the same integers:
    both orders are stable) -> (order [P] int64, ends [E] int32)."""
    from sparkspec.ops.moe import sort_by_expert_native

    P = ids.numel()
    if P > SORT_MAX_PAIRS or P == 0:
        return sort_by_expert_native(ids, num_experts)
    check(not ids.dtype.is_floating_point, f"sort_by_expert: ids must be integer, got {ids.dtype}")
    flat = ids.reshape(-1)
    flat = flat if flat.is_contiguous() else flat.contiguous()
    order = torch.empty(P, dtype=torch.long, device=ids.device)
    ends = torch.empty(num_experts, dtype=torch.int32, device=ids.device)
    _moe_sort_kernel[(triton.cdiv(max(P, num_experts), _SORT_BLOCK),)](
        flat, order, ends, P, num_experts, BLOCK=_SORT_BLOCK, num_warps=4)
    return order, ends


@triton.jit
def _swiglu_kernel(
    h_ptr,  # [T, 2I] gate then up (row stride stride_ht)
    out_ptr,  # [T, I]
    inter,
    stride_ht,
    limit,
    BLOCK: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(h_ptr + t * stride_ht + cols, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + t * stride_ht + inter + cols, mask=ok, other=0.0).to(tl.float32)
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    # rounded where torch's elementwise chain rounds: silu's result, then the product
    act = (gate / (1.0 + tl.exp(-gate))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + t * inter + cols, (act * up).to(out_ptr.dtype.element_ty), mask=ok)


@accelerated("swiglu_packed", "cuda", "rocm", "xpu")
def swiglu_packed(
    h: torch.Tensor,  # [T, 2I] gate (w1) columns then up (w3) columns
    limit: float,
) -> torch.Tensor:
    """Triton twin of `ops.moe.swiglu_packed` in one launch -> [T, I] h.dtype."""
    from sparkspec.ops.moe import swiglu_packed as native

    if torch.is_grad_enabled() and h.requires_grad:
        return native(h, limit)
    check(h.dim() == 2 and h.shape[1] % 2 == 0, f"swiglu_packed: h must be [T, 2I], got {tuple(h.shape)}")
    T, I = h.shape[0], h.shape[1] // 2
    h = h if h.stride(-1) == 1 else h.contiguous()
    out = torch.empty(T, I, dtype=h.dtype, device=h.device)
    if T == 0:
        return out
    block = min(max(next_pow2(I), 16), 1024)
    _swiglu_kernel[(T, triton.cdiv(I, block))](h, out, I, h.stride(0), float(limit), BLOCK=block, num_warps=4)
    return out
