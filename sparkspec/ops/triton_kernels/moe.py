"""Grouped-GEMM MoE experts (Triton), for accelerators where `torch._grouped_mm` is not usable (ROCm, XPU, CUDA
before sm90, fp32 weights). Called by `sparkspec.ops.moe.moe_experts_accelerated`, the registered version.

Legend: T tokens, H hidden, E experts, A active experts, I expert width, P = T·A (token, slot) pairs.
The pairs are sorted by expert (torch, on the device: no host sync), then two launches over row blocks that
each hold rows of ONE expert (a group of n rows takes ceil(n / BLOCK_M) blocks; the grid is the static bound
min(P, ceil(P / BLOCK_M) + E), spare programs find no block and exit):
  1. `_moe_up_kernel`: act = swiglu(x[token] · w1[e]ᵀ, x[token] · w3[e]ᵀ) -> [P, I] fp32, rows gathered in-kernel;
  2. `_moe_down_kernel`: out[pair] = weight[pair] · act · w2[e]ᵀ -> [P, H] fp32, stored in (token, slot) order,
     so the final Σ over slots is a plain fixed-order sum (deterministic, no atomics).
With FP4 experts (`Quantized` stacks: e2m1 bytes [E, ., ./2], e8m0 scales [E, ., ./32]) the same launches load
packed weight tiles and dequantise them in registers (`triton_kernels.quant.weight_tile`, constexpr FP4).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkspec.ops.formats import Quantized
from sparkspec.ops.triton_kernels.common import check, next_pow2, on_interpreter, same_device
from sparkspec.ops.triton_kernels.quant import dot_t, weight_tile


@triton.jit
def _row_block(
    ends_ptr,  # [E] int32 end row of each expert's group (sorted order)
    num_experts,
    BLOCK_M: tl.constexpr,
    E_P: tl.constexpr,
):
    """This program's row block -> (expert, rows [BLOCK_M] in sorted order, row mask); expert == E: no block.
    Expert e's rows take ceil(n_e / BLOCK_M) blocks; every program derives the block ends from `ends` itself
    (E_P values), which saves the host-side launches that computed them."""
    pid = tl.program_id(0)
    es = tl.arange(0, E_P)
    real = es < num_experts
    ends = tl.load(ends_ptr + es, mask=real, other=0)
    starts = tl.load(ends_ptr + es - 1, mask=real & (es > 0), other=0)
    block_ends = tl.cumsum((ends - starts + BLOCK_M - 1) // BLOCK_M, axis=0)
    block_ends = tl.where(real, block_ends, 0x7FFFFFFF)
    e = tl.sum((block_ends <= pid).to(tl.int32), axis=0)
    first_block = tl.sum(tl.where(es == e - 1, block_ends, 0), axis=0)  # 0 for e = 0
    start = tl.sum(tl.where(es == e, starts, 0), axis=0)
    end = tl.sum(tl.where(es == e, ends, 0), axis=0)  # 0 when e == E: no rows
    rows = start + (pid - first_block) * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, rows, rows < end


@triton.jit
def _moe_up_kernel(
    x_ptr,  # [T, H] (row stride stride_xt)
    order_ptr,  # [P] int64 pair of each sorted row
    ends_ptr,  # [E] int32
    w13_ptr,  # [E, 2I, H] contiguous (FP4: [E, 2I, H/2] uint8)
    s13_ptr,  # FP4: [E, 2I, H/32] uint8 e8m0; else unused
    act_ptr,  # [P, I] fp32 contiguous, sorted rows
    num_slots,  # A
    num_experts,
    limit,
    stride_xt,
    HIDDEN: tl.constexpr,  # H, I: constexpr (fixed per model; Triton 3.6's interpreter breaks on range(arg))
    INTER: tl.constexpr,
    IEEE: tl.constexpr,
    FP4: tl.constexpr,
    HALF_DOT: tl.constexpr,  # bf16 x and bf16-exact weight tiles on a GPU: the dot takes bf16 operands
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_P: tl.constexpr,
):
    e, rows, row_ok = _row_block(ends_ptr, num_experts, BLOCK_M, E_P)
    if e < num_experts:
        tok = tl.load(order_ptr + rows, mask=row_ok, other=0) // num_slots  # [BLOCK_M] int64
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of I
        col_ok = cols < INTER
        gate_rows = e.to(tl.int64) * 2 * INTER + cols  # rows of the [E·2I, H] stack; up rows: + I
        gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, HIDDEN, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < HIDDEN
            xt = tl.load(x_ptr + tok[:, None] * stride_xt + ks[None, :],
                         mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
            w1 = weight_tile(w13_ptr, s13_ptr, gate_rows, col_ok, k0, HIDDEN, BLOCK_K, FP4)  # [BLOCK_N, BLOCK_K]
            w3 = weight_tile(w13_ptr, s13_ptr, gate_rows + INTER, col_ok, k0, HIDDEN, BLOCK_K, FP4)
            if HALF_DOT:  # bf16 operands, fp32 accumulation: the products are exact either way
                w1, w3 = w1.to(xt.dtype), w3.to(xt.dtype)
            else:
                xt = xt.to(tl.float32)
            gate = dot_t(xt, w1, gate, IEEE)
            up = dot_t(xt, w3, up, IEEE)
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate * tl.sigmoid(gate) * up
        tl.store(act_ptr + rows[:, None].to(tl.int64) * INTER + cols[None, :], act,
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_down_kernel(
    act_ptr,  # [P, I] fp32 contiguous, sorted rows
    order_ptr,  # [P] int64
    ends_ptr,  # [E] int32
    w2_ptr,  # [E, H, I] contiguous (FP4: [E, H, I/2] uint8)
    s2_ptr,  # FP4: [E, H, I/32] uint8 e8m0; else unused
    weight_ptr,  # [P] fp32 routing weight of each pair
    out_ptr,  # [P, H] fp32, pair order
    num_experts,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    IEEE: tl.constexpr,
    FP4: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    E_P: tl.constexpr,
):
    e, rows, row_ok = _row_block(ends_ptr, num_experts, BLOCK_M, E_P)
    if e < num_experts:
        pair = tl.load(order_ptr + rows, mask=row_ok, other=0)  # [BLOCK_M] int64
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of H
        col_ok = cols < HIDDEN
        w_rows = e.to(tl.int64) * HIDDEN + cols  # rows of the [E·H, I] stack
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < INTER
            a = tl.load(act_ptr + rows[:, None].to(tl.int64) * INTER + ks[None, :],
                        mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # [BLOCK_M, BLOCK_K] fp32
            w = weight_tile(w2_ptr, s2_ptr, w_rows, col_ok, k0, INTER, BLOCK_K, FP4)  # [BLOCK_N, BLOCK_K]
            acc = dot_t(a, w, acc, IEEE)
        wt = tl.load(weight_ptr + pair, mask=row_ok, other=0.0)  # [BLOCK_M]
        tl.store(out_ptr + pair[:, None] * HIDDEN + cols[None, :], acc * wt[:, None],
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_slots_kernel(
    part_ptr,  # [S, T, A, H] fp32 per-(split, pair) outputs
    shared_ptr,  # [T, H] x.dtype, contiguous (read only with SHARED)
    out_ptr,  # [T, H] x.dtype
    num_tokens,
    hidden,
    NUM_SPLITS: tl.constexpr,
    NUM_SLOTS: tl.constexpr,
    SHARED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """out[t] = Σ_split Σ_slot part[split, t, slot] in that fixed order (fp32), rounded once; with SHARED plus
    shared[t], rounded again (what `routed + shared` in x.dtype gives)."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < hidden
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(NUM_SPLITS):
        for a in tl.static_range(NUM_SLOTS):
            acc += tl.load(part_ptr + ((s * num_tokens + t) * NUM_SLOTS + a) * hidden + cols, mask=ok, other=0.0)
    y = acc.to(out_ptr.dtype.element_ty)
    if SHARED:
        y = (y.to(tl.float32) + tl.load(shared_ptr + t * hidden + cols, mask=ok, other=0.0).to(tl.float32)).to(
            out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * hidden + cols, y, mask=ok)


