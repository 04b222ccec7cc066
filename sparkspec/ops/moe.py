"""MoE routing and expert compute. Legend: T tokens, H hidden, E experts, A active experts, I expert width.

Routed experts are stacked once per layer (`expert_weights`): bf16 / fp32 tensors, or, for experts kept in FP4
(`loading.quantized.Fp4Linear`), `Quantized` stacks of packed e2m1 bytes [E, out, in/2] and e8m0 scales
[E, out, in/32]. `moe_experts` takes either: the native dequantises the FP4 stacks and runs the bf16 path
(the oracle), the accelerated version decodes them in registers (`triton_kernels.moe_fp4`).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from sparkspec.ops.formats import Quantized
from sparkspec.ops.registry import accelerated, native, ops

Weights = torch.Tensor | Quantized  # a stack of expert weights: plain, or FP4 codes with their scales


def score_fn(logits: torch.Tensor, kind: str) -> torch.Tensor:
    if kind == "sqrtsoftplus":
        return torch.sqrt(F.softplus(logits))
    if kind == "sigmoid":
        return torch.sigmoid(logits)
    return torch.softmax(logits, dim=-1)


@native("moe_route")
def moe_route(
    logits: torch.Tensor,  # [T, E] fp32 router logits
    bias: torch.Tensor | None,  # [E] e_score_correction_bias: used for SELECTION only
    hash_ids: torch.Tensor | None,  # [T, A] experts fixed by tid2eid (hash layers)
    top_k: int,
    scoring_func: str,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (weights [T, A] fp32, expert ids [T, A] int64)."""
    scores = score_fn(logits.float(), scoring_func)
    if hash_ids is not None:
        ids = hash_ids.long()
    else:
        sel = scores if bias is None else scores + bias.float()
        ids = torch.topk(sel, top_k, dim=-1, sorted=False).indices
    w = scores.gather(1, ids)
    if norm_topk_prob:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return w * routed_scaling_factor, ids


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SwiGLU with the V4 clamp: gate clamped above at `limit`, up clamped to ±`limit`."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


@native("swiglu_packed")
def swiglu_packed(
    h: torch.Tensor,  # [T, 2I] gate (w1) columns then up (w3) columns: one GEMM's output
    limit: float,
) -> torch.Tensor:
    """`swiglu` of the two halves of h -> [T, I] h.dtype (the shared expert after its fused w1 / w3 GEMM)."""
    gate, up = h.chunk(2, dim=-1)
    return swiglu(gate, up, limit)


