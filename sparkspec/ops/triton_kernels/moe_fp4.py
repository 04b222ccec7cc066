"""FP4 (e2m1 + e8m0) routed experts: two launches that stream the packed checkpoint bytes as they ship.

Legend: T tokens, H hidden, E experts, A active experts, I expert width, P = T·A (token, slot) pairs,
G scale groups of a K tile (32 values = 16 bytes each).
Weights: w13 [E, 2I, H/2] / w2 [E, H, I/2] uint8, two e2m1 codes a byte (low nibble = even column), one e8m0
byte per 32 values (s13 [E, 2I, H/32], s2 [E, H, I/32]).

Same plan as `triton_kernels.moe` (pairs sorted by expert, programs over (row block of one expert, N block),
up -> act [P, I], down -> out [P, H] in pair order, Σ over slots in torch), with a cheaper inner loop:
* no interleave: a byte holds columns 2j and 2j+1, so the x tile is loaded as its even and odd columns and
  each nibble meets its own half;
* e2m1 -> fp32 in four integer ops and one convert: the 3 magnitude bits go to bits 9..11 of an fp16 and the
  sign to bit 15, which reads as value · 2^-14 (e = 0 lands on the fp16 subnormal m · 2^-15, exactly 0.5·m ·
  2^-14), and the fp16 -> fp32 convert is exact;
* the scale (after the 2^14) is applied once per 32-value group: to the group's partial sum on the FMA path,
  to the decoded tile on the `tl.dot` path. Both are multiplications by powers of two, so against
  dequantise-then-matmul only the summation order differs (barring fp32 over/underflow of partial sums).
Two inner products by BLOCK_M (constexpr):
* BLOCK_M < 16 (decode, T·A small): FMA on CUDA cores over a static loop of rows: at T = 1 the work is
  bandwidth, and tensor-core tiles of 16 rows would waste 15/16 of the dequantisation;
* BLOCK_M >= 16: `tl.dot` on the dequantised tile (bf16 operands for bf16 x on a GPU: e2m1 · 2^k is exact in
  bf16 away from its subnormals), the activations stored in x.dtype (as the native rounds them).
Knobs (`Fp4Config`, chosen per P by `fp4_config` from the H200 sweep in NOTES.md):
* split_k: K split in whole K steps over grid axis 2 (programs for decode, where E·N blocks leave SMs idle);
  partial sums in [split, P, ·] fp32, added in split order (deterministic) by `_swiglu_splits_kernel` for the
  up projection and by the Σ over slots for the down one: one more launch, a count fixed by the shapes;
* swap: the dot as W · xᵀ (weight rows on the MMA's M side) for few rows per expert;
* fuse_gate_up: gate and up rows as one 2·BLOCK_N tile, one K loop (x read once, twice the bytes in flight);
* x_pairs: x tiles as one contiguous load split into even / odd columns in registers (vector loads).
No host sync; the launch count and torch ops depend on the shapes only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sparkspec.ops.formats import Quantized
from sparkspec.ops.triton_kernels.common import check, next_pow2, on_interpreter, same_device
from sparkspec.ops.triton_kernels.moe import _row_block, sum_slots

GROUP_BYTES = tl.constexpr(16)  # one e8m0 scale per 32 values = 16 packed bytes


@triton.jit
def e2m1_pair(b):
    """Packed bytes (int32, 0..255) -> (low, high nibble) values · 2^-14 in fp32, exactly (see module doc)."""
    lo = ((b & 7) << 9) | ((b & 8) << 12)
    hi = ((b & 0x70) << 5) | ((b & 0x80) << 8)
    lo = lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    hi = hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    return lo, hi


@triton.jit
def group_scale(s):
    """e8m0 bytes (int32) -> 2^(s - 127) fp32 from its bits (byte 0, 2^-127, reads as 0)."""
    return (s << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp4_tile(
    w_ptr,  # [R, K/2] uint8
    s_ptr,  # [R, K/32] uint8
    rows,  # [BLOCK_N] int64 rows of the stack
    row_ok,  # [BLOCK_N] bool
    kb0,  # first byte of the tile (a multiple of 16)
    K: tl.constexpr,
    G: tl.constexpr,  # groups in the tile
):
    """-> (lo, hi [BLOCK_N, G, 16] fp32 values · 2^-14, scale [BLOCK_N, G] fp32)."""
    gs = kb0 // GROUP_BYTES + tl.arange(0, G)  # [G] scale groups
    js = tl.arange(0, GROUP_BYTES)  # [16] bytes of a group
    g_ok = gs < K // 32
    ok = row_ok[:, None, None] & g_ok[None, :, None]
    b = tl.load(w_ptr + rows[:, None, None] * (K // 2) + gs[None, :, None] * GROUP_BYTES + js[None, None, :],
                mask=ok, other=0).to(tl.int32)
    s = tl.load(s_ptr + rows[:, None] * (K // 32) + gs[None, :], mask=row_ok[:, None] & g_ok[None, :], other=0)
    lo, hi = e2m1_pair(b)
    return lo, hi, group_scale(s.to(tl.int32))


@triton.jit
def _x_halves(
    x_ptr,  # [.., K] rows
    row_off,  # [BLOCK_M] int64 element offset of each row
    row_ok,  # [BLOCK_M] bool
    kb0,
    K: tl.constexpr,
    G: tl.constexpr,
    X_PAIRS: tl.constexpr,
):
    """Even and odd columns of the rows' K tile -> 2 x [BLOCK_M, G, 16] fp32 (column 2·byte and 2·byte + 1).
    X_PAIRS: one contiguous load of the 32·G columns, split into the halves in registers (vector loads);
    else two stride-2 loads."""
    if X_PAIRS:
        col = 2 * kb0 + tl.arange(0, G)[:, None] * 32 + tl.arange(0, 32)[None, :]  # [G, 32]
        ok = row_ok[:, None, None] & (col[None] < K)
        v = tl.load(x_ptr + row_off[:, None, None] + col[None], mask=ok, other=0.0).to(tl.float32)
        return tl.split(tl.reshape(v, (v.shape[0], G, GROUP_BYTES, 2)))
    byte = kb0 + tl.arange(0, G)[:, None] * GROUP_BYTES + tl.arange(0, GROUP_BYTES)[None, :]  # [G, 16]
    ok = row_ok[:, None, None] & (byte[None] < K // 2)
    p = x_ptr + row_off[:, None, None] + 2 * byte[None]
    return (tl.load(p, mask=ok, other=0.0).to(tl.float32), tl.load(p + 1, mask=ok, other=0.0).to(tl.float32))


@triton.jit
def _fp4_gemm(
    acc,  # [BLOCK_M, BLOCK_N] fp32
    x_ptr,  # rows of the left operand
    row_off,  # [BLOCK_M] int64
    m_ok,  # [BLOCK_M] bool
    w_ptr,
    s_ptr,
    w_rows,  # [BLOCK_N] int64
    n_ok,  # [BLOCK_N] bool
    kb_lo,  # bytes kb_lo..kb_hi of each row (this program's K split; multiples of G·16)
    kb_hi,
    K: tl.constexpr,
    G: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    SWAP: tl.constexpr,
    X_PAIRS: tl.constexpr,
):
    """acc + x[rows] · W[w_rows]ᵀ over K columns 2·kb_lo..2·kb_hi, W dequantised tile by tile (FMA path or
    `tl.dot`, by BLOCK_M; SWAP: the dot as W · xᵀ, the weight tile on the MMA's wide side)."""
    ms = tl.arange(0, BLOCK_M)
    if BLOCK_M == 1:  # decode: per-group partial sums carried over K, one cross-group reduction at the end
        acc_g = tl.zeros([BLOCK_N, G], dtype=tl.float32)
        for kb0 in range(kb_lo, kb_hi, G * 16):
            lo, hi, sc = _fp4_tile(w_ptr, s_ptr, w_rows, n_ok, kb0, K, G)
            xe, xo = _x_halves(x_ptr, row_off, m_ok, kb0, K, G, X_PAIRS)  # [1, G, 16]
            xe, xo = tl.sum(xe, axis=0), tl.sum(xo, axis=0)  # [G, 16]
            acc_g += tl.sum(lo * xe[None] + hi * xo[None], axis=2) * 16384.0 * sc
        return acc + tl.sum(acc_g, axis=1)[None, :]
    acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)  # SWAP: W · xᵀ, transposed once at the end
    for kb0 in range(kb_lo, kb_hi, G * 16):
        lo, hi, sc = _fp4_tile(w_ptr, s_ptr, w_rows, n_ok, kb0, K, G)
        xe, xo = _x_halves(x_ptr, row_off, m_ok, kb0, K, G, X_PAIRS)  # [BLOCK_M, G, 16]
        if BLOCK_M >= 16:
            sc = sc[:, :, None]  # the 2^14 first: 2^(s - 127 + 14) may overflow where the product does not
            wl = tl.reshape(lo * 16384.0 * sc, (BLOCK_N, G * 16))
            wh = tl.reshape(hi * 16384.0 * sc, (BLOCK_N, G * 16))
            xe2 = tl.reshape(xe, (BLOCK_M, G * 16))
            xo2 = tl.reshape(xo, (BLOCK_M, G * 16))
            if HALF_DOT:
                wl, wh = wl.to(tl.bfloat16), wh.to(tl.bfloat16)
                xe2, xo2 = xe2.to(tl.bfloat16), xo2.to(tl.bfloat16)
            if SWAP:
                if IEEE:
                    acc_t = tl.dot(wl, tl.trans(xe2), acc_t, input_precision="ieee")
                    acc_t = tl.dot(wh, tl.trans(xo2), acc_t, input_precision="ieee")
                else:
                    acc_t = tl.dot(wl, tl.trans(xe2), acc_t)
                    acc_t = tl.dot(wh, tl.trans(xo2), acc_t)
            elif IEEE:
                acc = tl.dot(xe2, tl.trans(wl), acc, input_precision="ieee")
                acc = tl.dot(xo2, tl.trans(wh), acc, input_precision="ieee")
            else:
                acc = tl.dot(xe2, tl.trans(wl), acc)
                acc = tl.dot(xo2, tl.trans(wh), acc)
        else:
            for m in tl.static_range(BLOCK_M):
                sel = (ms == m)[:, None, None]
                xem = tl.sum(tl.where(sel, xe, 0.0), axis=0)  # [G, 16] row m (a register select, no load)
                xom = tl.sum(tl.where(sel, xo, 0.0), axis=0)
                part = tl.sum(lo * xem[None] + hi * xom[None], axis=2) * 16384.0 * sc  # [BLOCK_N, G] scaled once
                acc += tl.where((ms == m)[:, None], tl.sum(part, axis=1)[None, :], 0.0)
    if SWAP:
        acc += tl.trans(acc_t)
    return acc