def sum_slots(
    part: torch.Tensor,  # [S, T, A, H] fp32 (contiguous)
    dtype: torch.dtype,
    shared: torch.Tensor | None = None,  # [T, H] `dtype`: the shared expert's output
) -> torch.Tensor:
    """The experts' Σ over slots (and K splits), the cast to x's dtype and the shared expert's add in one launch
    -> [T, H] `dtype` (torch: a reduction, a copy and an add)."""
    check(part.dim() == 4 and part.is_contiguous() and part.dtype == torch.float32,
          f"sum_slots: want contiguous fp32 [S, T, A, H], got {part.dtype} {tuple(part.shape)}")
    S, T, A, H = part.shape
    if shared is not None:
        check(tuple(shared.shape) == (T, H) and shared.dtype == dtype and shared.device == part.device,
              f"sum_slots: shared must be {dtype} [{T}, {H}], got {shared.dtype} {tuple(shared.shape)}")
        shared = shared.contiguous()
    out = torch.empty(T, H, dtype=dtype, device=part.device)
    if T == 0:
        return out
    block = min(max(next_pow2(H), 16), 1024)
    _sum_slots_kernel[(T, triton.cdiv(H, block))](part, shared if shared is not None else out, out, T, H,
                                                 NUM_SPLITS=S, NUM_SLOTS=A, SHARED=shared is not None,
                                                 BLOCK=block, num_warps=4)
    return out


@dataclass(frozen=True)
class MoeConfig:
    block_m: int = 16  # rows per program (tl.dot needs >= 16)
    block_n: int = 64  # output columns per program
    block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3


def default_config(num_pairs: int, interpreter: bool) -> MoeConfig:
    if interpreter:
        return MoeConfig(16, 16, 16, 4, 1)
    if num_pairs <= 256:  # H200 sweep, E=256 H=4096 I=2048 bf16, graphed: K128 5-7% ahead of K64 at T = 1, 8, 32
        return MoeConfig(block_m=16, block_k=128)
    return MoeConfig(block_m=64)