def _stack(experts: Sequence[torch.nn.Module], attr: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(w13 [E, 2I, ...] with rows 0..I-1 from w1 and I..2I-1 from w3, w2 [E, H, ...]) of parameter `attr`."""
    w13 = torch.stack([torch.cat([getattr(e.w1, attr), getattr(e.w3, attr)], dim=0) for e in experts])
    return w13, torch.stack([getattr(e.w2, attr) for e in experts])


def is_fp4(experts: Sequence[torch.nn.Module]) -> bool:
    """The experts hold FP4 codes (`Fp4Linear`: uint8 `weight` with a `scale`)."""
    return experts[0].w1.weight.dtype == torch.uint8


def stack_experts(
    experts: Sequence[torch.nn.Module],  # E modules with .w1 [I, H] gate, .w2 [H, I] down, .w3 [I, H] up Linears
) -> tuple[Weights, Weights]:
    """-> (w13 [E, 2I, H] with rows 0..I-1 = w1 and I..2I-1 = w3, w2 [E, H, I]): copies, differentiable; for
    FP4 experts `Quantized` stacks (codes [E, ., ./2] and scales [E, ., ./32] stacked the same way)."""
    w13, w2 = _stack(experts, "weight")
    if not is_fp4(experts):
        return w13, w2
    s13, s2 = _stack(experts, "scale")
    return Quantized(w13, s13), Quantized(w2, s2)


def stack_experts_(moe: torch.nn.Module) -> tuple[Weights, Weights]:
    """Stack `moe.experts` once and re-point each expert's parameters to views of the stacks (no copy kept).

    Parameter names, values and `state_dict()` are unchanged, and in-place loads (`p.copy_`) land in the
    stacks. Anything that replaces `p.data` later (`.to(device / dtype)`) breaks the sharing:
    `expert_weights` then stacks again. Call it after placement."""
    with torch.inference_mode(False), torch.no_grad():  # normal tensors even when called from inference
        w13, w2 = stack_experts(moe.experts)
        inter = w2.shape[2]
        parts = [(w13, w2, "weight")]
        if isinstance(w13, Quantized):
            parts = [(w13.data, w2.data, "weight"), (w13.scale, w2.scale, "scale")]
        for s13, s2, attr in parts:
            for i, e in enumerate(moe.experts):
                getattr(e.w1, attr).data = s13[i, :inter]
                getattr(e.w3, attr).data = s13[i, inter:]
                getattr(e.w2, attr).data = s2[i]
    moe._stacked_experts = (w13, w2)  # a plain attribute: not in state_dict, not moved by .to()
    return w13, w2


def expert_weights(moe: torch.nn.Module) -> tuple[Weights, Weights]:
    """(w13 [E, 2I, H], w2 [E, H, I]) of `moe.experts` for `moe_experts`.

    Training (grad enabled and the weights require grad): a differentiable stack per call. Otherwise the
    shared stacks of `stack_experts_`, made on first use and again whenever placement broke the sharing
    (checked on the first and last expert: O(1) per call)."""
    experts = moe.experts
    if torch.is_grad_enabled() and experts[0].w1.weight.requires_grad:
        return stack_experts(experts)
    stacked = getattr(moe, "_stacked_experts", None)
    if stacked is None or not _shares(stacked, experts):
        stacked = stack_experts_(moe)
    return stacked


def _shares(stacked: tuple[Weights, Weights], experts: Sequence[torch.nn.Module]) -> bool:
    w13, w2 = (w.data if isinstance(w, Quantized) else w for w in stacked)
    first, last = experts[0], experts[-1]
    return (len(experts) == w13.shape[0] and first.w1.weight.data_ptr() == w13.data_ptr()
            and first.w1.weight.dtype == w13.dtype and first.w1.weight.device == w13.device
            and last.w2.weight.data_ptr() == w2[-1].data_ptr()
            and last.w3.weight.data_ptr() == w13[-1, first.w1.weight.shape[0]:].data_ptr())


def sort_by_expert(
    ids: torch.Tensor,  # [T, A] int expert ids
    num_experts: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (order [T*A] int64: flat (token, slot) pairs sorted by expert, stable;
    ends [E] int32: end of each expert's run of rows in that order (cumulative counts)). No host sync.
    Integers, so every implementation gives the same (`triton_kernels.moe_route`: one launch at decode sizes)."""
    return ops.sort_by_expert(ids, num_experts)


@native("sort_by_expert")
def sort_by_expert_native(ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`sort_by_expert` by a stable sort and a search of each expert's end."""
    sorted_ids, order = torch.sort(ids.reshape(-1), stable=True)
    ends = torch.searchsorted(sorted_ids, torch.arange(num_experts, device=ids.device, dtype=sorted_ids.dtype),
                              right=True, out_int32=True)
    return order, ends


@functools.cache
def _cuda_grouped_mm_arch(index: int) -> bool:
    return torch.version.cuda is not None and torch.cuda.get_device_capability(index)[0] in (9, 10)


def grouped_mm_ok(dtype: torch.dtype, device: torch.device, hidden: int, inter: int) -> bool:
    """Whether `torch._grouped_mm` runs the expert GEMMs here without a host sync: CPU (fp32/bf16/fp16), or
    CUDA sm90/sm100 in bf16 (other archs take a fallback that copies the offsets to the host); H and I
    must be multiples of 16 bytes (row strides)."""
    align = 16 // dtype.itemsize
    if not hasattr(torch, "_grouped_mm") or hidden % align or inter % align:
        return False
    if device.type == "cpu":
        return dtype in (torch.float32, torch.bfloat16, torch.float16)
    if device.type == "cuda":
        return dtype == torch.bfloat16 and _cuda_grouped_mm_arch(device.index or 0)
    return False


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


@native("moe_experts")
def moe_experts(
    x: torch.Tensor,  # [T, H]
    w13: Weights,  # [E, 2I, H] rows 0..I-1 gate (w1), I..2I-1 up (w3)
    w2: Weights,  # [E, H, I] down
    weights: torch.Tensor,  # [T, A] fp32
    ids: torch.Tensor,  # [T, A] int64
    limit: float,
    shared: torch.Tensor | None = None,  # [T, H] x.dtype: the shared expert's output, added to the result
) -> torch.Tensor:
    """Σ_a weights[t, a] · w2[e] swiglu(w1[e] x[t], w3[e] x[t]), e = ids[t, a] -> [T, H] (x.dtype), plus `shared`
    when given (added to the rounded sum, as `routed + shared` adds: accelerated versions do it in their last
    launch).

    No host sync and a torch-op count fixed by the shapes' path: (token, slot) pairs sorted by expert and two
    `torch._grouped_mm` (where `grouped_mm_ok`), else every expert on every token (`_moe_dense`). FP4 stacks
    are dequantised to the compute dtype first (rounded once from the fp32 product: what loading them
    dequantised gives)."""
    T, A = ids.shape
    E, H, I = w2.shape
    dt = _compute_dtype(x)
    w13, w2 = (w.dequantize(dt) if isinstance(w, Quantized) else w for w in (w13, w2))
    xc, w13, w2 = x.to(dt), w13.to(dt), w2.to(dt)  # no-ops unless autocast
    if T == 0 or not grouped_mm_ok(dt, x.device, H, I):
        y = _moe_dense(xc, w13, w2, weights, ids, limit).to(x.dtype)
        return y if shared is None else y + shared
    order, ends = sort_by_expert(ids, E)
    h = torch._grouped_mm(xc[order // A], w13.transpose(1, 2), offs=ends)  # [T*A, 2I] sorted rows
    o = torch._grouped_mm(swiglu(h[:, :I], h[:, I:], limit), w2.transpose(1, 2), offs=ends)  # [T*A, H]
    y = torch.empty_like(o).index_copy_(0, order, o)  # back to (token, slot) order: no add collisions
    y = (y.view(T, A, H).float() * weights.float().unsqueeze(-1)).sum(dim=1).to(x.dtype)
    return y if shared is None else y + shared


_TRITON_MAX_PAIRS = 256  # T·A up to this: the Triton kernel beats torch._grouped_mm (H200, decode sizes)


@accelerated("moe_experts", "cuda", "rocm", "xpu")
def moe_experts_accelerated(
    x: torch.Tensor,  # [T, H]
    w13: Weights,  # [E, 2I, H]
    w2: Weights,  # [E, H, I]
    weights: torch.Tensor,  # [T, A] fp32
    ids: torch.Tensor,  # [T, A] int64
    limit: float,
    shared: torch.Tensor | None = None,  # [T, H]
) -> torch.Tensor:
    """The Triton grouped GEMM for decode sizes (T·A <= 256), where `torch._grouped_mm` is not usable, and for
    FP4 stacks at any size (`triton_kernels.moe_fp4`: the packed bytes streamed and decoded in registers); the
    native (`torch._grouped_mm`) for larger plain batches, for CPU tensors, when autograd needs it, or without
    triton."""
    fp4 = isinstance(w13, Quantized)
    needs_grad = torch.is_grad_enabled() and (x.requires_grad or any(
        w.requires_grad for w in (w13, w2) if not isinstance(w, Quantized)))
    big = not fp4 and ids.numel() > _TRITON_MAX_PAIRS and grouped_mm_ok(_compute_dtype(x), x.device, *w2.shape[1:])
    if x.device.type == "cpu" or needs_grad or big or torch.is_autocast_enabled(x.device.type):
        return moe_experts(x, w13, w2, weights, ids, limit, shared)
    try:
        from sparkspec.ops.triton_kernels.moe import moe_experts_triton
        from sparkspec.ops.triton_kernels.moe_fp4 import moe_experts_fp4
    except ImportError:
        return moe_experts(x, w13, w2, weights, ids, limit, shared)
    if fp4:  # its own kernels, configured by T·A (FMA rows for decode, tensor-core tiles for large batches)
        return moe_experts_fp4(x, w13, w2, weights, ids, limit, shared=shared)
    return moe_experts_triton(x, w13, w2, weights, ids, limit, shared=shared)


_DENSE_BUDGET = 1 << 25  # elements of one [experts, T, 2I] intermediate in `_moe_dense`


def _moe_dense(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor,  # [E, 2I, H]
    w2: torch.Tensor,  # [E, H, I]
    weights: torch.Tensor,  # [T, A] fp32
    ids: torch.Tensor,  # [T, A] int64
    limit: float,
) -> torch.Tensor:
    """Every expert on every token, weighted by a dense [T, E] routing matrix (0 for unpicked experts):
    E/A times the needed flops, but sync-free; experts in chunks bounded by `_DENSE_BUDGET` -> [T, H] fp32."""
    T = x.shape[0]
    E, H, I = w2.shape
    dense = torch.zeros(T, E, device=x.device).scatter_add_(1, ids, weights.float())  # [T, E] repeats summed
    chunk = max(1, min(E, _DENSE_BUDGET // max(1, T * 2 * I)))
    y = x.new_zeros(T, H, dtype=torch.float32)
    for e0 in range(0, E, chunk):  # a count fixed by the shapes
        h = torch.matmul(x, w13[e0:e0 + chunk].transpose(1, 2))  # [e, T, 2I]
        o = torch.bmm(swiglu(h[..., :I], h[..., I:], limit), w2[e0:e0 + chunk].transpose(1, 2))  # [e, T, H]
        y = y + (o.float() * dense[:, e0:e0 + chunk].t().unsqueeze(-1)).sum(dim=0)
    return y