@triton.jit
def _fp4_up_kernel(
    x_ptr,  # [T, H] (row stride stride_xt)
    order_ptr,  # [P] int64 pair of each sorted row
    ends_ptr,  # [E] int32 end row of each expert's group
    w13_ptr,  # [E, 2I, H/2] uint8
    s13_ptr,  # [E, 2I, H/32] uint8
    act_ptr,  # [P, I] (act dtype) sorted rows; SPLIT > 1: [SPLIT, P, 2I] fp32 partial (gate | up) sums
    num_pairs,  # P
    num_slots,  # A
    num_experts,
    limit,
    stride_xt,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    HALF_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    SWAP: tl.constexpr,
    X_PAIRS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
    E_P: tl.constexpr,
    SPLIT: tl.constexpr,
    K_CHUNK: tl.constexpr,  # bytes of a row per K split (a multiple of G·16)
    FUSE_GU: tl.constexpr,  # gate and up rows in one tile (one K loop) instead of two loops
):
    e, rows, row_ok = _row_block(ends_ptr, num_experts, BLOCK_M, E_P)
    if e < num_experts:
        kb_lo = tl.program_id(2) * K_CHUNK
        kb_hi = tl.minimum(kb_lo + K_CHUNK, HIDDEN // 2)
        tok = tl.load(order_ptr + rows, mask=row_ok, other=0) // num_slots  # [BLOCK_M] int64
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of I
        col_ok = cols < INTER
        gate_rows = e.to(tl.int64) * 2 * INTER + cols  # rows of the [E·2I, H/2] stack; up rows: + I
        zero = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        x_off = tok * stride_xt
        if FUSE_GU:  # one [2·BLOCK_N]-row weight tile per K step (gate cols, then up cols): x tiles read once
            j = tl.arange(0, 2 * BLOCK_N)
            c2 = tl.program_id(1) * BLOCK_N + j % BLOCK_N  # [2 BLOCK_N] column of I of each tile row
            both = e.to(tl.int64) * 2 * INTER + (j // BLOCK_N) * INTER + c2  # [2 BLOCK_N] rows of the stack
            h = _fp4_gemm(tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32), x_ptr, x_off, row_ok, w13_ptr,
                          s13_ptr, both, c2 < INTER, kb_lo, kb_hi,
                          HIDDEN, G, BLOCK_M, 2 * BLOCK_N, HALF_DOT, IEEE, SWAP, X_PAIRS)  # [BLOCK_M, 2 BLOCK_N]
            gate, up = tl.split(tl.permute(tl.reshape(h, (BLOCK_M, 2, BLOCK_N)), (0, 2, 1)))
        else:
            gate = _fp4_gemm(zero, x_ptr, x_off, row_ok, w13_ptr, s13_ptr, gate_rows, col_ok, kb_lo, kb_hi,
                             HIDDEN, G, BLOCK_M, BLOCK_N, HALF_DOT, IEEE, SWAP, X_PAIRS)
            up = _fp4_gemm(zero, x_ptr, x_off, row_ok, w13_ptr, s13_ptr, gate_rows + INTER, col_ok, kb_lo, kb_hi,
                           HIDDEN, G, BLOCK_M, BLOCK_N, HALF_DOT, IEEE, SWAP, X_PAIRS)
        ok = row_ok[:, None] & col_ok[None, :]
        if SPLIT == 1:
            tl.store(act_ptr + rows[:, None].to(tl.int64) * INTER + cols[None, :],
                     _swiglu(gate, up, limit).to(act_ptr.dtype.element_ty), mask=ok)
        else:  # partial sums; `_swiglu_splits_kernel` adds them in split order and applies the activation
            p = act_ptr + (tl.program_id(2) * num_pairs + rows[:, None].to(tl.int64)) * (2 * INTER) + cols[None, :]
            tl.store(p, gate, mask=ok)
            tl.store(p + INTER, up, mask=ok)


@triton.jit
def _swiglu(gate, up, limit):
    """The V4 clamped SwiGLU (`ops.moe.swiglu`) in fp32."""
    gate = tl.minimum(gate, limit)
    up = tl.minimum(tl.maximum(up, -limit), limit)
    return gate * tl.sigmoid(gate) * up


@triton.jit
def _swiglu_splits_kernel(
    part_ptr,  # [SPLIT, P, 2I] fp32 partial sums (gate | up)
    act_ptr,  # [P, I] sorted rows
    num_pairs,  # P
    limit,
    INTER: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK] flat (row, col) of act
    ok = i < num_pairs * INTER
    src = (i // INTER) * (2 * INTER) + i % INTER
    gate = tl.zeros([BLOCK], dtype=tl.float32)
    up = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # split order: deterministic
        gate += tl.load(part_ptr + s * num_pairs * 2 * INTER + src, mask=ok, other=0.0)
        up += tl.load(part_ptr + s * num_pairs * 2 * INTER + src + INTER, mask=ok, other=0.0)
    tl.store(act_ptr + i, _swiglu(gate, up, limit).to(act_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _fp4_down_kernel(
    act_ptr,  # [P, I] sorted rows
    order_ptr,  # [P] int64
    ends_ptr,  # [E] int32
    w2_ptr,  # [E, H, I/2] uint8
    s2_ptr,  # [E, H, I/32] uint8
    weight_ptr,  # [P] fp32 routing weight of each pair
    out_ptr,  # [SPLIT, P, H] fp32, pair order: one partial sum per K split
    num_pairs,  # P
    num_experts,
    HIDDEN: tl.constexpr,
    INTER: tl.constexpr,
    HALF_DOT: tl.constexpr,
    IEEE: tl.constexpr,
    SWAP: tl.constexpr,
    X_PAIRS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    G: tl.constexpr,
    E_P: tl.constexpr,
    K_CHUNK: tl.constexpr,
):
    e, rows, row_ok = _row_block(ends_ptr, num_experts, BLOCK_M, E_P)
    if e < num_experts:
        kb_lo = tl.program_id(2) * K_CHUNK
        kb_hi = tl.minimum(kb_lo + K_CHUNK, INTER // 2)
        pair = tl.load(order_ptr + rows, mask=row_ok, other=0)  # [BLOCK_M] int64
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of H
        col_ok = cols < HIDDEN
        w_rows = e.to(tl.int64) * HIDDEN + cols  # rows of the [E·H, I/2] stack
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc = _fp4_gemm(acc, act_ptr, rows.to(tl.int64) * INTER, row_ok, w2_ptr, s2_ptr, w_rows, col_ok,
                        kb_lo, kb_hi, INTER, G, BLOCK_M, BLOCK_N, HALF_DOT, IEEE, SWAP, X_PAIRS)
        wt = tl.load(weight_ptr + pair, mask=row_ok, other=0.0)  # [BLOCK_M]
        dst = out_ptr + (tl.program_id(2) * num_pairs + pair[:, None]) * HIDDEN + cols[None, :]
        tl.store(dst, acc * wt[:, None], mask=row_ok[:, None] & col_ok[None, :])


@dataclass(frozen=True)
class Fp4Config:
    block_m: int = 1  # rows of one expert per program: < 16 FMA path, >= 16 (a power of two) tl.dot path
    block_n: int = 32  # output columns per program
    groups: int = 4  # 32-value scale groups per K step (16 bytes each)
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 1  # K splits of both projections (more programs at small P); partial sums added in order
    swap: bool = False  # tl.dot path only: W · xᵀ (weight rows on the MMA's M side, the few x rows on N)
    fuse_gate_up: bool = False  # up projection: gate and up rows in one 2·block_n tile, one pass over K
    x_pairs: bool = False  # x tiles as one contiguous load split into even / odd columns in registers

    def __post_init__(self):
        for name in ("block_m", "block_n", "groups", "split_k"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"Fp4Config.{name} must be a power of two, got {v}")
        if self.swap and self.block_m < 16:
            raise ValueError(f"Fp4Config.swap needs the tl.dot path (block_m >= 16), got block_m={self.block_m}")


def fp4_config(num_pairs: int, interpreter: bool) -> Fp4Config:
    """The H200 sweep's best at the V4-Flash expert shapes (E = 256, H = 4096, I = 2048; `.dev/gpu_K.sh`,
    NOTES.md): FMA rows split 4 ways over K for decode (P = 6 and 48), 16-row tensor-core tiles at P = 384,
    64-row W · xᵀ tiles for prefill (P = 12288). The P boundaries between those points are not measured."""
    if interpreter:
        return Fp4Config(block_m=1 if num_pairs <= 8 else 16, block_n=16, groups=1, num_stages=1)
    if num_pairs <= 128:
        return Fp4Config(block_m=1, block_n=64, groups=4, num_warps=4, num_stages=1, split_k=4)
    if num_pairs <= 2048:
        return Fp4Config(block_m=16, block_n=64, groups=4, num_warps=4, num_stages=3)
    return Fp4Config(block_m=64, block_n=128, groups=4, num_warps=8, num_stages=3, swap=True)


def moe_experts_fp4(
    x: torch.Tensor,  # [T, H]
    w13: Quantized,  # [E, 2I, H/2] uint8 codes, [E, 2I, H/32] uint8 scales; rows 0..I-1 gate, I..2I-1 up
    w2: Quantized,  # [E, H, I/2] uint8, [E, H, I/32] uint8
    weights: torch.Tensor,  # [T, A] fp32
    ids: torch.Tensor,  # [T, A] int expert ids
    limit: float,
    config: Fp4Config | None = None,
    shared: torch.Tensor | None = None,  # [T, H] x.dtype, added in the last launch
) -> torch.Tensor:
    """FP4 twin of `ops.moe.moe_experts` -> [T, H] (x.dtype). No host sync; launches fixed by the shapes."""
    from sparkspec.ops.moe import sort_by_expert

    check(isinstance(w13, Quantized) and isinstance(w2, Quantized) and w13.is_fp4 and w2.is_fp4,
          "moe_experts_fp4: w13 and w2 must be FP4 Quantized stacks (uint8 codes)")
    check(w13.scale.dtype == w2.scale.dtype == torch.uint8, "moe_experts_fp4: scales must be uint8 e8m0 bytes")
    check(x.dim() == 2 and len(w13.shape) == 3 and len(w2.shape) == 3 and ids.dim() == 2,
          f"moe_experts_fp4: want x [T,H], w13 [E,2I,H], w2 [E,H,I], ids [T,A]; got {tuple(x.shape)}, "
          f"{tuple(w13.shape)}, {tuple(w2.shape)}, {tuple(ids.shape)}")
    T, H = x.shape
    E, _, I = w2.shape
    check(tuple(w13.shape) == (E, 2 * I, H), f"moe_experts_fp4: w13 {tuple(w13.shape)} != {(E, 2 * I, H)}")
    check(H % 32 == 0 and I % 32 == 0, f"moe_experts_fp4: H {H} and I {I} must be multiples of 32 (scale groups)")
    for w, n in ((w13, 2 * I), (w2, H)):
        need = (E, n, w.shape[2] // 32)
        check(tuple(w.scale.shape) == need, f"moe_experts_fp4: scales {tuple(w.scale.shape)} != {need}")
    check(weights.shape == ids.shape, f"moe_experts_fp4: weights {tuple(weights.shape)} != ids {tuple(ids.shape)}")
    check(not ids.dtype.is_floating_point, f"moe_experts_fp4: ids must be integer, got {ids.dtype}")
    check(same_device(x, w13.data, w13.scale, w2.data, w2.scale, weights, ids),
          "moe_experts_fp4: x, weights, scales, routing weights and ids must share a device")
    A = ids.shape[1]
    P = T * A
    if P == 0:
        return x.new_zeros(T, H) if shared is None else shared.clone()
    interp = on_interpreter(x)
    cfg = config or fp4_config(P, interp)
    x = x if x.stride(-1) == 1 else x.contiguous()
    (w13d, s13), (w2d, s2) = ((w.data.contiguous(), w.scale.contiguous()) for w in (w13, w2))
    order, ends = sort_by_expert(ids, E)  # [P] int64, [E] int32
    bm = cfg.block_m
    use_dot = bm >= 16
    half_dot = use_dot and x.dtype == torch.bfloat16 and not interp  # the interpreter's bf16 dots are wrong
    ieee = x.dtype == torch.float32
    act_dtype = x.dtype if use_dot and x.dtype != torch.float32 else torch.float32
    act = torch.empty(P, I, device=x.device, dtype=act_dtype)  # sorted rows
    grid_m = min(P, triton.cdiv(P, bm) + E)
    e_p = max(next_pow2(E), 2)
    common = dict(HALF_DOT=half_dot, IEEE=ieee, SWAP=cfg.swap, X_PAIRS=cfg.x_pairs, BLOCK_M=bm,
                  BLOCK_N=cfg.block_n, G=cfg.groups, E_P=e_p, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    split_up, chunk_up = _k_split(H, cfg)
    part = act if split_up == 1 else torch.empty(split_up, P, 2 * I, device=x.device)  # fp32 partial sums
    _fp4_up_kernel[(grid_m, triton.cdiv(I, cfg.block_n), split_up)](
        x, order, ends, w13d, s13, part, P, A, E, float(limit), x.stride(0), HIDDEN=H, INTER=I,
        SPLIT=split_up, K_CHUNK=chunk_up, FUSE_GU=cfg.fuse_gate_up, **common)
    if split_up > 1:
        _swiglu_splits_kernel[(triton.cdiv(P * I, 1024),)](part, act, P, float(limit), INTER=I, SPLIT=split_up,
                                                           BLOCK=1024)
    split_dn, chunk_dn = _k_split(I, cfg)
    out = torch.empty(split_dn, P, H, device=x.device, dtype=torch.float32)  # pair order; all pairs written
    _fp4_down_kernel[(grid_m, triton.cdiv(H, cfg.block_n), split_dn)](
        act, order, ends, w2d, s2, weights.float().contiguous().view(-1), out, P, E, HIDDEN=H, INTER=I,
        K_CHUNK=chunk_dn, **common)
    return sum_slots(out.view(split_dn, T, A, H), x.dtype, shared)


def _k_split(K: int, cfg: Fp4Config) -> tuple[int, int]:
    """-> (splits, bytes of a row per split) over K columns (K/2 bytes): whole K steps of G·16 bytes per
    split, no empty split (so every partial-sum slot is written)."""
    step = cfg.groups * 16
    steps = triton.cdiv(K // 2, step)
    per = triton.cdiv(steps, min(cfg.split_k, steps))
    return triton.cdiv(steps, per), per * step