def moe_experts_triton(
    x: torch.Tensor,  # [T, H]
    w13: torch.Tensor | Quantized,  # [E, 2I, H] rows 0..I-1 gate (w1), I..2I-1 up (w3)
    w2: torch.Tensor | Quantized,  # [E, H, I] down
    weights: torch.Tensor,  # [T, A] fp32
    ids: torch.Tensor,  # [T, A] int expert ids
    limit: float,
    config: MoeConfig | None = None,
    shared: torch.Tensor | None = None,  # [T, H] x.dtype, added in the last launch
) -> torch.Tensor:
    """Triton twin of `ops.moe.moe_experts` -> [T, H] (x.dtype), on plain or FP4 (`Quantized`) stacks. No host
    sync; the launches and torch ops depend on the shapes only."""
    from sparkspec.ops.moe import sort_by_expert

    fp4 = isinstance(w13, Quantized)
    check(fp4 == isinstance(w2, Quantized), "moe_experts: w13 and w2 must both be FP4 stacks or both plain")
    check(x.dim() == 2 and len(w13.shape) == 3 and len(w2.shape) == 3 and ids.dim() == 2,
          f"moe_experts: want x [T,H], w13 [E,2I,H], w2 [E,H,I], ids [T,A]; got {tuple(x.shape)}, "
          f"{tuple(w13.shape)}, {tuple(w2.shape)}, {tuple(ids.shape)}")
    T, H = x.shape
    E, _, I = w2.shape
    check(tuple(w13.shape) == (E, 2 * I, H), f"moe_experts: w13 {tuple(w13.shape)} != {(E, 2 * I, H)} for w2 "
          f"{tuple(w2.shape)} and hidden {H}")
    check(weights.shape == ids.shape, f"moe_experts: weights {tuple(weights.shape)} != ids {tuple(ids.shape)}")
    check(not ids.dtype.is_floating_point, f"moe_experts: ids must be integer, got {ids.dtype}")
    if fp4:
        check(w13.is_fp4 and w2.is_fp4 and w13.scale.dtype == w2.scale.dtype == torch.uint8,
              "moe_experts: quantised experts must be FP4 (uint8 codes, uint8 e8m0 scales)")
        for w, n in ((w13, 2 * I), (w2, H)):
            need = (E, n, -(-w.shape[2] // 32))
            check(tuple(w.scale.shape) == need, f"moe_experts: FP4 scales {tuple(w.scale.shape)} != {need} "
                  f"for weights {w.shape} (one per 32 values)")
        (w13, s13), (w2, s2) = ((w.data.contiguous(), w.scale.contiguous()) for w in (w13, w2))
    else:
        w13, w2 = w13.contiguous(), w2.contiguous()
        s13, s2 = w13, w2  # unused by the kernels
    check(same_device(x, w13, w2, s13, s2, weights, ids),
          "moe_experts: x, w13, w2, weights and ids must share a device")
    A = ids.shape[1]
    P = T * A
    if P == 0:
        return x.new_zeros(T, H) if shared is None else shared.clone()
    x = x if x.stride(-1) == 1 else x.contiguous()
    order, ends = sort_by_expert(ids, E)  # [P] int64, [E] int32
    cfg = config or default_config(P, on_interpreter(x))
    bm = cfg.block_m
    act = torch.empty(P, I, device=x.device, dtype=torch.float32)  # sorted rows, kept fp32 (1 rounding)
    out = torch.empty(P, H, device=x.device, dtype=torch.float32)  # pair order; every pair is written
    grid_m = min(P, triton.cdiv(P, bm) + E)
    ieee = x.dtype == torch.float32 or w13.dtype == torch.float32  # FP4 tiles are exact in tf32
    # the up projection's dot in bf16 when x and the weight tiles are exact in it (bf16 weights, or FP4 codes
    # times power-of-two scales), on a GPU (the interpreter's bf16 dots are wrong); the products are exact and
    # the sums fp32 either way. The down projection reads fp32 activations and keeps fp32 dots.
    half_dot = x.dtype == torch.bfloat16 and (fp4 or w13.dtype == torch.bfloat16) and not on_interpreter(x)
    e_p = max(next_pow2(E), 2)
    _moe_up_kernel[(grid_m, triton.cdiv(I, cfg.block_n))](
        x, order, ends, w13, s13, act, A, E, float(limit), x.stride(0), HIDDEN=H, INTER=I,
        IEEE=ieee, FP4=fp4, HALF_DOT=half_dot, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, E_P=e_p,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    _moe_down_kernel[(grid_m, triton.cdiv(H, cfg.block_n))](
        act, order, ends, w2, s2, weights.float().contiguous().view(-1), out, E, HIDDEN=H, INTER=I,
        IEEE=ieee, FP4=fp4, BLOCK_M=bm, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, E_P=e_p,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return sum_slots(out.view(1, T, A, H), x.dtype, shared)
